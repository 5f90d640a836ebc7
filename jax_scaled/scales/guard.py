"""The range guard: keep narrow data (float16, float8) in range when static estimates drift.

Static scale estimates assume independent terms; correlated ones (a bias gradient summed
over a batch, attention logits of a trained model) make the data drift from unit scale.
With :class:`~jax_scaled.ScalifyConfig` ``guard=True`` (the default), the rules whose
estimate can drift read the largest output datum and, when it leaves the format's
comfortable band (:func:`guard_band`), move a power of two into the scale (:func:`guarded`).
Healthy data gets exactly the static result.

Example:
    >>> guard_band(jnp.float16), guard_band(jnp.float8_e4m3fn)
    ((-8, 7, 3), (-3, 7, 6))
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.config import current_config
from jax_scaled.dtypes import compute_dtype
from jax_scaled.memo import memoized, recorded
from jax_scaled.pow2.static import (
    EXPONENT_BIAS,
    MAX_SCALE_EXPONENT,
    MIN_SCALE_EXPONENT,
    static_pow2_bits,
    static_pow2_exponent,
)
from jax_scaled.pow2.xla import (
    binade_lookup,
    computed_apart,
    computed_once,
    computed_once_per_block,
    float_division,
    largest_magnitude,
    reciprocal_power,
    record_reciprocal,
    stacked_scalars,
)
from jax_scaled.scales.values import Value, make_scale, scale_f32, scale_mul, times_scalar


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
        target, high = centre_exponent(dtype), info.maxexp // 2 - 1
    else:
        target = info.maxexp - 3
        high = max(info.maxexp - 4, target + 1)
    low = min(info.minexp + (info.maxexp - info.minexp) // 5, target)
    return low, high, target


def centre_exponent(dtype) -> int:
    """The exponent ``t`` of ``2^t``, where the range guard puts the largest datum of a format
    wider than 8 bits, and :func:`~jax_scaled.quantize.quantize` the largest of a block: a
    fourth of the format's binades above 1, so that a product of up to four such data fits.

    Example:
        >>> centre_exponent(jnp.float16), centre_exponent(jnp.bfloat16)
        (3, 31)
    """
    return (jnp.finfo(dtype).maxexp - 1) // 4


def top_of_format(dtype) -> bool:
    """True for floats of 8 bits or fewer: their data may sit at the top of the format
    (:func:`~jax_scaled.quantize.quantize` maps a block's largest value near the format's, the
    OCP MX rule), so a pointwise rule cannot count on headroom: a sum or a product of such
    data can overflow (into NaN for E4M3, which has no infinity).

    Example:
        >>> top_of_format(jnp.float8_e4m3fn), top_of_format(jnp.float16)
        (True, False)
    """
    return jnp.finfo(dtype).bits <= 8


def sums_guarded(dtype) -> bool:
    """True when ``add`` and ``sub`` into ``dtype`` data get the range guard: 8-bit data
    (:func:`top_of_format`), and wider data with ``ScalifyConfig.guard_sums`` (``add_any``
    and joins have it whenever :func:`guard_band` applies).

    Example:
        >>> sums_guarded(jnp.float16), sums_guarded(jnp.float32), sums_guarded(jnp.float8_e5m2)
        (False, False, True)
    """
    if guard_band(dtype) is None:
        return False
    return current_config().guard_sums or top_of_format(dtype)


def products_guarded(dtype) -> bool:
    """True when products, quotients and powers into ``dtype`` data get the range guard:
    8-bit data (:func:`top_of_format`) with the guard on. Wider data keeps its headroom.

    Example:
        >>> products_guarded(jnp.float8_e4m3fn), products_guarded(jnp.float16)
        (True, False)
    """
    return top_of_format(dtype) and guard_band(dtype) is not None


def cast_guarded(from_dtype, to_dtype) -> bool:
    """True when a cast of float data from ``from_dtype`` into ``to_dtype`` is range-guarded:
    a narrowing into a format with a guard band (:func:`guard_band`).

    Example:
        >>> cast_guarded(jnp.float32, jnp.float16), cast_guarded(jnp.float16, jnp.float32)
        (True, False)
    """
    narrowing = jnp.finfo(to_dtype).maxexp < jnp.finfo(from_dtype).maxexp
    return narrowing and guard_band(to_dtype) is not None


def fitting_scale(bound: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``scale``, or a larger power of two where data of magnitude ``bound`` (a float32 0-d,
    in units of ``scale``) would reach the top binade of ``dtype``: then ``bound`` lands at
    the guard's target (:func:`guard_band`). Scalar work only, no reduction over data.
    ``scale`` unchanged when the guard is off.

    Example:
        >>> float(fitting_scale(jnp.float32(2.0**12), jnp.float32(1.0), jnp.float8_e4m3fn))
        64.0
        >>> float(fitting_scale(jnp.float32(3.0), jnp.float32(1.0), jnp.float8_e4m3fn))
        1.0
    """
    band = guard_band(dtype)
    if band is None:
        return scale
    band = (MIN_SCALE_EXPONENT, jnp.finfo(dtype).maxexp - 1, band[2])  # overflow only
    _, up = guard_factors(jnp.reshape(bound, (1,)), dtype, band=band)
    return scale_mul(scale, up)


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
    """A loop carry with its float32 (or bfloat16) data brought back near unit scale when its
    largest datum left :func:`carry_band` (the same value: the shift moves into the scale).

    Example:
        >>> x = recentred_carry(ScaledArray(jnp.array([2.0**40, 1.0]), jnp.float32(1.0)))
        >>> x.data.tolist(), float(x.scale) == 2.0**40
        ([1.0, 9.094947017729282e-13], True)
    """
    band = carry_band(x.data.dtype)
    if band is None or x.data.size == 0:
        return x
    wide = lax.convert_element_type(x.data, compute_dtype(x.data.dtype))  # bfloat16: float32
    down, up = guard_factors(wide, x.data.dtype, band=band)
    data = lax.convert_element_type(times_scalar(wide, down), x.data.dtype)
    return ScaledArray(data, make_scale(scale_mul(scale_f32(x), up), x))


