"""Block formats and block recipes: the one vocabulary of block scaling, and all its presets.

A **format** (:class:`BlockFormat`) says how one tensor is quantized: its element format, how
many consecutive elements of one axis share a scale (``block_size``), the scales' dtype, and
how a block's scale is rounded to a power of two (``scale_rounding``: ``"floor"``, OCP MX,
may saturate; ``"rceil"``, never saturates; see :mod:`jax_scaled.quantize`). Pass one to
:func:`~jax_scaled.quantize.quantize` with the axis the blocks lie along (for a matmul operand,
its contracting axis). The OCP Microscaling (MX) v1.0 formats share one power-of-two scale
(E8M0, ``float8_e8m0fnu``) among 32 elements:

=================  ==================  ==========  =======  ================  ==============
format preset      element format      largest     blocks   scales            bits/element
=================  ==================  ==========  =======  ================  ==============
MXFP8_E4M3         ``float8_e4m3fn``   448         32       E8M0, floor       8.25
MXFP8_E5M2         ``float8_e5m2``     57344       32       E8M0, floor       8.25
MXFP6_E2M3         ``float6_e2m3fn``   7.5         32       E8M0, floor       6.25
MXFP6_E3M2         ``float6_e3m2fn``   28          32       E8M0, floor       6.25
MXFP4_E2M1         ``float4_e2m1fn``   6           32       E8M0, floor       4.25
FP8_E4M3_BLOCK128  ``float8_e4m3fn``   448         128      float32, rceil    8.25
=================  ==================  ==========  =======  ================  ==============

A **recipe** (:class:`BlockRecipe`) says how a block-scaled matmul ``x (..., K) @ w (K, N)``
and its two gradient matmuls quantize their operands: a format for the activations ``x``,
one for the weights ``w`` (and their blocks, which may be square tiles), one for the output
gradient ``grad`` (:func:`jax_scaled.nn.block_linear`, ``js.nn.linear(block=...)``,
``js.dot_formats(block=...)``). Where a recipe is expected, a format ``F`` means ``F``
everywhere (:func:`as_recipe`):

==================  ======================================================================
recipe preset       formats
==================  ======================================================================
MXFP8               x ``MXFP8_E4M3``, w ``MXFP8_E4M3``, grad ``MXFP8_E5M2``
MXFP8_E4M3_GRADS    ``MXFP8_E4M3`` everywhere (the recipe of the format ``MXFP8_E4M3``)
MXFP4_WEIGHTS       x ``MXFP8_E4M3``, w ``MXFP4_E2M1``, grad ``MXFP8_E5M2``
FP8_BLOCK128        ``FP8_E4M3_BLOCK128`` everywhere, 128x128 weight tiles
==================  ======================================================================

The recipe presets are also ``js.nn.MXFP8``, ... (the same objects).

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
    >>> MXFP8.grad is MXFP8_E5M2, js.nn.MXFP8 is MXFP8
    (True, True)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import DTypeLike

from jax_scaled.dtypes import BLOCK_SCALE_DTYPES

ScaleRounding = Literal["floor", "rceil"]
SCALE_ROUNDINGS: tuple[str, ...] = ("floor", "rceil")
"""How a block's scale is rounded to a power of two (:mod:`jax_scaled.quantize`): ``"floor"``
(OCP MX: ``2^(floor(log2(amax)) - emax)``, may saturate) or ``"rceil"`` (``2^ceil(log2(amax /
max))``, never saturates)."""

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
    axis, the scale format, and how a block's scale is rounded to a power of two.

    Args:
        name: what the format is called (``"MXFP8_E4M3"``), for reprs and messages: two
            formats that differ only by name are equal.
        element_dtype: the elements' format: ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``,
            ``jnp.float6_e2m3fn``, ``jnp.float6_e3m2fn``, ``jnp.float4_e2m1fn`` or any
            ml_dtypes float.
        block_size: elements per scale along one axis (32, the MX block). None: the blocks
            are chosen where the format is used (:func:`~jax_scaled.quantize`'s
            ``block_shape``, one scale per tensor by default); a recipe needs a size.
        scale_dtype: the scales' dtype: ``jnp.float8_e8m0fnu`` (E8M0, default) or
            ``jnp.float32`` (:data:`~jax_scaled.dtypes.BLOCK_SCALE_DTYPES`).
        scale_rounding: how a block's largest magnitude sets its power-of-two scale:
            ``"floor"`` (OCP MX, default; the block's largest values may saturate) or
            ``"rceil"`` (never saturates); see :mod:`jax_scaled.quantize`.

    Example:
        >>> fmt = BlockFormat("MY_FP8", jnp.float8_e4m3fn, block_size=16, scale_rounding="rceil")
        >>> fmt.block_shape(3, axis=1), fmt.bits_per_element
        ((1, 16, 1), 8.5)
        >>> fmt == BlockFormat("SAME", jnp.float8_e4m3fn, 16, scale_rounding="rceil")
        True
        >>> BlockFormat("X", jnp.float8_e4m3fn, scale_rounding="ceil")
        Traceback (most recent call last):
        ValueError: scale_rounding is 'floor' or 'rceil', got 'ceil'.
    """

    name: str = dataclasses.field(compare=False)
    element_dtype: DTypeLike
    block_size: int | None = 32
    scale_dtype: DTypeLike = jnp.float8_e8m0fnu
    scale_rounding: ScaleRounding = "floor"

    def __post_init__(self):
        element, scale = np.dtype(self.element_dtype), np.dtype(self.scale_dtype)
        if not jnp.issubdtype(element, jnp.floating):
            raise TypeError(f"a block format needs a floating element format, got {element}.")
        if scale not in BLOCK_SCALE_DTYPES:
            raise ValueError(f"scale_dtype is float32 or float8_e8m0fnu, got {scale}.")
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale_rounding is 'floor' or 'rceil', got {self.scale_rounding!r}.")
        size = self.block_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ValueError(f"block_size must be a positive integer or None, got {size!r}.")
            object.__setattr__(self, "block_size", int(size))
        object.__setattr__(self, "element_dtype", element)
        object.__setattr__(self, "scale_dtype", scale)

    @property
    def bits_per_element(self) -> float:
        """Storage cost counting the scales: element bits + scale bits / block size (element
        bits alone without a block size).

        Example:
            >>> MXFP4_E2M1.bits_per_element, FP8_E4M3_BLOCK128.bits_per_element
            (4.25, 8.25)
        """
        if self.block_size is None:
            return float(element_bits(self.element_dtype))
        return element_bits(self.element_dtype) + element_bits(self.scale_dtype) / self.block_size

    def block_shape(self, ndim: int, axis: int = -1) -> tuple[int, ...] | None:
        """Blocks of ``block_size`` along ``axis`` of a rank-``ndim`` array, 1 elsewhere (None
        without a block size).

        Example:
            >>> free = BlockFormat("E5M2", jnp.float8_e5m2, block_size=None)
            >>> MXFP8_E4M3.block_shape(2, axis=0), free.block_shape(2)
            ((32, 1), None)
        """
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}.")
        if self.block_size is None:
            return None
        shape = [1] * ndim
        shape[axis % ndim] = self.block_size
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class BlockRecipe:
    """The formats of a block-scaled matmul ``x (..., K) @ w (K, N)`` and of its two gradient
    matmuls (:func:`jax_scaled.nn.block_linear`): each matmul takes operands quantized in
    blocks along its own contracting axis.

    Args:
        x: the activations' format: blocks of ``x.block_size`` along ``K`` (forward) and
            along the flattened batch ``M`` (weight gradient).
        w: the weights' format: blocks ``w_block`` (forward), transposed (input gradient).
        grad: the output gradient's format: blocks of ``grad.block_size`` along ``N`` (input
            gradient) and along ``M`` (weight gradient).
        w_block: the weight's blocks ``(along K, along N)``: ``(w.block_size, 1)`` by default
            (MX), ``(128, 128)`` for square tiles; the first is ``w.block_size``.
        name: what the recipe is called, for reprs and messages (not compared).

    Where a recipe is expected, a format ``F`` means ``BlockRecipe(F, F, F)``
    (:func:`as_recipe`). Each operand's scales have its format's dtype and rounding.

    Example:
        >>> recipe = BlockRecipe(MXFP8_E4M3, MXFP4_E2M1, MXFP8_E5M2)
        >>> recipe == MXFP4_WEIGHTS, recipe.w_block, recipe.x_block
        (True, (32, 1), 32)
        >>> FP8_BLOCK128.w_block, FP8_BLOCK128.x.scale_rounding
        ((128, 128), 'rceil')
    """

    x: BlockFormat
    w: BlockFormat
    grad: BlockFormat
    w_block: tuple[int, int] | None = None
    name: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        for role in ("x", "w", "grad"):
            fmt = getattr(self, role)
            if not isinstance(fmt, BlockFormat):
                raise TypeError(
                    f"BlockRecipe's {role} is a js.formats.BlockFormat "
                    f"({preset_names(FORMATS)}, or your own), got {fmt!r}."
                )
            if fmt.block_size is None:
                raise ValueError(f"BlockRecipe's {role} format {fmt.name} needs a block_size.")
        w_block = (self.w.block_size, 1) if self.w_block is None else tuple(self.w_block)
        if len(w_block) != 2 or min(w_block) < 1 or w_block[0] != self.w.block_size:
            raise ValueError(
                f"w_block is (along K, along N) with w.block_size ({self.w.block_size}) along "
                f"K and a positive size along N, got {self.w_block}."
            )
        object.__setattr__(self, "w_block", tuple(int(b) for b in w_block))

    @property
    def x_block(self) -> int:
        """The activations' block size along a matmul's contracting axis: ``x.block_size``."""
        return self.x.block_size


