"""Block formats: named presets of an element format, a block size and a scale format.

The OCP Microscaling (MX) v1.0 formats share one power-of-two scale (E8M0,
``float8_e8m0fnu``) among 32 consecutive elements of one axis. Pass a preset to
:func:`~jax_scaled.quantize.quantize` with the axis the blocks lie along (for a matmul
operand, its contracting axis):

============  ==================  ==========  =======  ===================
preset        element format      largest     blocks   bits per element
============  ==================  ==========  =======  ===================
MXFP8_E4M3    ``float8_e4m3fn``   448         32       8.25
MXFP8_E5M2    ``float8_e5m2``     57344       32       8.25
MXFP6_E2M3    ``float6_e2m3fn``   7.5         32       6.25
MXFP6_E3M2    ``float6_e3m2fn``   28          32       6.25
MXFP4_E2M1    ``float4_e2m1fn``   6           32       4.25
============  ==================  ==========  =======  ===================

Element formats are ml_dtypes' (``ml_dtypes.finfo`` gives their range). XLA in JAX 0.10 has
no float6 arrays ("Invalid XLA PrimitiveType F6E2M3FN"), so MXFP6 data is rounded to the
float6 format's values and stored in ``float8_e4m3fn``, which holds every one of them
exactly (:func:`storage_dtype`); bit counts are the format's. NVFP4 (16-element blocks with
E4M3 scales, not powers of two) is not offered.

Example:
    >>> MXFP8_E4M3.block_size, MXFP8_E4M3.bits_per_element
    (32, 8.25)
    >>> js.quantize(jnp.ones((2, 64)), MXFP8_E4M3, axis=-1).scale.shape
    (2, 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike

# XLA (JAX 0.10) cannot hold these element formats; their values live in a wider float8.
_CONTAINERS = {
    np.dtype(ml_dtypes.float6_e2m3fn): np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float6_e3m2fn): np.dtype(ml_dtypes.float8_e4m3fn),
}


def storage_dtype(dtype: DTypeLike) -> np.dtype:
    """The dtype of the arrays that hold data of element format ``dtype``: the format itself,
    or ``float8_e4m3fn`` for the float6 formats (XLA has no float6 arrays), which holds all
    their values exactly.

    Example:
        >>> storage_dtype(jnp.float8_e5m2), storage_dtype(jnp.float6_e2m3fn)
        (dtype(float8_e5m2), dtype(float8_e4m3fn))
    """
    dtype = np.dtype(dtype)
    return _CONTAINERS.get(dtype, dtype)


def element_bits(dtype: DTypeLike) -> int:
    """Bits per element of a floating format (its own width, not its storage's).

    Example:
        >>> element_bits(jnp.float6_e3m2fn), element_bits(jnp.float32)
        (6, 32)
    """
    return int(ml_dtypes.finfo(np.dtype(dtype)).bits)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block format: an element format, the number of elements sharing one scale along an
    axis, and the scale format.

    Example:
        >>> fmt = BlockFormat("MY_FP8", jnp.float8_e4m3fn, block_size=16)
        >>> fmt.block_shape(3, axis=1), fmt.bits_per_element
        ((1, 16, 1), 8.5)
    """

    name: str
    element_dtype: DTypeLike
    block_size: int = 32
    scale_dtype: DTypeLike = jnp.float8_e8m0fnu

    def __post_init__(self):
        object.__setattr__(self, "element_dtype", np.dtype(self.element_dtype))
        object.__setattr__(self, "scale_dtype", np.dtype(self.scale_dtype))
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")

    @property
    def bits_per_element(self) -> float:
        """Storage cost counting the scales: element bits + scale bits / block size."""
        return element_bits(self.element_dtype) + element_bits(self.scale_dtype) / self.block_size

    def block_shape(self, ndim: int, axis: int = -1) -> tuple[int, ...]:
        """Blocks of ``block_size`` along ``axis`` of a rank-``ndim`` array, 1 elsewhere."""
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}.")
        shape = [1] * ndim
        shape[axis % ndim] = self.block_size
        return tuple(shape)


MXFP8_E4M3 = BlockFormat("MXFP8_E4M3", ml_dtypes.float8_e4m3fn)
MXFP8_E5M2 = BlockFormat("MXFP8_E5M2", ml_dtypes.float8_e5m2)
MXFP6_E2M3 = BlockFormat("MXFP6_E2M3", ml_dtypes.float6_e2m3fn)
MXFP6_E3M2 = BlockFormat("MXFP6_E3M2", ml_dtypes.float6_e3m2fn)
MXFP4_E2M1 = BlockFormat("MXFP4_E2M1", ml_dtypes.float4_e2m1fn)

MX_FORMATS: Sequence[BlockFormat] = (MXFP8_E4M3, MXFP8_E5M2, MXFP6_E2M3, MXFP6_E3M2, MXFP4_E2M1)

__all__ = [
    "MXFP4_E2M1",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8_E4M3",
    "MXFP8_E5M2",
    "MX_FORMATS",
    "BlockFormat",
    "element_bits",
    "storage_dtype",
]
