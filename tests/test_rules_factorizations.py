"""Scale rules for matrix factorizations and solves against a float64 reference.

float32 data only, except for ``symmetric_product`` and ``cholesky_update``: XLA:CPU's LAPACK
has no float16/bfloat16 kernels (plain JAX fails on them too); those two lower to plain JAX
operations and are tested in every float format. Factors with an ambiguous sign or order
(eigenvectors, Schur vectors and forms) are multiplied back, or compared order-free.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    assert_close,
    assert_pow2_scales,
    check_scaled,
    eps,
    reference64,
    scaled_arrays,
    scales,
    value64,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

# Every example compiles two programs: run a third of the profile's examples per test.
few = settings(max_examples=max(3, settings.default.max_examples // 3))
F32 = jnp.float32


def _run(fn, *inputs):
    """``jit(scalify(fn))`` on ``inputs`` (power-of-two output scales checked) and ``fn`` in
    float64 on the represented values."""
    out = jax.jit(js.scalify(fn))(*inputs)
    assert_pow2_scales(out)
    return out, reference64(fn, *inputs)


def _assert_plain(*xs):
    for x in xs:
        assert not isinstance(x, js.ScaledArray), "expected a plain array"


def _spd(data, n: int) -> js.ScaledArray:
    """A well-conditioned symmetric positive definite float32 matrix at a random scale."""
    a = data.draw(scaled_arrays((n, n), F32))
    return js.ScaledArray(a.data @ a.data.T + n * jnp.eye(n), a.scale)


@few
@given(data=st.data(), shape=st.sampled_from([(3, 5), (4, 4), (2, 3, 2)]))
def test_svd_singular_values_keep_the_scale(data, shape):
    """float32 only: XLA:CPU's LAPACK has no float16/bfloat16 SVD (plain JAX fails too)."""
    x = data.draw(scaled_arrays(shape, F32))

    def fn(x):
        u, s, vt = jnp.linalg.svd(x, full_matrices=False)
        return jnp.linalg.svd(x, compute_uv=False), (u * s[..., None, :]) @ vt

    singular_values, rebuilt = check_scaled(fn, [x], F32, ulps=64, normwise=True)
    assert float(singular_values.scale) == float(x.scale)


def factorizations(spd, a, b):
    """eigh, qr, cholesky and triangular solves; sign-ambiguous factors are multiplied back."""
    values, vectors = jnp.linalg.eigh(spd, symmetrize_input=False)
    q, r = jnp.linalg.qr(a)
    lower = lax.linalg.cholesky(spd, symmetrize_input=False)
    solve = jax.scipy.linalg.solve_triangular
    return {
        "eigenvalues": values,
        "eigh_rebuilt": (vectors * values[..., None, :]) @ jnp.swapaxes(vectors, -1, -2),
        "qr_rebuilt": q @ r,
        "cholesky": lower,
        "solve": solve(lower, b, lower=True),
        "solve_unit_diagonal": solve(lower, b, lower=True, unit_diagonal=True),
    }


@few
@given(data=st.data(), n=st.integers(2, 4))
def test_factorizations_are_exact_in_the_scale(data, n):
    """float32 only: XLA:CPU's LAPACK has no float16/bfloat16 factorizations."""
    a, b = (data.draw(scaled_arrays((n, n), F32)) for _ in range(2))
    spd_data = a.data @ a.data.T + n * jnp.eye(n)  # well conditioned
    spd = js.ScaledArray(spd_data, data.draw(scaled_arrays((), F32)).scale)
    out = check_scaled(factorizations, [spd, a, b], F32, ulps=256, normwise=True)
    assert float(out["eigenvalues"].scale) == float(spd.scale)
    assert float(out["cholesky"].scale) ** 2 in (float(spd.scale), float(spd.scale) / 2)


@few
@given(data=st.data(), shape=st.sampled_from([(4, 4), (3, 5), (5, 3)]))
def test_lu_and_slogdet_are_plain_with_exact_values(data, shape):
    """The packed LU (and QR) matrices have no single scale: plain outputs, exact values."""
    x = data.draw(scaled_arrays(shape, F32))

    def fn(x):
        out = {"plu": jax.scipy.linalg.lu(x), "pivots": lax.linalg.lu(x)[1:]}
        if shape[0] == shape[1]:
            out["slogdet"] = jnp.linalg.slogdet(x)
            out["slogdet_qr"] = jnp.linalg.slogdet(x, method="qr")
        return out

    out, expected = _run(fn, x)
    _assert_plain(*js.tree.tree_leaves(out))
    p, lower, upper = out["plu"]
    assert_close(p, expected["plu"][0], F32, ulps=0)  # same pivots as in float64
    assert_close(lower, expected["plu"][1], F32, ulps=64, normwise=True)
    assert_close(upper, expected["plu"][2], F32, ulps=64, normwise=True)
    for got, want in zip(out["pivots"], expected["pivots"], strict=True):
        assert got.dtype == jnp.int32
        assert_close(got, want, F32)
    for method in ("slogdet", "slogdet_qr"):
        if method in out:
            sign, logdet = out[method]
            assert_close(sign, expected[method][0], F32, ulps=0)
            assert_close(logdet, expected[method][1], F32, ulps=64, atol=64 * eps(F32))


