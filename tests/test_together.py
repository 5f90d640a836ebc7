"""Equal work of independent equations done together (``jax_scaled.engine.together``): the
range guards of a step's parameter casts and the new scales of its rescales, each group in
one small kernel. The same factors, data and scales as one each, bit for bit, at real sizes
and scales far from 1."""

from itertools import product
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import HOW, built, covering
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled.engine import together
from jax_scaled.memo import scale_memo
from jax_scaled.scales.guard import guard_factors, guard_factors_together

NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]
SPECIAL = [0.0, np.inf, 2.0**-140, 2.0**127, np.nan]


SCALES = [2.0**-20, 1.0, 2.0**20]


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


@pytest.mark.parametrize(
    ("dtype", "scale", "how"),
    covering(list(product([jnp.float16, jnp.float8_e4m3fn], SCALES)), HOW),
)
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


def test_a_training_run_is_the_same_bit_for_bit_as_with_work_done_alone():
    params, losses = train(20)
    with mock.patch.dict(together._TOGETHER, clear=True):  # every guard on its own
        alone_params, alone_losses = train(20)
    assert losses == alone_losses and losses[-1] < losses[0]
    for name, p in params.items():
        assert np.array_equal(bits(p.data), bits(alone_params[name].data)), name
        assert bits(p.scale) == bits(alone_params[name].scale), name


def alone() -> mock._patch:
    """A block in which every equation does its own work (no groups)."""
    return mock.patch.dict(together._TOGETHER, clear=True)


def master_weights(scale: float, how: str, count: int = 5) -> tuple[dict, dict]:
    """Float16 master weights and float32 updates of ``count`` layers, as users build them;
    the first bias zero, as initialised."""
    keys = jax.random.split(jax.random.key(2), 2 * count)
    params, updates = {}, {}
    for i in range(count):
        shape = (192, 160) if i % 2 else (160,)
        value = jax.random.normal(keys[2 * i], shape) * (0.0 if i == 1 else 0.05)
        params[f"p{i}"] = built(how, value, jnp.float16, scale)
        updates[f"p{i}"] = js.as_scaled_array(jax.random.normal(keys[2 * i + 1], shape) * 1e-3)
    return params, updates


@pytest.mark.parametrize(
    ("rescale", "scale", "how"), covering(list(product(["l1", "l2", "max"], SCALES)), HOW)
)
def test_master_weights_updated_together_are_those_updated_alone(rescale, scale, how):
    params, updates = master_weights(scale, how)

    def step(params, updates):
        return js.optim.apply_updates(params, updates, rescale=rescale)

    new = jax.jit(js.scalify(step))(params, updates)
    with alone():
        expected = jax.jit(js.scalify(step))(params, updates)
    for name, x in new.items():
        assert np.array_equal(bits(x.data), bits(expected[name].data)), name
        assert bits(x.scale) == bits(expected[name].scale), name


def zero_dimensional_remainders(count: int) -> int:
    params, updates = master_weights(1.0, "as_scaled_array", count)
    rems = guard_remainders(js.optim.apply_updates, params, updates)
    return sum(not r.outvars[0].aval.shape for r in rems)


def test_master_weight_updates_take_kernels_that_do_not_grow_with_the_parameters():
    params, updates = master_weights(1.0, "as_scaled_array", 6)
    shapes = [
        r.outvars[0].aval.shape for r in guard_remainders(js.optim.apply_updates, params, updates)
    ]
    # the units of the float32 sums' statistics, the rescales' new scales, the casts' guards
    assert shapes.count((6,)) == 3
    assert zero_dimensional_remainders(3) == zero_dimensional_remainders(6)


@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
def test_rescales_of_one_data_at_two_scales_each_keep_their_own(norm):
    rescaled = {"l1": js.ops.dynamic_rescale_l1, "l2": js.ops.dynamic_rescale_l2,
                "max": js.ops.dynamic_rescale_max}[norm]  # fmt: skip
    x = js.scaled_array(jax.random.normal(jax.random.key(3), (256, 96)) * 2.0**-14, 2.0**-6)

    def three(x):
        return rescaled(x), rescaled(x * 8.0), rescaled(jnp.sin(x))  # x * 8: same data

    new = jax.jit(js.scalify(three))(x)
    with alone():
        expected = jax.jit(js.scalify(three))(x)
    for y, z in zip(new, expected, strict=True):
        assert np.array_equal(bits(y.data), bits(z.data))
        assert bits(y.scale) == bits(z.scale)
    np.testing.assert_array_equal(new[1].to_array(), 8.0 * new[0].to_array())


def test_float32_data_near_its_largest_value_rescaled_together_keeps_its_value():
    """Float32 data with a largest magnitude in [2^127, 2^128), at a scale of 2^-126: the
    rescale moves at most 2^126 into the scale, so that the data's factor stays a normal
    float32 (2^-127 was read as zero: the data became zeros). Worked out together with
    another tensor, it is the same as alone."""
    keys = jax.random.split(jax.random.key(4), 2)
    huge = js.scaled_array(jax.random.normal(keys[0], (64, 96)) * 2.0**126, 2.0**-126)
    small = js.scaled_array(jax.random.normal(keys[1], (96,)), 2.0**-126)
    assert float(jnp.max(jnp.abs(huge.data))) >= 2.0**127

    def both(a, b):
        return js.ops.dynamic_rescale_max(a), js.ops.dynamic_rescale_max(b)

    new = jax.jit(js.scalify(both))(huge, small)
    with alone():
        expected = jax.jit(js.scalify(both))(huge, small)
    for y, z in zip(new, expected, strict=True):
        assert np.array_equal(bits(y.data), bits(z.data))
        assert bits(y.scale) == bits(z.scale)
    assert float(new[0].scale) == 1.0  # 2^-126 times 2^126
    np.testing.assert_array_equal(new[0].to_array(), huge.to_array())
    np.testing.assert_array_equal(new[1].to_array(), small.to_array())
