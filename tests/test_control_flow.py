"""Control flow under scalify: scan, fori_loop, while_loop, cond/switch, checkpoint, PRNG keys.

Each model is checked for invariance in float32 (values, and ``jax.grad`` traced inside
scalify, against plain JAX) and, where it has a scale structure, for float16 fidelity at input
scales 2^-20 and 2^20 against a float64 reference (raw float16 under- or overflows there).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    HOW,
    assert_close,
    assert_pow2_scales,
    built,
    check_e8m0_matches,
    covering,
    reference64,
    value64,
)
from jax import lax

import jax_scaled as js
from jax_scaled import _jax_internals as jax_internals
from jax_scaled.rules.higher_order import control_flow

RTOL = 1e-5
EXPONENTS = [-20, 20]
MODEL_EXPONENTS = [-20, 0, 20]
T, N = 5, 4  # scan length, feature size


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(
        np.max(np.abs(actual - expected), initial=0.0) / max(np.max(np.abs(expected)), 1e-300)
    )


def check_invariance(fn, *args, jit: bool = True, scale_args: bool = True):
    """float32: ``scalify(fn)`` on scaled ``args`` gives ``fn(args)``; returns its output."""
    expected = jax.jit(fn)(*args)
    scalified = jax.jit(js.scalify(fn)) if jit else js.scalify(fn)
    out = scalified(*(js.as_scaled_array(args) if scale_args else args))
    assert_pow2_scales(out)
    leaves, want = js.tree.tree_leaves(out), jax.tree.leaves(expected)
    assert len(leaves) == len(want)
    for got, wanted in zip(leaves, want, strict=True):
        if jnp.issubdtype(wanted.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(wanted))
        else:
            error = relative_error(value64(got), wanted)
            assert error <= RTOL, error
    return out


def scaled16(x, exponent: int) -> js.ScaledArray:
    """float16 data ``x`` at scale ``2^exponent``: the value ``x * 2^exponent``."""
    return js.ScaledArray(jnp.asarray(x, jnp.float16), jnp.float32(2.0**exponent))


def check_fidelity(fn, *inputs, ulps: float = 32.0):
    """float16: ``jit(scalify(fn))`` within float16 roundings of the float64 reference."""
    out = jax.jit(js.scalify(fn))(*inputs)
    expected = reference64(fn, *inputs)
    assert_pow2_scales(out)
    for got, want in zip(js.tree.tree_leaves(out), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(np.asarray(want).dtype, jnp.floating):
            assert isinstance(got, js.ScaledArray)
            assert got.dtype == jnp.float16
        assert_close(got, want, jnp.float16, ulps=ulps, normwise=True)
    return out


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


# -- scan: cumulative carries that start plain -------------------------------------------------


def cumulative(xs):
    """A sum and a product carry (scale changing every step), from plain zeros and ones."""

    def step(carry, x):
        total, product = carry
        return (total + x, product * x), total

    init = (jnp.zeros(xs.shape[1:], xs.dtype), jnp.ones(xs.shape[1:], xs.dtype))
    (total, product), partial_sums = lax.scan(step, init, xs)
    return total, product, partial_sums


@pytest.mark.parametrize("jit", [True, False])
def test_cumulative_scan_invariance(jit):
    total, product, partial_sums = check_invariance(cumulative, normal(0, (T, N)), jit=jit)
    assert all(isinstance(x, js.ScaledArray) for x in (total, product, partial_sums))
    assert partial_sums.scale.shape == ()  # stacked per-step scales unified to one


def test_cumulative_scan_grad_invariance():
    grad = jax.grad(lambda xs: sum(jnp.sum(jnp.sin(y)) for y in cumulative(xs)))
    check_invariance(grad, normal(1, (T, N)))


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_cumulative_scan_float16_fidelity(exponent):
    xs = jax.random.uniform(jax.random.key(2), (T, N), minval=0.5, maxval=2.0)
    total, product, _ = check_fidelity(cumulative, scaled16(xs, exponent))
    assert float(product.scale) == 2.0 ** (exponent * T)  # the scale followed the product
    raw = cumulative((xs * 2.0**exponent).astype(jnp.float16))[1]
    assert not np.all(np.isfinite(raw) & (raw != 0))  # raw float16 under/overflows


# -- scan: an RNN ---------------------------------------------------------------------------------


def rnn(params, xs, activation=jnp.tanh):
    def cell(h, x):
        h = activation(h @ params["w"] + x @ params["u"] + params["b"])
        return h, h

    return lax.scan(cell, jnp.zeros((N,), xs.dtype), xs)


def rnn_params(seed: int) -> dict:
    return {
        "w": normal(seed, (N, N), 0.5),
        "u": normal(seed + 1, (N, N), 0.5),
        "b": normal(seed + 2, (N,), 0.1),
    }


def test_rnn_scan_value_and_grad_invariance():
    def loss(params, xs):
        return jnp.mean(rnn(params, xs)[1] ** 2)

    check_invariance(jax.value_and_grad(loss), rnn_params(3), normal(6, (T, N)))


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_relu_rnn_scan_float16_fidelity(exponent):
    params = {k: scaled16(v, exponent if k == "b" else 0) for k, v in rnn_params(7).items()}
    xs = scaled16(normal(10, (T, N)), exponent)
    check_fidelity(lambda params, xs: rnn(params, xs, jax.nn.relu), params, xs)


# -- fori_loop (static: scan; dynamic: while) and while_loop -------------------------------------


def power_iteration(x, w, n):
    return lax.fori_loop(0, n, lambda i, h: (h @ w) * (i + 1.0), x)


@pytest.mark.parametrize("dynamic", [False, True])
def test_fori_loop_invariance(dynamic):
    w, x = normal(11, (N, N), 0.5), normal(12, (3, N))
    if dynamic:  # (JAX cannot differentiate a while loop)
        check_invariance(lambda w, x, n: power_iteration(x, w, n), w, x, jnp.int32(3))
    else:
        fn = jax.value_and_grad(lambda w, x: jnp.sum(power_iteration(x, w, 3)))
        check_invariance(fn, w, x)


@pytest.mark.parametrize("exponent", EXPONENTS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_fori_loop_float16_fidelity(dynamic, exponent):
    w = scaled16(normal(13, (N, N), 0.5), 0)
    x = scaled16(normal(14, (3, N)), exponent)
    if dynamic:
        check_fidelity(power_iteration, x, w, jnp.int32(3))
    else:
        check_fidelity(functools.partial(power_iteration, n=3), x, w)


def newton_sqrt(a):
    """sqrt(a) by Newton's iteration, until a scaled convergence test passes."""

    def unconverged(c):
        return jnp.max(jnp.abs(c * c - a)) > 1e-2 * jnp.max(a)

    return lax.while_loop(unconverged, lambda c: 0.5 * (c + a / c), a)


