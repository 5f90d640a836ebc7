"""Stochastic rounding to any float format: unbiased, deterministic for a given key.

``x`` lies between two neighbouring values ``low <= x <= high`` of the format. Stochastic
rounding returns ``high`` with probability ``(x - low) / (high - low)`` and ``low``
otherwise, so that its expectation is ``x``: small updates and gradients are not lost on
average, where round-to-nearest would always round them away.

**How.** In float32 (float64 for float64 inputs), ``|x|`` is divided by the format's spacing
at ``|x|``, ``2^(max(e, emin) - mantissa_bits)`` for ``|x|`` in ``[2^e, 2^(e+1))`` (the
``emin`` clamp gives the format's subnormals their fixed spacing): the quotient's integer
part counts whole spacings, its fraction is the probability of rounding up. One uniform
32-bit random integer per element decides. Every step is exact (powers of two built from
bits, no ``log2`` or ``exp2``), so the rounding is exactly unbiased whenever the input's
bits below the format's spacing fit in 32 bits: every float32, float16 and bfloat16 input
down to 2^-9 of the format's smallest subnormal. Below that, the probability is rounded up to
a multiple of 2^-32 (a bias under 2^-32 of the smallest subnormal).

**Format conventions**, as for the casts of :mod:`jax_scaled.ops.casts`: the result is
``x``'s neighbour cast to the format, so a value above the largest finite value that rounds
up overflows as the format defines (``inf``, ``NaN`` for the ``fn``/``fnuz`` float8 formats,
``±6`` for ``float4_e2m1fn``); there the rounding cannot be unbiased. ``inf`` and ``NaN``
inputs become what a cast makes of them. Formats that hold every value of ``x``'s dtype
(``float8`` to ``float16``, say) are a plain cast, without randomness. XLA CPU flushes
float32 subnormals to zero, so there float32 inputs below 2^-126 (the subnormal range of
bfloat16) round to zero.

**Under scalify** the rounding applies to a ScaledArray's data and keeps its scale, like
``convert_element_type``'s rule, range guard included (:class:`~jax_scaled.ScalifyConfig`):
data that would leave the narrow format's comfortable band moves a power of two into the
scale first. It is a primitive with a batching rule, so it keeps its scale rule under
``vmap`` traced inside scalify.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.scales import guard_factors, make_scale, scale_f32, scale_mul, times_scalar, widened

RoundingMode = Literal["nearest", "stochastic"]
ROUNDING_MODES = ("nearest", "stochastic")


def stochastic_round(x: jax.Array, dtype: jnp.dtype, key: jax.Array) -> jax.Array:
    """``x`` rounded stochastically to the values of ``dtype``, returned in ``dtype``.

    Unbiased: ``E[stochastic_round(x)] == x`` for ``x`` within the format's finite range
    (see the module notes). Deterministic for a given ``key``; jittable and vmappable.
    Under scalify a ScaledArray's data is rounded and its scale kept. The derivative is
    the identity (straight-through).

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the float format to round to, e.g. ``jnp.float8_e4m3fn``.
        key: a PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``).

    Returns:
        An array of ``x``'s shape and dtype ``dtype``.

    Example:
        >>> from jax_scaled.ops.stochastic import stochastic_round
        >>> x = jnp.full(10_000, 1 + 2.0**-5)  # between the E4M3 values 1 and 1.125
        >>> y = stochastic_round(x, jnp.float8_e4m3fn, jax.random.key(0))
        >>> sorted(set(y.astype(float).tolist())), round(float(y.astype(float).mean()), 2)
        ([1.0, 1.125], 1.03)
    """
    return round_with_bits(x, dtype, random_bits(key, jnp.shape(x)))


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The uniform uint32 random integers that decide a stochastic rounding of ``shape``.

    Args:
        key: a PRNG key.
        shape: the shape of the array to round.

    Returns:
        A uint32 array of ``shape``.

    Example:
        >>> from jax_scaled.ops.stochastic import random_bits
        >>> random_bits(jax.random.key(0), (2, 3)).dtype
        dtype('uint32')
    """
    return jax.random.bits(key, shape, jnp.uint32)