def as_recipe(block: Any, where: str = "block", also: str = "") -> BlockRecipe:
    """``block`` as a recipe: a :class:`BlockRecipe` as it is, a :class:`BlockFormat` ``F`` as
    ``F`` everywhere (``BlockRecipe(F, F, F)``).

    Args:
        block: a recipe or a format.
        where: the argument, named in the error (``"dot_formats(block=...)"``).
        also: other accepted values to name in the error.

    Raises:
        TypeError: for anything else; the message lists the presets.

    Example:
        >>> as_recipe(MXFP8) is MXFP8, as_recipe(MXFP8_E4M3) == MXFP8_E4M3_GRADS
        (True, True)
        >>> as_recipe("MXFP8")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: block takes a js.formats.BlockRecipe (MXFP8, MXFP8_E4M3_GRADS, ...; got 'MXFP8'.
    """
    if isinstance(block, BlockRecipe):
        return block
    if isinstance(block, BlockFormat):
        return BlockRecipe(block, block, block, name=block.name)
    raise TypeError(
        f"{where} takes a js.formats.BlockRecipe ({preset_names(RECIPES)}; also js.nn.MXFP8, ...) "
        f"or a js.formats.BlockFormat, meaning that format everywhere ({preset_names(FORMATS)})"
        f"{also}; got {block!r}."
    )


