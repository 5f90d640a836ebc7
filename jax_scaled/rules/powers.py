"""Scale rules for powers and roots: exact structural splits of the power-of-two scale.

A power ``x^y`` has scale ``s^y`` and data ``d^y``; a root splits ``s = 2^(n*k + r)`` into a
root scale ``2^k`` and a remainder ``2^r`` folded into the data. Powers into float16 and
float8 are range-guarded first (:func:`integer_pow_rule`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT
from jax_scaled.pow2.traced import (
    floor_divide_exponent,
    pow2_exponent,
    pow2_from_exponent,
    pow2_reciprocal,
    pow2_sqrt_split,
)
from jax_scaled.scales import (
    centred,
    guard_band,
    guard_factors,
    guarded,
    make_scale,
    products_guarded,
    scale_f32,
    scale_mul,
    times_scalar,
    widened,
)


def _root_split(x: ScaledArray, n: int) -> tuple[jax.Array, jax.Array]:
    """``(d * 2^r, 2^k)``, the data in the compute dtype, with ``s = 2^(n*k + r)``,
    ``0 <= r < n``; a square root's on the exponent field in place (:func:`pow2_sqrt_split`)."""
    if n == 2:
        root, remainder = pow2_sqrt_split(scale_f32(x))
        return times_scalar(widened(x.data), remainder), root
    exponent = pow2_exponent(scale_f32(x))
    k = floor_divide_exponent(exponent, n)
    remainder = pow2_from_exponent(lax.sub(exponent, lax.mul(k, np.int32(n))))
    return times_scalar(widened(x.data), remainder), pow2_from_exponent(k)


@register_scale_rule(lax.integer_pow_p, properties=Property.FOLDS_SCALARS)
def integer_pow_rule(x: ScaledArray, *, y: int, **params) -> ScaledArray:
    """Exact: scale s^y, data d^y (in float32, rounded once; for 8-bit data, its largest
    datum put at the guard's target: :func:`~jax_scaled.scales.guard.centred`).

    Powers magnify any drift of the data from unit scale (data 300 squares to 90000, past
    float16's range). With the range guard (:class:`~jax_scaled.ScalifyConfig`), for
    ``y >= 2`` into float16 or float8, a power of two ``2^t`` is first moved from the data
    into the scale (value unchanged) whenever the largest ``|d|^y`` would leave the guard
    band; ``t`` puts ``max |d|`` in ``[1, 2)``. Healthy data gives the static result.
    A negative power's largest datum comes from the smallest ``|d|``, which the largest one
    does not bound: it is formed in float32 and guarded like a quotient (``jax.grad`` of a
    division by a traced denominator takes ``integer_pow(denominator, -2)``, which
    overflowed float16 data of the denominator below ``2^-8``).
    """
    if y < 0 and guard_band(x.dtype) is not None:
        return _negative_power_guarded(x, y)
    wide, scale = widened(x.data), scale_f32(x)
    factors = _power_guard_factors(wide, x.dtype, y)
    if factors is not None:
        down, up = factors
        wide, scale = times_scalar(wide, down), scale_mul(scale, up)
    data, scale = _power_with_scale_in_range(wide, scale, y)
    if products_guarded(x.dtype):  # 8-bit: a cube of in-band data can overflow
        return centred(data, scale, x.dtype, x)
    return ScaledArray(data.astype(x.dtype), make_scale(scale, x))


def _negative_power_guarded(x: ScaledArray, y: int) -> ScaledArray:
    """``x^y`` for ``y < 0`` into a guarded format: float32 data, then the range guard of a
    quotient (:func:`~jax_scaled.scales.guard.guarded`; 8-bit data centred)."""
    data, scale = _power_with_scale_in_range(widened(x.data), scale_f32(x), y)
    if products_guarded(x.dtype):
        return centred(data, scale, x.dtype, x)
    return guarded(data, scale, x.dtype, x)


def _power_with_scale_in_range(
    wide: jax.Array, scale: jax.Array, y: int
) -> tuple[jax.Array, jax.Array]:
    """``(wide^y, scale^y)``; for ``y >= 3`` (a gelu's cube) and ``y < 0``, an exponent of
    ``scale^y`` beyond float32's normal range stays in the data instead (exact: a power of
    two), so a value float32 holds (``2^130`` data ``0.01``) does not get an infinite scale,
    whose zeros would turn into NaN. A square's scale leaves the range only for values near
    ``2^64``: left as is, its scalar chain costs nothing more in every Adam update."""
    if 0 <= y < 3:
        return lax.integer_pow(wide, y), lax.integer_pow(scale, y)
    exponent = lax.mul(pow2_exponent(scale), np.int32(y))
    kept = lax.clamp(np.int32(MIN_SCALE_EXPONENT), exponent, np.int32(126))
    excess = pow2_from_exponent(lax.sub(exponent, kept))  # clamped: beyond it, float32 overflows
    return times_scalar(lax.integer_pow(wide, y), excess), pow2_from_exponent(kept, clamp=False)


def _power_guard_factors(wide: jax.Array, dtype, y: int) -> tuple | None:
    """``(down, up)`` that move ``max |d|`` into ``[1, 2)`` before raising the data to ``y``
    (see :func:`integer_pow_rule`), or None where no guard applies: the range guard's
    factors (:func:`~jax_scaled.scales.guard.guard_factors`, one small kernel and a
    division, not copied into each reader) for the band of exponents ``e`` with ``y * e``
    in the format's band, and target ``2^0``."""
    band = guard_band(dtype)
    if y < 2 or band is None:
        return None
    low, high, _ = band
    ceil_low, ceil_high = -(-low // y), -(-high // y)  # y * e >= bound  <=>  e >= ceil
    return guard_factors(wide, dtype, band=(ceil_low, ceil_high, 0))


@register_scale_rule(lax.square_p, properties=Property.FOLDS_SCALARS, fold=np.square)
def square_rule(x: ScaledArray, **params) -> ScaledArray:
    """Exact: scale s^2, data d^2 (in float32, rounded once)."""
    return integer_pow_rule(x, y=2)


@register_scale_rule(lax.sqrt_p, properties=Property.FOLDS_SCALARS)
def sqrt_rule(x: ScaledArray, **params) -> ScaledArray:
    """Exact: s = 2^(2k+r) gives scale 2^k, data sqrt(d * 2^r)."""
    data, root = _root_split(x, 2)
    return ScaledArray(lax.sqrt(data).astype(x.dtype), make_scale(root, x))


@register_scale_rule(lax.rsqrt_p, properties=Property.FOLDS_SCALARS)
def rsqrt_rule(x: ScaledArray, **params) -> ScaledArray:
    """Exact: s = 2^(2k+r) gives scale 2^-k, data rsqrt(d * 2^r)."""
    data, root = _root_split(x, 2)
    return ScaledArray(lax.rsqrt(data).astype(x.dtype), make_scale(pow2_reciprocal(root), x))


@register_scale_rule(lax.cbrt_p, properties=Property.POINTWISE)
def cbrt_rule(x: ScaledArray, **params) -> ScaledArray:
    """Exact: s = 2^(3k+r) gives scale 2^k, data cbrt(d * 2^r)."""
    data, root = _root_split(x, 3)
    return ScaledArray(lax.cbrt(data).astype(x.dtype), make_scale(root, x))