_LARGEST = "largest_magnitude"


def record_largest_magnitude(data: jax.Array, largest: jax.Array) -> None:
    """Record ``largest`` (a float32 0-d, ``max(|data|)`` up to the sign of a zero) for the
    float32 ``data`` a rule has just made, so that a range guard of ``data`` reads it rather
    than reducing ``data`` again (:func:`guard_factors` reads only its exponent field).
    Nothing for other dtypes or outside a scalified call.

    Example:
        >>> record_largest_magnitude(jnp.ones(3), jnp.float32(1.0))  # concrete: nothing kept
        >>> recorded_largest_magnitude(jnp.ones(3)) is None
        True
    """
    if data.dtype == jnp.float32 and largest.dtype == jnp.float32 and not largest.ndim:
        memoized(_LARGEST, data, lambda: largest)


def recorded_largest_magnitude(data: jax.Array) -> jax.Array | None:
    """The largest magnitude recorded for ``data`` (:func:`record_largest_magnitude`), or
    the one a range guard of it computed, or None."""
    return recorded(_LARGEST, data)


_NARROW_LARGEST = "narrow_largest_magnitude"


def widened(data: jax.Array) -> jax.Array:
    """``data`` in its compute dtype (float32 for narrow formats), converted once per traced
    array and scalified call. Where a range guard made ``data``, the largest magnitude it
    took comes along: a later guard of the widened data (a cast to float8, a power) reads it
    instead of reducing the data again.

    Example:
        >>> widened(jnp.ones(2, jnp.float16)).dtype
        dtype('float32')
    """

    def convert() -> jax.Array:
        wide = lax.convert_element_type(data, compute_dtype(data.dtype))
        guard = recorded(_NARROW_LARGEST, data)
        if guard is not None:
            memoized(_LARGEST, wide, lambda: _rounded_largest(data.dtype, *guard))
        return wide

    return memoized("widened", data, convert)


def carry_largest_magnitude(source: jax.Array, result: jax.Array) -> None:
    """Give ``result`` the largest-magnitude records of ``source`` (a guard's, a rescale's),
    for data holding exactly the magnitudes of ``source``, some repeated: a reshape, a
    transpose, a broadcast, a sum of one term. A later guard of ``result`` then reads them
    rather than reducing it again. Nothing for another dtype or outside a scalified call.

    Example:
        >>> from jax_scaled.memo import scale_memo
        >>> def moved_record(x):
        ...     with scale_memo():
        ...         record_largest_magnitude(x, jnp.max(jnp.abs(x)))
        ...         moved = x.reshape(2, 2)
        ...         carry_largest_magnitude(x, moved)
        ...         return recorded_largest_magnitude(moved)
        >>> float(jax.jit(moved_record)(jnp.array([1.0, -5.0, 2.0, 3.0])))
        5.0
    """
    if result.dtype != source.dtype:
        return
    for kind in (_LARGEST, _NARROW_LARGEST):
        record = recorded(kind, source)
        if record is not None:
            memoized(kind, result, lambda record=record: record)


