"""Scale rules for matrix factorizations and solves.

Factorizations are exact: a power-of-two scale goes to the factor that carries the
magnitude (singular values, eigenvalues, R, a Cholesky factor), the orthonormal factors are
plain. Outputs that pack a scale-free part and a scaled part in one matrix (LAPACK's packed
LU, QR and Hessenberg forms) have no single scale: they are returned plain, with their exact
values. Complex outputs (``eig``) are plain too: ScaledArray data is real.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.lax import linalg as lax_linalg

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value, data_dtype_value
from jax_scaled.engine.registry import register_scale_rule
from jax_scaled.pow2.traced import floor_divide_exponent, pow2_exponent, pow2_from_exponent
from jax_scaled.scales import align, as_scaled, make_scale, rescale, scale_f32


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
    k = floor_divide_exponent(exponent, 2)
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


@register_scale_rule(lax_linalg.schur_p)
def schur_rule(x: ScaledArray, **params) -> list[Value]:
    """Exact: ``schur(d * s) = (T * s, Q)``: the quasi-triangular Schur form keeps the scale,
    the Schur vectors ``Q`` (orthonormal) are plain."""
    form, *vectors = lax_linalg.schur_p.bind(x.data, **params)
    return [ScaledArray(form, x.scale), *vectors]


@register_scale_rule(lax_linalg.eig_p)
def eig_rule(x: ScaledArray, **params) -> list[jax.Array]:
    """Exact: ``eig(d * s)`` has eigenvalues ``w * s`` and the same (unit-norm) eigenvectors.
    Every output is complex, hence plain: the eigenvalues of the data are multiplied by the
    power of two ``s`` (exact, within the format's range)."""
    values, *vectors = lax_linalg.eig_p.bind(x.data, **params)
    real, imag = lax.real(values), lax.imag(values)
    s = scale_f32(x).astype(real.dtype)
    return [lax.complex(real * s, imag * s), *vectors]


@register_scale_rule(lax_linalg.tridiagonal_p)
def tridiagonal_rule(x: ScaledArray, *, lower: bool, **params) -> list[Value]:
    """Exact: the diagonal ``d`` and off-diagonal ``e`` of the tridiagonal form of
    ``data * s`` keep the scale ``s``, the Householder ``taus`` are plain. The packed matrix
    holds the scale-free reflectors beyond the first off-diagonal and values at scale ``s``
    elsewhere (``T`` and the untouched other triangle): it is returned plain, that part
    multiplied by ``s``."""
    packed, d, e, taus = lax_linalg.tridiagonal_p.bind(x.data, lower=lower, **params)
    rows = lax.broadcasted_iota(jnp.int32, packed.shape, packed.ndim - 2)
    cols = lax.broadcasted_iota(jnp.int32, packed.shape, packed.ndim - 1)
    reflectors = (rows - cols >= 2) if lower else (cols - rows >= 2)
    packed = lax.select(reflectors, packed, rescale(packed, scale_f32(x)))
    return [packed, ScaledArray(d, x.scale), ScaledArray(e, x.scale), taus]


@register_scale_rule(lax_linalg.tridiagonal_solve_p)
def tridiagonal_solve_rule(dl: Value, d: Value, du: Value, b: Value, **params) -> ScaledArray:
    """Exact: the solution of ``(A sa) x = db sb`` is ``solve(A, db)`` at scale ``sb / sa``.
    The three diagonals of ``A`` are first brought to their largest scale ``sa`` (exact
    unless a smaller one's data underflows)."""
    (dl_data, d_data, du_data), scale = align(dl, d, du)
    rhs = as_scaled(b)
    x = lax_linalg.tridiagonal_solve_p.bind(dl_data, d_data, du_data, rhs.data, **params)
    return ScaledArray(x, make_scale(scale_f32(rhs) / scale, dl, d, du, rhs))


@register_scale_rule(lax_linalg.cholesky_update_p)
def cholesky_update_rule(r: Value, w: Value, **params) -> ScaledArray:
    """Exact: the factor of ``R^T R + w w^T`` is homogeneous of degree 1 in ``(R, w)``: with
    both brought to their larger scale ``s`` (exact unless the smaller one's data
    underflows), the update of the data is the updated factor at scale ``s``."""
    (r_data, w_data), scale = align(r, w)
    factor = lax_linalg.cholesky_update_p.bind(r_data, w_data, **params)
    return ScaledArray(factor, make_scale(scale, r, w))


@register_scale_rule(lax_linalg.symmetric_product_p)
def symmetric_product_rule(a: Value, c: Value, *, alpha, beta, **params) -> ScaledArray:
    """Exact: ``alpha (A sa)(A sa)^T + beta (C sc)`` at scale ``2^(2m)``, the smallest even
    power of two at least ``max(sa^2, sc)`` (a term with a zero coefficient left out): the
    product of ``A * (2^m / sa)`` with itself and ``C * (sc / 2^(2m))`` (powers of two at
    most 1: exact unless the data underflows). ``2^(2m)`` must be a float32 scale: ``sa`` up
    to ``2^63``."""
    a_exp, c_exp = pow2_exponent(scale_f32(a)), pow2_exponent(scale_f32(c))
    half_c_exp = -floor_divide_exponent(-c_exp, 2)  # ceil(c_exp / 2)
    # A term with a zero coefficient neither bounds the scale nor is rescaled (0 * inf).
    m = a_exp if beta == 0 else half_c_exp if alpha == 0 else lax.max(a_exp, half_c_exp)
    a_data, c_data = as_scaled(a).data, as_scaled(c).data
    if alpha != 0:
        a_data = rescale(a_data, pow2_from_exponent(a_exp - m))
    if beta != 0:
        c_data = rescale(c_data, pow2_from_exponent(c_exp - 2 * m))
    out = lax_linalg.symmetric_product_p.bind(a_data, c_data, alpha=alpha, beta=beta, **params)
    return ScaledArray(out, make_scale(pow2_from_exponent(2 * m), a, c))


@register_scale_rule(lax_linalg.ormqr_p)
def ormqr_rule(a: Value, taus: Value, c: Value, **params) -> Value:
    """Exact in ``c``: ``Q (c * s) = (Q c) * s``, the scale of ``c`` is kept. ``Q`` is applied
    from the represented values of the reflectors ``a`` and ``taus`` (scale free: a
    reflector has an implicit unit leading entry)."""
    reflectors, factors = data_dtype_value(a), data_dtype_value(taus)
    if not isinstance(c, ScaledArray):
        return lax_linalg.ormqr_p.bind(reflectors, factors, c, **params)
    return ScaledArray(lax_linalg.ormqr_p.bind(reflectors, factors, c.data, **params), c.scale)


def _on_value(primitive: jxi.Primitive, why: str) -> Callable:
    """A value-based rule: ``primitive`` bound on the represented values, outputs plain."""

    def rule(*args: Value, **params) -> Value:
        return primitive.bind(*map(data_dtype_value, args), **params)

    rule.__name__ = f"{primitive.name}_rule"
    rule.__doc__ = (
        f"Value-based: {why}. Computed on the represented values; every output is plain, "
        "with exact values within the format's range (integer outputs do not depend on the "
        "scale)."
    )
    return rule


_PACKED_QR = (
    "the packed matrix holds R, at the input's scale, and scale-free reflectors: no single scale"
)
_PACKED_LU = "the packed matrix holds scale-free L and U, at the input's scale: no single scale"
_PACKED_H = (
    "the packed matrix holds H, at the input's scale, and scale-free reflectors: no single scale"
)
_REFLECTORS = (
    "Q is orthonormal (scale free) but depends on the reflectors' values, each with an "
    "implicit unit entry, not on their data and scale separately"
)
register_scale_rule(lax_linalg.lu_p)(_on_value(lax_linalg.lu_p, _PACKED_LU))
register_scale_rule(lax_linalg.hessenberg_p)(_on_value(lax_linalg.hessenberg_p, _PACKED_H))
register_scale_rule(lax_linalg.householder_product_p)(
    _on_value(lax_linalg.householder_product_p, _REFLECTORS)
)
if jxi.geqrf_p is not None:
    register_scale_rule(jxi.geqrf_p)(_on_value(jxi.geqrf_p, _PACKED_QR))
if jxi.geqp3_p is not None:
    register_scale_rule(jxi.geqp3_p)(_on_value(jxi.geqp3_p, _PACKED_QR))
