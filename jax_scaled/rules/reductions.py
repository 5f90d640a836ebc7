"""Scale rules for reductions: reduce_*, arg*, cumulative ops, sort, top_k, reduce_window_*.

Order-based ops (max, min, arg*, sort, top_k, approx_top_k) run on the data directly: a
positive scale does not change an order. Sums follow the unit-scaling estimate ``s * sqrt(N)``
for ``N`` summed terms. Products have no useful unit-scaling estimate; their rules are exact
while the represented values stay in range (see :func:`reduce_prod_rule` and
:func:`cumprod_rule`).

Reductions with a user computation (``lax.reduce``, ``lax.reduce_window`` with a function
other than ``lax.add``/``max``/``min``, ``select_and_scatter``) are in
:mod:`jax_scaled.rules.reductions_custom`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine import estimates
from jax_scaled.engine.facts import summed_fact
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.pow2.static import MAX_SCALE_EXPONENT, MIN_SCALE_EXPONENT
from jax_scaled.pow2.traced import pow2_exponent, pow2_from_exponent
from jax_scaled.scales import (
    carry_largest_magnitude,
    from_compute,
    guarded,
    make_scale,
    round_scale,
    scale_f32,
    scale_mul,
    sqrt_pow2,
    to_compute,
)


def _same_scale(x: ScaledArray, data: jax.Array) -> ScaledArray:
    return ScaledArray(data, x.scale)


def _sum_like(x: ScaledArray, total: jax.Array, n: int) -> ScaledArray:
    """A sum of ``n`` unit terms has scale ``sqrt(n)``: data ``total / sqrt(n)`` (pow2)."""
    sqrt_n = sqrt_pow2(n)
    data = total / jnp.asarray(sqrt_n, total.dtype) if sqrt_n != 1 else total
    return ScaledArray(data, make_scale(scale_f32(x) * np.float32(sqrt_n), x))


def _times_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """``x * 2**exponent``, exact while the result is in range (|exponent| up to 252)."""
    half = exponent // 2
    return (
        x
        * pow2_from_exponent(half).astype(x.dtype)
        * pow2_from_exponent(exponent - half).astype(x.dtype)
    )


@register_scale_rule(
    lax.reduce_sum_p, properties=Property.ADDING, estimate=estimates.reduced_sum, facts=summed_fact
)
def reduce_sum_rule(x: ScaledArray, *, axes: tuple[int, ...], **params) -> ScaledArray:
    """Scale ``s * sqrt(N)``; data summed in float32 (or wider), divided by ``sqrt(N)``.

    Accumulating narrow data in float32 is more accurate, and it makes the result
    independent of how XLA fuses the reduction (float16 accumulation order varies).
    """
    count = math.prod(x.shape[a] for a in axes)
    if count == 1:  # one term (a size-1 axis, e.g. the gradient of a broadcast): exact as is
        data = lax.reduce_sum_p.bind(x.data, axes=axes, **params)
        carry_largest_magnitude(x.data, data)
        return _same_scale(x, data)
    wide = lax.convert_element_type(x.data, compute_dtype(x.dtype))
    wide = lax.reduce_sum_p.bind(wide, axes=axes, **params)
    sqrt_n = sqrt_pow2(count)
    return guarded(wide, scale_mul(scale_f32(x), np.float32(sqrt_n)), x.dtype, x, divisor=sqrt_n)


@register_scale_rule(
    lax.reduce_max_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.first
)
def reduce_max_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: the maximum of the data."""
    return _same_scale(x, lax.reduce_max_p.bind(x.data, **params))


@register_scale_rule(
    lax.reduce_min_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.first
)
def reduce_min_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: the minimum of the data."""
    return _same_scale(x, lax.reduce_min_p.bind(x.data, **params))


@register_scale_rule(lax.reduce_prod_p)
def reduce_prod_rule(x: ScaledArray, *, axes: tuple[int, ...], **params) -> ScaledArray:
    """Scale ``s**N`` (static, exact); data the product of the data in float32.

    Exact while ``s**N`` is a float32 normal and the data product fits the data dtype; a
    scale beyond the float32 range is clipped and the remainder folded into the data.
    """
    wide = compute_dtype(x.dtype)
    total_exp = pow2_exponent(scale_f32(x)) * math.prod(x.shape[a] for a in axes)
    out_exp = jnp.clip(total_exp, MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    prod = lax.reduce_prod_p.bind(x.data.astype(wide), axes=axes, **params)
    data = _times_pow2(prod, total_exp - out_exp).astype(x.dtype)
    return ScaledArray(data, make_scale(pow2_from_exponent(out_exp), x))


@register_scale_rule(lax.argmax_p)
def argmax_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain indices: the argmax of the data (a positive scale keeps the order)."""
    return lax.argmax_p.bind(x.data, **params)