def _record_guarded(data: jax.Array, wide: jax.Array, down: jax.Array) -> None:
    """Record for the narrow ``data = cast(wide * down)`` its largest magnitude, from the one
    the guard took of ``wide``: rounding to ``data``'s format is monotone and symmetric, so
    the largest rounded datum is the rounded largest, as float32 exactly (NaN and infinity
    included)."""
    largest = recorded(_LARGEST, wide)
    if largest is not None and data.dtype != wide.dtype:  # worked out only where it is read
        memoized(_NARROW_LARGEST, data, lambda: (largest, down))


def _rounded_largest(dtype, largest: jax.Array, down: jax.Array) -> jax.Array:
    rounded = lax.convert_element_type(times_scalar(largest, down), dtype)
    return lax.convert_element_type(rounded, jnp.float32)


def guard_factors(
    wide: jax.Array, dtype, divisor_exponent: int = 0, band: tuple[int, int, int] | None = None
) -> tuple[jax.Array, jax.Array] | None:
    """``(down, up)``, two float32 powers of two with ``down * up == 2^-divisor_exponent``,
    that range-guard ``wide / 2^divisor_exponent`` for a cast to the narrow ``dtype``
    (:func:`guard_band`, or the ``band`` given): the data becomes ``wide * down`` and its
    scale ``scale * up``. None where no guard applies.

    When the largest datum ``2^e`` of ``wide / 2^divisor_exponent`` leaves the band, ``e``
    is moved to the band's target; otherwise, and for data that is all zero or holds an
    infinity, ``up`` is 1 (the static scale is kept). Looked up by the binade of the largest
    magnitude (:func:`_up_table`), without branches: ``up`` in a small kernel of its own
    (:func:`~jax_scaled.pow2.xla.computed_once`), and ``down`` divided out of it
    (:func:`~jax_scaled.pow2.xla.reciprocal_power`), which :func:`times_scalar` applies as
    a division of the data by ``up * 2^divisor_exponent`` (that product is what the small
    kernel works out for a positive ``divisor_exponent``, and ``up`` is derived from it).
    Copied, the chain was compiled again in the kernel that writes the
    guarded data and in every kernel that reads its scale (the 4-layer GPT's float16 step:
    50.8k instructions instead of 42.1k); carried by a variadic reduction, both factors
    cost a reduction and its region per guard (4% of the 1-layer GPT's float16 step). The
    shift is clamped at ``2^-126`` so that both factors stay normal floats, which makes the
    division exact.

    Example:
        >>> down, up = guard_factors(jnp.array([2.0**17, 2.0]), jnp.float16)
        >>> float(down), float(up)
        (6.103515625e-05, 16384.0)
    """
    band = guard_band(dtype) if band is None else band
    if band is None or wide.size == 0:
        return None
    kind = _factors_kind(band, divisor_exponent)
    found = recorded(kind, wide)
    if found is not None:
        return found
    largest = memoized(_LARGEST, wide, lambda: largest_magnitude(wide))
    if divisor_exponent > 0:  # the data divided by up * 2^d, worked out in the small kernel
        divisor = computed_once(_up_factor(largest, band, divisor_exponent, divisor_exponent))
        return reciprocal_power(divisor), scale_mul(divisor, np.float32(2.0**-divisor_exponent))
    up = computed_once(_up_factor(largest, band, divisor_exponent))
    # Exact: both factors are normal powers of two.
    return reciprocal_power(up, divisor_exponent), up


def _factors_kind(band: tuple[int, int, int], divisor_exponent: int) -> str:
    return f"guard_factors{band}/{divisor_exponent}"


def _up_factor(
    largest: jax.Array, band: tuple[int, int, int], divisor_exponent: int, times: int = 0
) -> jax.Array:
    """The guard's factor ``up`` (times ``2^times``) for data whose largest magnitude is
    ``largest`` (float32, elementwise for several guards at once): a lookup by its binade
    (:func:`~jax_scaled.pow2.xla.binade_lookup`) in :func:`_up_table`."""
    table = _up_table(band, divisor_exponent, times)
    largest = lax.convert_element_type(largest, jnp.float32)  # float64 data: its binade's bits
    return lax.bitcast_convert_type(binade_lookup(largest, table), jnp.float32)


