"""Scale rules: transcendental primitives.

These functions have no scale structure (``f(d * s)`` is not ``f(d) * g(s)``), so each rule
evaluates ``f`` in the compute dtype (float32, or wider for wider data) on the represented
value, never forming ``data * scale`` in a narrow dtype, and re-splits the result at a
power-of-two output scale estimated from the input scale alone:

* ``exp``, ``exp2``, ``cos``, ``cosh``, ``logistic``, ``erfc``: scale 1 (the result is O(1)
  for O(1) inputs, whatever the input scale).
* ``sin``, ``tanh``, ``erf``, ``atan``, ``sinh``, ``tan``, ``expm1``, ``log1p``, ``erf_inv``:
  ``f(x) ~ x`` near 0, so scale ``min(s, 1)``: tiny inputs keep their full relative precision.
* ``log``: ``log(m) + (k + log2 s)·ln2`` from an exact split of the data, scale ``max(1, |ln s|)``.
* ``atan2``: scale-invariant in its operands; scale ``min(1, sy/sx)``.
* ``pow``: ``dx^y · 2^(ex·y)`` with ``sx = 2^ex``; scale ``sx^p`` (see :func:`pow_rule`).

Where the result is bounded (``atan2``, ``erf_inv``) the scale is floored so that the bound
still fits in the data format.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.pow2 import pow2_exponent, static_pow2_round
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import (
    as_scaled,
    compute_dtype,
    from_compute,
    make_scale,
    round_scale,
    scale_f32,
    to_compute,
    wide_data,
)

Value = Any  # jax.Array | ScaledArray
ScaleEstimate = Callable[[jax.Array], jax.Array]

# ln 2 = _LN2_HI + _LN2_LO with _LN2_HI exact in 16 bits, so n * _LN2_HI is exact for |n| < 2^8.
_LN2_HI = 0.693145751953125
_LN2_LO = math.log(2.0) - _LN2_HI


def _unit(s: jax.Array) -> jax.Array:
    return jnp.ones_like(s)


def _linear(s: jax.Array) -> jax.Array:
    return jnp.minimum(s, jnp.float32(1))


def _resplit(
    value: jax.Array, scale: jax.Array, dtype, *like: Value, bound: float = 0.0
) -> ScaledArray:
    """``value`` (compute dtype) as ``dtype`` data at the power-of-two rounding of ``scale``.

    ``bound`` (max ``|value|``) floors the scale so that ``bound / scale`` fits in ``dtype``.
    """
    scale = round_scale(scale)
    if bound:
        floor = static_pow2_round(bound / float(jnp.finfo(dtype).max), "up")
        scale = jnp.maximum(scale, jnp.float32(floor))
    return from_compute(value, scale, dtype, *like)


def _evaluate(primitive, x: Value, estimate: ScaleEstimate, params: dict, bound: float = 0.0):
    """Bind ``primitive`` on the represented value in the compute dtype; re-split at
    ``estimate(input scale)``."""
    x = as_scaled(x)
    value = primitive.bind(to_compute(x), **params)
    return _resplit(value, estimate(scale_f32(x)), x.dtype, x, bound=bound)


@register_scale_rule(lax.exp_p)
def exp_rule(x: Value, **params) -> ScaledArray:
    """exp: output scale 1."""
    return _evaluate(lax.exp_p, x, _unit, params)


@register_scale_rule(lax.exp2_p)
def exp2_rule(x: Value, **params) -> ScaledArray:
    """exp2: output scale 1."""
    return _evaluate(lax.exp2_p, x, _unit, params)


@register_scale_rule(lax.cos_p)
def cos_rule(x: Value, **params) -> ScaledArray:
    """cos: output scale 1."""
    return _evaluate(lax.cos_p, x, _unit, params)


@register_scale_rule(lax.cosh_p)
def cosh_rule(x: Value, **params) -> ScaledArray:
    """cosh: output scale 1."""
    return _evaluate(lax.cosh_p, x, _unit, params)


@register_scale_rule(lax.logistic_p)
def logistic_rule(x: Value, **params) -> ScaledArray:
    """logistic: output scale 1."""
    return _evaluate(lax.logistic_p, x, _unit, params)


@register_scale_rule(lax.erfc_p)
def erfc_rule(x: Value, **params) -> ScaledArray:
    """erfc: output scale 1."""
    return _evaluate(lax.erfc_p, x, _unit, params)


@register_scale_rule(lax.sin_p)
def sin_rule(x: Value, **params) -> ScaledArray:
    """sin: output scale min(s, 1)."""
    return _evaluate(lax.sin_p, x, _linear, params)


@register_scale_rule(lax.tan_p)
def tan_rule(x: Value, **params) -> ScaledArray:
    """tan: output scale min(s, 1)."""
    return _evaluate(lax.tan_p, x, _linear, params)


@register_scale_rule(lax.tanh_p)
def tanh_rule(x: Value, **params) -> ScaledArray:
    """tanh: output scale min(s, 1)."""
    return _evaluate(lax.tanh_p, x, _linear, params)


@register_scale_rule(lax.sinh_p)
def sinh_rule(x: Value, **params) -> ScaledArray:
    """sinh: output scale min(s, 1)."""
    return _evaluate(lax.sinh_p, x, _linear, params)


@register_scale_rule(lax.atan_p)
def atan_rule(x: Value, **params) -> ScaledArray:
    """atan: output scale min(s, 1)."""
    return _evaluate(lax.atan_p, x, _linear, params)


@register_scale_rule(lax.erf_p)
def erf_rule(x: Value, **params) -> ScaledArray:
    """erf: output scale min(s, 1)."""
    return _evaluate(lax.erf_p, x, _linear, params)


@register_scale_rule(lax.erf_inv_p)
def erf_inv_rule(x: Value, **params) -> ScaledArray:
    """erf_inv: output scale min(s, 1), floored so that |erf_inv| <= 6 fits."""
    return _evaluate(lax.erf_inv_p, x, _linear, params, bound=6.0)


@register_scale_rule(lax.expm1_p)
def expm1_rule(x: Value, **params) -> ScaledArray:
    """expm1: output scale min(s, 1)."""
    return _evaluate(lax.expm1_p, x, _linear, params)


@register_scale_rule(lax.log1p_p)
def log1p_rule(x: Value, **params) -> ScaledArray:
    """log1p: output scale min(s, 1)."""
    return _evaluate(lax.log1p_p, x, _linear, params)


def _scale_exponent(x: ScaledArray) -> jax.Array:
    """``log2`` of the (power-of-two) scale of ``x``, as an int32 0-d array."""
    return pow2_exponent(scale_f32(x))


@register_scale_rule(lax.log_p)
def log_rule(x: Value, **params) -> ScaledArray:
    """log: log(m) + n·ln2 with data = m·2^k, n = k + log2 s exact; scale max(1, |ln s|)."""
    x = as_scaled(x)
    wide = compute_dtype(x.dtype)
    mantissa, k = jnp.frexp(x.data)  # |mantissa| in [1/2, 1): move it to [1/sqrt2, sqrt2)
    low = jnp.abs(mantissa) < math.sqrt(0.5)
    mantissa, k = jnp.where(low, 2 * mantissa, mantissa), jnp.where(low, k - 1, k)
    # |log(mantissa)| <= ln2/2 <= |n·ln2| unless n = 0: the sum never cancels.
    n = (k + _scale_exponent(x)).astype(wide)
    value = n * _LN2_HI + (n * _LN2_LO + lax.log_p.bind(mantissa.astype(wide), **params))
    estimate = jnp.maximum(jnp.abs(_scale_exponent(x)).astype(jnp.float32) * math.log(2.0), 1)
    return _resplit(value, estimate, x.dtype, x)


@register_scale_rule(lax.atan2_p)
def atan2_rule(y: Value, x: Value, **params) -> ScaledArray:
    """atan2: operands aligned to their larger scale; output scale min(1, sy/sx), floored for pi."""
    y, x = as_scaled(y), as_scaled(x)
    sy, sx = scale_f32(y), scale_f32(x)
    common = jnp.maximum(sy, sx)
    value = lax.atan2_p.bind(wide_data(y, common), wide_data(x, common), **params)
    estimate = jnp.clip(sy / sx, jnp.float32(2.0**-126), jnp.float32(1))
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


@register_scale_rule(lax.pow_p)
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
