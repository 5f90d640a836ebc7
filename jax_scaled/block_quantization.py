"""The arithmetic of block quantization (:mod:`jax_scaled.quantize` is the API, and its notes
the rules): each block's power-of-two scale from its largest finite magnitude, the elements
divided by it exactly and rounded to the element format."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled.array import ScaledArray, expand_scale
from jax_scaled.formats import BlockFormat, storage_dtype
from jax_scaled.pow2.static import EXPONENT_BIAS, EXPONENT_FIELD, MANTISSA_BITS
from jax_scaled.pow2.traced import biased_exponent, pow2_from_exponent, pow2_reciprocal
from jax_scaled.pow2.xla import computed_once_per_block, stored_once
from jax_scaled.scales import centre_exponent, top_of_format

_MANTISSA_MASK = np.uint32((1 << MANTISSA_BITS) - 1)
# int32 forms of float32 bit fields, for block_scales and _divide.
_EXPONENT_FIELD = np.int32(EXPONENT_FIELD)
_MANTISSA_FIELD = np.int32(_MANTISSA_MASK)
_SIGN_BIT = np.int32(-(2**31))
_MANTISSA_BITS_IN_FIELD = np.int32(MANTISSA_BITS << MANTISSA_BITS)  # 2^-23 as an exponent shift


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def quantize_value(
    value: jax.Array,
    fmt: BlockFormat,
    block_shape: tuple[int, ...] | None,
    exact_subnormals: bool = True,
    read_elsewhere: bool = False,
) -> ScaledArray:
    """``value`` (float32) quantized to ``fmt`` in blocks of ``block_shape`` (None: one
    scale for the tensor), as :func:`~jax_scaled.quantize.quantize` describes (and its
    ``exact_subnormals``).

    Block quantization reads ``value`` twice (the blocks' maxima, the elements), and XLA
    computes a producer again in each reader it fuses into, so ``value`` is stored once
    (:func:`~jax_scaled.pow2.xla.stored_once`), unless ``read_elsewhere``: a value that the
    program also reads outside the quantization (an optimizer's new moment, which the
    update reads too) is stored once by XLA itself for all its readers, and the remainder
    would store a copy that only the quantization reads, leaving the other readers to
    compute the value again.

    Example:
        >>> fmt = js.formats.BlockFormat("E4M3", jnp.float8_e4m3fn, 2, scale_rounding="rceil")
        >>> q = quantize_value(jnp.array([448.0, 1.0, 449.0, 0.0]), fmt, (2,))
        >>> q.scale.tolist(), q.data.astype(jnp.float32).tolist()
        ([1.0, 2.0], [448.0, 1.0, 224.0, 0.0])
    """
    if block_shape is not None and not read_elsewhere:
        value = stored_once(value)
    scale = lax.stop_gradient(block_scales(value, fmt, block_shape))
    if scale.ndim:  # the kernel writing the elements reads them, not the blocks' maxima
        scale = computed_once_per_block(scale)
    in_range = fmt.scale_rounding == "rceil"
    data = _to_elements(value, scale, fmt.element_dtype, in_range, exact_subnormals)
    return ScaledArray._trusted(data, scale.astype(fmt.scale_dtype))


def block_scales(
    value: jax.Array, fmt: BlockFormat, block_shape: Sequence[int] | None = None
) -> jax.Array:
    """The float32 power-of-two scale of every block of ``value`` under ``fmt``'s scale
    rounding and element format.

    Args:
        value: a float32 array.
        fmt: the format (its element dtype and ``scale_rounding``).
        block_shape: the blocks, dividing ``value``'s shape (no ``-1``); None: ``fmt``'s
            blocks along the last axis, or one scale for the tensor without a block size.

    Example:
        >>> fmt = js.formats.BlockFormat("E4M3", jnp.float8_e4m3fn, 2, scale_rounding="rceil")
        >>> block_scales(jnp.array([[448.0, 1.0, 449.0, 0.0]]), fmt).tolist()
        [[1.0, 2.0]]
    """
    if block_shape is None:
        block_shape = fmt.block_shape(jnp.ndim(value)) if jnp.ndim(value) else None
    amax = _block_amax(value, None if block_shape is None else tuple(block_shape))
    top = _top(fmt.element_dtype)
    emax = int(np.frexp(top)[1]) - 1
    # floor(log2(amax)) - emax on the exponent field of amax (finite, not negative): a zero
    # or subnormal amax counts as 2^-126, and the scale is clamped to [2^-126, 2^127].
    amax_bits = lax.bitcast_convert_type(amax, jnp.int32)
    field = lax.sub(lax.bitwise_and(amax_bits, _EXPONENT_FIELD), np.int32(emax << MANTISSA_BITS))
    top_mantissa = top.view(np.uint32) & _MANTISSA_MASK
    if fmt.scale_rounding == "rceil" and top_mantissa != _MANTISSA_MASK:
        # + 1 where amax's mantissa is above top's (never, for a top with a full mantissa)
        above = lax.gt(lax.bitwise_and(amax_bits, _MANTISSA_FIELD), np.int32(top_mantissa))
        field = lax.add(field, lax.shift_left(above.astype(jnp.int32), np.int32(MANTISSA_BITS)))
    field = lax.max(field, np.int32(1 << MANTISSA_BITS))
    if emax < 1:  # the scale of the largest amax could pass 2^127
        field = lax.min(field, np.int32(EXPONENT_FIELD - (1 << MANTISSA_BITS)))
    return lax.bitcast_convert_type(field, jnp.float32)


def _top(dtype: np.dtype) -> np.float32:
    """The value a block's largest magnitude maps near: the format's largest for 8 bits and
    fewer (OCP MX); below ``2^(t+1)`` for wider formats (see the module notes), with a full
    mantissa, so that ``rceil`` gives ``floor``'s scale.

    Example:
        >>> float(_top(np.dtype(jnp.float8_e4m3fn))), float(_top(np.dtype(jnp.float16)))
        (448.0, 15.999999046325684)
    """
    if top_of_format(dtype):
        return np.float32(ml_dtypes.finfo(dtype).max)
    return np.nextafter(np.float32(2.0 ** (centre_exponent(dtype) + 1)), np.float32(0))


def _block_amax(value: jax.Array, block_shape: tuple[int, ...] | None) -> jax.Array:
    """The largest finite magnitude of every block (0-d for ``None``: the whole tensor)."""
    magnitude = jnp.where(jnp.isfinite(value), jnp.abs(value), np.float32(0))
    # The maximum of the bits, which order finite magnitudes as their values do: an integer
    # reduction that XLA:CPU fuses with the magnitude (and its producers) into one kernel,
    # where its YNNPACK float reduction of 4096 elements or more materialised it first.
    bits = lax.bitcast_convert_type(magnitude, jnp.int32)
    if block_shape is None:
        return lax.bitcast_convert_type(jnp.max(bits), jnp.float32)
    grid = [n // b for n, b in zip(value.shape, block_shape, strict=True)]
    interleaved = [n for pair in zip(grid, block_shape, strict=True) for n in pair]
    block_axes = tuple(range(1, 2 * value.ndim, 2))
    largest = jnp.max(bits.reshape(interleaved), axis=block_axes)
    return lax.bitcast_convert_type(largest, jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _to_elements(
    value: jax.Array,
    scale: jax.Array,
    element_dtype: np.dtype,
    in_range: bool,
    exact_subnormals: bool = True,
) -> jax.Array:
    """``value / scale`` (block scales) rounded to the element format, saturating.
    ``in_range``: the scales are ``rceil``'s, under which no finite quotient passes the
    format's largest value, so that only the cast is left of the rounding (where the format
    is its own storage dtype). ``exact_subnormals``: see :func:`_divide`."""
    quotient = _divide(value, scale, exact_subnormals)
    if in_range and storage_dtype(element_dtype) == np.dtype(element_dtype):
        return quotient.astype(element_dtype)
    return round_to_format(quotient, element_dtype)


def _divide(x: jax.Array, scale: jax.Array, exact_subnormals: bool = True) -> jax.Array:
    """``x / scale`` for float32 ``x`` and the block scales of :func:`block_scales`, powers of
    two in ``[2^-126, 2^126]`` (a format's top is at least 4, and no amax reaches 2^128).

    ``x`` times the reciprocal of its scale, exact; a float32-subnormal ``x``, which XLA's
    CPU backend flushes to zero in float arithmetic, as ``2^126 x`` (its integer mantissa
    times ``2^-23``, a normal number) times ``2^-126 / scale``. A quotient below float32's
    normal range is flushed where the platform flushes subnormals: below the smallest value
    of every 8- and 16-bit format but bfloat16. Both factors are worked out per block,
    before they are expanded onto the elements.

    ``exact_subnormals=False`` keeps the product alone (the kernel writing an Adam moment's
    float16 blocks: 14 instructions instead of 43): a float32-subnormal ``x`` then counts as
    the platform's float arithmetic counts it, zero where it flushes subnormals, exact
    elsewhere. That is the same quotient for an ``x`` that this program's float arithmetic
    computed, which a flushing platform never leaves subnormal.
    """
    quotient = x * expand_scale(pow2_reciprocal(scale), x.shape)
    if not exact_subnormals:
        return quotient
    bits = lax.bitcast_convert_type(x, jnp.int32)
    subnormal = lax.eq(lax.bitwise_and(bits, _EXPONENT_FIELD), np.int32(0))  # zeros too
    mantissa = lax.convert_element_type(lax.bitwise_and(bits, _MANTISSA_FIELD), jnp.float32)
    # Times 2^-23 on the exponent field (0 stays 0): XLA would fold a multiplication by the
    # constant into the block factor, a product that is itself subnormal.
    unit = lax.sub(lax.bitcast_convert_type(mantissa, jnp.int32), _MANTISSA_BITS_IN_FIELD)
    raised = lax.bitwise_or(lax.max(unit, np.int32(0)), lax.bitwise_and(bits, _SIGN_BIT))
    below_normal = expand_scale(_below_normal_factor(scale), x.shape)
    from_subnormal = lax.mul(lax.bitcast_convert_type(raised, jnp.float32), below_normal)
    return lax.select(subnormal, from_subnormal, quotient)


def _below_normal_factor(scale: jax.Array) -> jax.Array:
    """``2^-126 / scale`` for block scales in ``[2^-126, 2^127]``, on the exponent field
    (``2^-e`` has bits ``(254 << 23) - bits(2^e)``, and 2^-126 is 126 binades lower); 0
    where the quotient is below float32's normal range."""
    bits = lax.bitcast_convert_type(scale, jnp.int32)
    quotient = lax.sub(np.int32((EXPONENT_BIAS + 1) << MANTISSA_BITS), bits)
    return lax.bitcast_convert_type(lax.max(quotient, np.int32(0)), jnp.float32)


@_to_elements.defjvp
def _to_elements_jvp(
    element_dtype: np.dtype, in_range: bool, exact_subnormals: bool, primals, tangents
):
    """Straight-through: the tangent is divided by the scale, neither rounded nor clipped."""
    (value, scale), (tangent, _) = primals, tangents
    out = _to_elements(value, scale, element_dtype, in_range, exact_subnormals)
    return out, (tangent / expand_scale(scale, value.shape)).astype(out.dtype)


def round_to_format(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """Float32 ``x`` rounded to the nearest value of format ``dtype`` (ties to even, the
    format's subnormals kept), finite values beyond its largest clipped to it, in
    :func:`~jax_scaled.formats.storage_dtype` (for float6: rounded here, as XLA cannot
    cast to it; elsewhere XLA's cast, which is ml_dtypes'). Infinities become what the
    format has for them: ``inf`` (E5M2), NaN (E4M3), the largest value (E2M1, float6);
    NaN stays NaN, except in E2M1, which has none (a zero, as ml_dtypes casts).

    Example:
        >>> round_to_format(jnp.array([0.3, 9.0, 1e9]), jnp.float6_e2m3fn).tolist()
        [0.25, 7.5, 7.5]
    """
    top = np.float32(ml_dtypes.finfo(dtype).max)
    storage = storage_dtype(dtype)
    if storage != np.dtype(dtype):  # float6: no infinities (inf saturates, as in ml_dtypes)
        return _round_to_grid(lax.clamp(-top, x, top), ml_dtypes.finfo(dtype)).astype(storage)
    return jnp.where(jnp.isfinite(x), lax.clamp(-top, x, top), x).astype(storage)


def _round_to_grid(x: jax.Array, finfo: Any) -> jax.Array:
    """Round to the values of a format with ``finfo.nmant`` mantissa bits and smallest normal
    exponent ``finfo.minexp``: a multiple of ``2^(max(e, minexp) - nmant)`` for ``x`` in
    ``[2^e, 2^(e+1))``, ties to even (multiplications by powers of two are exact)."""
    exponent = lax.sub(biased_exponent(lax.abs(x)), np.int32(EXPONENT_BIAS))
    step = pow2_from_exponent(lax.max(exponent, np.int32(finfo.minexp)) - np.int32(finfo.nmant))
    return lax.round(x / step, lax.RoundingMethod.TO_NEAREST_EVEN) * step
