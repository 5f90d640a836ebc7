"""js.nn: same values as jax.nn outside scalify; accurate scale rules inside it."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jax_scaled as js
from tests.helpers import (
    HOW,
    assert_close,
    assert_pow2_scales,
    built,
    random_data,
    reference32,
    reference64,
)

MASK = jnp.tril(jnp.ones((4, 8), bool))


def _layer_norm_ref(x, eps=1e-6):
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) / jnp.sqrt(jnp.var(x, -1, keepdims=True) + eps)


def _rms_norm_ref(x, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


# (js.nn function, jax reference)
PAIRS = {
    "relu": (js.nn.relu, jax.nn.relu),
    "gelu_exact": (functools.partial(js.nn.gelu, approximate=False),
                   functools.partial(jax.nn.gelu, approximate=False)),
    "gelu_tanh": (js.nn.gelu, jax.nn.gelu),
    "silu": (js.nn.silu, jax.nn.silu),
    "swish": (js.nn.swish, jax.nn.swish),
    "softplus": (js.nn.softplus, jax.nn.softplus),
    "elu": (js.nn.elu, jax.nn.elu),
    "leaky_relu": (functools.partial(js.nn.leaky_relu, negative_slope=0.1),
                   functools.partial(jax.nn.leaky_relu, negative_slope=0.1)),
    "layer_norm": (js.nn.layer_norm, _layer_norm_ref),
    "rms_norm": (js.nn.rms_norm, _rms_norm_ref),
    "softmax": (js.nn.softmax, jax.nn.softmax),
    "log_softmax": (js.nn.log_softmax, jax.nn.log_softmax),
    "masked_softmax": (functools.partial(js.nn.softmax, where=MASK),
                       functools.partial(jax.nn.softmax, where=MASK)),
    "masked_log_softmax": (functools.partial(js.nn.log_softmax, where=MASK),
                           functools.partial(jax.nn.log_softmax, where=MASK)),
}  # fmt: skip


def _x(dtype=jnp.float32, seed=0):
    return jnp.asarray(random_data(seed, (4, 8), dtype))


def _finite_close(got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_same_values_and_gradients_as_jax_nn_outside_scalify(name):
    ours, theirs = PAIRS[name]
    x, w = _x(), _x(seed=1)
    _finite_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)

    def loss(f):
        return lambda x: jnp.sum(jnp.where(jnp.isfinite(f(x)), f(x) * w, 0))

    _finite_close(jax.grad(loss(ours))(x), jax.grad(loss(theirs))(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_float32_model_invariance_under_scalify(name):
    ours, _ = PAIRS[name]
    x, w = _x(), _x(seed=1)

    def loss(x):
        y = ours(x)
        return jnp.sum(jnp.where(jnp.isfinite(y), y * w, 0))

    got = jax.jit(js.scalify(ours))(js.as_scaled_array(x))
    assert_pow2_scales(got)
    _finite_close(js.asarray(got), ours(x), rtol=1e-5, atol=1e-6)
    grad = jax.jit(js.scalify(jax.grad(loss)))(js.as_scaled_array(x))
    _finite_close(js.asarray(grad), jax.grad(loss)(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(PAIRS))
@given(exponent=st.integers(-24, 24), seed=st.integers(0, 2**16))
def test_float16_rules_are_accurate_at_any_scale(name, exponent, seed):
    ours, theirs = PAIRS[name]
    x = js.scaled_array(_x(jnp.float16, seed), 2.0**exponent)
    out = jax.jit(js.scalify(ours))(x)
    assert isinstance(out, js.ScaledArray) and out.dtype == jnp.float16
    assert_pow2_scales(out)
    assert_close(out, reference64(theirs, x), jnp.float16, ulps=8, normwise=True)


def test_masked_softmax_rows_ignore_masked_entries_at_tiny_scale():
    x = js.scaled_array(_x(jnp.float16), 2.0**-20)
    out = js.asarray(js.scalify(lambda x: js.nn.softmax(x, where=MASK))(x))
    np.testing.assert_array_equal(np.asarray(out)[~np.asarray(MASK)], 0)
    np.testing.assert_allclose(np.sum(np.asarray(out, np.float64), -1), 1, rtol=1e-2)


def test_softmax_cross_entropy_matches_optax_style_reference_and_gradient():
    logits, labels = _x(), jax.nn.one_hot(jnp.arange(4) % 8, 8)

    def reference(logits):
        return jnp.mean(-jnp.sum(labels * jax.nn.log_softmax(logits), -1))

    def ours(logits):
        return jnp.mean(js.nn.softmax_cross_entropy(logits, labels))

    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(reference)(logits), rtol=1e-5)
    grad = jax.jit(js.scalify(jax.grad(ours)))(js.as_scaled_array(logits))
    np.testing.assert_allclose(js.asarray(grad), jax.grad(reference)(logits), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("batch,classes", [(64, 16), (256, 1024)])
def test_softmax_cross_entropy_gradient_is_unit_scaled(batch, classes):
    logits = jax.random.normal(jax.random.PRNGKey(0), (batch, classes))
    labels = jax.nn.one_hot(jnp.arange(batch) % classes, classes)

    def loss(logits):
        return jnp.mean(js.nn.softmax_cross_entropy(logits, labels))

    scaled = js.tree.astype(js.as_scaled_array(logits), jnp.float16)
    grad = jax.jit(js.scalify(jax.grad(loss)))(scaled)
    rms = float(jnp.sqrt(jnp.mean(jnp.square(grad.data.astype(jnp.float32)))))
    assert 0.5 <= rms <= 2, rms
    want = jax.grad(loss)(scaled.to_array(jnp.float32))
    atol = 1e-3 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(js.asarray(grad, jnp.float32), want, rtol=2e-2, atol=atol)


@pytest.mark.parametrize("exponent", [-20, 0, 20])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dot_product_attention_matches_jax_nn(exponent, is_causal):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (2, 8, 2, 16)) for key in keys)
    mask = jax.random.bernoulli(keys[0], 0.8, (2, 2, 8, 8)).at[..., 0].set(True)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    got = js.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def scaled(x):
        return js.scaled_array(x.astype(jnp.float16), 2.0**exponent)

    def attention(q, k, v):
        return js.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)

    out = jax.jit(js.scalify(attention))(scaled(q), scaled(k), scaled(v))
    want64 = reference64(attention, scaled(q), scaled(k), scaled(v))
    assert np.all(np.isfinite(js.asarray(out, jnp.float32)))
    assert_close(out, want64, jnp.float16, ulps=16, normwise=True)


GATED = ["gelu_exact", "gelu_tanh", "silu", "swish", "elu", "leaky_relu", "relu"]


@pytest.mark.parametrize("name", GATED)
@given(exponent=st.integers(-24, 24), seed=st.integers(0, 2**16))
def test_float16_activation_gradients_are_accurate_at_any_scale(name, exponent, seed):
    """The backward rule keeps the cotangent's scale: no x f'(x) term at the input's scale."""
    ours, theirs = PAIRS[name]
    w = jnp.asarray(random_data(seed + 1, (4, 8), jnp.float16))

    def grad(f):
        return jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32) * w.astype(jnp.float32)))

    x = js.scaled_array(_x(jnp.float16, seed), 2.0**exponent)
    out = jax.jit(js.scalify(grad(ours)))(x)
    assert out.dtype == jnp.float16  # plain for relu/leaky_relu: the mask alone depends on x
    assert_pow2_scales(out)
    assert_close(out, reference64(grad(theirs), x), jnp.float16, ulps=8, normwise=True)


