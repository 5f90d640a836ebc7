"""Scale rules for contractions: dot_general and conv_general_dilated.

Matrix factorizations and solves are in :mod:`jax_scaled.rules.factorizations`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine import estimates
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.rules.toolkit import bind_contraction
from jax_scaled.scales import (
    as_scaled,
    guard_band,
    guarded,
    make_scale,
    scale_f32,
    scale_mul,
    sqrt_pow2,
)


def _contract(
    x: Value, y: Value, contraction_size: int, contract: Callable, out_dtype: Any
) -> ScaledArray:
    """Unit-scaling estimate: a sum of K unit products has scale sqrt(K).

    A narrow (float16, float8) result is accumulated and divided in float32, then cast once
    with the range guard (:func:`~jax_scaled.scales.guard.guarded`).
    """
    x, y = as_scaled(x), as_scaled(y)
    sqrt_k = sqrt_pow2(contraction_size)
    scale = scale_mul(scale_mul(scale_f32(x), scale_f32(y)), np.float32(sqrt_k))
    if out_dtype is None:  # the primitive's own choice for these inputs
        out_dtype = jax.eval_shape(contract, x.data, y.data, None).dtype
    if guard_band(out_dtype) is None:
        out = contract(x.data, y.data, out_dtype)
        data = lax.div(out, np.asarray(sqrt_k, out.dtype)) if sqrt_k != 1 else out
        return ScaledArray(data, make_scale(scale, x, y))
    out = contract(x.data, y.data, jnp.float32)
    return guarded(out, scale, out_dtype, x, y, divisor=sqrt_k)


@register_scale_rule(
    lax.dot_general_p, properties=Property.MULTIPLICATIVE, estimate=estimates.contraction
)
def dot_general_rule(x: Value, y: Value, *, dimension_numbers, **params) -> ScaledArray:
    """Scale ``sx * sy * sqrt(K)``, K the contraction size; data dot of the data / sqrt(K)."""
    (x_contract, _), _ = dimension_numbers
    size = math.prod(x.shape[d] for d in x_contract)
    out_dtype = params.pop("preferred_element_type", None)

    def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
        return bind_contraction(
            lax.dot_general_p, a, b,
            dimension_numbers=dimension_numbers, preferred_element_type=dtype, **params,
        )  # fmt: skip

    return _contract(x, y, size, contract, out_dtype)


@register_scale_rule(lax.conv_general_dilated_p, properties=Property.MULTIPLICATIVE)
def conv_general_dilated_rule(
    lhs: Value, rhs: Value, *, dimension_numbers, **params
) -> ScaledArray:
    """Scale ``sl * sr * sqrt(K)``, K = kernel input features (per group) x kernel window."""
    size = math.prod(rhs.shape[d] for d in dimension_numbers.rhs_spec[1:])
    out_dtype = params.pop("preferred_element_type", None)

    def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
        return bind_contraction(
            lax.conv_general_dilated_p, a, b,
            dimension_numbers=dimension_numbers, preferred_element_type=dtype, **params,
        )  # fmt: skip

    return _contract(lhs, rhs, size, contract, out_dtype)


def _with_scale_of(x: Value, block_scale: Value) -> tuple[ScaledArray, jax.Array]:
    """``x`` with the scalar scale of its block scales folded in, and the block scales' data.

    ``x * block_scale`` is unchanged: a ScaledArray of block scales contributes its own
    (power-of-two) scale to ``x``'s, and its data becomes the block scales bound.
    """
    x, block_scale = as_scaled(x), as_scaled(block_scale)
    scale = scale_f32(x) * scale_f32(block_scale)
    return ScaledArray(x.data, scale), block_scale.data


if jxi.ragged_dot_general_p is not None:

    @register_scale_rule(jxi.ragged_dot_general_p)
    def ragged_dot_general_rule(
        lhs: Value, rhs: Value, group_sizes: jax.Array, *, ragged_dot_dimension_numbers, **params
    ) -> ScaledArray:
        """As ``dot_general``: scale ``sl * sr * sqrt(K)``, K the full contraction size (each
        group contracts at most K terms); ``group_sizes`` (integers) passes through."""
        (lhs_contract, _), _ = ragged_dot_dimension_numbers.dot_dimension_numbers
        size = math.prod(lhs.shape[d] for d in lhs_contract)
        out_dtype = params.pop("preferred_element_type", None)

        def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
            return jxi.ragged_dot_general_p.bind(
                a,
                b,
                group_sizes,
                ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
                preferred_element_type=dtype,
                **params,
            )

        return _contract(lhs, rhs, size, contract, out_dtype)


if jxi.scaled_dot_p is not None:

    @register_scale_rule(jxi.scaled_dot_p)
    def scaled_dot_rule(
        lhs: Value, rhs: Value, lhs_scale: Value, rhs_scale: Value, *, dimension_numbers, **params
    ) -> ScaledArray:
        """Block-scaled dot (``lax.scaled_dot``, MX formats): the block scales stay with the
        data, each operand's scalar scale (times its block scales' own, if scaled) goes to the
        output: scale ``sl * sr * sqrt(K)`` as for ``dot_general``."""
        (lhs_contract, _), _ = dimension_numbers
        size = math.prod(lhs.shape[d] for d in lhs_contract)
        out_dtype = params.pop("preferred_element_type", None)
        lhs, lhs_blocks = _with_scale_of(lhs, lhs_scale)
        rhs, rhs_blocks = _with_scale_of(rhs, rhs_scale)

        def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
            return jxi.scaled_dot_p.bind(
                a,
                b,
                lhs_blocks,
                rhs_blocks,
                dimension_numbers=dimension_numbers,
                preferred_element_type=dtype,
                **params,
            )

        return _contract(lhs, rhs, size, contract, out_dtype)
