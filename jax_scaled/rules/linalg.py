"""Scale rules for contractions: dot_general and conv_general_dilated."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import as_scaled, make_scale, scale_f32, sqrt_pow2


def _contract(x, y, contraction_size: int, contract) -> ScaledArray:
    """Unit-scaling estimate: a sum of K unit products has scale sqrt(K)."""
    x, y = as_scaled(x), as_scaled(y)
    out = contract(x.data, y.data)
    sqrt_k = sqrt_pow2(contraction_size)
    data = (out / jnp.asarray(sqrt_k, out.dtype)) if sqrt_k != 1 else out
    scale = scale_f32(x) * scale_f32(y) * jnp.float32(sqrt_k)
    return ScaledArray(data, make_scale(scale, x, y))


@register_scale_rule(lax.dot_general_p)
def dot_general_rule(x, y, *, dimension_numbers, **params):
    (x_contract, _), _ = dimension_numbers
    size = math.prod(x.shape[d] for d in x_contract)
    return _contract(
        x, y, size, lambda a, b: lax.dot_general_p.bind(a, b, dimension_numbers=dimension_numbers, **params)
    )