SCALED_BACKWARD = ["layer_norm", "rms_norm", "softmax", "masked_softmax", "log_softmax"]


@pytest.mark.parametrize("name", SCALED_BACKWARD)
@given(exponent=st.integers(-24, 24), seed=st.integers(0, 2**16))
def test_float16_softmax_and_norm_gradients_are_accurate_at_any_scale(name, exponent, seed):
    """The backward rules (softmax, norms) and log_softmax's automatic backward, against the
    float32 program: a peaked softmax row's gradient ``p_i p_j (g_i - g_j)`` is below float32's
    resolution of ``g`` at large input scales, in the float32 program as in ours."""
    ours, theirs = PAIRS[name]
    w = jnp.asarray(random_data(seed + 1, (4, 8), jnp.float16))

    def grad(f):
        def loss(x):
            y = f(x).astype(jnp.float32)
            return jnp.sum(jnp.where(jnp.isfinite(y), y * w.astype(jnp.float32), 0))

        return jax.grad(loss)

    x = js.scaled_array(_x(jnp.float16, seed), 2.0**exponent)
    out = jax.jit(js.scalify(grad(ours)))(x)
    assert isinstance(out, js.ScaledArray) and out.dtype == jnp.float16
    assert_pow2_scales(out)
    assert_close(out, reference32(grad(theirs), x), jnp.float16, ulps=16, normwise=True)


