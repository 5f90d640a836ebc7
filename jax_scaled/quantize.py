"""Block quantization: a tensor to narrow data with power-of-two block scales.

:func:`quantize` splits a tensor into blocks (the whole tensor, rows, MX's 32 elements along
an axis, 128x128 tiles, ...), gives each block a power-of-two scale from its largest
magnitude ``amax``, and rounds ``x / scale`` to the element format. The **scale rounding**
(``scale_rounding=``, a :class:`~jax_scaled.formats.BlockFormat`'s ``scale_rounding``) says
how ``amax`` sets the power of two:

* ``scale_rounding="floor"`` is the OCP MX v1.0 rule: ``2^(floor(log2(amax)) - emax)``, with
  ``emax`` the exponent of the format's largest finite value (E4M3: 8, E5M2: 15, E2M3: 2,
  E3M2: 4, E2M1: 2). ``amax / scale`` then lies in ``[2^emax, 2^(emax+1))``, above the
  largest finite value ``max`` when the block's largest mantissa exceeds ``max / 2^emax``
  (1.75 for E4M3, E5M2 and E3M2, 1.875 for E2M3, 1.5 for E2M1): such values **saturate** to
  ``+-max`` (for E4M3, ``|x| / scale`` in ``(448, 512)``). This is the rule of the MX spec
  and of torchao's default; it keeps one more binade of the block's small values.
* ``scale_rounding="rceil"``: ``2^ceil(log2(amax / max))`` (cuBLAS, Transformer Engine and
  ``jax.nn.scaled_dot_general``), computed exactly from the exponent and mantissa fields,
  so ``|x| / scale <= max``: it **never saturates**.

Formats wider than 8 bits (``float16``, ``bfloat16``, ``float32``) have range to spare, and
scalify's rules count on data that keeps headroom (a sum or product of data at the top of
float16 overflows): their blocks' largest magnitude maps to ``[2^t, 2^(t+1))``, ``t`` the
range guard's exponent (:func:`~jax_scaled.scales.guard.centre_exponent`; float16: 3), under
either rounding, and nothing saturates.

Rounding is to nearest, ties to even, with the format's subnormals, as ml_dtypes and XLA cast
(values below half the smallest subnormal flush to zero, keeping their sign). Scales are
powers of two in ``[2^-126, 2^127]``, the range of every jax_scaled scale (float32's normal
range, inside E8M0's ``[2^-127, 2^127]``): an all-zero block gets the smallest, ``2^-126``
(E8M0 has no zero), and the OCP exponent is clamped there (it differs from the spec's
``-127`` only for blocks whose ``amax`` is below ``2^(emax-126)``). Input values that are
float32 subnormals are divided exactly (XLA's CPU backend flushes them to zero in float
arithmetic). Non-finite values take no part in ``amax``; they become what the format has for
them (:func:`round_to_format`). The input is quantized from its float32
value.

Example:
    >>> q = quantize(jnp.array([[1.0, 3.0, 0.5, 500.0]]), jnp.float8_e4m3fn, block_shape=(1, 2))
    >>> q.scale.tolist(), q.data.astype(jnp.float32).tolist()  # 500 saturates to 448
    ([[0.0078125, 1.0]], [[128.0, 384.0, 0.5, 448.0]])
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.array import ScaledArray
from jax_scaled.block_quantization import block_scales, quantize_value, round_to_format
from jax_scaled.engine.registry import register_block_rule, register_scale_rule
from jax_scaled.formats import (
    FORMATS,
    RECIPES,
    BlockFormat,
    BlockRecipe,
    ScaleRounding,
    preset_names,
)
from jax_scaled.pow2.static import is_static_one
from jax_scaled.primitives import stop_scaling


def quantize(
    x: Any,
    dtype: DTypeLike | BlockFormat | str,
    *,
    block_shape: Sequence[int] | None = None,
    axis: int | None = None,
    scale_rounding: ScaleRounding | None = None,
    scale_dtype: DTypeLike | None = None,
    scale_rule: ScaleRounding | None = None,
    exact_subnormals: bool = True,
) -> ScaledArray:
    """Quantize ``x`` to element format ``dtype`` with one power-of-two scale per block.

    The module docstring gives the scale roundings, which values saturate, rounding, zero blocks
    and non-finite values.

    Args:
        x: an array (any float or integer dtype) or a ScaledArray (requantized from its
            float32 value).
        dtype: the element format (``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``,
            ``jnp.float6_e2m3fn``, ``jnp.float6_e3m2fn``, ``jnp.float4_e2m1fn``, or any
            ml_dtypes float), or a :class:`~jax_scaled.formats.BlockFormat` such as
            ``js.formats.MXFP8_E4M3`` (its blocks lie along ``axis``, default -1; its scale
            dtype and rounding are the defaults of ``scale_dtype`` and ``scale_rounding``);
            a dtype or a preset may be given by name (``"float8_e4m3fn"``, ``"mxfp8_e4m3"``).
            A recipe (``js.nn.MXFP8``) is refused: it holds three formats.
        block_shape: the elements one scale covers, one entry per axis of ``x``, each
            dividing the axis (no padding); ``-1`` spans the whole axis (``(1, -1)``: one
            scale per row). None (default): one 0-d scale for the tensor. Under
            ``jax.vmap``, give each example one scale with ``(-1, ..., -1)`` (shape
            ``(1, ..., 1)``, stacked to ``(B, 1, ..., 1)``): stacked 0-d scales are no
            valid scale of the stacked data.
        axis: with a format that has a block size (the presets), the axis its blocks lie
            along.
        scale_rounding: ``"floor"`` (OCP MX, may saturate; the default for a dtype) or
            ``"rceil"`` (never saturates); None: the format's.
        scale_dtype: ``jnp.float32`` (the default for a dtype) or ``jnp.float8_e8m0fnu`` (the
            presets' default); None: the format's.
        scale_rule: deprecated name of ``scale_rounding`` (warns ``DeprecationWarning``).
        exact_subnormals: True (default): float32-subnormal values of ``x`` are divided by
            their scale exactly, even where the platform's float arithmetic flushes them
            (XLA's CPU backend). False: they count as that arithmetic counts them (zero
            where it flushes, exact elsewhere), which saves two thirds of the instructions
            of the kernel writing the elements. The result is the same for an ``x`` computed
            by float arithmetic in the same program, which a flushing platform never leaves
            subnormal: js.optim stores its updated state this way. A ScaledArray's value
            is such a product (``data * scale``), so it is quantized without the exact
            path either way, unless its scale is a trace-time 1 on bfloat16 data or data of
            float32 or wider.

    Returns:
        A ScaledArray of ``x``'s shape: data in the element format (float6 in a
        ``float8_e4m3fn`` container), scale of shape ``x.shape // block_shape`` (0-d per
        tensor).

    **Gradients** are straight-through (a ``jax.custom_jvp``): the tangent of the quantized
    value is the input's tangent, rounding and saturation passing it unchanged (saturated
    values get their gradient). JAX gives a tangent its primal's dtype, so outside scalify
    the data's tangent is ``dx / scale`` cast to the element format: the gradient is rounded
    to that format at the forward's block scale (and overflows it where ``dx`` is far above
    ``x``). Inside :func:`~jax_scaled.scalify` (a scalified train step) the ``quantize``
    primitive passes the tangent on cast to the element format, and tangents carry scales
    of their own.

    **Inside scalify** a plain array or a per-tensor ScaledArray is quantized too, and the
    scalified function can return the block-scaled result. While scalify traces under
    :func:`tracing_for_scalify`, ``quantize`` binds the ``quantize`` primitive instead: the
    traced program gets a plain array of the element dtype, which scalify holds as the
    block-scaled ScaledArray and later operations propagate (without it, the traced program
    holds a ScaledArray of traced data and scale, which ``jax.numpy`` cannot take).

    Example:
        >>> x = jnp.arange(64.0).reshape(2, 32) % 16 - 8  # values E4M3 holds exactly
        >>> q = quantize(x, js.formats.MXFP8_E4M3, axis=-1)
        >>> q.data.dtype, q.scale.dtype, q.scale.shape, q.block_shape
        (dtype(float8_e4m3fn), dtype(float8_e8m0fnu), (2, 1), (1, 32))
        >>> bool((q.to_array(jnp.float32) == x).all())
        True
        >>> quantize(jnp.array([[1.0, 480.0]]), jnp.float8_e4m3fn, block_shape=(1, 2),
        ...          scale_rounding="rceil").to_array(jnp.float32).tolist()  # "floor": 448
        [[1.0, 480.0]]
    """
    if scale_rule is not None:
        warnings.warn(
            "quantize(scale_rule=...) is deprecated: the choice is named scale_rounding=.",
            DeprecationWarning,
            stacklevel=2,
        )
        if scale_rounding is not None:
            raise TypeError("quantize: pass scale_rounding= only (scale_rule= is its old name).")
        scale_rounding = scale_rule
    fmt, blocks = _resolve(np.shape(x), dtype, block_shape, axis, scale_rounding, scale_dtype)
    return _quantized(x, fmt, blocks, bool(exact_subnormals), read_elsewhere=False)


def quantize_read_elsewhere(
    x: Any,
    dtype: DTypeLike,
    *,
    block_shape: Sequence[int],
    scale_rounding: ScaleRounding | None = None,
    scale_dtype: DTypeLike | None = None,
    exact_subnormals: bool = True,
) -> ScaledArray:
    """:func:`quantize` of a value that the program also reads elsewhere: XLA stores such a
    value once for all its readers, so the quantization does not store a copy of its own
    (:func:`~jax_scaled.block_quantization.quantize_value`). js.optim stores an optimizer's
    new moments, which the update reads as well, this way. The same result as
    :func:`quantize`.

    Example:
        >>> x = jnp.arange(64.0).reshape(2, 32) % 16 - 8
        >>> q = quantize_read_elsewhere(x, jnp.float8_e4m3fn, block_shape=(1, 32))
        >>> bool((q.data == quantize(x, jnp.float8_e4m3fn, block_shape=(1, 32)).data).all())
        True
    """
    fmt, blocks = _resolve(np.shape(x), dtype, block_shape, None, scale_rounding, scale_dtype)
    return _quantized(x, fmt, blocks, bool(exact_subnormals), read_elsewhere=True)


def _quantized(
    x: Any, fmt: BlockFormat, blocks: tuple[int, ...] | None, exact: bool, read_elsewhere: bool
) -> ScaledArray:
    if isinstance(x, ScaledArray):
        value, exact = _value_of(x, exact)
        return quantize_value(value, fmt, blocks, exact, read_elsewhere)
    if in_scalify_trace():
        return quantize_p.bind(jnp.asarray(x), **_params(fmt, blocks, exact, read_elsewhere))
    value = stop_scaling(jnp.asarray(x), jnp.float32)
    return quantize_value(value, fmt, blocks, exact, read_elsewhere)


def _value_of(x: ScaledArray, exact_subnormals: bool) -> tuple[jax.Array, bool]:
    """``x``'s float32 value and whether quantizing it needs the exact division of float32
    subnormals. It does not when the value is a product ``data * scale`` (float arithmetic,
    which a platform that flushes subnormals never leaves subnormal; where they are kept,
    the product by the block's reciprocal is exact) or the data's own subnormals are
    float32 normals (float16, float8): the same bits, with two thirds fewer instructions
    where the elements are written."""
    info = jnp.finfo(x.dtype)
    narrow = info.smallest_subnormal >= jnp.finfo(jnp.float32).smallest_normal
    # Wider data (float64) is multiplied in its own dtype, then rounded to float32.
    multiplied = not is_static_one(x.scale) and info.bits <= 32
    return x.to_array(jnp.float32), exact_subnormals and not (narrow or multiplied)


# -- resolving the arguments ----------------------------------------------------------------


def _resolve(
    shape: tuple[int, ...],
    dtype: DTypeLike | BlockFormat | str,
    block_shape: Sequence[int] | None,
    axis: int | None,
    scale_rounding: str | None,
    scale_dtype: DTypeLike | None,
) -> tuple[BlockFormat, tuple[int, ...] | None]:
    """The format (without block size: element dtype, scale dtype and rounding) and the block
    shape (None: one scale for the tensor) of a :func:`quantize` call."""
    fmt = _as_format(dtype)
    if fmt.block_size is not None:
        if block_shape is not None:
            raise ValueError(f"{fmt.name} sets the block shape: pass axis=, not block_shape=.")
        block_shape = fmt.block_shape(len(shape), -1 if axis is None else axis)
    elif axis is not None:
        raise ValueError(
            "axis= applies to a block format with a block size (js.formats.MXFP8_E4M3, ...); "
            "pass block_shape=."
        )
    fmt = BlockFormat(
        fmt.name,
        fmt.element_dtype,
        None,
        fmt.scale_dtype if scale_dtype is None else scale_dtype,
        fmt.scale_rounding if scale_rounding is None else scale_rounding,
    )
    return fmt, None if block_shape is None else _blocks(shape, block_shape)


def _as_format(dtype: DTypeLike | BlockFormat | str) -> BlockFormat:
    """``dtype`` as a format: a format as it is, a preset's name as the preset, a dtype (or
    its name) as the format of its elements with float32 scales, rounded ``"floor"``."""
    if isinstance(dtype, str):
        dtype = _named_format(dtype)
    if isinstance(dtype, BlockFormat):
        return dtype
    if isinstance(dtype, BlockRecipe):
        raise TypeError(
            f"quantize takes one format, not a recipe ({dtype.name or dtype}): pass one of its "
            f"formats (.x, .w, .grad) or a preset of js.formats ({preset_names(FORMATS)})."
        )
    try:
        element = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"quantize takes a format: a js.formats.BlockFormat ({preset_names(FORMATS)}) or a "
            f"floating dtype such as jnp.float8_e4m3fn; got {dtype!r}."
        ) from None
    if not jnp.issubdtype(element, jnp.floating):
        raise TypeError(f"quantize needs a floating element format, got {element}.")
    return BlockFormat(element.name, element, None, np.float32)


def _named_format(name: str) -> BlockFormat | np.dtype:
    """A preset of js.formats by its name (any case) or a dtype by its numpy name."""
    presets = {f.name.lower(): f for f in FORMATS}
    if name.lower() in presets:
        return presets[name.lower()]
    try:
        return np.dtype(name)
    except TypeError:
        recipe = [r.name for r in RECIPES if r.name.lower() == name.lower()]
        hint = f" ({recipe[0]} is a recipe of three formats)" if recipe else ""
        raise ValueError(
            f"unknown format {name!r}{hint}: pass a preset of js.formats "
            f"({preset_names(FORMATS)}, by object or name) or a floating dtype such as "
            "jnp.float8_e4m3fn."
        ) from None


def _params(
    fmt: BlockFormat,
    block_shape: tuple[int, ...] | None,
    exact_subnormals: bool,
    read_elsewhere: bool = False,
) -> dict[str, Any]:
    """The parameters of the ``quantize`` primitive."""
    return {
        "element_dtype": fmt.element_dtype,
        "block_shape": block_shape,
        "scale_rounding": fmt.scale_rounding,
        "scale_dtype": fmt.scale_dtype,
        "exact_subnormals": exact_subnormals,
        "read_elsewhere": read_elsewhere,
    }


def _from_params(
    element_dtype: np.dtype,
    block_shape: tuple[int, ...] | None,
    scale_rounding: str,
    scale_dtype,
    exact_subnormals: bool = True,
    read_elsewhere: bool = False,
) -> tuple[BlockFormat, tuple[int, ...] | None, bool, bool]:
    """The format, block shape, subnormal handling and ``read_elsewhere`` of the
    ``quantize`` primitive's parameters."""
    name = np.dtype(element_dtype).name
    fmt = BlockFormat(name, element_dtype, None, scale_dtype, scale_rounding)
    return fmt, block_shape, exact_subnormals, read_elsewhere