def test_while_loop_with_scaled_convergence_test_invariance():
    a = jnp.abs(normal(15, (N,))) + 0.5
    out = check_invariance(newton_sqrt, a, jit=False)
    np.testing.assert_allclose(value64(out), np.sqrt(a), rtol=1e-2)
    # Forward mode (JAX cannot reverse-differentiate a while loop): d sqrt(a) = da / (2 sqrt(a)).
    check_invariance(lambda a, da: jax.jvp(newton_sqrt, (a,), (da,)), a, normal(16, (N,)))


@pytest.mark.parametrize("exponent", [-40, 40])
def test_while_loop_float16_fidelity(exponent):
    a = jnp.abs(normal(16, (N,))) + 0.5
    out = check_fidelity(newton_sqrt, scaled16(a, exponent))
    np.testing.assert_allclose(value64(out), np.sqrt(a) * 2.0 ** (exponent / 2), rtol=1e-2)


# -- custom_linear_solve: the user's solve, iterative (cg) or direct ----------------------------


def spd_matrix(seed: int) -> jax.Array:
    a = normal(seed, (N, N))
    return a @ a.T + N * jnp.eye(N)  # well conditioned


def cg_solve(m, b):
    """Conjugate gradients (``custom_linear_solve`` around a ``while_loop``)."""
    return jax.scipy.sparse.linalg.cg(lambda v: m @ v, b, tol=1e-6)[0]