@functools.cache
def _up_table(band: tuple[int, int, int], divisor_exponent: int, times: int) -> np.ndarray:
    """The float32 bits of ``up * 2^times`` for each sign and exponent field of the largest
    magnitude ``2^e`` (512 entries, the sign ignored). When ``e`` leaves the band (shifted by
    ``divisor_exponent``), ``e`` moves to its target, no lower than ``2^-126`` times it;
    otherwise, and for zero, subnormal and non-finite magnitudes (the fields 0 and 255),
    ``up`` is 1.

    Example:
        >>> [float(np.uint32(b).view(np.float32)) for b in _up_table((-8, 7, 3), 0, 0)[[127, 147]]]
        [1.0, 131072.0]
    """
    low, high, target = (e + divisor_exponent for e in band)
    fields = np.arange(512) % 256
    exponents = fields - EXPONENT_BIAS
    moves = (fields > 0) & (fields < 255) & ((exponents < low) | (exponents >= high))
    up = np.where(moves, np.maximum(exponents, target - 126), target) - target + times
    in_range = MIN_SCALE_EXPONENT <= up.min() and up.max() <= MAX_SCALE_EXPONENT
    if not (in_range and MIN_SCALE_EXPONENT <= low and high <= MAX_SCALE_EXPONENT + 1):
        raise ValueError(f"the guard band {band} shifted by 2^{divisor_exponent} leaves float32")
    table = static_pow2_bits(up)
    table.flags.writeable = False  # shared by every trace
    return table


def guard_factors_together(wides: Sequence[jax.Array], dtype) -> None:
    """Work out the range guard's factors (:func:`guard_factors`) of several arrays at once,
    in one small kernel rather than one per array; :func:`guard_factors` then reads them.
    For guards whose data are all known at the same point (the casts of a step's
    parameters). Nothing where no guard applies or outside a scalified call. Each array's
    factors leave the vector apart (:func:`~jax_scaled.pow2.xla.computed_apart`).

    Example:
        >>> from jax_scaled.memo import scale_memo
        >>> def both(x, y):
        ...     with scale_memo():
        ...         guard_factors_together([x, y], jnp.float16)
        ...         return guard_factors(x, jnp.float16)[1], guard_factors(y, jnp.float16)[1]
        >>> [float(u) for u in jax.jit(both)(jnp.array([2.0**17]), jnp.array([1.0]))]
        [16384.0, 1.0]
    """
    band = guard_band(dtype)
    wides = list({id(w): w for w in wides if w.size and isinstance(w, jxi.Tracer)}.values())
    if band is None or len(wides) < 2:
        return
    largest = stacked_scalars(
        [memoized(_LARGEST, w, lambda w=w: largest_magnitude(w)) for w in wides]
    )
    up = computed_once_per_block(_up_factor(largest, band, 0))
    down = float_division(np.ones(up.shape, np.float32), up)
    kind = _factors_kind(band, 0)
    for wide, factors in zip(wides, zip(computed_apart(down), computed_apart(up)), strict=True):
        memoized(kind, wide, lambda factors=factors: factors)
        record_reciprocal(*factors)


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
    _record_guarded(data, wide, down)
    return ScaledArray(data, make_scale(scale_mul(scale, up), *like))


def centred(wide: jax.Array, scale: jax.Array, dtype, *like: Value) -> ScaledArray:
    """Like :func:`guarded`, but the largest datum always moves to the guard's target: for
    8-bit products, quotients and powers (:func:`products_guarded`), whose data has no
    static estimate worth keeping (a product of data at the top of the format lands 2^8
    above it, a quotient near 1), and whose few binades cannot spare any below the target.

    Example:
        >>> x = centred(jnp.array([2.0, 0.5]), jnp.float32(1.0), jnp.float8_e4m3fn)
        >>> x.data.astype(jnp.float32).tolist(), float(x.scale)
        ([64.0, 16.0], 0.03125)
    """
    band = guard_band(dtype)
    if band is None or wide.size == 0:
        return ScaledArray(lax.convert_element_type(wide, dtype), make_scale(scale, *like))
    target = band[2]
    down, up = guard_factors(wide, dtype, band=(target, target + 1, target))
    data = lax.convert_element_type(times_scalar(wide, down), dtype)
    _record_guarded(data, wide, down)
    return ScaledArray(data, make_scale(scale_mul(scale, up), *like))
