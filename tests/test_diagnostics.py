"""js.diagnostics: records of every scaled value's data statistics, forward and backward."""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_scaled as js


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def test_records_forward_and_backward_under_jit_and_grad():
    w = js.as_scaled_array(jnp.full((16, 4), 0.5, jnp.float16))
    x = js.as_scaled_array(jnp.ones((8, 16), jnp.float16))
    with js.diagnostics.record_scales() as records:
        grad = jax.jit(js.scalify(jax.grad(loss)))(w, x)
        jax.block_until_ready(grad)
    assert records and [r.index for r in records] == sorted(r.index for r in records)
    dots = [r for r in records if r.primitive == "dot_general"]
    assert any(not r.backward for r in dots) and any(r.backward for r in dots)
    forward = next(r for r in dots if not r.backward)
    assert forward.shape == (8, 4) and forward.dtype == "float16"
    data = np.full((8, 4), 16 * 0.5 * 1.0)  # x @ w in units of the rule's output scale
    assert math.isclose(forward.max_abs * forward.scale, float(data.max()), rel_tol=1e-3)
    assert "test_diagnostics.py" in forward.source


def test_counts_nans_infinities_zeros_and_ranks_them_first():
    x = js.scaled_array(jnp.array([1.0, 0.0, jnp.inf, 2.0], jnp.float16), 1.0)
    with js.diagnostics.record_scales() as records:
        js.scalify(lambda x: (x - x) * 2.0)(x)
    sub = next(r for r in records if r.primitive == "sub")
    assert sub.nans == 1 and sub.nonfinite == 1 and sub.zeros == 3
    assert js.diagnostics.worst(records, limit=1)[0].nans == 1
    assert "NaN=1" in js.diagnostics.format_records([sub])


def test_nothing_is_recorded_outside_the_block():
    x = js.as_scaled_array(jnp.ones(4, jnp.float16))
    with js.diagnostics.record_scales() as records:
        pass
    js.scalify(lambda x: x * 2.0)(x)
    assert records == [] and not js.diagnostics.is_recording()
