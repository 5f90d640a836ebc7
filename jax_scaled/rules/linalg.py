"""Scale rules for contractions: dot_general and conv_general_dilated."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import Value, as_scaled, make_scale, scale_f32, sqrt_pow2


def _contract(x: Value, y: Value, contraction_size: int, contract: Callable) -> ScaledArray:
    """Unit-scaling estimate: a sum of K unit products has scale sqrt(K)."""
    x, y = as_scaled(x), as_scaled(y)
    out = contract(x.data, y.data)
    sqrt_k = sqrt_pow2(contraction_size)
    data = (out / jnp.asarray(sqrt_k, out.dtype)) if sqrt_k != 1 else out
    scale = scale_f32(x) * scale_f32(y) * jnp.float32(sqrt_k)
    return ScaledArray(data, make_scale(scale, x, y))


@register_scale_rule(lax.dot_general_p)
def dot_general_rule(x: Value, y: Value, *, dimension_numbers, **params) -> ScaledArray:
    """Scale ``sx * sy * sqrt(K)``, K the contraction size; data dot of the data / sqrt(K)."""
    (x_contract, _), _ = dimension_numbers
    size = math.prod(x.shape[d] for d in x_contract)

    def contract(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.dot_general_p.bind(a, b, dimension_numbers=dimension_numbers, **params)

    return _contract(x, y, size, contract)


@register_scale_rule(lax.conv_general_dilated_p)
def conv_general_dilated_rule(
    lhs: Value, rhs: Value, *, dimension_numbers, **params
) -> ScaledArray:
    """Scale ``sl * sr * sqrt(K)``, K = kernel input features (per group) x kernel window."""
    size = math.prod(rhs.shape[d] for d in dimension_numbers.rhs_spec[1:])

    def contract(a: jax.Array, b: jax.Array) -> jax.Array:
        return lax.conv_general_dilated_p.bind(a, b, dimension_numbers=dimension_numbers, **params)

    return _contract(lhs, rhs, size, contract)
