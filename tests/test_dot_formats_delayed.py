"""``dot_formats(scaling="delayed")``: casts scaled from amax histories, the state a step
carries, checked against a float64 reference of the recipe and in training runs."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from test_dot_formats import E4M3, E5M2, FP8_RTOL, normal, rel_l2

import jax_scaled as js
from jax_scaled.nn.delayed_contraction import ContractionHistory
from jax_scaled.ops import DelayedScaling


def delayed_scale64(history, dtype, margin: int = 0) -> float:
    """Transformer Engine's power-of-two scale from an amax history ("max"), in float64."""
    ratio = float(np.max(history)) / (float(ml_dtypes.finfo(dtype).max) / 2.0**margin)
    mantissa, exponent = math.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [.5, 1)
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def saturated64(x, dtype, scale: float) -> np.ndarray:
    """``x`` divided by ``scale``, clipped to ``dtype``'s range, rounded, multiplied back."""
    largest = float(ml_dtypes.finfo(dtype).max)
    y = np.clip(np.asarray(x, np.float64) / scale, -largest, largest)
    return y.astype(dtype).astype(np.float64) * scale


def history_of(*amaxes: float, length: int = 4) -> jax.Array:
    return jnp.zeros((length,), jnp.float32).at[: len(amaxes)].set(jnp.array(amaxes))


def a_state(f, lhs_amax, rhs_amax, grad_amax, *args):
    (key,) = f.init(*args)
    return {key: ContractionHistory(*(history_of(a) for a in (lhs_amax, rhs_amax, grad_amax)))}


# ---------------------------------------------------------------------------------------
# The recipe against float64
# ---------------------------------------------------------------------------------------


DELAYED_MATMUL = js.dot_formats(jnp.matmul, scaling=DelayedScaling(4))


@jax.jit
def delayed_matmul_vjp(state, x, w, cotangent):
    y, vjp = jax.vjp(functools.partial(DELAYED_MATMUL, state), x, w)
    return y, *vjp(cotangent)


# Magnitudes each dtype holds as a plain array, with room for the products (float16's
# largest is 2^16): 2^-20 to 2^20 where the dtype has float32's range.
EXPONENTS = {jnp.float32: (-20, 20), jnp.bfloat16: (-20, 20), jnp.float16: (-8, 8)}


@settings(max_examples=30, deadline=None)
@given(
    case=st.sampled_from(list(EXPONENTS)).flatmap(
        lambda d: st.tuples(st.just(d), st.integers(*EXPONENTS[d]))
    ),
    headroom=st.integers(-2, 3),
)
def test_casts_take_the_history_scale_and_saturate(case, headroom):
    """Operands and cotangent are cast at the scale of their histories' amax (a history
    ``2^headroom`` below the value's amax saturates its largest entries), against float64."""
    dtype, exponent = case
    scale = 2.0**exponent
    x, w = normal(0, (16, 64), scale, dtype), normal(1, (64, 32), 1.0, dtype)
    cotangent = normal(2, (16, 32), 1.0, dtype)
    histories = [float(jnp.max(jnp.abs(v.astype(jnp.float32)))) / 2.0**headroom for v in (x, w)]
    histories.append(float(jnp.max(jnp.abs(cotangent.astype(jnp.float32)))))
    state = a_state(DELAYED_MATMUL, *histories, x, w)
    y, dx, dw = delayed_matmul_vjp(state, x, w, cotangent)

    qx = saturated64(x, E4M3, delayed_scale64(histories[0], E4M3))
    qw = saturated64(w, E4M3, delayed_scale64(histories[1], E4M3))
    qg = saturated64(cotangent, E5M2, delayed_scale64(histories[2], E5M2))
    tolerance = 4 * float(jnp.finfo(dtype).eps) + 1e-5  # rounding to dtype, float32 sums
    for got, want in [(y, qx @ qw), (dx, qg @ qw.T), (dw, qx.T @ qg)]:
        assert got.dtype == dtype
        atol = tolerance * np.max(np.abs(want))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol)