def cholesky_linear_solve(m, b):
    """``custom_linear_solve`` with a direct solve: differentiable through its custom rule."""

    def solve(_, rhs):
        return jax.scipy.linalg.solve(m, rhs, assume_a="pos")

    return lax.custom_linear_solve(lambda v: m @ v, b, solve, solve, symmetric=True)


def test_custom_linear_solve_invariance():
    m, b = spd_matrix(17), normal(18, (N,))
    check_invariance(cg_solve, m, b, jit=False)
    check_invariance(cholesky_linear_solve, m, b)
    # Reverse mode traced inside scalify: the transposed solve of the custom rule runs.
    loss = lambda m, b: jnp.sum(cholesky_linear_solve(m, b) ** 2)  # noqa: E731
    check_invariance(jax.grad(loss, argnums=(0, 1)), m, b)


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_custom_linear_solve_float16_fidelity(exponent):
    """float16 ``b`` at ``2^e``, outside float16's range (``m`` is float32: LAPACK has no
    float16 solves): the solution keeps the scale, within float16 roundings of float64."""
    m = js.ScaledArray(spd_matrix(17), jnp.float32(1.0))
    b = scaled16(normal(18, (N,)), exponent)
    out = jax.jit(js.scalify(cholesky_linear_solve))(m, b)
    assert_pow2_scales(out)
    assert float(out.scale) == 2.0**exponent
    want = reference64(cholesky_linear_solve, m, b)
    assert_close(out, want, jnp.float16, ulps=32, normwise=True)


# -- scan options: reverse, unroll, length without xs, stacked scales ----------------------------


def decaying_scan(c0, xs, reverse=True, unroll=2):
    return lax.scan(lambda c, x: (0.5 * c + x * c, c), c0, xs, reverse=reverse, unroll=unroll)


@pytest.mark.parametrize("reverse,unroll", [(True, 2), (False, True)])
def test_scan_reverse_unroll_invariance(reverse, unroll):
    fn = functools.partial(decaying_scan, reverse=reverse, unroll=unroll)
    check_invariance(fn, normal(17, (N,)), normal(18, (T, N)))
    check_invariance(
        jax.grad(lambda c, xs: jnp.sum(fn(c, xs)[1])), normal(17, (N,)), normal(18, (T, N))
    )


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_scan_reverse_unroll_float16_fidelity(exponent):
    xs = scaled16(normal(19, (T, N), 0.5), 0)
    check_fidelity(decaying_scan, scaled16(normal(20, (N,)), exponent), xs)


def test_scan_with_length_and_no_xs():
    def doubling(x):
        return lax.scan(lambda c, _: (c * 2.0, c), x, None, length=T)

    final, stacked = check_invariance(doubling, normal(21, (N,)))
    assert float(final.scale) == 2.0**T * float(js.as_scaled_array(normal(21, (N,))).scale)
    assert stacked.shape == (T, N) and stacked.scale.shape == ()


def test_loop_invariant_output_scale_is_kept_without_rescaling():
    xs = js.as_scaled_array(normal(22, (T, N)))
    fn = js.scalify(lambda xs: lax.scan(lambda c, x: (c + x, -x), jnp.zeros(N), xs)[1])
    assert float(fn(xs).scale) == float(xs.scale)
    assert "reduce_max" not in str(jax.make_jaxpr(fn)(xs))  # no unification pass


def test_per_step_scales_reach_a_consuming_scan_unrounded():
    """Rows spanning 2^80 (beyond float16 at one scale) feed a second scan row by row."""

    def fn(x, w):
        _, rows = lax.scan(lambda c, _: (c * w, c), x, None, length=T)
        return lax.scan(lambda c, row: (c, row / jnp.max(jnp.abs(row))), 0.0, rows)[1]

    x, w = scaled16(normal(23, (N,)), 0), scaled16(jnp.float32(1.0), 20)
    out = jax.jit(js.scalify(fn))(x, w)
    assert_close(out, reference64(fn, x, w), jnp.float16, ulps=2)  # elementwise, every row