def round_with_bits(x: jax.Array, dtype: jnp.dtype, bits: jax.Array) -> jax.Array:
    """``x`` rounded to ``dtype``, up where ``bits < (x - low) / (high - low) * 2^32``.

    The deterministic core of :func:`stochastic_round`: ``bits`` are uint32 of ``x``'s
    shape, uniform for an unbiased rounding.

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the float format to round to.
        bits: uint32 integers of ``x``'s shape.

    Returns:
        An array of ``x``'s shape and dtype ``dtype``.

    Example:
        >>> from jax_scaled.ops.stochastic import round_with_bits
        >>> x = jnp.full(2, 1 + 2.0**-5)  # a quarter of the way from 1 to 1.125 in E4M3
        >>> bits = jnp.array([2**30 - 1, 2**30], jnp.uint32)
        >>> round_with_bits(x, jnp.float8_e4m3fn, bits)
        Array([1.125, 1], dtype=float8_e4m3fn)
    """
    bits = lax.convert_element_type(bits, jnp.uint32)
    if jnp.shape(bits) != jnp.shape(x):
        raise ValueError(f"bits of shape {jnp.shape(bits)} for x of shape {jnp.shape(x)}.")
    return stochastic_round_p.bind(x, bits, dtype=jnp.dtype(dtype))


def check_rounding(rounding: str, key: jax.Array | None) -> bool:
    """True for ``"stochastic"``, False for ``"nearest"``; a clear error otherwise, or when
    stochastic rounding is asked for without a key.

    Args:
        rounding: the rounding mode asked for.
        key: the PRNG key given with it, or None.

    Returns:
        Whether the rounding is stochastic.

    Example:
        >>> from jax_scaled.ops.stochastic import check_rounding
        >>> check_rounding("nearest", None), check_rounding("stochastic", jax.random.key(0))
        (False, True)
    """
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}.")
    if rounding == "stochastic" and key is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed) "
            "(split it for every call whose rounding must be independent)."
        )
    return rounding == "stochastic"


# -- the rounding, elementwise ------------------------------------------------------------


