"""Traced power-of-two arithmetic on float32 scales: exponent-field operations with ``lax``.

Scale rules run these on every traced scale of a scalified program, so they are written with
``lax`` operations only (a ``jax.numpy`` operator costs a nested trace) and, where it keeps
the compiled program lean, with integer operations on the float32 bits instead of float
arithmetic (:mod:`jax_scaled.pow2.xla` says why). Each function states its exactness: the
splits and ratios are exact for powers of two in ``[2^-126, 2^127]``; the roundings return
such a power of two.

Example:
    >>> m, s = pow2_split(jnp.float16(-6.0))
    >>> float(m), float(s), float(pow2_ratio(jnp.float32(2.0**-3), jnp.float32(2.0**5)))
    (-1.5, 4.0, 0.00390625)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.pow2.static import (
    EXPONENT_BIAS,
    EXPONENT_FIELD,
    MANTISSA_BITS,
    MAX_SCALE_EXPONENT,
    MIN_SCALE_EXPONENT,
    SQRT2_MANTISSA_BITS,
    Rounding,
    static_pow2_bits,
)


def as_float32(x) -> jax.Array | np.ndarray:
    """``x`` as float32: a jax array (or tracer) is converted only if it has another dtype;
    a numpy or Python value becomes a numpy float32 array, which a ``lax`` operation stages
    as a literal (``jnp.asarray`` would put it on the device first, at every call).

    Example:
        >>> as_float32(0.5).dtype, type(as_float32(np.float16(0.5))).__name__
        (dtype('float32'), 'ndarray')
    """
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.float32 else lax.convert_element_type(x, jnp.float32)
    return np.asarray(x, np.float32)


def biased_exponent(x: jnp.ndarray) -> jnp.ndarray:
    """The biased exponent field (int32) of a non-negative float32 ``x``: ``e + 127`` for
    ``x`` in ``[2^e, 2^(e+1))``, 0 for zeros and subnormals, 255 for inf and NaN. Cheaper
    than :func:`pow2_exponent` where the caller handles those cases itself.

    Example:
        >>> int(biased_exponent(jnp.float32(3.0))) - EXPONENT_BIAS
        1
    """
    bits = lax.bitcast_convert_type(as_float32(x), jnp.int32)
    return lax.shift_right_logical(bits, np.int32(MANTISSA_BITS))


def pow2_from_exponent(exponent: jnp.ndarray, clamp: bool = True) -> jnp.ndarray:
    """``2**exponent`` as float32, built from bits; exponent clipped to the normal range.

    ``clamp=False`` skips the clip for exponents the caller already keeps in ``[-126, 127]``
    (outside it, the result is garbage).

    Example:
        >>> float(pow2_from_exponent(jnp.int32(-3))), float(pow2_from_exponent(jnp.int32(500)))
        (0.125, 1.7014118346046923e+38)
    """
    if isinstance(exponent, np.ndarray | np.generic | int):  # static: numpy in, numpy out
        exponent = np.asarray(exponent, np.int32)
        if clamp:
            exponent = np.clip(exponent, MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
        biased = (exponent + EXPONENT_BIAS).astype(np.uint32) << MANTISSA_BITS
        return np.asarray(biased).view(np.float32)
    if clamp:
        exponent = lax.clamp(MIN_SCALE_EXPONENT, exponent, MAX_SCALE_EXPONENT)
    biased = lax.convert_element_type(lax.add(exponent, np.int32(EXPONENT_BIAS)), jnp.uint32)
    return lax.bitcast_convert_type(lax.shift_left(biased, np.uint32(MANTISSA_BITS)), jnp.float32)


def floor_divide_exponent(exponent: jnp.ndarray, n: int) -> jnp.ndarray:
    """``floor(exponent / n)`` for an int32 scale exponent in ``[-126, 127]`` and ``n >= 1``,
    in at most three integer operations (``jnp.floor_divide`` traces a dozen, sign fix-ups
    included, and scale rules take roots of every normalised value's scale).

    Example:
        >>> [int(floor_divide_exponent(jnp.int32(e), n)) for e, n in [(-5, 2), (7, 3)]]
        [-3, 2]
    """
    if n & (n - 1) == 0:  # a power of two: an arithmetic shift rounds towards -inf
        return lax.shift_right_arithmetic(exponent, np.int32(n.bit_length() - 1))
    # Offset to a non-negative numerator, where lax.div's truncation is the floor.
    offset = -(MIN_SCALE_EXPONENT // n) + 1
    shifted = lax.div(lax.add(exponent, np.int32(n * offset)), np.int32(n))
    return lax.sub(shifted, np.int32(offset))


def pow2_exponent(x, rounding: Rounding | str = Rounding.DOWN) -> jnp.ndarray:
    """Integer exponent ``e`` with ``2**e`` the power of two nearest ``|x|`` in ``rounding``.

    Zeros, subnormals below ``2^-126``, infinities and NaNs have no meaningful exponent and get
    the clamped bound (``-126`` for zeros and subnormals, ``0`` for non-finite values).

    Example:
        >>> int(pow2_exponent(jnp.float32(3.0)))
        1
        >>> int(pow2_exponent(jnp.float32(3.0), "up"))
        2
    """
    magnitude = _magnitude_bits(x)
    rounded = _rounded_up_bits(magnitude, rounding)
    biased = lax.shift_right_logical(rounded, np.int32(MANTISSA_BITS))
    exponent = lax.clamp(
        np.int32(MIN_SCALE_EXPONENT),
        lax.sub(biased, np.int32(EXPONENT_BIAS)),
        np.int32(MAX_SCALE_EXPONENT),
    )
    return _select(_not_finite(magnitude), 0, exponent)


def pow2_round(x, rounding: Rounding | str = Rounding.DOWN) -> jnp.ndarray:
    """Round ``|x|`` to a power of two, as float32 in ``[2^-126, 2^127]``.

    Zeros and non-finite values round to 1 (they carry no scale information).

    Example:
        >>> float(pow2_round(jnp.float32(0.3)))
        0.25
        >>> float(pow2_round(jnp.float32(0.3), "up"))
        0.5
    """
    magnitude = _magnitude_bits(x)
    field = lax.bitwise_and(_rounded_up_bits(magnitude, rounding), _EXPONENT_FIELD_INT)
    # Subnormals and zeros get 2^-126, a rounding past 2^127 gets 2^127: one clamp.
    field = lax.clamp(_SMALLEST_NORMAL_BITS, field, _LARGEST_POW2_BITS)
    no_scale = lax.bitwise_or(lax.eq(magnitude, np.int32(0)), _not_finite(magnitude))
    return _select(no_scale, 1, lax.bitcast_convert_type(field, jnp.float32))


# Integer (int32) forms of float32 bit patterns for the functions above: the exponent field,
# the magnitude (all but the sign), 2^-126's and 2^127's patterns.
_EXPONENT_FIELD_INT = np.int32(EXPONENT_FIELD)
_MAGNITUDE_BITS = np.int32(0x7FFFFFFF)
_SMALLEST_NORMAL_BITS = np.int32((MIN_SCALE_EXPONENT + EXPONENT_BIAS) << MANTISSA_BITS)
_LARGEST_POW2_BITS = np.int32((MAX_SCALE_EXPONENT + EXPONENT_BIAS) << MANTISSA_BITS)


def _magnitude_bits(x) -> jnp.ndarray:
    """The bits of ``|x|`` as float32, as a non-negative int32."""
    return lax.bitwise_and(_int32_bits(x), _MAGNITUDE_BITS)


def _rounded_up_bits(magnitude: jnp.ndarray, rounding: Rounding | str) -> jnp.ndarray:
    """``magnitude`` (finite float32 bits) plus the offset that carries a mantissa at or past
    ``rounding``'s threshold into the exponent field: the field is then the rounded exponent's.
    Non-finite patterns wrap around; callers select them out."""
    offset = _ROUNDING_OFFSET[Rounding(rounding)]
    return lax.add(magnitude, np.int32(offset)) if offset else magnitude


def _not_finite(magnitude: jnp.ndarray) -> jnp.ndarray:
    return lax.ge(magnitude, _EXPONENT_FIELD_INT)


def _select(condition: jnp.ndarray, on_true, on_false) -> jnp.ndarray:
    """``jnp.where(condition, on_true, on_false)`` as one ``select_n``, with no nested ``jit``
    to trace and lower (these helpers run for every scale of a scalified program)."""
    dtype, shape = jnp.result_type(on_true, on_false), jnp.shape(condition)

    def full(value):
        if not isinstance(value, jax.Array):  # a trace-time constant: stays a literal
            value = np.asarray(value, dtype)
            return value if shape == () else lax.full(shape, value, dtype)
        value = lax.convert_element_type(value, dtype)
        return value if value.shape == shape else lax.broadcast_in_dim(value, shape, ())

    return lax.select(condition, full(on_true), full(on_false))


def pow2_split(x, rounding: Rounding | str = Rounding.DOWN) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Split ``x`` into ``(mantissa, scale)`` with ``mantissa * scale == x`` exactly.

    ``scale`` is a float32 power of two (elementwise); ``mantissa`` keeps the dtype of ``x``.
    With ``"down"`` rounding, ``|mantissa|`` is in ``[1, 2)``; ``"up"`` gives ``(1/2, 1]``;
    ``"nearest"`` gives ``[1/sqrt(2), sqrt(2))``. Zeros, infinities and NaNs get scale 1 and
    are their own mantissa; values below ``2^-126`` get scale ``2^-126`` and a mantissa below 1.

    Example:
        >>> m, s = pow2_split(jnp.float16(-6.0))
        >>> float(m), float(s)
        (-1.5, 4.0)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"pow2_split needs a floating-point array, got dtype {x.dtype}.")
    scale = pow2_round(x, rounding)
    mantissa = _exact_divide_by_pow2(lax.convert_element_type(x, jnp.float32), scale)
    return lax.convert_element_type(mantissa, x.dtype), scale


def _exact_divide_by_pow2(x: jnp.ndarray, scale: jnp.ndarray) -> jnp.ndarray:
    """``x / scale`` for float32 ``x`` (maybe subnormal) and a normal power-of-two ``scale``."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    is_subnormal = lax.eq(lax.bitwise_and(bits, EXPONENT_FIELD), np.uint32(0))
    # A subnormal x is (sign) * m * 2^-149 with integer m < 2^23: rebuild it from its integer
    # mantissa so that no float operation ever sees the subnormal (flushed to zero on CPU).
    negative = lax.eq(lax.shift_right_logical(bits, np.uint32(31)), np.uint32(1))
    sign = _select(negative, np.float32(-1), np.float32(1))
    mantissa_field = lax.bitwise_and(bits, np.uint32((1 << MANTISSA_BITS) - 1))
    integer_mantissa = lax.convert_element_type(mantissa_field, jnp.float32)
    below_normal = lax.div(np.float32(2.0**-126), scale)
    from_subnormal = lax.mul(lax.mul(sign, integer_mantissa), np.float32(2.0**-23) * below_normal)
    return _select(is_subnormal, from_subnormal, lax.div(x, scale))


_ROUNDING_OFFSET = {
    Rounding.DOWN: 0,
    Rounding.UP: (1 << MANTISSA_BITS) - 1,
    Rounding.NEAREST: (1 << MANTISSA_BITS) - SQRT2_MANTISSA_BITS,
}


def pow2_round_positive(x, rounding: Rounding | str = Rounding.DOWN) -> jax.Array:
    """:func:`pow2_round` for positive float32 scale estimates, in five operations.

    Scale rules produce positive estimates only (products, quotients and norms of scales), so
    this skips the zero/sign/NaN handling of :func:`pow2_round`. The result is clamped to
    ``[2^-126, 2^127]``: a zero estimate gives ``2^-126``, an infinite one ``2^127``.

    Example:
        >>> float(pow2_round_positive(jnp.float32(0.3))), float(pow2_round_positive(3.0, "up"))
        (0.25, 4.0)
    """
    bits = lax.bitcast_convert_type(as_float32(x), jnp.uint32)
    offset = _ROUNDING_OFFSET[Rounding(rounding)]
    if offset:
        bits = bits + np.uint32(offset)
    rounded = lax.bitcast_convert_type(bits & np.uint32(0xFF800000), jnp.float32)
    return lax.clamp(
        np.float32(2.0**MIN_SCALE_EXPONENT), rounded, np.float32(2.0**MAX_SCALE_EXPONENT)
    )


def pow2_reciprocal(scale) -> jax.Array:
    """``1 / scale`` for a float32 power of two in ``[2^-126, 2^127]``, with integer operations.

    Exact, and cheap enough for XLA to fuse into the consumers (a float division is not).
    ``1 / 2^127`` is below float32's normal range and gives 0; so does any ``scale`` whose
    reciprocal would be subnormal. Only valid for powers of two.

    Example:
        >>> float(pow2_reciprocal(jnp.float32(0.25)))
        4.0
    """
    bits = lax.bitcast_convert_type(as_float32(scale), jnp.int32)
    # 2^e has bits (e + 127) << 23 and 2^-e has (127 - e) << 23 = (254 << 23) - bits: never a
    # subnormal pattern; 2^127 gives 0 and an infinite scale is clamped to 0 as well.
    reciprocal = lax.max(lax.sub(np.int32(254 << MANTISSA_BITS), bits), np.int32(0))
    return lax.bitcast_convert_type(reciprocal, jnp.float32)


def pow2_ratio(numerator, denominator) -> jax.Array:
    """``numerator / denominator`` of float32 powers of two in ``[2^-126, 2^127]`` (or 0),
    by subtracting exponents: exact wherever the quotient is a float32 normal, clamped to
    ``[0, 2^127]`` outside (a quotient below ``2^-126`` gives 0). A zero numerator gives 0
    (``0 / 0`` included), any other over a zero denominator gives inf. The arguments
    broadcast against each other.

    Scale rules divide scales with it: a float division is an operation XLA will not copy
    into the kernels that read its result, so each one costs a kernel of its own.

    Example:
        >>> float(pow2_ratio(jnp.float32(2.0**-3), jnp.float32(2.0**5)))
        0.00390625
        >>> float(pow2_ratio(jnp.float32(2.0**127), jnp.float32(2.0**127)))
        1.0
    """
    n_biased, d_biased = biased_exponent(numerator), biased_exponent(denominator)
    difference = lax.add(lax.sub(n_biased, d_biased), np.int32(EXPONENT_BIAS))  # 0-d broadcasts
    biased = lax.clamp(np.int32(0), difference, np.int32(254))
    biased = lax.select(lax.eq(d_biased, np.int32(0)), lax.full_like(biased, 255), biased)  # x/0
    biased = lax.select(lax.eq(n_biased, np.int32(0)), lax.full_like(biased, 0), biased)  # 0/y
    return lax.bitcast_convert_type(lax.shift_left(biased, np.int32(MANTISSA_BITS)), jnp.float32)


def pow2_sqrt_split(scale) -> tuple[jax.Array, jax.Array]:
    """``(2^k, 2^r)`` with ``|scale| = 2^(2k + r)``, ``r`` in ``{0, 1}``: a square root's
    scale and the factor its data keeps, with integer operations on the exponent field.

    Same results as taking :func:`pow2_exponent` of ``scale`` and halving it (a zero or a
    subnormal counts as ``2^-126``, a non-finite value as ``1``), in half the operations: the
    biased exponent ``b`` of ``2^k`` is ``(b(scale) + 127) >> 1`` and ``r`` is bit 23 of
    ``b(scale) + 1``. Square roots of every Adam update and every normalisation run it.

    Example:
        >>> [float(v) for v in pow2_sqrt_split(jnp.float32(2.0**-7))]
        [0.0625, 2.0]
    """
    magnitude = _magnitude_bits(scale)
    normal = lax.max(magnitude, _SMALLEST_NORMAL_BITS)
    bits = _select(_not_finite(magnitude), _ONE_BITS, normal)
    root = lax.shift_left(
        lax.shift_right_logical(lax.add(bits, _ONE_BITS), np.int32(MANTISSA_BITS + 1)),
        np.int32(MANTISSA_BITS),
    )
    odd = lax.bitwise_and(lax.add(bits, _LOWEST_EXPONENT_BIT), _LOWEST_EXPONENT_BIT)
    remainder = lax.add(odd, _ONE_BITS)
    return _as_float32_bits(root), _as_float32_bits(remainder)


_ONE_BITS = np.int32(static_pow2_bits(0))
_LOWEST_EXPONENT_BIT = np.int32(1 << MANTISSA_BITS)


def pow2_smallest_normal_over(scale, floor=None, ceiling=None) -> jax.Array:
    """``2^-126 / scale`` for a float32 power of two ``scale``, clamped to ``[floor,
    ceiling]`` (float32 powers of two, ``[2^-126, 1]`` by default): zeros and subnormals
    give the ceiling, infinities the floor (the sign is ignored). A ``floor`` equal to the
    ``ceiling`` gives it whatever ``scale`` is.

    On the exponent fields in place (``2^e`` has the field ``b = e + 127``, the quotient
    ``128 - b``): four operations, because XLA copies them into every reader (a promoted
    zero's scale is read by each parameter's update), where a float division would be a
    kernel of its own for every promoted operand.

    Example:
        >>> float(pow2_smallest_normal_over(jnp.float32(2.0**-100))) == 2.0**-26
        True
        >>> float(pow2_smallest_normal_over(jnp.float32(2.0**-100), 8.0, 8.0))
        8.0
    """
    low = _SMALLEST_NORMAL_BITS if floor is None else _int32_bits(floor)
    high = _ONE_BITS if ceiling is None else _int32_bits(ceiling)
    field = lax.bitwise_and(_int32_bits(scale), _EXPONENT_FIELD_INT)  # sign and mantissa off
    quotient = lax.clamp(low, lax.sub(_TWO_BITS, field), high)
    return _as_float32_bits(quotient)


def _int32_bits(x) -> jax.Array:
    return lax.bitcast_convert_type(as_float32(x), jnp.int32)


_TWO_BITS = np.int32(static_pow2_bits(1))  # 2^-126 / 2^e has the field 2^1's minus 2^e's


def split_bits(value: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The int32 bits of ``(mantissa, scale, any_scale, factor_floor)`` of a float32 0-d
    ``value``: for a normal number, its exact split into a signed mantissa in ``[1, 2)``
    and a power of two; for anything else, the value itself at scale 1. ``any_scale`` (0 or
    1) marks zeros, infinities and NaNs, the same at any scale; ``factor_floor`` is
    ``2^-126`` for them and the scale otherwise (the floor of
    :func:`pow2_smallest_normal_over`). Int32, as the readers' exponent-field arithmetic
    takes them.

    Example:
        >>> [hex(int(b)) for b in split_bits(jnp.float32(-6.0))]
        ['-0x40400000', '0x40800000', '0x0', '0x40800000']
    """
    bits = _int32_bits(value)
    field = lax.bitwise_and(bits, _EXPONENT_FIELD_INT)
    not_finite = lax.eq(field, _EXPONENT_FIELD_INT)
    normal = lax.bitwise_and(lax.ne(field, np.int32(0)), lax.bitwise_not(not_finite))
    unit = lax.bitwise_or(lax.bitwise_and(bits, ~_EXPONENT_FIELD_INT), _ONE_BITS)
    scale = lax.select(normal, field, _ONE_BITS)
    zero = lax.eq(lax.bitwise_and(bits, _MAGNITUDE_BITS), np.int32(0))
    any_scale = lax.bitwise_or(zero, not_finite)
    factor_floor = lax.select(any_scale, _SMALLEST_NORMAL_BITS, scale)
    mantissa = lax.select(normal, unit, bits)
    return mantissa, scale, lax.convert_element_type(any_scale, jnp.int32), factor_floor


def _as_float32_bits(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, jnp.float32)


def pow2_round_sqrt(x, rounding: Rounding | str = Rounding.DOWN) -> jax.Array:
    """``pow2_round_positive(sqrt(x))`` for a positive float32 ``x``, without a square root.

    ``sqrt(m * 2^e)`` with ``1 <= m < 2`` is rounded from the exponent ``e`` alone: down to
    ``2^floor(e/2)``, up to ``2^ceil(log2(x)/2)``, nearest (the same tie rule as
    :func:`pow2_round`) to ``2^ceil(e/2)``.

    Example:
        >>> float(pow2_round_sqrt(jnp.float32(8.0))), float(pow2_round_sqrt(8.0, "up"))
        (2.0, 4.0)
    """
    rounding = Rounding(rounding)
    bits = lax.bitcast_convert_type(as_float32(x), jnp.int32)
    exponent = lax.sub(
        lax.shift_right_arithmetic(bits, np.int32(MANTISSA_BITS)), np.int32(EXPONENT_BIAS)
    )
    if rounding is Rounding.UP:
        inexact = lax.ne(lax.bitwise_and(bits, np.int32((1 << MANTISSA_BITS) - 1)), np.int32(0))
        exponent = lax.add(exponent, lax.add(lax.convert_element_type(inexact, jnp.int32), 1))
    elif rounding is Rounding.NEAREST:
        exponent = lax.add(exponent, np.int32(1))
    half = lax.shift_right_arithmetic(exponent, np.int32(1))
    return pow2_from_exponent(half)