def _blocks(shape: tuple[int, ...], block_shape: Sequence[int]) -> tuple[int, ...]:
    """``block_shape`` with ``-1`` entries resolved, checked to tile ``shape``."""
    block_shape = tuple(int(b) for b in block_shape)
    if len(block_shape) != len(shape):
        raise ValueError(
            f"block_shape {block_shape} needs one entry per axis of an array of shape {shape}."
        )
    blocks = tuple(n if b == -1 else b for n, b in zip(shape, block_shape, strict=True))
    if any(b < 1 or n % b for n, b in zip(shape, blocks, strict=True)):
        raise ValueError(
            f"block_shape {block_shape} does not tile an array of shape {shape}: every entry "
            "must divide its axis (or be -1, the whole axis); quantize does not pad."
        )
    return blocks


# -- under scalify: the quantize primitive ------------------------------------------------


@contextlib.contextmanager
def tracing_for_scalify() -> Iterator[None]:
    """Context in which :func:`quantize` binds the ``quantize`` primitive: for scalify to
    enter while it traces a function, so that a quantized value is a plain array of the
    traced program (held by scalify as a block-scaled ScaledArray).

    Example:
        >>> with tracing_for_scalify():
        ...     in_scalify_trace()
        True
    """
    with context.entered(scalify_tracing=True):  # as scalify's call context does
        yield