def test_the_next_state_is_the_gradient_of_the_state():
    x, w = normal(0, (8, 32), 2.0**-20), normal(1, (32, 16))
    f = js.dot_formats(lambda x, w: jnp.sum(jnp.tanh(x @ w)), scaling=DelayedScaling(3))
    state = f.init(x, w)
    for step in range(4):
        state, _ = jax.grad(f, argnums=(0, 1))(state, x * 2.0**step, w)
    (history,) = state.values()
    amaxes = [float(jnp.max(jnp.abs(x))) * 2.0**s for s in (3, 2, 1)]  # most recent first
    np.testing.assert_array_equal(np.asarray(history.lhs), np.float32(amaxes))
    np.testing.assert_array_equal(np.asarray(history.rhs), np.full(3, jnp.max(jnp.abs(w))))
    cotangent = 1 - jnp.tanh(x * 8 @ w) ** 2
    assert float(history.grad[0]) == pytest.approx(float(jnp.max(cotangent)), rel=1e-6)


def test_the_first_step_is_current_scaling():
    """Empty histories fall back to current scaling: the same values, bit for bit."""
    x, w, r = normal(0, (16, 64), 2.0**20), normal(1, (64, 32)), normal(2, (16, 32))
    delayed = js.dot_formats(jnp.matmul, scaling="delayed")
    first = jax.vjp(functools.partial(delayed, delayed.init(x, w)), x, w)
    current = jax.vjp(js.dot_formats(jnp.matmul), x, w)
    for a, b in zip((first[0], *first[1](r)), (current[0], *current[1](r)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_margin_and_most_recent_amax_are_applied():
    x, w = normal(0, (8, 32)), normal(1, (32, 8))
    recipe = DelayedScaling(4, margin=2, amax_compute="most_recent")
    f = js.dot_formats(jnp.matmul, scaling=recipe, grad=None)
    (key,) = f.init(x, w)
    lhs = history_of(1.0, 1000.0)  # most recent: 1, so the scale is 2^-8 * 2^2 (margin)
    state = {key: ContractionHistory(lhs, history_of(4.0), history_of(1.0))}
    got = f(state, x, w)
    scale = 2.0 ** math.ceil(math.log2(1.0 * 4 / 448))
    want = saturated64(x, E4M3, scale) @ saturated64(w, E4M3, delayed_scale64([16.0], E4M3))
    atol = 1e-5 * np.max(np.abs(want))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------
# The state: keys, checks, regions
# ---------------------------------------------------------------------------------------


class Mlp(nn.Module):
    """Normalised after its first layer (epsilon far below any variance here), so that it
    computes the same function of inputs of any magnitude."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(256, use_bias=False, name="fc")(x)  # no bias: no offset to dwarf x
        h = nn.LayerNorm(epsilon=2.0**-100)(h)
        return nn.Dense(10, name="head")(nn.gelu(h))


def mlp_problem(exponent: int = 0):
    """Inputs of magnitude ``2^exponent``: the first layer's operands and its kernel's
    gradient (``x^T g``, ``2^exponent`` too) are far from 1."""
    x = normal(0, (128, 64), 2.0**exponent)
    labels = jax.random.randint(jax.random.key(1), (128,), 0, 10)
    params = Mlp().init(jax.random.key(2), x)

    def loss(params, x):
        logits = Mlp().apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss, params, x


def test_state_keys_follow_the_program_and_its_module_paths():
    loss, params, x = mlp_problem()
    state = js.dot_formats(loss, scaling="delayed").init(params, x)
    assert list(state) == ["000:Mlp/fc", "001:Mlp/head"]
    assert all(h.lhs.shape == (1024,) and h.lhs.dtype == jnp.float32 for h in state.values())
    excluded = js.dot_formats(loss, scaling="delayed", exclude=".*/head")
    assert list(excluded.init(params, x)) == ["000:Mlp/fc"]


def test_contractions_inside_nested_jit_take_histories():
    """``jnp.einsum`` is a nested ``jit``: inlined, its contraction has a history."""
    q, k = normal(0, (2, 6, 3, 8)), normal(1, (2, 7, 3, 8))
    attention = js.dot_formats(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), scaling="delayed")
    state = attention.init(q, k)
    assert list(state) == ["000:bqhd,bkhd->bhqk"]  # einsum's jit names its contraction
    lowered = jax.jit(attention).lower(state, q, k).as_text()
    assert "f8E4M3FN" in lowered
    assert rel_l2(attention(state, q, k), jnp.einsum("bqhd,bkhd->bhqk", q, k)) < FP8_RTOL


def test_a_loop_body_is_refused_with_the_reason():
    def scanned(x, ws):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    f = js.dot_formats(scanned, scaling="delayed")
    with pytest.raises(NotImplementedError, match="inside scan.*runs once per call"):
        f.init(normal(0, (4, 8)), normal(1, (3, 8, 8)))


def test_a_wrong_state_is_refused():
    loss, params, x = mlp_problem()
    f = js.dot_formats(loss, scaling="delayed")
    state = f.init(params, x)
    with pytest.raises(TypeError, match="state made by .init"):
        f(params, x)
    with pytest.raises(TypeError, match="rebuild_like"):
        f({k: list(h) for k, h in state.items()}, params, x)
    with pytest.raises(ValueError, match="no history for contraction '001:Mlp/head'"):
        f({"000:Mlp/fc": state["000:Mlp/fc"]}, params, x)
    with pytest.raises(ValueError, match="does not have.*'002:extra'"):
        f({**state, "002:extra": state["000:Mlp/fc"]}, params, x)


# ---------------------------------------------------------------------------------------
# Training: a flax MLP with optax's Adam, outside and inside scalify
# ---------------------------------------------------------------------------------------


def train(loss, params, x, steps: int, *, scalified: bool = False):
    """``steps`` of Adam; the loss of the last step. ``loss`` may be a DelayedFormats."""
    optimizer = optax.adam(1e-3)
    delayed = isinstance(loss, js.dot_delayed.DelayedFormats)
    fp8_state = loss.init(params, x) if delayed else {}

    def step(params, opt_state, fp8_state, x):
        if delayed:
            value, (fp8_state, grads) = jax.value_and_grad(loss, argnums=(0, 1))(
                fp8_state, params, x
            )
        else:
            value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, value

    step = jax.jit(js.scalify(step) if scalified else step)
    opt_state = optimizer.init(params)
    if scalified:
        params, x = js.as_scaled_array(params), js.as_scaled_array(x)
    for _ in range(steps):
        params, opt_state, fp8_state, value = step(params, opt_state, fp8_state, x)
    return float(js.asarray(value)), fp8_state


@pytest.mark.parametrize("exponent", [-20, 0, 20])
def test_training_with_delayed_scaling_follows_float32(exponent):
    """200 Adam steps of an MLP (16k + 2.5k weights) on inputs of magnitude 2^exponent: the
    loss follows float32 training, and the histories hold the last steps' amaxes."""
    loss, params, x = mlp_problem(exponent)
    reference, _ = train(loss, params, x, 200)
    got, fp8_state = train(js.dot_formats(loss, scaling="delayed"), params, x, 200)
    assert abs(got - reference) / reference < FP8_RTOL
    fc = fp8_state["000:Mlp/fc"]
    assert float(fc.lhs[0]) == float(jnp.max(jnp.abs(x)))
    assert np.all(np.asarray(fc.rhs[:200]) > 0) and np.all(np.asarray(fc.rhs[200:]) == 0)


def test_training_under_scalify_follows_float32():
    loss, params, x = mlp_problem(-20)
    reference, _ = train(loss, params, x, 100)
    f = js.dot_formats(loss, scaling="delayed")
    got, fp8_state = train(f, params, x, 100, scalified=True)
    assert abs(got - reference) / reference < FP8_RTOL
    head = fp8_state["001:Mlp/head"]
    assert np.all(np.isfinite(np.asarray(js.asarray(head.grad)))) and float(head.grad[0]) > 0


def test_a_restored_state_is_rebuilt_into_its_histories():
    """Restored without a target (orbax: a namedtuple as a dict of its fields), the state is
    refused; ``js.tree.rebuild_like`` gives it back its histories, values unchanged."""
    loss, params, x = mlp_problem()
    f = js.dot_formats(loss, scaling=DelayedScaling(8))
    state, _ = jax.grad(f, argnums=(0, 1))(f.init(params, x), params, x)
    raw = {key: h._asdict() for key, h in state.items()}
    with pytest.raises(TypeError, match="rebuild_like"):
        f(raw, params, x)
    rebuilt = js.tree.rebuild_like(raw, jax.eval_shape(lambda: state))
    assert float(f(rebuilt, params, x)) == float(f(state, params, x))
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
