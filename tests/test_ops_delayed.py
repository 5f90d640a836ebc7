"""Delayed scaling (js.ops.DelayedScaling): delayed scale, value kept, history rolled."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_data, value64

import jax_scaled as js
from jax_scaled import ops

E4M3_MAX = float(ml_dtypes.finfo(jnp.float8_e4m3fn).max)


def expected_scale(reference_amax: float, margin: int, largest: float = E4M3_MAX) -> float:
    """2^ceil(log2(amax * 2^margin / largest)), computed in float64."""
    return 2.0 ** math.ceil(math.log2(reference_amax * 2.0**margin / largest))


def inputs(exponents: list[int]) -> list[js.ScaledArray]:
    """Unit-ish float32 data times 2^e, at scale 2^-e+3 (the data itself is off by 2^3)."""
    return [
        js.ScaledArray(jnp.asarray(random_data(i, (4, 8), jnp.float32) * 8.0), jnp.float32(2.0**e))
        for i, e in enumerate(exponents)
    ]


@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
def test_several_jitted_steps(amax_compute):
    ds = ops.DelayedScaling(history_len=3, margin=1, amax_compute=amax_compute)
    xs = inputs([-30, -28, -31, -25, -29])
    traces = []

    def update(x, state):
        traces.append(None)
        return ds.update(x, state)

    step = jax.jit(js.scalify(update))
    state = ds.init(xs[0])
    history = [float(np.max(np.abs(value64(xs[0])))), 0.0, 0.0]
    structure = jax.tree.structure(state)
    for x in xs:
        reference = history[0] if amax_compute == "most_recent" else max(history)
        y, state = step(x, state)
        assert float(y.scale) == expected_scale(reference, margin=1)
        np.testing.assert_array_equal(value64(y), value64(x))  # y == x
        history = [float(np.max(np.abs(value64(x)))), *history[:-1]]  # rolled, amax recorded
        np.testing.assert_array_equal(np.asarray(state.amax_history), np.float32(history))
        assert jax.tree.structure(state) == structure
        assert state.amax_history.shape == (3,) and state.amax_history.dtype == jnp.float32
    assert len(traces) == 1


def test_data_fits_the_format_with_margin():
    """While the amax does not grow, the data stays within max(format) / 2^margin."""
    for margin in [0, 2]:
        ds = ops.DelayedScaling(history_len=2, margin=margin)
        x = inputs([-40])[0]
        y, _ = js.scalify(ds.update)(x, ds.init(x))
        largest = float(np.max(np.abs(np.asarray(y.data))))
        assert E4M3_MAX / 2.0 ** (margin + 1) < largest <= E4M3_MAX / 2.0**margin


def test_delayed_scale_makes_fp8_usable_at_tiny_magnitudes():
    ds = ops.DelayedScaling(history_len=4)
    x = js.ScaledArray(jnp.asarray(random_data(7, (16,), jnp.float16)), jnp.float32(2.0**-40))

    def quantise(x, state):
        y, state = ds.update(x, state)
        return ops.cast_on_forward(y, jnp.float8_e4m3fn), state

    q, _ = jax.jit(js.scalify(quantise))(x, ds.init(x))
    assert q.dtype == jnp.float8_e4m3fn
    error = np.abs(value64(q) - value64(x))
    assert np.all(error <= 2.0**-4 * np.abs(value64(x)) + 2.0**-9 * float(q.scale))
    raw = ops.cast_on_forward(x.to_array().astype(jnp.float32), jnp.float8_e4m3fn)
    assert not np.any(np.asarray(raw, np.float32))  # without scaling: all flushed to zero


def test_outside_scalify_y_is_x_and_history_still_records():
    ds = ops.DelayedScaling(history_len=2)
    x = jnp.asarray(random_data(3, (5,), jnp.float32)) * 1000
    y, state = jax.jit(ds.update)(x, ds.init(x * 2))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    amax = float(np.max(np.abs(np.asarray(x))))
    np.testing.assert_array_equal(np.asarray(state.amax_history), np.float32([amax, 2 * amax]))


def test_plain_input_under_scalify_gets_the_delayed_scale():
    ds = ops.DelayedScaling(history_len=2, dtype=jnp.float8_e5m2)
    x = jnp.asarray(random_data(4, (6,), jnp.float32)) * 2.0**20
    y, _ = js.scalify(ds.update)(x, ds.init(x))
    assert isinstance(y, js.ScaledArray)
    assert float(y.scale) == expected_scale(float(jnp.max(jnp.abs(x))), 0, 57344.0)
    np.testing.assert_array_equal(value64(y), np.asarray(x, np.float64))


def test_empty_history_keeps_the_scale():
    ds = ops.DelayedScaling(history_len=3)
    x = js.ScaledArray(jnp.asarray(random_data(5, (4,), jnp.float32)), jnp.float32(2.0**-7))
    y, state = js.scalify(ds.update)(x, ds.init(jnp.zeros(4)))
    assert float(y.scale) == 2.0**-7
    np.testing.assert_array_equal(np.asarray(y.data), np.asarray(x.data))
    assert float(state.amax_history[0]) == float(np.max(np.abs(value64(x))))


def test_init_and_amax_on_scaled_arrays():
    x = js.ScaledArray(jnp.array([1.0, -6.0], jnp.float16), jnp.float32(2.0**-20))
    assert float(ops.amax(x)) == 6.0 * 2.0**-20
    assert float(js.scalify(ops.amax)(x)) == 6.0 * 2.0**-20
    history = ops.DelayedScaling(2).init(x).amax_history
    np.testing.assert_array_equal(np.asarray(history), np.float32([6.0 * 2.0**-20, 0.0]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(history_len=0),
        dict(history_len=2, margin=-1),
        dict(history_len=2, amax_compute="mean"),
        dict(history_len=2, dtype=jnp.int8),
    ],
)
def test_invalid_settings_are_refused(kwargs):
    with pytest.raises((ValueError, TypeError)):
        ops.DelayedScaling(**kwargs)
