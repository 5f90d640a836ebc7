"""Scale rules: transcendental primitives.

These functions have no scale structure (``f(d * s)`` is not ``f(d) * g(s)``), so each rule
evaluates ``f`` in the compute dtype (float32, or wider for wider data) on the represented
value, never forming ``data * scale`` in a narrow dtype, and re-splits the result at a
power-of-two output scale estimated from the input scale alone:

* ``exp``, ``exp2``, ``cos``, ``cosh``, ``logistic``, ``erfc``, ``acos``, ``acosh``: scale 1
  (the result is O(1) for O(1) inputs, whatever the input scale).
* ``sin``, ``tanh``, ``erf``, ``atan``, ``sinh``, ``tan``, ``expm1``, ``log1p``, ``erf_inv``,
  ``asin``, ``atanh``, ``asinh``: ``f(x) ~ x`` near 0, so scale ``min(s, 1)``: tiny inputs
  keep their full relative precision.
* ``log``: ``log(m) + (k + log2 s)·ln2`` from an exact split of the data, scale ``max(1, |ln s|)``.
* ``lgamma``, ``digamma``, ``polygamma``: their asymptotics at 0 and infinity (see the rules).
* ``atan2``: scale-invariant in its operands; scale ``min(1, sy/sx)``.
* ``pow``: ``dx^y · 2^(ex·y)`` with ``sx = 2^ex``; scale ``sx^p`` (see :func:`pow_rule`).

Where the result is bounded (``atan2``, ``erf_inv``, ``asin``, ``acos``) the scale is floored
so that the bound still fits in the data format.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine import estimates
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.pow2.static import is_static, static_pow2_round
from jax_scaled.pow2.traced import pow2_exponent, pow2_reciprocal
from jax_scaled.scales import (
    as_scaled,
    from_compute,
    make_scale,
    round_scale,
    scale_f32,
    to_compute,
    wide_data,
)
from jax_scaled.scales.wide import wide_value

ScaleEstimate = Callable[[jax.Array], jax.Array]

# ln 2 = _LN2_HI + _LN2_LO with _LN2_HI exact in 16 bits, so n * _LN2_HI is exact for |n| < 2^8.
_LN2_HI = 0.693145751953125
_LN2_LO = math.log(2.0) - _LN2_HI


def _unit(s: jax.Array) -> np.ndarray:
    """The scale estimate 1, static (no equation: see ``jax_scaled.pow2.xla``)."""
    return np.ones((), np.float32)


def _linear(s: jax.Array) -> jax.Array:
    return jnp.minimum(s, np.float32(1))


def _resplit(
    value: jax.Array, scale: jax.Array, dtype, *like: Value, bound: float = 0.0
) -> ScaledArray:
    """``value`` (compute dtype) as ``dtype`` data at the power-of-two rounding of ``scale``.

    ``bound`` (max ``|value|``) floors the scale so that ``bound / scale`` fits in ``dtype``.
    """
    scale = round_scale(scale)
    if bound:
        floor = np.float32(static_pow2_round(bound / float(jnp.finfo(dtype).max), "up"))
        scale = np.maximum(scale, floor) if is_static(scale) else lax.max(scale, floor)
    return from_compute(value, scale, dtype, *like)


def _evaluate(primitive, x: Value, estimate: ScaleEstimate, params: dict, bound: float = 0.0):
    """Bind ``primitive`` on the represented value in the compute dtype; re-split at
    ``estimate(input scale)``."""
    x = as_scaled(x)
    value = primitive.bind(wide_value(x), **params)
    return _resplit(value, estimate(scale_f32(x)), x.dtype, x, bound=bound)


@register_scale_rule(lax.exp_p, properties=Property.FOLDS_SCALARS, estimate=estimates.unit)
def exp_rule(x: Value, **params) -> ScaledArray:
    """exp: output scale 1."""
    return _evaluate(lax.exp_p, x, _unit, params)


@register_scale_rule(lax.exp2_p, properties=Property.FOLDS_SCALARS, estimate=estimates.unit)
def exp2_rule(x: Value, **params) -> ScaledArray:
    """exp2: output scale 1."""
    return _evaluate(lax.exp2_p, x, _unit, params)


@register_scale_rule(lax.cos_p, properties=Property.POINTWISE, estimate=estimates.unit)
def cos_rule(x: Value, **params) -> ScaledArray:
    """cos: output scale 1."""
    return _evaluate(lax.cos_p, x, _unit, params)


@register_scale_rule(lax.cosh_p, properties=Property.POINTWISE)
def cosh_rule(x: Value, **params) -> ScaledArray:
    """cosh: output scale 1."""
    return _evaluate(lax.cosh_p, x, _unit, params)


@register_scale_rule(lax.logistic_p, properties=Property.FOLDS_SCALARS, estimate=estimates.unit)
def logistic_rule(x: Value, **params) -> ScaledArray:
    """logistic: output scale 1."""
    return _evaluate(lax.logistic_p, x, _unit, params)


@register_scale_rule(lax.erfc_p, properties=Property.POINTWISE, estimate=estimates.unit)
def erfc_rule(x: Value, **params) -> ScaledArray:
    """erfc: output scale 1."""
    return _evaluate(lax.erfc_p, x, _unit, params)


@register_scale_rule(lax.sin_p, properties=Property.POINTWISE)
def sin_rule(x: Value, **params) -> ScaledArray:
    """sin: output scale min(s, 1)."""
    return _evaluate(lax.sin_p, x, _linear, params)


@register_scale_rule(lax.tan_p, properties=Property.POINTWISE)
def tan_rule(x: Value, **params) -> ScaledArray:
    """tan: output scale min(s, 1)."""
    return _evaluate(lax.tan_p, x, _linear, params)


@register_scale_rule(lax.tanh_p, properties=Property.FOLDS_SCALARS)
def tanh_rule(x: Value, **params) -> ScaledArray:
    """tanh: output scale min(s, 1)."""
    return _evaluate(lax.tanh_p, x, _linear, params)


@register_scale_rule(lax.sinh_p, properties=Property.POINTWISE)
def sinh_rule(x: Value, **params) -> ScaledArray:
    """sinh: output scale min(s, 1)."""
    return _evaluate(lax.sinh_p, x, _linear, params)


@register_scale_rule(lax.atan_p, properties=Property.POINTWISE)
def atan_rule(x: Value, **params) -> ScaledArray:
    """atan: output scale min(s, 1)."""
    return _evaluate(lax.atan_p, x, _linear, params)


@register_scale_rule(lax.erf_p, properties=Property.POINTWISE)
def erf_rule(x: Value, **params) -> ScaledArray:
    """erf: output scale min(s, 1)."""
    return _evaluate(lax.erf_p, x, _linear, params)


@register_scale_rule(lax.erf_inv_p, properties=Property.POINTWISE)
def erf_inv_rule(x: Value, **params) -> ScaledArray:
    """erf_inv: output scale min(s, 1), floored so that |erf_inv| <= 6 fits."""
    return _evaluate(lax.erf_inv_p, x, _linear, params, bound=6.0)


@register_scale_rule(lax.expm1_p, properties=Property.FOLDS_SCALARS)
def expm1_rule(x: Value, **params) -> ScaledArray:
    """expm1: output scale min(s, 1)."""
    return _evaluate(lax.expm1_p, x, _linear, params)


@register_scale_rule(lax.log1p_p, properties=Property.FOLDS_SCALARS)
def log1p_rule(x: Value, **params) -> ScaledArray:
    """log1p: output scale min(s, 1)."""
    return _evaluate(lax.log1p_p, x, _linear, params)


@register_scale_rule(lax.asin_p, properties=Property.POINTWISE)
def asin_rule(x: Value, **params) -> ScaledArray:
    """asin: output scale min(s, 1), floored so that |asin| <= pi/2 fits."""
    return _evaluate(lax.asin_p, x, _linear, params, bound=math.pi / 2)


@register_scale_rule(lax.atanh_p, properties=Property.POINTWISE)
def atanh_rule(x: Value, **params) -> ScaledArray:
    """atanh: output scale min(s, 1)."""
    return _evaluate(lax.atanh_p, x, _linear, params)


@register_scale_rule(lax.asinh_p, properties=Property.POINTWISE)
def asinh_rule(x: Value, **params) -> ScaledArray:
    """asinh: output scale min(s, 1) (asinh grows like log |x|: O(1) for large inputs)."""
    return _evaluate(lax.asinh_p, x, _linear, params)


@register_scale_rule(lax.acos_p, properties=Property.POINTWISE)
def acos_rule(x: Value, **params) -> ScaledArray:
    """acos: output scale 1, floored so that acos <= pi fits."""
    return _evaluate(lax.acos_p, x, _unit, params, bound=math.pi)


@register_scale_rule(lax.acosh_p, properties=Property.POINTWISE)
def acosh_rule(x: Value, **params) -> ScaledArray:
    """acosh: output scale 1 (acosh grows like log x)."""
    return _evaluate(lax.acosh_p, x, _unit, params)


def _log_of_scale(s: jax.Array) -> jax.Array:
    """``|ln s|`` for a power-of-two ``s``, exact to float32 rounding."""
    return jnp.abs(pow2_exponent(s)).astype(jnp.float32) * np.float32(math.log(2.0))


def _lgamma_estimate(s: jax.Array) -> jax.Array:
    """lgamma(x) ~ -ln x near 0 and x ln x for large x: ``max(1, |ln s| * max(1, s))``."""
    return jnp.maximum(_log_of_scale(s) * jnp.maximum(s, 1), 1)


def _digamma_estimate(s: jax.Array) -> jax.Array:
    """digamma(x) ~ -1/x near 0 and ln x for large x: ``1/s`` below 1, ``max(1, ln s)`` above."""
    return jnp.where(s < 1, pow2_reciprocal(s), jnp.maximum(_log_of_scale(s), 1))


@register_scale_rule(lax.lgamma_p, properties=Property.POINTWISE)
def lgamma_rule(x: Value, **params) -> ScaledArray:
    """lgamma: output scale ``max(1, |ln s| max(1, s))``."""
    return _evaluate(lax.lgamma_p, x, _lgamma_estimate, params)


@register_scale_rule(lax.digamma_p, properties=Property.POINTWISE)
def digamma_rule(x: Value, **params) -> ScaledArray:
    """digamma: output scale ``1/s`` for ``s < 1``, else ``max(1, ln s)``."""
    return _evaluate(lax.digamma_p, x, _digamma_estimate, params)


def _trigamma_estimate(s: jax.Array) -> jax.Array:
    """polygamma(1, x) ~ 1/x^2 near 0 and 1/x for large x (capped at the largest scale)."""
    inverse = pow2_reciprocal(s)
    return jnp.minimum(jnp.where(s < 1, inverse * inverse, inverse), np.float32(2.0**127))


@register_scale_rule(lax.polygamma_p, properties=Property.POINTWISE)
def polygamma_rule(m: Value, x: Value, **params) -> ScaledArray:
    """polygamma(m, x) on the values in float32; output scale that of ``m = 1`` (digamma's
    derivative, the usual case): ``1/s^2`` for ``s < 1``, else ``1/s``."""
    x = as_scaled(x)
    value = lax.polygamma_p.bind(to_compute(m), to_compute(x), **params)
    return _resplit(value, _trigamma_estimate(scale_f32(x)), x.dtype, x, m)


def _scale_exponent(x: ScaledArray) -> jax.Array:
    """``log2`` of the (power-of-two) scale of ``x``, as an int32 0-d array."""
    return pow2_exponent(scale_f32(x))


@register_scale_rule(lax.log_p, properties=Property.FOLDS_SCALARS)
def log_rule(x: Value, **params) -> ScaledArray:
    """log: log(m) + n·ln2 with data = m·2^k, n = k + log2 s exact; scale max(1, |ln s|)."""
    x = as_scaled(x)
    wide = compute_dtype(x.dtype)
    # data = mantissa * 2^k with |mantissa| in [1/sqrt2, sqrt2)
    if wide == jnp.float32:
        mantissa, k = _split_near_one(lax.convert_element_type(x.data, wide))
    else:
        mantissa, k = _frexp_near_one(x.data)
    # |log(mantissa)| <= ln2/2 <= |n·ln2| unless n = 0: the sum never cancels.
    n = lax.convert_element_type(lax.add(k, _scale_exponent(x)), wide)
    log_mantissa = lax.log_p.bind(lax.convert_element_type(mantissa, wide), **params)
    value = n * _LN2_HI + (n * _LN2_LO + log_mantissa)
    log_scale = lax.convert_element_type(lax.abs(_scale_exponent(x)), jnp.float32)
    estimate = lax.max(lax.mul(log_scale, np.float32(math.log(2.0))), np.float32(1))
    return _resplit(value, estimate, x.dtype, x)


def _split_near_one(data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(m, k)`` with ``data = m * 2^k`` and ``|m|`` in ``[1/sqrt2, sqrt2)`` for float32
    ``data``, from its bits (exact, subnormals included). Zeros, infinities and NaNs come
    back as they are with ``k = 0``, so that ``log`` gives -inf, inf or NaN for them.

    Example:
        >>> m, k = _split_near_one(jnp.array([3.0, 0.75, 0.0], jnp.float32))
        >>> m.tolist(), k.tolist()
        ([0.75, 0.75, 0.0], [2, 0, 0])
    """
    bits = lax.bitcast_convert_type(data, jnp.int32)
    magnitude = lax.bitwise_and(bits, np.int32(0x7FFFFFFF))
    # A subnormal is its mantissa bits times 2^-149: convert those to float (exactly, and with
    # integer operations: XLA:CPU flushes subnormal operands of float arithmetic to zero).
    subnormal = lax.lt(magnitude, np.int32(0x00800000))
    as_normal = lax.bitcast_convert_type(
        lax.convert_element_type(magnitude, jnp.float32), jnp.int32
    )
    sign = lax.bitwise_and(bits, np.int32(-0x80000000))
    bits = lax.select(subnormal, lax.bitwise_or(as_normal, sign), bits)
    fraction = lax.bitwise_and(bits, np.int32(-0x7F800001))  # sign and mantissa: 0x807FFFFF
    high = lax.ge(lax.bitwise_and(fraction, np.int32(0x7FFFFF)), np.int32(0x3504F3))  # >= sqrt2
    high = lax.convert_element_type(high, jnp.int32)  # 1: halve the mantissa, add 1 to k
    exponent_bits = lax.sub(np.int32(127 << 23), lax.shift_left(high, np.int32(23)))
    mantissa = lax.bitcast_convert_type(lax.bitwise_or(fraction, exponent_bits), jnp.float32)
    biased = lax.shift_right_logical(lax.bitwise_and(bits, np.int32(0x7FFFFFFF)), np.int32(23))
    k = lax.add(lax.sub(biased, np.int32(127)), high)
    k = lax.sub(k, lax.mul(lax.convert_element_type(subnormal, jnp.int32), np.int32(149)))
    special = lax.bitwise_or(
        lax.eq(magnitude, np.int32(0)), lax.ge(magnitude, np.int32(0x7F800000))
    )  # zero, inf, NaN: log of the data itself, no exponent
    return lax.select(special, data, mantissa), lax.select(special, lax.full_like(k, 0), k)