@pytest.mark.parametrize(
    "exponents",
    [(127, 126, 0, -126), (-126, -126, -125, -126), (127, 127, 127, 127), (3, 127, -60, 0)],
)
def test_stacked_rows_are_unified_exactly_at_the_ends_of_the_scale_range(exponents):
    """Rows of float16 data at scales from ``2^-126`` to ``2^127`` (the second row all
    zero) brought to the largest scale of a non-zero row: each element is its exact value
    at that scale rounded once to float16. A division of the scales that XLA turns into a
    product by the reciprocal loses every row under a common scale of ``2^127``, whose
    reciprocal is below float32's normal range."""
    data = np.asarray(np.random.default_rng(5).standard_normal((4, 512)), np.float16)
    data[1] = 0
    scales = np.exp2(np.asarray(exponents, np.float32))
    unify = jax.jit(lambda d, s: control_flow._unify_rows((d, s)).value)
    out = unify(data, scales)
    nonzero = np.any(data != 0, axis=1)
    common = np.max(scales[nonzero]) if nonzero.any() else np.max(scales)
    assert float(out.scale) == common
    exact = data.astype(np.float64) * (scales.astype(np.float64) / common)[:, None]
    np.testing.assert_array_equal(np.asarray(out.data), exact.astype(np.float16))


def _geometric_rows(exponent: int, dtype=jnp.float16):
    """``(x, w) -> rows`` and ``w``: row ``i`` is ``x * 2^(exponent i)``, at a scale of its own."""

    def rows(x, w):
        return lax.scan(lambda c, _: (c * w, c), x, None, length=8)[1]

    return rows, js.ScaledArray(jnp.ones((), dtype), jnp.float32(2.0**exponent))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_stop_scaling_reads_a_stacked_output_at_its_rows_scales(dtype):
    """8 rows of 4096 elements at ``2^-20`` times ``2^0 .. 2^56`` (beyond float16 at one
    scale): ``stop_scaling`` (what an optimizer reads) and a cast before it give each row's
    exact value; the rows brought to one scale first lost every float16 row but the last."""
    rows, w = _geometric_rows(8, dtype)
    x = js.ScaledArray(normal(70, (4096,)).astype(dtype), jnp.float32(2.0**-20))

    def read(x, w):
        stacked = rows(x, w)
        return js.stop_scaling(stacked, jnp.float32), js.stop_scaling(stacked.astype(jnp.float32))

    exact = np.asarray(x.data, np.float64) * 2.0**-20 * 2.0 ** (8 * np.arange(8))[:, None]
    for out in jax.jit(js.scalify(read))(x, w):
        np.testing.assert_array_equal(np.asarray(out), exact.astype(np.float32))


@pytest.mark.parametrize(("how", "exponent"), covering(HOW, EXPONENTS))
def test_stacked_rows_are_read_exactly_however_the_input_was_built(how, exponent):
    """The rows of the test above from a float16 input built every way the API allows, at
    ``2^-20`` and ``2^20``: ``stop_scaling`` gives each row's exact value."""
    rows, w = _geometric_rows(8)
    x = built(how, normal(76, (4096,)), jnp.float16, 2.0**exponent)
    out = jax.jit(js.scalify(lambda x, w: js.stop_scaling(rows(x, w), jnp.float32)))(x, w)
    exact = value64(x) * 2.0 ** (8 * np.arange(8))[:, None]
    np.testing.assert_array_equal(np.asarray(out), exact.astype(np.float32))


def test_is_finite_of_a_stacked_output_reads_each_row():
    """An infinite element in one row and a zero row at ``2^100``: ``is_finite`` (the finite
    check of a train step) is the reference's, element by element, and the compiled check
    does not bring the rows to one scale (no test for the zero rows)."""

    def fn(x, w):
        stacked = lax.scan(lambda c, s: (c * w, c * s), x, jnp.asarray([1.0, 1.0, jnp.inf, 0.0]))
        return jnp.isfinite(stacked[1])

    x, w = scaled16(normal(71, (4096,)), -20), scaled16(jnp.float32(1.0), 40)
    expected = reference64(fn, x, w)
    assert expected[:2].all() and not expected[2].any() and expected[3].all()
    np.testing.assert_array_equal(jax.jit(js.scalify(fn))(x, w), expected)
    compiled = jax.jit(js.scalify(fn)).lower(x, w).compile().as_text()
    assert "direction=NE" not in compiled