@few
@given(data=st.data(), n=st.integers(2, 5))
def test_eig_eigenvalues_carry_the_scale(data, n):
    """Complex outputs are plain: the eigenvalues are multiplied by the scale, exactly."""
    x = data.draw(scaled_arrays((n, n), F32))

    def fn(x):
        values, right = jnp.linalg.eig(x)
        _, left = lax.linalg.eig(x, compute_right_eigenvectors=False)
        return values, right, left

    (values, right, left), (want, _, _) = _run(fn, x)
    _assert_plain(values, right, left)
    assert values.dtype == right.dtype == left.dtype == jnp.complex64
    a = value64(x)
    norm = np.max(np.abs(a))
    tol = 16 * n * eps(F32)
    # Eigenpairs A vr = vr w and vl^H A = w vl^H, to float32 accuracy (backward error).
    assert np.max(np.abs(a @ right - right * values)) <= tol * norm
    assert np.max(np.abs(left.conj().T @ a - values[:, None] * left.conj().T)) <= tol * norm
    # Eigenvalues against float64, order-free (sorting is 1-Lipschitz).
    for part in (np.real, np.imag):
        error = np.abs(np.sort(part(values)) - np.sort(part(want)))
        assert np.max(error) <= 1e-4 * np.max(np.abs(want)), (values, want)


@few
@given(data=st.data(), n=st.integers(2, 5))
def test_schur_form_keeps_the_scale(data, n):
    x = data.draw(scaled_arrays((n, n), F32))

    def fn(x):
        form, vectors = jax.scipy.linalg.schur(x)
        return form, vectors, vectors @ form @ vectors.T

    (form, vectors, rebuilt), (_, _, want) = _run(fn, x)
    assert isinstance(form, js.ScaledArray) and float(form.scale) == float(x.scale)
    _assert_plain(vectors)
    assert_close(rebuilt, want, F32, ulps=64 * n, normwise=True)
    assert np.all(np.tril(np.asarray(form.data), -2) == 0)  # quasi-triangular
    assert_close(vectors.T @ vectors, np.eye(n), F32, ulps=16 * n, atol=16 * n * eps(F32))


@few
@given(data=st.data(), n=st.integers(2, 5))
def test_hessenberg_is_plain_with_exact_values(data, n):
    x = data.draw(scaled_arrays((n, n), F32))

    def fn(x):
        packed, taus = lax.linalg.hessenberg(x)
        h, q = jax.scipy.linalg.hessenberg(x, calc_q=True)
        return packed, taus, h, q @ h @ q.T

    out, expected = _run(fn, x)
    _assert_plain(*out)
    for got, want in zip(out, expected, strict=True):
        assert_close(got, want, F32, ulps=64 * n, normwise=True)
    assert np.all(np.tril(np.asarray(out[2]), -2) == 0)


@few
@given(data=st.data(), n=st.integers(2, 5), lower=st.booleans())
def test_tridiagonal_diagonals_keep_the_scale(data, n, lower):
    spd = _spd(data, n)

    def fn(x):
        packed, d, e, taus = lax.linalg.tridiagonal(x, lower=lower)
        return packed, d, jnp.abs(e), taus

    out, expected = _run(fn, spd)
    packed, d, e, taus = out
    _assert_plain(packed, taus)
    assert float(d.scale) == float(e.scale) == float(spd.scale)
    for got, want in zip(out, expected, strict=True):
        assert_close(got, want, F32, ulps=64 * n, normwise=True)


@few
@given(data=st.data(), m=st.integers(1, 6), shared=st.booleans())
def test_tridiagonal_solve(data, m, shared):
    """Diagonally dominant systems; off-diagonals at the diagonal's scale or below it."""
    d = data.draw(scaled_arrays((2, m), F32, low=2.0, high=3.0))
    off = [
        data.draw(scaled_arrays((2, m), F32, low=-0.9, high=0.9, min_exp=0, max_exp=0))
        for _ in range(2)
    ]
    ratios = [1.0 if shared else 2.0 ** -data.draw(st.integers(0, 8)) for _ in range(2)]
    dl, du = (js.ScaledArray(o.data, d.scale * r) for o, r in zip(off, ratios, strict=True))
    b = data.draw(scaled_arrays((2, m, 3), F32))
    out = check_scaled(lax.linalg.tridiagonal_solve, [dl, d, du, b], F32, ulps=64, normwise=True)
    assert float(out.scale) == float(b.scale) / float(d.scale)