def _frexp_near_one(data: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``_split_near_one`` for float64 data, with ``jnp.frexp``."""
    mantissa, k = jnp.frexp(data)  # |mantissa| in [1/2, 1): move it to [1/sqrt2, sqrt2)
    low = jnp.abs(mantissa) < math.sqrt(0.5)
    return jnp.where(low, 2 * mantissa, mantissa), jnp.where(low, k - 1, k)


@register_scale_rule(lax.atan2_p, properties=Property.POINTWISE)
def atan2_rule(y: Value, x: Value, **params) -> ScaledArray:
    """atan2: operands aligned to their larger scale; output scale min(1, sy/sx), floored for pi."""
    y, x = as_scaled(y), as_scaled(x)
    sy, sx = scale_f32(y), scale_f32(x)
    common = jnp.maximum(sy, sx)
    value = lax.atan2_p.bind(wide_data(y, common), wide_data(x, common), **params)
    estimate = jnp.clip(sy / sx, np.float32(2.0**-126), np.float32(1))
    return _resplit(value, estimate, y.dtype, y, x, bound=math.pi)


def _split_mantissa(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Veltkamp split ``y = hi + lo`` with ``hi`` holding half the mantissa bits (exact)."""
    bits = jnp.finfo(y.dtype).nmant + 1
    c = y * jnp.asarray(2.0 ** ((bits + 1) // 2) + 1, y.dtype)
    hi = c - (c - y)
    return hi, y - hi


def _pow2_estimate(log2_estimate: jax.Array) -> jax.Array:
    """``2^log2_estimate`` rounded to a power of two, exact for integer ``log2_estimate``."""
    whole = jnp.floor(log2_estimate)
    fraction = round_scale(jnp.exp2(log2_estimate - whole))  # 1 or 2
    return round_scale(jnp.ldexp(fraction, whole.astype(jnp.int32)))


@register_scale_rule(lax.pow_p, properties=Property.FOLDS_SCALARS)
def pow_rule(x: Value, y: Value, **params) -> ScaledArray:
    """pow: x^y = dx^y · 2^(ex·y - K) · 2^K (sx = 2^ex); output scale 2^K ~ sx^mean(y).

    The exponent's value, not its scale, sets the result's magnitude, so the estimate reads
    the mean of ``y`` (exactly the constant for ``x ** c``); the base contributes its scale only.
    """
    x = as_scaled(x)
    wide = compute_dtype(x.dtype)
    p = to_compute(y) if isinstance(y, ScaledArray) else y.astype(wide)
    ex = _scale_exponent(x).astype(wide)
    scale = _pow2_estimate(jnp.clip(ex * jnp.mean(p), -126, 127).astype(jnp.float32))
    hi, lo = _split_mantissa(p)  # ex·hi and ex·lo are exact (|ex| < 2^8)
    shift = (ex * hi - pow2_exponent(scale).astype(wide)) + ex * lo
    value = lax.pow(*jnp.broadcast_arrays(x.data.astype(wide), p)) * jnp.exp2(shift)
    return ScaledArray(value.astype(x.dtype), make_scale(scale, x, y))