def test_a_cast_stacked_output_reaches_a_consuming_scan_unrounded():
    """Rows spanning 2^56, cast to float32 between two scans, read by the second row by
    row at their own scales: float16 data at one scale would have lost the small rows."""
    rows, w = _geometric_rows(8)

    def fn(x, w):
        wide = rows(x, w).astype(jnp.float32)
        return lax.scan(lambda c, row: (c, row * 2.0), 0.0, wide)[1]

    x = scaled16(normal(72, (4096,)), -20)
    out = jax.jit(js.scalify(fn))(x, w)
    np.testing.assert_array_equal(value64(out), reference64(fn, x, w))


@pytest.mark.parametrize("exponent", MODEL_EXPONENTS)
def test_a_scanned_models_gradients_as_read_are_the_unrolled_models(exponent):
    """``grad`` of six float16 layers (256 x 256), scanned and unrolled with a leaf per layer:
    the gradients as the optimizer reads them (``stop_scaling``, after a cast to float32 or
    not) are the same bits. The layers' gains alternate ``2^+-8``, so their gradients'
    scales span ``2^16``: at one scale, the float16 rows of the small ones lost bits."""
    gains = np.exp2(8.0 * (-1.0) ** np.arange(6))[:, None, None].astype(np.float32)
    ws = js.as_scaled_array((normal(73, (6, 256, 256), 1 / 16) * gains).astype(jnp.float16))
    x = scaled16(normal(74, (128, 256)), exponent)

    def loss(ws, x):
        step = lambda h, w: (jnp.tanh(h @ w), None)  # noqa: E731
        if isinstance(ws, list):
            h = functools.reduce(lambda h, w: step(h, w)[0], ws, x)
        else:
            h = lax.scan(step, x, ws)[0]
        return jnp.sum(h.astype(jnp.float32) ** 2)

    def read(ws, x):
        grads = jax.grad(loss)(ws, x)
        plain = functools.partial(js.stop_scaling, dtype=jnp.float32)
        return jax.tree.map(plain, grads), jax.tree.map(
            lambda g: plain(g.astype(jnp.float32)), grads
        )

    layers = [js.ScaledArray(ws.data[i], ws.scale) for i in range(6)]
    scanned = jax.jit(js.scalify(read))(ws, x)
    unrolled = jax.jit(js.scalify(read))(layers, x)
    for got, want in zip(scanned, unrolled, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.stack(want))
        assert np.all(np.isfinite(got)) and np.any(got != 0)


def _scan_eqns(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is lax.scan_p:
            found.append(eqn)
        for sub in jax_internals.eqn_subjaxprs(eqn):
            found += _scan_eqns(sub)
    return found


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_fp8_rows_of_a_scan_are_stacked_as_bytes_and_read_back_exactly(exponent):
    """``grad`` of a scan over FP8 layers (``dot_formats``, 256-wide, 32k-element
    activations at ``2^exponent``): the forward scan stacks its FP8 residuals as bytes
    (XLA:CPU widens an 8-bit float stack to float16 and back to write each row), and the
    gradients are the unrolled loop's bit for bit. At 2^20 the first layer's tanh saturates:
    its all-zero gradient row, at a scale 2^23 above the others, must not set the stacked
    gradient's scale (the other rows' float16 data would keep about 1 bit)."""

    def layers(ws, x, scan):
        if scan:
            h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        else:
            h = x
            for i in range(ws.shape[0]):
                h = jnp.tanh(h @ ws[i])
        return jnp.sum(h.astype(jnp.float32) ** 2)

    ws = js.as_scaled_array(normal(60, (3, 256, 256), 1 / 16).astype(jnp.float16))
    x = scaled16(normal(61, (128, 256)), exponent)
    grads = {
        scan: jax.jit(js.scalify(jax.grad(js.dot_formats(functools.partial(layers, scan=scan)))))
        for scan in (False, True)
    }
    np.testing.assert_array_equal(value64(grads[True](ws, x)), value64(grads[False](ws, x)))
    jaxpr = jax.make_jaxpr(grads[True])(ws, x).jaxpr
    stacked = [v.aval.dtype for eqn in _scan_eqns(jaxpr) for v in eqn.outvars]
    assert jnp.dtype(jnp.uint8) in stacked
    assert not any(jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits == 8 for d in stacked)


def test_nested_loops_invariance():
    """A while loop and a cond inside a scan body, differentiated (forward mode)."""

    def fn(w, xs):
        def step(h, x):
            h = lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ w), h + x)
            return lax.cond(jnp.sum(h) > 0, lambda h: h, lambda h: -h, h), jnp.sum(h)

        return lax.scan(step, jnp.zeros(N), xs)

    w, xs = normal(54, (N, N), 0.5), normal(55, (T, N))
    check_invariance(fn, w, xs)
    check_invariance(jax.grad(lambda w, xs: jnp.sum(fn(w, xs)[1])), w, xs)


