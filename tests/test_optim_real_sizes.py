"""js.optim.scaled_state at real sizes: 32k-element weights, Gaussian and heavy-tailed
gradients, ten updates of each optimizer of the training zoo with default hyperparameters
(DESIGN.md, invariant 6). The reference is float32 optax on the same float16 gradients."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_computations

import jax_scaled as js
from jax_scaled.optim._storage import stored_tree

SHAPE, STEPS = (512, 64), 10
EPS16 = float(jnp.finfo(jnp.float16).eps)

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "lamb": lambda: optax.lamb(1e-3),
}


def float16_gradients(kind: str) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(1), STEPS)
    if kind == "gaussian":
        grads = [jax.random.normal(k, SHAPE) * 1e-2 for k in keys]
    else:  # heavy-tailed: Student-t with 1.5 degrees of freedom (infinite variance)
        grads = [jax.random.t(k, 1.5, SHAPE) * 1e-4 for k in keys]
    return [g.astype(jnp.float16) for g in grads]


def run(opt, grads, scalified: bool):
    weight = jax.random.normal(jax.random.key(0), SHAPE) * 0.05
    state = opt.init(weight)
    update = jax.jit(js.scalify(opt.update) if scalified else opt.update)
    steps = []
    for g in grads:
        g = js.tree.astype(js.as_scaled_array(g), jnp.float16) if scalified else g.astype(float)
        updates, state = update(g, state, weight)
        step = js.asarray(updates, jnp.float32)
        steps.append(step)
        weight = weight + step
    return weight, steps, state


@pytest.mark.parametrize("kind", ["gaussian", "student_t"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_scaled_state_follows_float32_on_real_sizes(name, kind):
    grads = float16_gradients(kind)
    want, want_steps, _ = run(OPTIMIZERS[name](), grads, scalified=False)
    got, _, state = run(js.optim.scaled_state(OPTIMIZERS[name]()), grads, scalified=True)
    assert np.all(np.isfinite(got))
    # Each step's update is within a few float16 roundings (the state's stored leaves, one
    # each per step) of its largest element, accumulated over the steps.
    largest_step = max(float(jnp.max(jnp.abs(s))) for s in want_steps)
    off = jnp.abs(got - want) > STEPS * 8 * EPS16 * largest_step
    if name == "lion":  # sign(): a float16 rounding flips it where its argument is near 0
        assert float(jnp.mean(off)) <= 2 * EPS16, float(jnp.mean(off))  # P(|N(0,1)| < eps)
    else:
        assert not jnp.any(off), float(jnp.max(jnp.abs(got - want)))
    for leaf in js.tree.tree_leaves(state):  # the state stays float16
        if isinstance(leaf, js.ScaledArray) and leaf.ndim == 2:
            assert leaf.dtype == jnp.float16


def test_adafactor_on_a_tall_weight_stays_finite():
    """optax.adafactor(1e-2) with its defaults was non-finite at the first update of a
    (4096, 16) parameter; its second moment is unfactored there (16 < 128)."""
    keys = jax.random.split(jax.random.key(3), 3)
    grads = [jax.random.normal(k, (4096, 16)) * 1e-2 for k in keys]
    opt = js.optim.scaled_state(optax.adafactor(1e-2))
    weight = js.tree.astype(js.as_scaled_array(jnp.full((4096, 16), 0.05)), jnp.float16)
    state = opt.init(js.asarray(weight, jnp.float32))
    update = jax.jit(js.scalify(opt.update))
    for g in grads:
        updates, state = update(js.tree.astype(js.as_scaled_array(g), jnp.float16), state, weight)
        assert np.all(np.isfinite(js.asarray(updates, jnp.float32)))


def test_casting_optax_state_to_float16_warns_and_names_the_leaves():
    state = optax.adam(1e-3).init({"w": jnp.zeros((64, 512)), "b": jnp.zeros(512)})
    with pytest.warns(js.tree.OptimizerStateWarning, match=r"\[0\]\.mu\['b'\].*scaled_state"):
        js.tree.astype(js.as_scaled_array(state), jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", js.tree.OptimizerStateWarning)
        js.tree.astype(js.as_scaled_array(state), jnp.bfloat16)  # float32's range: no warning


@pytest.mark.parametrize("exponent", [-70, -20, 0, 20])
@pytest.mark.parametrize("kind", ["gaussian", "student_t"])
def test_block_stored_state_is_the_exact_division_of_the_update(kind, exponent):
    """js.optim stores an update's new state without the exact division of float32
    subnormals (``js.quantize(exact_subnormals=False)``): the update's float32 arithmetic
    leaves none where the platform flushes them. Adam's state of 32k-element float16
    gradients at ``2^exponent`` (at 2^-70 the squares fall below float32's normal range),
    stored both ways from the same values in one program, over the steps: bit for bit."""
    inner = optax.adam(1e-3)

    def stored_both_ways(grads, state):
        _, new_state = inner.update(js.stop_scaling(grads, jnp.float32), state)
        return [stored_tree(new_state, jnp.float16, None, 32, None, exact) for exact in (1, 0)]

    store = jax.jit(js.scalify(stored_both_ways))
    state = inner.init(jnp.zeros(SHAPE))
    for g in float16_gradients(kind)[:3]:
        exact, fast = store(js.scaled_array(g / jnp.max(jnp.abs(g)), 2.0**exponent), state)
        for a, b in zip(jax.tree.leaves(exact), jax.tree.leaves(fast), strict=True):
            np.testing.assert_array_equal(bytes_of(a), bytes_of(b))
        state = js.asarray(exact, jnp.float32)


def bytes_of(x: jax.Array) -> np.ndarray:
    return np.asarray(x).reshape(-1).view(np.uint8)


def test_block_stored_state_is_written_without_integer_work_on_its_elements():
    """The kernels writing Adam's new float16 state in blocks (32k elements) divide by the
    blocks' reciprocals only: none of the exact subnormal path's integer operations on the
    elements' bits (26 instructions of the state's shape before)."""
    opt = js.optim.scaled_state(optax.adam(1e-3))
    weight = jnp.zeros(SHAPE)
    grads = js.as_scaled_array(jnp.ones(SHAPE, jnp.float16))
    args = (grads, opt.init(weight), js.as_scaled_array(weight))
    bodies = compiled_computations(js.scalify(opt.update), *args).values()
    shape = re.escape(f"s32[{','.join(map(str, SHAPE))}]")
    # Bitcasts aside: the block maxima reduce the magnitudes' bits (a reinterpretation).
    work = [line for body in bodies for line in body if "bitcast-convert(" not in line]
    assert not any(re.search(f"= {shape}", line) for line in work)
