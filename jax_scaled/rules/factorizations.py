"""Scale rules for matrix factorizations and solves.

Factorizations are exact: a power-of-two scale goes to the factor that carries the
magnitude (singular values, eigenvalues, R, a Cholesky factor), the orthonormal factors are
plain.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.lax import linalg as lax_linalg

from jax_scaled.array import ScaledArray
from jax_scaled.pow2 import pow2_exponent, pow2_from_exponent
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import Value, as_scaled, make_scale, rescale, scale_f32


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