def _peaked_logits(size, dtype, hot=(3,)):
    """Rows of logits with ``hot`` entries 2^7 above the rest: nearly one-hot softmax rows."""
    data = jnp.zeros((4, size), jnp.float32).at[:, list(hot)].set(8.0)
    return js.scaled_array(data.astype(dtype), 16.0)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e5m2, jnp.float8_e4m3fn])
@pytest.mark.parametrize("size", [64, 1024, 2**16])
@pytest.mark.parametrize("guard", [True, False])
def test_a_one_hot_softmax_never_overflows_its_data(dtype, size, guard):
    """A probability 1 is data ``1 / scale``: the scale ``~1/N`` is clamped to what the
    format holds (float16, E5M2: 2^15; E4M3, whose largest finite value is 448: 2^8)."""
    softmax = js.scalify(js.nn.softmax, config=js.ScalifyConfig(guard=guard))
    out = jax.jit(softmax)(_peaked_logits(size, dtype))
    data = np.asarray(out.data, np.float32)
    assert np.all(np.isfinite(data)) and out.dtype == dtype
    assert_pow2_scales(out)
    largest = 2.0 ** (jnp.finfo(dtype).maxexp - 1)
    assert np.max(data) == min(largest, size)  # the static estimate 1/N, or the clamp
    np.testing.assert_array_equal(np.asarray(js.asarray(out, jnp.float32))[:, 3], 1.0)


@pytest.mark.parametrize("size", [1024, 2**14])
def test_the_gradient_of_a_two_hot_softmax_is_guarded_against_overflow(size):
    """``p (g - sum(p g))`` is up to ``max|g| / 4`` at two entries of 1/2: ``N / 4`` times its
    static estimate ``scale(p) scale(g)``; the guard moves that into the scale."""
    x = _peaked_logits(size, jnp.float16, hot=(3, 5))
    w = jnp.zeros((4, size), jnp.float16).at[:, 3].set(100.0).at[:, 5].set(-100.0)

    def grad(softmax):
        return jax.grad(lambda x: jnp.sum(softmax(x).astype(jnp.float32) * w))

    out = jax.jit(js.scalify(grad(js.nn.softmax)))(x)
    assert np.all(np.isfinite(np.asarray(out.data, np.float32)))
    assert_pow2_scales(out)
    assert_close(out, reference64(grad(jax.nn.softmax), x), jnp.float16, ulps=8, normwise=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_peaked_attention_is_finite_and_accurate_in_float16(is_causal):
    """Trained attention: logits ``q . k / sqrt(d)`` of aligned vectors, rows nearly one-hot."""
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 1024, 1, 16))
    q = js.scaled_array(q.astype(jnp.float16), 4.0)  # diagonal logits about 256

    def loss(q):
        out = js.nn.dot_product_attention(q, q, q, is_causal=is_causal)
        return jnp.sum(out.astype(jnp.float32) * jnp.linspace(-1, 1, 16))

    def attention_and_grad(q):
        return js.nn.dot_product_attention(q, q, q, is_causal=is_causal), jax.grad(loss)(q)

    out, grad = jax.jit(js.scalify(attention_and_grad))(q)
    want_out, want_grad = reference64(attention_and_grad, q)
    assert_close(out, want_out, jnp.float16, ulps=16, normwise=True)
    assert_close(grad, want_grad, jnp.float16, ulps=64, normwise=True)


