"""Scale rules for contractions (dot_general, conv_general_dilated) and factorizations.

Factorizations are exact: a power-of-two scale goes to the factor that carries the
magnitude (singular values, eigenvalues, R, a Cholesky factor), the orthonormal factors are
plain. ``lu`` is not covered: its packed output holds the scale-free L and the scaled U in
one matrix, which no single scale represents.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.lax import linalg as lax_linalg

from jax_scaled.array import ScaledArray
from jax_scaled.pow2 import pow2_exponent, pow2_from_exponent
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import (
    Value,
    as_scaled,
    guard_band,
    guarded,
    make_scale,
    rescale,
    scale_f32,
    sqrt_pow2,
)


def _contract(
    x: Value, y: Value, contraction_size: int, contract: Callable, out_dtype: Any
) -> ScaledArray:
    """Unit-scaling estimate: a sum of K unit products has scale sqrt(K).

    A narrow (float16, float8) result is accumulated and divided in float32, then cast once
    with the range guard (:func:`~jax_scaled.rules._common.guarded`).
    """
    x, y = as_scaled(x), as_scaled(y)
    sqrt_k = sqrt_pow2(contraction_size)
    scale = scale_f32(x) * scale_f32(y) * jnp.float32(sqrt_k)
    if out_dtype is None:  # the primitive's own choice for these inputs
        out_dtype = jax.eval_shape(contract, x.data, y.data, None).dtype
    if guard_band(out_dtype) is None:
        out = contract(x.data, y.data, out_dtype)
        data = (out / jnp.asarray(sqrt_k, out.dtype)) if sqrt_k != 1 else out
        return ScaledArray(data, make_scale(scale, x, y))
    out = contract(x.data, y.data, jnp.float32)
    return guarded(out / jnp.float32(sqrt_k), scale, out_dtype, x, y)


@register_scale_rule(lax.dot_general_p)
def dot_general_rule(x: Value, y: Value, *, dimension_numbers, **params) -> ScaledArray:
    """Scale ``sx * sy * sqrt(K)``, K the contraction size; data dot of the data / sqrt(K)."""
    (x_contract, _), _ = dimension_numbers
    size = math.prod(x.shape[d] for d in x_contract)
    out_dtype = params.pop("preferred_element_type", None)

    def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
        return lax.dot_general_p.bind(
            a, b, dimension_numbers=dimension_numbers, preferred_element_type=dtype, **params
        )

    return _contract(x, y, size, contract, out_dtype)


@register_scale_rule(lax.conv_general_dilated_p)
def conv_general_dilated_rule(
    lhs: Value, rhs: Value, *, dimension_numbers, **params
) -> ScaledArray:
    """Scale ``sl * sr * sqrt(K)``, K = kernel input features (per group) x kernel window."""
    size = math.prod(rhs.shape[d] for d in dimension_numbers.rhs_spec[1:])
    out_dtype = params.pop("preferred_element_type", None)

    def contract(a: jax.Array, b: jax.Array, dtype) -> jax.Array:
        return lax.conv_general_dilated_p.bind(
            a, b, dimension_numbers=dimension_numbers, preferred_element_type=dtype, **params
        )

    return _contract(lhs, rhs, size, contract, out_dtype)


@register_scale_rule(lax_linalg.svd_p)
def svd_rule(x: ScaledArray, **params) -> list[Value]:
    """Exact: singular values keep the scale ``s`` (``svd(d * s) = U (S * s) V^H``); the
    singular vectors ``U``, ``V^H`` are plain (unit norm, scale free)."""
    singular_values, *vectors = lax_linalg.svd_p.bind(x.data, **params)
    return [ScaledArray(singular_values, x.scale), *vectors]


@register_scale_rule(lax_linalg.eigh_p)
def eigh_rule(x: ScaledArray, **params) -> list[Value]:
    """Exact: eigenvalues keep the scale ``s``; the eigenvectors are plain (unit norm)."""
    vectors, values = lax_linalg.eigh_p.bind(x.data, **params)
    return [vectors, ScaledArray(values, x.scale)]


@register_scale_rule(lax_linalg.qr_p)
def qr_rule(x: ScaledArray, **params) -> list[Value]:
    """Exact: ``qr(d * s) = Q, R * s``; ``Q`` (orthonormal) and pivots are plain."""
    q, r, *pivots = lax_linalg.qr_p.bind(x.data, **params)
    return [q, ScaledArray(r, x.scale), *pivots]


@register_scale_rule(lax_linalg.cholesky_p)
def cholesky_rule(x: ScaledArray, **params) -> ScaledArray:
    """Exact: with ``s = 2^(2k + r)``, ``cholesky(d * s) = cholesky(d * 2^r) * 2^k``."""
    exponent = pow2_exponent(scale_f32(x))
    k = jnp.floor_divide(exponent, 2)
    data = rescale(x.data, pow2_from_exponent(exponent - 2 * k))
    factor = lax_linalg.cholesky_p.bind(data, **params)
    return ScaledArray(factor, make_scale(pow2_from_exponent(k), x))


@register_scale_rule(lax_linalg.triangular_solve_p)
def triangular_solve_rule(a: Value, b: Value, *, unit_diagonal: bool, **params) -> ScaledArray:
    """Exact: the solution of ``(da sa) x = db sb`` is ``solve(da, db)`` at scale ``sb / sa``.

    With ``unit_diagonal`` the diagonal of ``a`` is an implicit 1 *in value*: the solve then
    uses ``a``'s represented value (in its data dtype), and the scale is ``sb``.
    """
    a, b = as_scaled(a), as_scaled(b)
    solve = functools.partial(
        lax_linalg.triangular_solve_p.bind, unit_diagonal=unit_diagonal, **params
    )
    if unit_diagonal:
        return ScaledArray(solve(a.to_array(), b.data), make_scale(scale_f32(b), a, b))
    return ScaledArray(solve(a.data, b.data), make_scale(scale_f32(b) / scale_f32(a), a, b))