def in_scalify_trace() -> bool:
    """True inside :func:`tracing_for_scalify`, or while scalify traces (in this thread).

    Example:
        >>> in_scalify_trace()
        False
    """
    return context.current().scalify_tracing


def _quantize_impl(x, **params) -> jax.Array:
    """Outside scalify (scale 1): ``x`` rounded to the element format, saturating."""
    return round_to_format(x.astype(jnp.float32), params["element_dtype"])


def _quantize_batcher(args, dims, *, block_shape, **params):
    """Each example is quantized alone: a block of 1 along the batch axis."""
    (x,), (axis,) = args, dims
    if block_shape is None:  # one scale per example
        block_shape = tuple(n for d, n in enumerate(x.shape) if d != axis)
    batched = (*block_shape[:axis], 1, *block_shape[axis:])
    return quantize_p.bind(x, block_shape=batched, **params), axis


quantize_p = jxi.define_primitive(
    "quantize", _quantize_impl, straight_through=True, batcher=_quantize_batcher
)


@register_scale_rule(quantize_p, applies_to_unscaled=True)
def _quantize_rule(x, **params) -> ScaledArray:
    """A plain, per-tensor or block-scaled ``x`` quantized from its float32 value."""
    fmt, blocks, exact, read_elsewhere = _from_params(**params)
    if isinstance(x, ScaledArray):
        value, exact = _value_of(x, exact)
    else:
        value = x.astype(jnp.float32)
    return quantize_value(value, fmt, blocks, exact, read_elsewhere)


register_block_rule(quantize_p)(_quantize_rule)


__all__ = [
    "block_scales",
    "in_scalify_trace",
    "quantize",
    "quantize_p",
    "quantize_read_elsewhere",
    "round_to_format",
    "tracing_for_scalify",
]
