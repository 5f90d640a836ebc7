"""The range guards of a step's parameter casts, worked out together in one small kernel:
the same factors, data and scales as one guard per cast, bit for bit, at real sizes and
scales far from 1."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import built
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled.memo import scale_memo
from jax_scaled.scales.guard import guard_factors, guard_factors_together

NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
SPECIAL = [0.0, np.inf, 2.0**-140, 2.0**127, np.nan]


def bits(x: jax.Array) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def largest_datum(data: st.DataObject) -> float:
    if data.draw(st.booleans()):
        return data.draw(st.sampled_from(SPECIAL))
    mantissa = data.draw(st.sampled_from([1.0, 1.5]))
    return float(np.float32(2.0 ** data.draw(st.integers(-149, 127)) * mantissa))


@pytest.mark.parametrize("dtype", NARROW)
@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_factors_worked_out_together_are_those_of_one_guard_each(dtype, data):
    """Largest data anywhere in float32's range, zeros, subnormals, infinities and NaNs."""
    largest = [largest_datum(data) for _ in range(data.draw(st.integers(2, 7)))]
    wides = [np.array([x, -x / 4, 1.0], np.float32) for x in largest]

    def together(*wides):
        with scale_memo():
            guard_factors_together(wides, dtype)
            return [guard_factors(w, dtype) for w in wides]

    for (down, up), wide in zip(jax.jit(together)(*wides), wides, strict=True):
        alone_down, alone_up = jax.jit(guard_factors, static_argnums=1)(wide, dtype)
        assert bits(down) == bits(alone_down) and bits(up) == bits(alone_up), wide[0]


def parameters(scale: float, how: str) -> dict:
    """A layer's parameters as a user builds them (float32 ScaledArrays), one of them beyond
    float16's range at scale 1 and one all zero."""
    keys = jax.random.split(jax.random.key(0), 3)
    values = {
        "w": jax.random.normal(keys[0], (256, 384)) * 0.02,
        "b": jnp.zeros((384,)),
        "g": 1.0 + 0.1 * jax.random.normal(keys[1], (384,)),
        "e": jax.random.normal(keys[2], (512, 64)) * 2.0**18,  # overflows float16 unguarded
    }
    return {k: built(how, v, jnp.float32, scale) for k, v in values.items()}


def cast_each_alone(params: dict, dtype) -> dict:
    cast = js.scalify(lambda p: p.astype(dtype))
    return {k: jax.jit(cast)(p) for k, p in params.items()}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20])
@pytest.mark.parametrize("how", ["as_scaled_array", "scaled_array", "quantize", "in_jit"])
def test_parameter_casts_keep_the_data_and_scales_of_one_guard_each(dtype, scale, how):
    params = parameters(scale, how)
    together = jax.jit(js.scalify(lambda p: js.tree.astype(p, dtype)))(params)
    for name, alone in cast_each_alone(params, dtype).items():
        assert np.array_equal(bits(together[name].data), bits(alone.data)), name
        assert bits(together[name].scale) == bits(alone.scale), name
    assert np.all(np.isfinite(np.asarray(together["e"].to_array(jnp.float32))))


def guard_remainders(fn, *args) -> list:
    """The exact remainders of ``fn``'s scalified jaxpr: each guard factor's kernel has one
    (:func:`~jax_scaled.pow2.xla.computed_once`)."""
    jaxpr = jax.make_jaxpr(js.scalify(fn))(*args).jaxpr
    return [e for e in jaxpr.eqns if e.primitive is lax.rem_p]


def test_the_casts_of_a_step_parameters_share_one_guard_kernel():
    params = parameters(1.0, "as_scaled_array")
    (rem,) = guard_remainders(lambda p: js.tree.astype(p, jnp.float16), params)
    assert rem.outvars[0].aval.shape == (len(params),)


def test_casts_to_formats_without_a_guard_or_of_one_value_work_as_before():
    params = parameters(2.0**-20, "scaled_array")
    assert not guard_remainders(lambda p: js.tree.astype(p, jnp.bfloat16), params)
    (rem,) = guard_remainders(lambda w: w.astype(jnp.float16), params["w"])
    assert rem.outvars[0].aval.shape == ()
    both = guard_remainders(lambda p: (p["w"].astype(jnp.float16), p["b"].astype(jnp.float8_e5m2)),
                            params)  # fmt: skip
    assert sorted(r.outvars[0].aval.shape for r in both) == [(), ()]


def test_block_scaled_parameters_keep_their_own_guards():
    params = parameters(1.0, "as_scaled_array")
    params["w"] = js.quantize(params["w"].to_array(), jnp.float32, block_shape=(1, 32))
    together = jax.jit(js.scalify(lambda p: js.tree.astype(p, jnp.float16)))(params)
    for name, alone in cast_each_alone(params, jnp.float16).items():
        assert np.array_equal(bits(together[name].data), bits(alone.data)), name
        assert np.array_equal(bits(together[name].scale), bits(alone.scale)), name


def train(steps: int) -> tuple:
    """A float16 MLP with float32 parameters trained by Adam (parameters cast each step)."""
    keys = jax.random.split(jax.random.key(1), 4)
    params = js.as_scaled_array({
        "w1": jax.random.normal(keys[0], (128, 256)) / 128**0.5, "b1": jnp.zeros((256,)),
        "w2": jax.random.normal(keys[1], (256, 64)) / 256**0.5, "b2": jnp.zeros((64,)),
    })  # fmt: skip
    x = jax.random.normal(keys[2], (512, 128))
    y = jax.random.normal(keys[3], (512, 64)) * 2.0**-12  # small targets, small gradients
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16)

    def loss(params, x, y):
        p = js.tree.astype(params, jnp.float16)
        h = jax.nn.gelu(x.astype(jnp.float16) @ p["w1"] + p["b1"])
        return jnp.mean(((h @ p["w2"] + p["b2"]).astype(jnp.float32) - y) ** 2)

    @jax.jit
    @js.scalify
    def step(params, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return js.optim.apply_updates(params, updates), state, value

    state, losses = opt.init(params), []
    for _ in range(steps):
        params, state, value = step(params, state, x, y)
        losses.append(float(js.asarray(value)))
    return params, losses


def test_a_training_run_is_the_same_bit_for_bit_as_with_one_guard_per_cast():
    params, losses = train(20)
    with mock.patch("jax_scaled.engine.interpreter.casts_guarded_together", lambda *a: None):
        alone_params, alone_losses = train(20)
    assert losses == alone_losses and losses[-1] < losses[0]
    for name, p in params.items():
        assert np.array_equal(bits(p.data), bits(alone_params[name].data)), name
        assert bits(p.scale) == bits(alone_params[name].scale), name