@few
@given(data=st.data(), shape=st.sampled_from([(4, 4), (5, 3), (3, 5)]))
def test_qr_raw_and_qr_multiply(data, shape):
    """geqrf/geqp3 outputs are plain; ``Q c`` (ormqr) keeps the scale of ``c``."""
    a = data.draw(scaled_arrays(shape, F32))
    right = data.draw(scaled_arrays((2, shape[0]), F32))
    left = data.draw(scaled_arrays((min(shape), 2), F32))

    def fn(a, right, left):
        return {
            "raw": jnp.linalg.qr(a, mode="raw"),
            "right": jax.scipy.linalg.qr_multiply(a, right),
            "left_pivoting": jax.scipy.linalg.qr_multiply(a, left, mode="left", pivoting=True),
        }

    out, expected = _run(fn, a, right, left)
    _assert_plain(*out["raw"], out["right"][1], *out["left_pivoting"][1:])
    assert float(out["right"][0].scale) == float(right.scale)
    assert float(out["left_pivoting"][0].scale) == float(left.scale)
    for got, want in zip(js.tree.tree_leaves(out), jax.tree.leaves(expected), strict=True):
        assert_close(got, want, F32, ulps=64, normwise=True)


@few
@given(data=st.data(), shape=st.sampled_from([(4, 4), (5, 3)]))
def test_reflectors_are_used_by_value(data, shape):
    """householder_product and ormqr on Householder reflectors given as ScaledArrays."""
    a = data.draw(scaled_arrays(shape, F32))
    packed, taus = jnp.linalg.qr(a.data, mode="raw")
    s1, s2 = data.draw(scales()), data.draw(scales())
    reflectors = js.ScaledArray(packed.mT / s1, jnp.float32(s1))
    factors = js.ScaledArray(taus / s2, jnp.float32(s2))
    c = data.draw(scaled_arrays((shape[0], 2), F32))

    def fn(reflectors, factors, c):
        q = lax.linalg.householder_product(reflectors, factors)
        return q, lax.linalg.ormqr(reflectors, factors, c, transpose=True)

    (q, qtc), expected = _run(fn, reflectors, factors, c)
    _assert_plain(q)
    assert float(qtc.scale) == float(c.scale)
    for got, want in zip([q, qtc], expected, strict=True):
        assert_close(got, want, F32, ulps=64, normwise=True)
    assert_close(q.T @ q, np.eye(shape[1]), F32, ulps=64, atol=64 * eps(F32))


@few
@given(data=st.data(), n=st.integers(1, 5), dtype=st.sampled_from(FLOAT_DTYPES))
def test_cholesky_update(data, n, dtype):
    """``R`` and ``w`` at independent scales: the update is at the larger one."""
    spd = _spd(data, n)
    upper = js.ScaledArray(jnp.linalg.cholesky(spd.data).T.astype(dtype), spd.scale)
    w = data.draw(scaled_arrays((n,), dtype))
    out = check_scaled(lax.linalg.cholesky_update, [upper, w], dtype, ulps=8 * n, normwise=True)
    assert out.dtype == dtype
    assert float(out.scale) == max(float(upper.scale), float(w.scale))


@few
@given(
    data=st.data(),
    shape=st.sampled_from([(3, 2), (4, 4), (2, 5), (2, 3, 3)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    coefficients=st.sampled_from([(1.0, 0.0), (2.0, 0.5), (-0.5, 3.0), (0.0, 2.0)]),
    symmetrize=st.booleans(),
)
def test_symmetric_product(data, shape, dtype, coefficients, symmetrize):
    """``alpha A A^T + beta C`` at the smallest even power of two above both terms' scales."""
    *batch, m, n = shape
    a = data.draw(scaled_arrays(shape, dtype))
    c = data.draw(scaled_arrays((*batch, m, m), dtype))
    c = js.ScaledArray((c.data + c.data.mT) / 2, c.scale)
    alpha, beta = coefficients

    def fn(a, c):
        return lax.linalg.symmetric_product(
            a, c, alpha=alpha, beta=beta, symmetrize_output=symmetrize
        )

    out = check_scaled(fn, [a, c], dtype, ulps=2 * n + 8, normwise=True)
    assert out.dtype == dtype
    exponents = [np.log2(float(a.scale)), np.ceil(np.log2(float(c.scale)) / 2)]
    exponent = max(e for e, coefficient in zip(exponents, coefficients) if coefficient)
    assert float(out.scale) == 2.0 ** (2 * exponent)


@pytest.mark.parametrize("symmetrize", [False, True])
def test_symmetric_product_keeps_the_larger_term(symmetrize):
    """A C term far below ``alpha A A^T`` rounds away instead of overflowing the data."""
    a = js.ScaledArray(jnp.ones((2, 3), jnp.float16), jnp.float32(2.0**20))
    c = js.ScaledArray(jnp.eye(2, dtype=jnp.float16), jnp.float32(2.0**-30))
    fn = lambda a, c: lax.linalg.symmetric_product(a, c, symmetrize_output=symmetrize)  # noqa: E731
    out = jax.jit(js.scalify(fn))(a, c)
    assert float(out.scale) == 2.0**40
    np.testing.assert_array_equal(value64(out), np.full((2, 2), 3 * 2.0**40))
