"""Shared building blocks for scale rules.

Conventions every rule follows:

* Scale arithmetic is done in float32 on 0-d arrays, then rounded to a power of two with the
  configured rounding (:func:`round_scale`) and cast to the output scale dtype
  (:func:`make_scale`), so float32 and E8M0 scales give bit-identical results.
* Re-scaling data by a power-of-two ratio (:func:`rescale`) is done in float32 for narrow
  dtypes and cast back once: exact unless the result leaves the data format's range.
* A rule returns data in the dtype and shape the program expects (the interpreter checks).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled import dtypes
from jax_scaled.array import ScaledArray
from jax_scaled.config import current_config
from jax_scaled.memo import memoized
from jax_scaled.pow2 import (
    EXPONENT_BIAS,
    EXPONENT_FIELD,
    MAX_SCALE_EXPONENT,
    MIN_SCALE_EXPONENT,
    Rounding,
    as_float32,
    biased_exponent,
    pow2_from_exponent,
    pow2_reciprocal,
    pow2_round_positive,
    pow2_round_sqrt,
    static_pow2_bits,
    static_pow2_exponent,
    static_pow2_round,
)

Value = Any  # jax.Array | ScaledArray


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype rules compute in for data of ``dtype``: float32, or wider if ``dtype`` is."""
    return dtypes.compute_dtype(dtype)


def scale_f32(x: Value) -> jax.Array:
    """The scale of ``x`` as a float32 0-d array (1 for a plain array)."""
    if isinstance(x, ScaledArray):
        return x.scale if x.scale.dtype == jnp.float32 else x.scale.astype(jnp.float32)
    return np.ones((), np.float32)


def out_scale_dtype(*xs: Value) -> jnp.dtype:
    """Scale dtype of a rule's output: the configured one, else E8M0 if any input has it."""
    configured = current_config().scale_dtype
    if configured is not None:
        return configured
    dtypes = {jnp.dtype(x.scale.dtype) for x in xs if isinstance(x, ScaledArray)}
    e8m0 = jnp.dtype(jnp.float8_e8m0fnu)
    return e8m0 if e8m0 in dtypes else jnp.dtype(jnp.float32)


def is_static(x: Any) -> bool:
    """True for a trace-time constant (a numpy value or Python number), as rules produce
    for scales known without tracing (``scale 1`` of ``exp``, a constant operand's)."""
    return isinstance(x, np.ndarray | np.generic | float | int)


def round_scale(scale: jax.Array) -> jax.Array:
    """Round a positive float32 scale estimate to a power of two (configured rounding); a
    static estimate is rounded at trace time, to a numpy float32."""
    rounding = current_config().rounding
    if is_static(scale):  # the same clamping as pow2_round_positive
        value = float(scale)
        if not value > 0:
            return np.float32(2.0**MIN_SCALE_EXPONENT)
        return np.float32(
            2.0**MAX_SCALE_EXPONENT if math.isinf(value) else static_pow2_round(value, rounding)
        )
    return pow2_round_positive(scale, rounding)


def make_scale(scale: jax.Array, *like: Value) -> jax.Array:
    """Cast a float32 power-of-two ``scale`` to the scale dtype of the inputs ``like``.

    A traced scale goes through ``optimization_barrier``, which keeps XLA's simplifier from
    merging the chains of scalar arithmetic of a deep unrolled network (measured in
    docs/benchmarks.md).
    A static scale (numpy, see :func:`is_static`) stays a numpy value: no staged constant,
    and rules that read it can fold it at trace time.
    """
    dtype = out_scale_dtype(*like)
    if is_static(scale):  # a trace-time constant stays one (no staged constant)
        if dtype == jnp.float8_e8m0fnu:
            scale = max(float(scale), 2.0**-127)  # E8M0 has no zero (see below)
        return np.asarray(scale, np.float32).astype(dtype)
    scale = as_float32(scale)
    if not isinstance(scale, jxi.Tracer):
        return _cast_scale(scale, dtype)
    return _cast_scale(lax.optimization_barrier(scale), dtype)


def _cast_scale(scale: jax.Array, dtype) -> jax.Array:
    if scale.dtype == dtype:
        return scale
    if dtype == jnp.float8_e8m0fnu:
        # E8M0 has no zero: a scale flushed to 0 (a product below 2^-126) becomes the
        # smallest E8M0 power, 2^-127, instead of E8M0's NaN.
        smallest = jnp.asarray(2.0**-127, dtype)
        return jnp.where(scale > 0, lax.convert_element_type(scale, dtype), smallest)
    return lax.convert_element_type(scale, dtype)