@register_scale_rule(lax.argmin_p)
def argmin_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain indices: the argmin of the data (a positive scale keeps the order)."""
    return lax.argmin_p.bind(x.data, **params)


@register_scale_rule(lax.cumsum_p, estimate=estimates.first)
def cumsum_rule(x: ScaledArray, *, axis: int, reverse: bool) -> ScaledArray:
    """Scale ``s * sqrt(N)`` with ``N`` the axis length; data cumsum in its dtype / sqrt(N)."""
    total = lax.cumsum_p.bind(x.data, axis=axis, reverse=reverse)
    return _sum_like(x, total, x.shape[axis])


@register_scale_rule(lax.cumprod_p)
def cumprod_rule(x: ScaledArray, *, axis: int, reverse: bool) -> ScaledArray:
    """Scale ``2^floor(e (N+1) / 2)`` for ``s = 2^e``: the geometric middle of the prefix
    scales ``s**k`` (k = 1..N), so the first and last prefixes are equally far from it.

    Position ``k`` holds ``prod(data[:k]) * s**k / scale`` computed in float32, exact while
    that fits the data dtype: the prefix magnitudes span ``s**(N-1)``, so for short axes and
    moderate scales (two float16 prefixes at ``s = 2^±20``). No per-tensor scale suits long
    products (the data of a product drifts geometrically).
    """
    n = x.shape[axis]
    wide = compute_dtype(x.dtype)
    exponent = pow2_exponent(scale_f32(x))
    out_exp = jnp.clip((exponent * (n + 1)) // 2, MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    counts = lax.broadcasted_iota(jnp.int32, x.shape, axis) + 1
    counts = n + 1 - counts if reverse else counts
    prod = lax.cumprod_p.bind(x.data.astype(wide), axis=axis, reverse=reverse)
    data = _times_pow2(prod, exponent * counts - out_exp).astype(x.dtype)
    return ScaledArray(data, make_scale(pow2_from_exponent(out_exp), x))


@register_scale_rule(lax.cummax_p)
def cummax_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: the running maximum of the data."""
    return _same_scale(x, lax.cummax_p.bind(x.data, **params))


@register_scale_rule(lax.cummin_p)
def cummin_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: the running minimum of the data."""
    return _same_scale(x, lax.cummin_p.bind(x.data, **params))


@register_scale_rule(lax.cumlogsumexp_p)
def cumlogsumexp_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``max(s, 1)``: computed in float32 (or wider) from the represented value.

    Along an axis of length 1 it is the identity: the input is returned as it is (at scale 1,
    a tiny float16 value would become subnormal and lose its precision).
    """
    if x.shape[params["axis"]] == 1:
        return _same_scale(x, x.data)
    out = lax.cumlogsumexp_p.bind(to_compute(x), **params)
    scale = round_scale(jnp.maximum(scale_f32(x), np.float32(1)))
    return from_compute(out, scale, x.dtype, x)


@register_scale_rule(lax.sort_p, estimate=estimates.first)
def sort_rule(*operands, **params) -> list:
    """Each output keeps its operand's scale; scaled keys sort by data (scales are positive)."""
    datas = [o.data if isinstance(o, ScaledArray) else o for o in operands]
    outs = lax.sort_p.bind(*datas, **params)
    pairs = zip(operands, outs, strict=True)
    return [_same_scale(o, d) if isinstance(o, ScaledArray) else d for o, d in pairs]


@register_scale_rule(lax.top_k_p)
def top_k_rule(x: ScaledArray, **params) -> list:
    """Values keep scale ``s``; indices are plain."""
    values, indices = lax.top_k_p.bind(x.data, **params)
    return [_same_scale(x, values), indices]


@register_scale_rule(lax.approx_top_k_p)
def approx_top_k_rule(x: ScaledArray, **params) -> list:
    """Values keep scale ``s`` (max-k or min-k: a positive scale keeps the order); indices are
    plain."""
    values, indices = lax.approx_top_k_p.bind(x.data, **params)
    return [_same_scale(x, values), indices]


@register_scale_rule(lax.reduce_window_sum_p)
def reduce_window_sum_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s * sqrt(window size)``; data window sums in its dtype / sqrt(window size)."""
    total = lax.reduce_window_sum_p.bind(x.data, **params)
    return _sum_like(x, total, math.prod(params["window_dimensions"]))


@register_scale_rule(lax.reduce_window_max_p)
def reduce_window_max_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: window maxima of the data."""
    return _same_scale(x, lax.reduce_window_max_p.bind(x.data, **params))


@register_scale_rule(lax.reduce_window_min_p)
def reduce_window_min_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale ``s``: window minima of the data."""
    return _same_scale(x, lax.reduce_window_min_p.bind(x.data, **params))