def test_scale_estimates_follow_the_unit_scaling_assumptions():
    """softmax: e^0.5 / N; log_softmax and the cross-entropy loss: sqrt(log^2 N + (1 + 2 log N)
    s^2); norms: 1 (input gradient: scale(g) / s), each rounded down to a power of two."""
    x = js.scaled_array(jax.random.normal(jax.random.PRNGKey(0), (8, 1024), jnp.float16), 1.0)
    labels = jax.nn.one_hot(jnp.arange(8), 1024, dtype=jnp.float16)
    assert float(js.scalify(js.nn.softmax)(x).scale) == 2.0**-10  # e^0.5 / 1024 = 2^-9.3
    assert float(js.scalify(js.nn.log_softmax)(x).scale) == 4.0  # 7.9
    loss = js.scalify(js.nn.softmax_cross_entropy)(x, labels)
    assert float(loss.scale) == 4.0
    big = js.scaled_array(x.data, 2.0**20)
    assert float(js.scalify(js.nn.log_softmax)(big).scale) == 2.0**21  # 3.9 * 2^20
    assert float(js.scalify(js.nn.layer_norm)(big).scale) == 1.0
    grad = js.scalify(jax.grad(lambda x: jnp.sum(js.nn.rms_norm(x).astype(jnp.float32))))(big)
    assert float(grad.scale) == 2.0**-20


NORMS = {name: PAIRS[name] for name in ("layer_norm", "rms_norm")}


def _value_and_grad(f, w: jax.Array):
    """``x -> (f(x), d/dx sum(f(x) * w))``, the sum over the finite outputs."""

    def loss(x):
        y = f(x).astype(jnp.float32)
        return jnp.sum(jnp.where(jnp.isfinite(y), y * w, 0))

    return lambda x: (f(x), jax.grad(loss)(x))


@functools.cache
def _norm_programs(name: str, eps: float) -> tuple:
    """The scalified program (jitted: every input scale runs the same compiled step) and its
    reference, 32 x 2048 elements; cached, so that the cases of one ``eps`` compile once."""
    ours, theirs = NORMS[name]
    w = jnp.asarray(random_data(4, (32, 2048), jnp.float32))
    ours, theirs = (functools.partial(f, eps=eps) for f in (ours, theirs))
    return jax.jit(js.scalify(_value_and_grad(ours, w))), _value_and_grad(theirs, w)


def _norm_input(exponent: int) -> js.ScaledArray:
    return js.scaled_array(jnp.asarray(random_data(3, (32, 2048), jnp.float16)), 2.0**exponent)


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("exponent", [-100, -76, -20, 0, 20, 100])
def test_norms_without_eps_are_accurate_where_the_scale_squared_flushes(name, exponent):
    """``eps=0``: the normalised data do not depend on the input's scale. A float32 ``s^2``
    flushes to zero below ``2^-75``; the rule must not form it (it gave NaN data at scale
    ``2^126``). Forward and input gradient, 64k elements, against float64."""
    scalified, reference = _norm_programs(name, 0.0)
    x = _norm_input(exponent)
    out, grad = scalified(x)
    want_out, want_grad = reference64(reference, x)
    assert float(out.scale) == 1.0
    assert_pow2_scales(grad)
    assert_close(out, want_out, jnp.float16, ulps=8, normwise=True)
    assert_close(grad, want_grad, jnp.float16, ulps=16, normwise=True)


@pytest.mark.parametrize("eps", [1e-12, 1e-6, 1e-5, 0.25, 4.0, 1e6])
@pytest.mark.parametrize("exponent", [-126, -60, -12, -1, 0, 1, 30, 126])
def test_norm_output_scale_is_the_unit_estimate_min_1_s_over_sqrt_eps(eps, exponent):
    """The output scale is ``min(1, s / sqrt(eps))`` rounded down to a power of two, at least
    ``2^-126``; the data then hold the normalised value at that scale, and the input gradient
    ``scale(g) * r0 / s`` holds the gradient at every ``s`` (64k elements, against float64)."""
    scalified, reference = _norm_programs("layer_norm", eps)
    x = _norm_input(exponent)
    out, grad = scalified(x)
    estimate = 2.0**exponent / math.sqrt(float(np.float32(eps)))  # float64: no overflow
    assert float(out.scale) == max(2.0**-126, min(1.0, 2.0 ** math.floor(math.log2(estimate))))
    want_out, want_grad = reference64(reference, x)
    assert_close(out, want_out, jnp.float16, ulps=8, normwise=True)
    assert_pow2_scales(grad)
    assert_close(grad, want_grad, jnp.float16, ulps=16, normwise=True)


