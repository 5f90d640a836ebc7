"""Float formats: checked dtypes, which are narrower than float32, and the dtype to compute
them in.

``jnp.promote_types(float8, float32)`` raises in JAX (8-bit floats take no implicit
promotion), so the library widens with :func:`compute_dtype` instead.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.typing import DTypeLike

BLOCK_SCALE_DTYPES: tuple[jnp.dtype, ...] = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e8m0fnu))
"""The dtypes block scales are stored in: float32, or E8M0 (``float8_e8m0fnu``: powers of two
only). The ``scale_dtype`` of :class:`~jax_scaled.ScalifyConfig`, :func:`~jax_scaled.quantize`
and :class:`~jax_scaled.formats.BlockFormat` is one of them."""


def is_floating(dtype: Any) -> bool:
    """True for floating dtypes (the dtypes a ScaledArray's data and scale may have).

    Example:
        >>> is_floating(jnp.float8_e4m3fn), is_floating(jnp.int32)
        (True, False)
    """
    return jnp.issubdtype(dtype, jnp.floating)


def is_narrow_float(dtype: Any) -> bool:
    """True for floating dtypes narrower than float32 (float16, bfloat16, float8, float4).

    Example:
        >>> is_narrow_float(jnp.float16), is_narrow_float(jnp.float32), is_narrow_float(jnp.int8)
        (True, False, False)
    """
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def compute_dtype(dtype: Any) -> Any:
    """The dtype to compute on data of ``dtype`` in: float32 for narrower floats, the dtype
    itself otherwise (float32, float64, integers, PRNG keys).

    Example:
        >>> compute_dtype(jnp.float8_e4m3fn), compute_dtype(jnp.float64)
        (dtype('float32'), dtype('float64'))
    """
    if is_narrow_float(dtype):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype) if jnp.issubdtype(dtype, jnp.number) else dtype


def float_dtype(dtype: DTypeLike) -> jnp.dtype:
    """``dtype`` as a numpy dtype, checked to be a floating-point format.

    Example:
        >>> float_dtype(jnp.float8_e5m2)
        dtype(float8_e5m2)
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"expected a floating-point format, got {dtype}.")
    return dtype