# -- carries that change representation --------------------------------------------------------


def test_carry_made_scaled_by_the_body_is_promoted_before_the_loop():
    """The body scales a plain carry with set_scaling: found on a re-interpretation."""

    def fn(w, xs):
        def step(c, x):
            return js.set_scaling(c + x, 4.0), x @ w

        return lax.scan(step, jnp.zeros(N), xs)

    w, xs = normal(24, (N, N)), normal(25, (T, N))
    final, ys = jax.jit(js.scalify(fn))(js.as_scaled_array(w), xs)
    assert isinstance(final, js.ScaledArray) and float(final.scale) == 4.0
    np.testing.assert_allclose(value64(final), np.sum(xs, 0), rtol=RTOL)
    assert relative_error(value64(ys), fn(w, xs)[1]) <= RTOL


def count_body_interpretations(monkeypatch, fn, *args) -> int:
    """How many times scalify interprets loop bodies while tracing ``fn``."""
    calls = []
    interpret = control_flow.interpret_closed
    monkeypatch.setattr(
        control_flow, "interpret_closed", lambda *a: calls.append(1) or interpret(*a)
    )
    jax.make_jaxpr(js.scalify(fn))(*args)
    return len(calls)


def test_loop_bodies_are_interpreted_once_when_the_guess_holds(monkeypatch):
    """grad of an RNN: forward scan (plain zero state) and backward scan (zero cotangents)."""

    def loss(params, xs):
        return jnp.sum(rnn(params, xs)[1])

    args = js.as_scaled_array((rnn_params(52), normal(53, (T, N))))
    assert count_body_interpretations(monkeypatch, jax.grad(loss), *args) == 2


def test_a_missed_guess_costs_one_more_interpretation(monkeypatch):
    def fn(w, xs):
        return lax.scan(lambda c, x: (js.set_scaling(c + x, 4.0), x @ w), jnp.zeros(N), xs)

    args = js.as_scaled_array(normal(24, (N, N))), normal(25, (T, N))
    assert count_body_interpretations(monkeypatch, fn, *args) == 2


def test_carry_unscaled_by_the_body_stays_scaled():
    def fn(w, x):
        return lax.fori_loop(0, 3, lambda i, c: js.stop_scaling(c @ w), x)

    out = jax.jit(js.scalify(fn))(*js.as_scaled_array((normal(26, (N, N)), normal(27, (N,)))))
    want = fn(normal(26, (N, N)), normal(27, (N,)))
    assert relative_error(value64(out), want) <= RTOL


def test_e8m0_constant_makes_the_carry_e8m0():
    def fn(w, x):
        return lax.fori_loop(0, 3, lambda i, c: c @ w, x)

    w = js.as_scaled_array(normal(28, (N, N)), scale_dtype=jnp.float8_e8m0fnu)
    x = js.as_scaled_array(normal(29, (N,)))
    out = jax.jit(js.scalify(fn))(w, x)
    assert out.scale.dtype == jnp.float8_e8m0fnu
    assert relative_error(value64(out), fn(js.asarray(w), js.asarray(x))) <= RTOL
    check_e8m0_matches(fn, [js.as_scaled_array(normal(28, (N, N))), x])


# -- cond and switch -----------------------------------------------------------------------------