def preset_names(presets: Sequence[Any]) -> str:
    """The names of ``presets``, for error messages that list what is accepted.

    Example:
        >>> preset_names(MX_FORMATS[:2])
        'MXFP8_E4M3, MXFP8_E5M2'
    """
    return ", ".join(p.name for p in presets)


MXFP8_E4M3 = BlockFormat("MXFP8_E4M3", ml_dtypes.float8_e4m3fn)
MXFP8_E5M2 = BlockFormat("MXFP8_E5M2", ml_dtypes.float8_e5m2)
MXFP6_E2M3 = BlockFormat("MXFP6_E2M3", ml_dtypes.float6_e2m3fn)
MXFP6_E3M2 = BlockFormat("MXFP6_E3M2", ml_dtypes.float6_e3m2fn)
MXFP4_E2M1 = BlockFormat("MXFP4_E2M1", ml_dtypes.float4_e2m1fn)

FP8_E4M3_BLOCK128 = BlockFormat(
    "FP8_E4M3_BLOCK128", ml_dtypes.float8_e4m3fn, 128, np.float32, scale_rounding="rceil"
)

MX_FORMATS: Sequence[BlockFormat] = (MXFP8_E4M3, MXFP8_E5M2, MXFP6_E2M3, MXFP6_E3M2, MXFP4_E2M1)
FORMATS: Sequence[BlockFormat] = (*MX_FORMATS, FP8_E4M3_BLOCK128)

MXFP8 = BlockRecipe(MXFP8_E4M3, MXFP8_E4M3, MXFP8_E5M2, name="MXFP8")
MXFP8_E4M3_GRADS = BlockRecipe(MXFP8_E4M3, MXFP8_E4M3, MXFP8_E4M3, name="MXFP8_E4M3_GRADS")
MXFP4_WEIGHTS = BlockRecipe(MXFP8_E4M3, MXFP4_E2M1, MXFP8_E5M2, name="MXFP4_WEIGHTS")
FP8_BLOCK128 = BlockRecipe(
    FP8_E4M3_BLOCK128, FP8_E4M3_BLOCK128, FP8_E4M3_BLOCK128, (128, 128), name="FP8_BLOCK128"
)

RECIPES: Sequence[BlockRecipe] = (MXFP8, MXFP8_E4M3_GRADS, MXFP4_WEIGHTS, FP8_BLOCK128)

__all__ = [
    "FORMATS",
    "FP8_BLOCK128",
    "FP8_E4M3_BLOCK128",
    "MXFP4_E2M1",
    "MXFP4_WEIGHTS",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "MXFP8_E4M3",
    "MXFP8_E4M3_GRADS",
    "MXFP8_E5M2",
    "MX_FORMATS",
    "RECIPES",
    "SCALE_ROUNDINGS",
    "BlockFormat",
    "BlockRecipe",
    "ScaleRounding",
    "as_recipe",
    "element_bits",
    "storage_dtype",
]