def sqrt_pow2(n: int) -> float:
    """``sqrt(n)`` rounded to a power of two with the configured rounding (trace-time)."""
    return static_pow2_round(math.sqrt(max(n, 1)), current_config().rounding)


def as_scaled(x: Value) -> ScaledArray:
    """``x`` as a ScaledArray: a plain floating array gets scale 1."""
    if isinstance(x, ScaledArray):
        return x
    return ScaledArray(x, np.ones((), np.float32))


def scale_mul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` of two float32 0-d scales; a numpy product when both are static.

    Rules multiply scales with it rather than with ``*``: a ``jax.numpy`` operator costs
    a nested trace, and scale arithmetic runs for every equation of a scalified program.

    Example:
        >>> scale_mul(np.float32(2.0), np.float32(4.0))
        np.float32(8.0)
    """
    if is_static(a) and is_static(b):
        return np.float32(np.float32(a) * np.float32(b))
    return lax.mul(as_float32(a), as_float32(b))


def times_scalar(data: jax.Array, factor: Any) -> jax.Array:
    """``data * factor`` in ``data``'s dtype, for a 0-d ``factor`` (static or traced).

    Example:
        >>> times_scalar(jnp.array([1.0, 2.0]), np.float32(0.5)).tolist()
        [0.5, 1.0]
    """
    if is_static(factor):
        return lax.mul(data, np.asarray(factor, data.dtype))
    return lax.mul(data, lax.convert_element_type(factor, data.dtype))


def rescale(data: jax.Array, ratio: jax.Array) -> jax.Array:
    """``data * ratio`` (ratio a float32 power of two), rounded once into ``data.dtype``."""
    wide = compute_dtype(data.dtype)
    if jnp.ndim(ratio) != 0:  # per-row ratios (stacked scan outputs): broadcasting multiply
        return (data.astype(wide) * ratio.astype(wide)).astype(data.dtype)
    return lax.convert_element_type(
        times_scalar(lax.convert_element_type(data, wide), ratio), data.dtype
    )


def safe_ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` for scales; 0/0 (two zero scales) gives 0, not NaN."""
    if numerator is denominator:
        return np.ones((), np.float32)
    # Scales are >= 2^-126 unless zero; a zero denominator means a zero numerator (the
    # denominator is the larger scale), whose data is multiplied by 0: the value stays 0.
    return numerator / lax.max(denominator, np.float32(2.0**-126))


def ratio_to_pow2(scale: jax.Array, target: jax.Array) -> jax.Array:
    """``scale / target`` for a power-of-two ``target`` (a rule's rounded output scale).

    A multiplication by an integer-built reciprocal: exact, and fusable by XLA into the
    data computation that uses it, where a float division would be compiled on its own.
    """
    if scale is target:
        return np.ones((), np.float32)
    return scale_mul(scale, scale_reciprocal(target))


def scale_reciprocal(scale: jax.Array) -> jax.Array:
    """``1 / scale`` of a power-of-two scale (:func:`~jax_scaled.pow2.pow2_reciprocal`),
    computed once per traced scale within a scalified call (:mod:`jax_scaled.memo`).

    Example:
        >>> float(scale_reciprocal(np.float32(0.25)))
        4.0
    """
    return memoized("pow2_reciprocal", scale, lambda: pow2_reciprocal(scale))


def align(*xs: Value, scale: jax.Array | None = None) -> tuple[list[jax.Array], jax.Array]:
    """Express every input at one common scale: ``(datas, scale)``.

    The common scale defaults to the largest input scale, so nothing overflows.
    """
    scales = [scale_f32(x) for x in xs]
    pow2_target = scale is None  # the largest of power-of-two scales
    if scale is None:
        scale = max_scale(scales)
    ratio = ratio_to_pow2 if pow2_target else safe_ratio
    datas = [
        as_scaled(x).data if s is scale else rescale(as_scaled(x).data, ratio(s, scale))
        for x, s in zip(xs, scales, strict=True)
    ]
    return datas, scale


def max_scale(scales: list[jax.Array]) -> jax.Array:
    """Elementwise maximum of a list of 0-d scales (the same object when all are the same)."""
    out = scales[0]
    for s in scales[1:]:
        if s is not out:
            out = lax.max(out, s)
    return out


def min_scale(a: jax.Array, b: jax.Array) -> jax.Array:
    """The smaller of two 0-d scales; static when both are.

    Example:
        >>> min_scale(np.float32(0.5), np.float32(4.0))
        np.float32(0.5)
    """
    if a is b:
        return a
    if is_static(a) and is_static(b):
        return np.minimum(np.float32(a), np.float32(b))
    return lax.min(as_float32(a), as_float32(b))


def to_compute(x: Value) -> jax.Array:
    """The represented value ``data * scale`` in the compute dtype (float32 for narrow data)."""
    x = as_scaled(x)
    return times_scalar(lax.convert_element_type(x.data, compute_dtype(x.dtype)), x.scale)


def from_compute(value: jax.Array, scale: jax.Array, dtype, *like: Value) -> ScaledArray:
    """A ScaledArray of ``value`` (compute dtype) at the power-of-two ``scale`` (float32)."""
    if is_static(scale):
        data = value if float(scale) == 1 else value / np.asarray(scale, value.dtype)
    else:
        data = value / scale.astype(value.dtype)
    return ScaledArray(data.astype(dtype), make_scale(scale, *like))


def rounded_l2_scale(*scales: jax.Array) -> jax.Array:
    """``sqrt(sum(s**2))`` of power-of-two scales, rounded to a power of two.

    The unit-scaling estimate for a sum of independent terms, computed without sqrt or
    division.

    The largest scale is rounded first (a no-op for powers of two), the others are expressed
    relative to it by exact reciprocal multiplication, and the square root is rounded from
    the exponent of the sum of squares: every operation is cheap and fusable.
    """
    rounding = current_config().rounding
    if rounding is Rounding.DOWN and len(scales) <= 3:
        # Scales are powers of two (checked at ScaledArray construction; every rule keeps
        # it): their maximum needs no rounding.
        return max_scale(list(scales))
    largest = round_scale(max_scale(list(scales)))
    total = sum(lax.square(ratio_to_pow2(s, largest)) for s in scales)
    return round_scale(pow2_round_sqrt(total, rounding) * largest)


def wide_data(x: Value, scale: jax.Array, *, pow2_target: bool = False) -> jax.Array:
    """The data of ``x`` re-expressed at ``scale``, in the compute dtype (not rounded back).

    ``pow2_target=True`` promises ``scale`` is a power of two (a rounded estimate): the ratio
    is then a fusable reciprocal multiplication instead of a division.
    """
    x = as_scaled(x)
    data = lax.convert_element_type(x.data, compute_dtype(x.dtype))
    own_scale = scale_f32(x)
    if own_scale is scale:
        return data
    ratio = ratio_to_pow2 if pow2_target else safe_ratio
    return times_scalar(data, ratio(own_scale, scale))


# ---------------------------------------------------------------------------------------
# Range guard for narrow data (ScalifyConfig.guard)
# ---------------------------------------------------------------------------------------


def guard_band(dtype) -> tuple[int, int, int] | None:
    """``(low, high, target)`` exponents of the guard for data of ``dtype``, or None.

    The largest datum ``2^e`` is left alone while ``low <= e < high``; outside, the data is
    shifted to ``e = target``. None for formats with bfloat16's range or more, for
    sub-byte formats (float4, float6), and when the guard is off
    (:class:`~jax_scaled.ScalifyConfig`).

    Example:
        >>> guard_band(jnp.float16), guard_band(jnp.float8_e4m3fn), guard_band(jnp.float32)
        ((-8, 7, 3), (-3, 7, 6), None)
    """
    info = jnp.finfo(dtype)
    if not current_config().guard or info.maxexp > 64 or info.bits < 8:
        return None  # wide formats need no guard; sub-byte ones have no room for a band
    # 16-bit data may meet another multiplication: keep it near unit scale, and below the
    # square root of its largest value, so that the product of two guarded data (x * x**2
    # in a gelu's gradient) cannot overflow. 8-bit data goes into a matmul: use the top of its
    # few bits of range, leaving one binade of headroom.
    if info.bits > 8:
        target, high = (info.maxexp - 1) // 4, info.maxexp // 2 - 1
    else:
        target = info.maxexp - 3
        high = max(info.maxexp - 4, target + 1)
    low = min(info.minexp + (info.maxexp - info.minexp) // 5, target)
    return low, high, target


def sums_guarded(dtype) -> bool:
    """True when ``add`` and ``sub`` into ``dtype`` data get the range guard
    (``ScalifyConfig.guard_sums``; ``add_any`` and joins have it whenever
    :func:`guard_band` applies).

    Example:
        >>> sums_guarded(jnp.float16), sums_guarded(jnp.float32)
        (False, False)
    """
    return current_config().guard_sums and guard_band(dtype) is not None


# Loop carries with float32 (or wider) data: no rule guards them, and a static estimate that
# is off by a factor compounds over the iterations (a polynomial iteration such as muon's
# Newton-Schulz one drifts by 2^(3^n)). Keep their largest datum within 2^+-8 of 1: a
# fifth power of the carry inside one iteration (muon) then stays in float32's range.
WIDE_CARRY_BAND = (-8, 8, 0)


def carry_band(dtype) -> tuple[int, int, int] | None:
    """The guard band of a loop carry's data: :data:`WIDE_CARRY_BAND` for float32 and wider
    (the narrow formats' rules guard their own outputs); None otherwise or with the guard off.

    Example:
        >>> carry_band(jnp.float32), carry_band(jnp.float16)
        ((-8, 8, 0), None)
    """
    if not current_config().guard or jnp.finfo(dtype).maxexp <= 64:
        return None
    return WIDE_CARRY_BAND


def recentred_carry(x: ScaledArray) -> ScaledArray:
    """A loop carry with its float32 data brought back near unit scale when its largest
    datum left :func:`carry_band` (the same value: the shift moves into the scale).

    Example:
        >>> x = recentred_carry(ScaledArray(jnp.array([2.0**40, 1.0]), jnp.float32(1.0)))
        >>> x.data.tolist(), float(x.scale) == 2.0**40
        ([1.0, 9.094947017729282e-13], True)
    """
    band = carry_band(x.data.dtype)
    if band is None or x.data.size == 0:
        return x
    down, up = guard_factors(x.data, x.data.dtype, band=band)
    data = lax.convert_element_type(times_scalar(x.data, down), x.data.dtype)
    return ScaledArray(data, make_scale(scale_mul(scale_f32(x), up), x))


def guard_factors(
    wide: jax.Array, dtype, divisor_exponent: int = 0, band: tuple[int, int, int] | None = None
) -> tuple[jax.Array, jax.Array] | None:
    """``(down, up)``, two float32 powers of two with ``down * up == 2^-divisor_exponent``,
    that range-guard ``wide / 2^divisor_exponent`` for a cast to the narrow ``dtype``
    (:func:`guard_band`, or the ``band`` given): the data becomes ``wide * down`` and its
    scale ``scale * up``. None where no guard applies.

    When the largest datum ``2^e`` of ``wide / 2^divisor_exponent`` leaves the band, ``e``
    is moved to the band's target; otherwise, and for data that is all zero or holds an
    infinity, ``up`` is 1 (the static scale is kept). Worked out on the bits of the largest
    magnitude, without branches or float division: XLA copies this scalar code into every
    kernel that reads the guarded data, so every instruction counts
    (``benchmarks/compile_breakdown.py``). The shift is clamped at ``2^-126`` so that both
    factors stay normal floats.

    Example:
        >>> down, up = guard_factors(jnp.array([2.0**17, 2.0]), jnp.float16)
        >>> float(down), float(up)
        (6.103515625e-05, 16384.0)
    """
    band = guard_band(dtype) if band is None else band
    if band is None or wide.size == 0:
        return None
    low, high, target = (e + divisor_exponent for e in band)
    field = static_pow2_bits  # the exponent field of 2^e, as a uint32 literal
    exponent_bits = lax.bitwise_and(
        lax.bitcast_convert_type(largest_magnitude(wide), jnp.uint32), EXPONENT_FIELD
    )
    # Below the band but not zero, or above it but finite: two unsigned range tests, where
    # a field under the range's start wraps around to a huge value.
    outside = lax.bitwise_or(
        lax.lt(lax.sub(exponent_bits, np.uint32(1)), np.uint32(field(low) - 1)),
        lax.lt(lax.sub(exponent_bits, field(high)), np.uint32(EXPONENT_FIELD - field(high))),
    )
    # The exponent field moved to the target: the largest datum's (no lower than 2^-126
    # times the target), or the target's own when nothing moves.
    centre = lax.select(outside, lax.max(exponent_bits, field(target - 126)), field(target))
    up = lax.sub(centre, field(target - EXPONENT_BIAS))
    down = lax.sub(field(target + EXPONENT_BIAS - divisor_exponent), centre)
    return lax.bitcast_convert_type(down, jnp.float32), lax.bitcast_convert_type(up, jnp.float32)


def largest_biased_exponent(wide: jax.Array) -> jax.Array:
    """The biased float32 exponent (int32) of the largest ``|datum|`` of ``wide``: ``e + 127``
    for a largest magnitude in ``[2^e, 2^(e+1))``; 0 when every datum is zero (or a float32
    subnormal), and 0 as well when a datum is infinite (data that has already overflowed
    is not shifted). A NaN gives 0 or is ignored, depending on how XLA compiles the
    reduction. It runs on every guarded output.

    Example:
        >>> int(largest_biased_exponent(jnp.array([0.75, -3.0]))) - 127
        1
        >>> int(largest_biased_exponent(jnp.array([0.75, jnp.inf])))
        0
    """
    biased = biased_exponent(largest_magnitude(wide))
    return lax.select(biased == 255, np.int32(0), biased)


# XLA:CPU hands a maximum over this many elements or more to its YNNPACK reduction, with
# ``abs`` fused in; below, it splits the reduction in two kernels and materialises ``abs``.
_LARGE_REDUCTION = 4096


def largest_magnitude(wide: jax.Array) -> jax.Array:
    """``max(|wide|)`` over all axes, written the way XLA compiles into the fewest kernels
    (the guard adds one per guarded output, and on CPU each kernel costs compile time):
    ``reduce_max(abs(x))`` for large arrays, one variadic reduction of the largest and
    smallest datum for small ones (one kernel instead of three; measured in
    ``benchmarks/compile_breakdown.py``).

    Example:
        >>> float(largest_magnitude(jnp.array([0.75, -3.0, 2.0])))
        3.0
    """
    axes = tuple(range(wide.ndim))
    if wide.size >= _LARGE_REDUCTION:
        return lax.reduce_max(lax.abs(wide), axes)
    lowest, highest = np.array(-np.inf, wide.dtype), np.array(np.inf, wide.dtype)
    largest, smallest = lax.reduce((wide, wide), (lowest, highest), _max_and_min, axes)
    return lax.max(largest, lax.neg(smallest))


def _max_and_min(a: tuple, b: tuple) -> tuple:
    return lax.max(a[0], b[0]), lax.min(a[1], b[1])


def shift_into_scale(
    wide: jax.Array, scale: jax.Array, shift: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(wide * 2^-shift, scale * 2^shift)``: the same value, ``shift`` (an int32 in
    ``[-126, 126]``) moved from the data into the scale."""
    down = pow2_from_exponent(lax.neg(shift), clamp=False)
    return times_scalar(wide, down), scale_mul(scale, pow2_from_exponent(shift, clamp=False))


def guarded(
    wide: jax.Array, scale: jax.Array, dtype, *like: Value, divisor: float = 1.0
) -> ScaledArray:
    """A ScaledArray of ``wide / divisor * scale`` (``wide`` in the compute dtype, ``scale`` a
    float32 power of two, ``divisor`` a static power of two) with data cast to ``dtype``,
    range-guarded (:func:`guard_band`).

    The guard reads ``wide`` itself and folds ``divisor`` into its factor: data and
    division are one multiplication, and the largest magnitude is taken before it.

    Example:
        >>> x = guarded(jnp.array([2.0**17, 2.0]), jnp.float32(1.0), jnp.float16)
        >>> x.data.tolist(), float(x.scale)
        ([8.0, 0.0001220703125], 16384.0)
        >>> y = guarded(jnp.array([8.0, 2.0]), jnp.float32(1.0), jnp.float16, divisor=4.0)
        >>> y.data.tolist(), float(y.scale)
        ([2.0, 0.5], 1.0)
    """
    divisor_exponent = static_pow2_exponent(divisor)
    factors = guard_factors(wide, dtype, divisor_exponent)
    if factors is None:
        if divisor_exponent:
            wide = times_scalar(wide, np.float32(2.0**-divisor_exponent))
        return ScaledArray(lax.convert_element_type(wide, dtype), make_scale(scale, *like))
    down, up = factors
    data = lax.convert_element_type(times_scalar(wide, down), dtype)
    return ScaledArray(data, make_scale(scale_mul(scale, up), *like))