def mixed_cond(x, flag):
    return lax.cond(flag, lambda x: x * 2.0, lambda x: jnp.zeros_like(x), x)


def mixed_switch(index, x, y):
    branches = [lambda x, y: x, lambda x, y: y * 3.0, lambda x, y: jnp.full_like(x, 0.25)]
    return lax.switch(index, branches, x, y)


@pytest.mark.parametrize("flag", [True, False])
def test_cond_with_a_plain_branch_invariance(flag):
    out = check_invariance(mixed_cond, normal(30, (N,)), flag, jit=flag)
    assert isinstance(out, js.ScaledArray)
    grad = jax.grad(lambda x, flag: jnp.sum(jnp.sin(mixed_cond(x, flag))))
    check_invariance(grad, normal(30, (N,)), flag)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_with_plain_operand_and_constant_branch(index):
    x, y = js.as_scaled_array(normal(31, (N,))), normal(32, (N,))  # y stays plain
    out = jax.jit(js.scalify(mixed_switch))(index, x, y)
    assert isinstance(out, js.ScaledArray)
    assert_pow2_scales(out)
    want = mixed_switch(index, js.asarray(x), y)
    assert relative_error(value64(out), want) <= RTOL


def test_switch_joins_scale_dtypes():
    x = js.as_scaled_array(normal(33, (N,)), scale_dtype=jnp.float8_e8m0fnu)
    y = js.as_scaled_array(normal(34, (N,)))
    out = jax.jit(js.scalify(mixed_switch))(1, x, y)
    assert out.scale.dtype == jnp.float8_e8m0fnu
    assert relative_error(value64(out), 3.0 * js.asarray(y)) <= RTOL


@pytest.mark.parametrize("exponent", EXPONENTS)
@pytest.mark.parametrize("flag", [True, False])
def test_cond_float16_fidelity(exponent, flag):
    out = check_fidelity(
        functools.partial(mixed_cond, flag=flag), scaled16(normal(35, (N,)), exponent)
    )
    if not flag:
        assert float(out.scale) == 2.0**-126  # zeros take the smallest scale


# -- checkpoint -----------------------------------------------------------------------------------


def remat_mlp(params, x, policy=jax.checkpoint_policies.dots_saveable, prevent_cse=True):
    @functools.partial(jax.checkpoint, policy=policy, prevent_cse=prevent_cse, static_argnums=(2,))
    def block(w, h, activation):
        return activation(h @ w)

    for w in params:
        x = block(w, x, jax.nn.relu)
    return jnp.mean(x**2)


@pytest.mark.parametrize(
    "policy,prevent_cse",
    [(jax.checkpoint_policies.dots_saveable, True), (None, False), (None, (False, True))],
)
def test_checkpoint_under_grad_invariance(policy, prevent_cse):
    params = [normal(36, (N, N), 0.5), normal(37, (N, N), 0.5)]
    fn = jax.value_and_grad(functools.partial(remat_mlp, policy=policy, prevent_cse=prevent_cse))
    check_invariance(fn, params, normal(38, (3, N)))
    jaxpr = jax.make_jaxpr(js.scalify(fn))(*js.as_scaled_array((params, normal(38, (3, N)))))
    remats = [e for e in jaxpr.eqns if e.primitive.name.startswith("remat")]
    assert remats and all(e.params["policy"] is policy for e in remats)
    assert any(e.params["differentiated"] for e in remats)  # the backward recomputation


def test_checkpoint_forward_invariance():
    params = [normal(39, (N, N), 0.5)]
    check_invariance(remat_mlp, params, normal(40, (3, N)), jit=False)


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_checkpoint_grad_float16_fidelity(exponent):
    params = [scaled16(normal(41, (N, N), 0.5), 0), scaled16(normal(42, (N, N), 0.5), 0)]

    def fn(params, x):
        return jax.grad(remat_mlp)(params, x)

    check_fidelity(fn, params, scaled16(normal(43, (3, N)), exponent), ulps=64)


# -- PRNG keys, dropout, integer outputs ---------------------------------------------------------