def _round_impl(x: jax.Array, bits: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    if _holds_all_values(dtype, x.dtype):
        return lax.convert_element_type(x, dtype)  # exact: nothing to round
    work = compute_dtype(x.dtype)
    wide = lax.convert_element_type(x, work)
    finite = lax.is_finite(wide)
    magnitude = lax.select(finite, lax.abs(wide), lax.full_like(wide, 0))
    info = ml_dtypes.finfo(dtype)
    exponent = lax.max(_floor_log2(magnitude), np.int32(info.minexp))
    spacing = lax.sub(exponent, np.int32(info.nmant))  # log2 of the format's spacing
    spacings = _times_pow2(magnitude, lax.neg(spacing))  # exact: a power-of-two scaling
    low = lax.floor(spacings)
    up = lax.lt(bits, _threshold(lax.sub(spacings, low)))
    rounded = _times_pow2(lax.add(low, lax.convert_element_type(up, work)), spacing)
    signed = lax.select(finite, _copy_sign(rounded, wide), wide)
    return lax.convert_element_type(signed, dtype)


def _holds_all_values(dtype: jnp.dtype, source: jnp.dtype) -> bool:
    """True when every value of ``source`` is a value of ``dtype`` (a cast is exact)."""
    fmt, src = ml_dtypes.finfo(dtype), ml_dtypes.finfo(source)
    return (
        fmt.nmant >= src.nmant
        and fmt.maxexp >= src.maxexp
        and fmt.minexp - fmt.nmant <= src.minexp - src.nmant
    )


def _int_type(work: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(f"int{jnp.finfo(work).bits}")


def _floor_log2(magnitude: jax.Array) -> jax.Array:
    """``e`` (int32) for ``magnitude`` in ``[2^e, 2^(e+1))``; ``emin - 1`` for subnormals
    and zero, below every format's clamp."""
    info = jnp.finfo(magnitude.dtype)
    bits = lax.bitcast_convert_type(magnitude, _int_type(magnitude.dtype))
    field = lax.shift_right_logical(bits, np.asarray(info.nmant, bits.dtype))
    exponent = lax.sub(field, np.asarray(1 - info.minexp, bits.dtype))
    return lax.convert_element_type(exponent, jnp.int32)


def _pow2(exponent: jax.Array, work: jnp.dtype) -> jax.Array:
    """``2^exponent`` in ``work`` from bits, for ``exponent`` in its normal range."""
    info = jnp.finfo(work)
    int_type = _int_type(work)
    biased = lax.convert_element_type(lax.add(exponent, np.int32(1 - info.minexp)), int_type)
    field = lax.shift_left(biased, np.asarray(info.nmant, int_type))
    return lax.bitcast_convert_type(field, work)


def _times_pow2(value: jax.Array, exponent: jax.Array) -> jax.Array:
    """``value * 2^exponent``, exactly (two normal factors: ``2^exponent`` itself may not
    be a normal float, as for bfloat16's subnormal spacing 2^-133)."""
    half = lax.shift_right_arithmetic(exponent, np.int32(1))
    first = lax.mul(value, _pow2(half, value.dtype))
    return lax.mul(first, _pow2(lax.sub(exponent, half), value.dtype))


def _threshold(fraction: jax.Array) -> jax.Array:
    """``ceil(fraction * 2^32)`` as uint32: ``bits < threshold`` with probability
    ``fraction`` (exactly, when ``fraction`` is a multiple of 2^-32)."""
    scaled = lax.ceil(lax.mul(fraction, np.asarray(2.0**32, fraction.dtype)))
    below = np.nextafter(np.asarray(2.0**32, fraction.dtype), 0)  # no uint32 overflow
    return lax.convert_element_type(lax.min(scaled, below), jnp.uint32)


def _copy_sign(magnitude: jax.Array, sign_of: jax.Array) -> jax.Array:
    """``magnitude`` with the sign bit of ``sign_of`` (``-0`` stays ``-0``)."""
    int_type = _int_type(magnitude.dtype)
    sign_bit = np.asarray(np.iinfo(int_type).min, int_type)
    sign = lax.bitwise_and(lax.bitcast_convert_type(sign_of, int_type), sign_bit)
    bits = lax.bitwise_or(lax.bitcast_convert_type(magnitude, int_type), sign)
    return lax.bitcast_convert_type(bits, magnitude.dtype)


# -- the primitive: abstract evaluation, lowering, JVP, batching, scale rule ---------------


def _batch(args, dims, *, dtype):
    """Elementwise: both operands with the batch axis first (an unbatched one broadcast)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not jxi.NOT_MAPPED)
    x, bits = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is jxi.NOT_MAPPED else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims, strict=True)
    )
    return stochastic_round_p.bind(x, bits, dtype=dtype), 0


# Straight-through derivative: the rounding is not differentiated.
stochastic_round_p = jxi.define_primitive(
    "stochastic_round", _round_impl, straight_through=True, batcher=_batch
)


@register_scale_rule(stochastic_round_p, properties=Property.POINTWISE)
def stochastic_round_rule(x: ScaledArray, bits: jax.Array, *, dtype: jnp.dtype) -> ScaledArray:
    """Input scale; the data is rounded. Range-guarded like ``convert_element_type``: into
    a narrower float16/float8 format, out-of-band data moves a power of two into the scale
    before it is rounded."""
    narrowing = jnp.finfo(dtype).maxexp < jnp.finfo(x.dtype).maxexp
    wide = widened(x.data) if narrowing else None
    factors = guard_factors(wide, dtype) if narrowing else None
    if factors is None:
        data = stochastic_round_p.bind(x.data, bits, dtype=dtype)
        return ScaledArray(data, make_scale(scale_f32(x), x))
    down, up = factors
    data = stochastic_round_p.bind(times_scalar(wide, down), bits, dtype=dtype)
    return ScaledArray(data, make_scale(scale_mul(scale_f32(x), up), x))