BFLOAT16_RULES = ["layer_norm", "rms_norm", "softmax", "log_softmax"]


@functools.cache
def _bfloat16_programs(name: str) -> tuple:
    """``x -> (f(x), d/dx sum(f(x) * w))`` scalified (jitted once: the scale is an input) and
    as its float64 reference, for the js.nn function ``name``, and the resolution of the
    gradient's float32 arithmetic: for the softmax family, float32's of the cotangent ``w``
    (a peaked row's ``p_i (g_i - sum p g)`` at its largest entry is below it, in the float32
    program as in ours); the norms' gradient is ``1 / s`` times data, with no floor."""
    ours, theirs = PAIRS[name]
    w = jnp.asarray(random_data(2**16 + 1, (32, 1024), jnp.float32))  # not a drawn seed
    floor = float(jnp.finfo(jnp.float32).eps * jnp.max(jnp.abs(w))) if "softmax" in name else 0.0
    return jax.jit(js.scalify(_value_and_grad(ours, w))), _value_and_grad(theirs, w), floor


@pytest.mark.parametrize("name", BFLOAT16_RULES)
@given(exponent=st.integers(-100, 100), seed=st.integers(0, 2**16))
def test_bfloat16_norm_and_softmax_rules_are_accurate_at_any_scale(name, exponent, seed):
    """The custom rules on bfloat16 data at scales a float16 program could not hold (a float32
    one neither: the norms' sum of squares overflows from ``2^59``), 32k elements, output and
    input gradient against float64."""
    scalified, reference, floor = _bfloat16_programs(name)
    x = js.scaled_array(jnp.asarray(random_data(seed, (32, 1024), jnp.bfloat16)), 2.0**exponent)
    out, grad = scalified(x)
    want_out, want_grad = reference64(reference, x)
    assert out.dtype == grad.dtype == jnp.bfloat16
    assert_pow2_scales((out, grad))
    assert_close(out, want_out, jnp.bfloat16, ulps=8, normwise=True)
    assert_close(grad, want_grad, jnp.bfloat16, ulps=16, normwise=True, atol=floor)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    "dtype,exponent,eps",
    [(jnp.float16, -20, 1e-5), (jnp.float16, 20, 1e-5), (jnp.float16, -100, 0.0),
     (jnp.float32, -100, 1e-5)],
)  # fmt: skip
def test_norms_of_scaled_arrays_built_every_way(how, dtype, exponent, eps):
    """Layer norm on inputs built every way the API allows (a scale computed inside jit
    included), float16 at ``2^-20`` and ``2^20``, without ``eps`` at ``2^-100`` where ``s^2``
    flushes, and float32 at a non-unit scale: output and input gradient against float64.
    ``as_scaled_array`` splits the float32 values, then the ScaledArray is cast, as users get
    float16 ones: a float16 array cannot hold values at ``2^-100`` or ``2^20``."""
    values = jnp.asarray(random_data(3, (32, 2048), jnp.float32))
    if how == "as_scaled_array":
        x = js.tree.astype(js.as_scaled_array(values * 2.0**exponent), dtype)
    else:
        x = built(how, values, dtype, 2.0**exponent)
    data = np.asarray(x.data, np.float32)
    assert np.all(np.isfinite(data)) and np.any(data)  # a value the test can check
    scalified, reference = _norm_programs("layer_norm", eps)
    out, grad = scalified(x)
    want_out, want_grad = reference64(reference, x)
    assert out.dtype == grad.dtype == dtype
    assert_pow2_scales((out, grad))
    assert_close(out, want_out, dtype, ulps=8, normwise=True)
    assert_close(grad, want_grad, dtype, ulps=16, normwise=True)