def uniform32_mask(key, p, shape):
    """A Bernoulli mask drawn in float32 even under x64 (same mask as the float64 reference)."""
    return jax.random.uniform(key, shape, jnp.float32) < p


def dropout_layers(key, x, ws, bernoulli=jax.random.bernoulli):
    def layer(carry, w):
        key, h = carry
        key, sub = jax.random.split(key)
        keep = bernoulli(sub, 0.75, h.shape)
        return (key, jnp.where(keep, jax.nn.relu(h @ w) / 0.75, 0)), None

    return lax.scan(layer, (key, x), ws)[0][1]


def test_dropout_in_a_scan_with_a_carried_key():
    key, ws, x = jax.random.key(44), normal(45, (3, N, N), 0.5), normal(46, (8, N))
    grad = jax.value_and_grad(lambda ws, x, key: jnp.sum(dropout_layers(key, x, ws) ** 2))
    check_invariance(grad, ws, x, key)
    out = check_invariance(dropout_layers, jax.random.PRNGKey(44), x, ws)  # a raw uint32 key
    assert np.any(value64(out) == 0)  # some units were dropped


@pytest.mark.parametrize("exponent", EXPONENTS)
def test_dropout_float16_fidelity(exponent):
    key, ws = jax.random.key(47), scaled16(normal(48, (3, N, N), 0.5), 0)
    x = scaled16(normal(49, (8, N)), exponent)
    out = check_fidelity(lambda x, ws: dropout_layers(key, x, ws, uniform32_mask), x, ws)
    assert np.any(value64(out) == 0)


def test_random_bits_iota_and_argsort_pass_through():
    def fn(key, x):
        def step(key, row):
            key, sub = jax.random.split(key)
            order = jnp.argsort(row)
            bits = jax.random.bits(sub, row.shape)
            return key, (order, row[order] * jnp.arange(N, dtype=row.dtype), bits)

        return lax.scan(step, key, x)

    key, x = jax.random.key(50), normal(51, (T, N))
    _, (order, weighted, bits) = check_invariance(fn, key, x)
    assert order.dtype == jnp.int32 and bits.dtype == jnp.uint32
    assert isinstance(weighted, js.ScaledArray)


def test_float32_carry_of_a_polynomial_iteration_stays_in_range():
    """muon's Newton-Schulz iteration: x <- a x + b (x x^T) x + c (x x^T)^2 x, five times.
    The static estimates of its products are off by a constant factor, which compounds to
    2^(5^k) over the iterations: without re-centring the float32 carry, its data leaves
    float32's range (NaN). Carries leave each iteration within 2^+-8 of unit data."""

    def orthogonalize(x):
        x = x / (jnp.linalg.norm(x) + 1e-7)

        def step(x, _):
            a = x @ x.T
            return 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x, None

        return lax.scan(step, x, None, length=5)[0]

    x = jax.random.normal(jax.random.key(0), (4, 8))
    out = check_invariance(orthogonalize, x)
    assert np.abs(np.log2(np.max(np.abs(np.asarray(out.data))))) <= 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("exponent", EXPONENTS)
def test_bfloat16_and_float64_carries_are_recentred_like_float32(exponent, dtype):
    """A bfloat16 or float64 carry has float32's exponent range or more, so it is re-centred
    like a float32 one; its guard looks up the binade of its largest datum as float32 (the
    bfloat16 or float64 bits did not fit the lookup). A carry multiplied by data 2 at scale
    ``2^4`` for 12 steps from ``2^exponent`` (its data would grow by ``2^12``) leaves with its
    data within ``2^+-8`` of 1 and its value exact."""
    with jax.enable_x64(dtype == "float64"):
        x = js.ScaledArray(normal(75, (4096,)).astype(dtype), jnp.float32(2.0**exponent))
        w = js.ScaledArray(jnp.full((), 2.0, dtype), jnp.float32(2.0**4))
        fn = lambda x, w: lax.scan(lambda c, _: (c * w, None), x, None, length=12)[0]  # noqa: E731
        out = jax.jit(js.scalify(fn))(x, w)
        assert out.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(value64(out), reference64(fn, x, w))
        assert np.abs(np.log2(np.max(np.abs(np.asarray(out.data, np.float64))))) <= 8
