"""Scale rules for elementwise arithmetic primitives."""

from __future__ import annotations

from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import (
    as_scaled,
    l2_scale,
    make_scale,
    round_scale,
    scale_f32,
    wide_data,
)


def _add_or_sub(x, y, op) -> ScaledArray:
    """Unit-scaling estimate for a sum of independent terms: sqrt(sx^2 + sy^2)."""
    scale = round_scale(l2_scale(scale_f32(x), scale_f32(y)))
    data = op(wide_data(x, scale), wide_data(y, scale)).astype(x.dtype)
    return ScaledArray(data, make_scale(scale, x, y))


@register_scale_rule(lax.add_p)
def add_rule(x, y, **params):
    return _add_or_sub(x, y, lax.add)


@register_scale_rule(lax.sub_p)
def sub_rule(x, y, **params):
    return _add_or_sub(x, y, lax.sub)


@register_scale_rule(lax.mul_p)
def mul_rule(x, y, **params):
    x, y = as_scaled(x), as_scaled(y)
    return ScaledArray(lax.mul_p.bind(x.data, y.data, **params), make_scale(scale_f32(x) * scale_f32(y), x, y))


@register_scale_rule(lax.div_p)
def div_rule(x, y, **params):
    x, y = as_scaled(x), as_scaled(y)
    return ScaledArray(lax.div_p.bind(x.data, y.data, **params), make_scale(scale_f32(x) / scale_f32(y), x, y))


@register_scale_rule(lax.neg_p)
def neg_rule(x, **params):
    return ScaledArray(-x.data, x.scale)
