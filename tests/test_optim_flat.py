"""js.optim.scaled_state(..., flat=True): the state's block-quantized leaves in one buffer per
block length. The buffers must hold the very data and scales of the per-leaf layout, train
the same way, keep the state readable, and cost a few kernels whatever the leaf count."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import compiled_computations
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled.optim._storage import stored, stored_tree
from jax_scaled.optim.flat import FlatState, InBuffer, expanded_plain, flattened

# Leaf shapes of every block layout storage_blocks gives: (1, 32) rows, blocks over rows
# ((16, 8): 4 x 8), a 16-wide last axis, a last axis 32 does not divide (one block per row
# of 65), a vector, and leaves stored alone (one element, scalar).
SHAPES = [(512, 64), (16, 8), (3, 3, 1, 16), (128, 65), (65,), (96,), (1,), ()]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn]
EPS16 = float(jnp.finfo(jnp.float16).eps)


def spread_tree(exponents: list[int], seed: int = 0) -> dict[str, jax.Array]:
    """A leaf per shape, normal values times ``2^exponent``, one block of them 2^-12
    smaller still (blocks of one leaf far apart), one leaf of zeros."""
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    tree = {}
    for i, (shape, e, key) in enumerate(zip(SHAPES, exponents, keys, strict=True)):
        x = jax.random.normal(key, shape) * 2.0**e
        if x.ndim and x.shape[-1] >= 32:
            x = x.at[..., :16].multiply(2.0**-12)
        tree[f"leaf{i}"] = x
    tree["zeros"] = jnp.zeros((4, 32))
    tree["count"] = jnp.int32(3)
    return tree


def per_leaf_and_flat(tree, dtype, scale_dtype=None):
    def both(tree):
        per_leaf = stored_tree(tree, dtype, "l2", 32, scale_dtype, exact_subnormals=False)

        def store(x, length):
            if length is None:
                return stored_tree(x, dtype, "l2", 32, scale_dtype, exact_subnormals=False)
            return stored(x, dtype, "l2", length, scale_dtype, exact_subnormals=False)

        flat = flattened(tree, 32, store)
        return per_leaf, flat, expanded_plain(flat, jnp.float32)

    per_leaf, flat, plain = jax.jit(js.scalify(both))(tree)
    assert_bitwise(js.asarray(js.tree.astype(per_leaf, jnp.float32)), js.asarray(plain))
    return per_leaf, flat.expanded()


def assert_bitwise(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@settings(max_examples=8, deadline=None)
@given(exponents=st.lists(st.integers(-40, 40), min_size=len(SHAPES), max_size=len(SHAPES)))
def test_the_buffers_hold_each_leafs_data_and_scales_bit_for_bit(dtype, exponents):
    assert_bitwise(*per_leaf_and_flat(spread_tree(exponents), dtype))


def test_the_buffers_hold_e8m0_scales_bit_for_bit():
    assert_bitwise(*per_leaf_and_flat(spread_tree([-20, 0, 5, 20, -8, 3, 0, 1]), jnp.float16,
                                      jnp.float8_e8m0fnu))  # fmt: skip


def test_leaves_of_a_block_length_share_a_buffer_and_the_rest_stay_in_the_tree():
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16, flat=True)
    state = opt.init({"w": jnp.ones((64, 128)), "head": jnp.ones((128, 65)), "s": jnp.ones(())})
    assert isinstance(state, FlatState)
    assert [b.shape for b in state.buffers] == [(2 * 64 * 128,), (2 * 128 * 65,)]
    assert [b.scale.shape for b in state.buffers] == [(2 * 64 * 4,), (2 * 128,)]
    adam = state.tree[0]
    assert adam.mu["w"] == InBuffer(0, 0, (64, 128)) and adam.nu["head"].buffer == 1
    assert adam.count.dtype == jnp.int32 and adam.mu["s"].data.dtype == jnp.float32
    expanded = state.expanded()[0]
    assert expanded.mu["w"].shape == (64, 128) and expanded.nu["head"].dtype == jnp.float16
    layered = js.optim.scaled_state(optax.adam(1e-3), jnp.float16).init(
        {"w": jnp.ones((64, 128)), "head": jnp.ones((128, 65)), "s": jnp.ones(())}
    )
    offsets = 4 * 4  # an int32 offset per leaf in a buffer
    assert js.optim.state_bytes(state) == js.optim.state_bytes(layered) + offsets
    slots = (adam.mu["head"], adam.mu["w"], adam.nu["head"], adam.nu["w"])
    assert [int(o) for o in state.offsets] == [x.offset for x in slots]


def test_a_float32_state_has_no_buffers():
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float32, flat=True)
    state = opt.init({"w": jnp.ones((64, 128))})
    assert state.buffers == () and state.tree[0].mu["w"].dtype == jnp.float32


def mlp_params():
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "w1": jax.random.normal(keys[0], (256, 512)) / 16,
        "b1": jnp.zeros(512),
        "w2": jax.random.normal(keys[1], (512, 64)) / 22,
        "b2": jnp.zeros(64),
        "ln": jnp.ones((16, 8)),
    }


def float16_gradients(steps: int):
    keys = jax.random.split(jax.random.key(1), steps)
    params = mlp_params()
    return [
        {n: (jax.random.t(k, 1.5, p.shape) * 1e-4).astype(jnp.float16) for n, p in params.items()}
        for k in keys
    ]


def train(opt, steps: int = 10):
    """Updates and state after ``steps`` scalified, jitted updates of float16 gradients."""
    params = js.as_scaled_array(mlp_params())
    state = opt.init(mlp_params())
    step = jax.jit(js.scalify(lambda g, s, p: opt.update(g, s, p)))
    for grads in float16_gradients(steps):
        updates, state = step(js.as_scaled_array(grads), state, params)
    return updates, state.expanded() if isinstance(state, FlatState) else state


def assert_within_one_rounding(a, b, eps):
    """Equal values up to one rounding of ``eps`` relative to each leaf's largest: XLA
    contracts ``a * b + c`` to one FMA within a kernel, so where the layouts' kernels differ
    a float32 value can differ in its last bit, and its narrow rounding by one step."""
    for x, y in zip(jax.tree.leaves(js.asarray(a)), jax.tree.leaves(js.asarray(b)), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.all(np.abs(x - y) <= eps * np.max(np.abs(x), initial=0.0))


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lion": lambda: optax.lion(1e-4),
    "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_flat_state_trains_as_the_per_leaf_state(name):
    flat = train(js.optim.scaled_state(OPTIMIZERS[name](), jnp.float16, flat=True))
    per_leaf = train(js.optim.scaled_state(OPTIMIZERS[name](), jnp.float16))
    assert jax.tree.structure(flat) == jax.tree.structure(per_leaf)
    assert_within_one_rounding(flat, per_leaf, EPS16)


def test_a_flat_state_computed_in_float16_trains_as_the_per_leaf_state():
    opt = lambda flat: js.optim.scaled_state(  # noqa: E731
        optax.adam(1e-3), jnp.float16, compute_dtype=None, rescale_grads=True, flat=flat
    )
    assert_within_one_rounding(train(opt(True)), train(opt(False)), EPS16)


def test_hyperparameters_stay_readable_and_settable_by_name():
    opt = js.optim.scaled_state(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), jnp.float16, flat=True
    )
    state = opt.init(mlp_params())
    assert float(js.asarray(state.tree.hyperparams["learning_rate"])) == pytest.approx(1e-3)
    zero_lr = state.tree.hyperparams | {"learning_rate": js.as_scaled_array(jnp.float32(0.0))}
    state = dataclasses.replace(state, tree=state.tree._replace(hyperparams=zero_lr))
    grads = js.as_scaled_array(float16_gradients(1)[0])
    updates, _ = jax.jit(js.scalify(opt.update))(grads, state, js.as_scaled_array(mlp_params()))
    assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(js.asarray(updates)))


def entry_kernels(leaves: int, flat: bool) -> int:
    params = {f"b{i}": jnp.zeros(128) for i in range(leaves)}
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16, flat=flat)
    grads = js.as_scaled_array(jax.tree.map(lambda p: p.astype(jnp.float16) + 1, params))
    args = (grads, opt.init(params), js.as_scaled_array(params))
    entry = compiled_computations(js.scalify(opt.update), *args)["ENTRY"]
    return sum(" fusion(" in line for line in entry)


def test_the_state_is_stored_by_the_same_kernels_whatever_its_leaf_count():
    """Per leaf, the per-leaf layout writes each moment's block scales and data with a
    kernel each; the flat one writes each buffer once. From 4 to 16 leaves its kernels grow
    by at least 2 a leaf less (the per-leaf arithmetic, gradients and update, stays)."""
    per_leaf = entry_kernels(16, False) - entry_kernels(4, False)
    flat = entry_kernels(16, True) - entry_kernels(4, True)
    assert flat <= per_leaf - 2 * 12


def test_a_state_of_the_other_layout_is_refused():
    params = mlp_params()
    flat = js.optim.scaled_state(optax.adam(1e-3), jnp.float16, flat=True)
    per_leaf = js.optim.scaled_state(optax.adam(1e-3), jnp.float16)
    grads = js.as_scaled_array(float16_gradients(1)[0])
    with pytest.raises(TypeError, match="flat=True.*other layout"):
        jax.jit(js.scalify(flat.update))(grads, per_leaf.init(params))
    with pytest.raises(TypeError, match="flat=False.*FlatState"):
        jax.jit(js.scalify(per_leaf.update))(grads, flat.init(params))


def distinct(computations: list[list[str]]) -> int:
    """How many of ``computations`` differ once their instructions' names are numbered in
    order: XLA:CPU compiles one kernel for all fusions of one computation."""

    def canonical(lines: list[str]) -> str:
        names: dict[str, str] = {}
        text = "\n".join(line.split(", metadata=")[0] for line in lines)
        return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"), text)

    return len({canonical(lines) for lines in computations})


def test_the_leaves_of_one_shape_are_read_by_one_compiled_computation():
    """Each leaf is read from its buffer at an offset the step is given, not a constant of
    the program, so the kernels of equal-shaped leaves are one computation to compile (XLA
    numbers one of the 8 leaves' operands apart: two computations per kind of kernel)."""
    params = {f"b{i}": jnp.zeros((4, 128)) for i in range(8)}
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16, flat=True)
    grads = js.as_scaled_array(jax.tree.map(lambda p: p.astype(jnp.float16) + 1, params))
    args = (grads, opt.init(params), js.as_scaled_array(params))
    computations = compiled_computations(js.scalify(opt.update), *args)
    buffer = f"f16[{2 * 8 * 4 * 128}]"  # the moments' data
    readers = [c for c in computations.values() if any(f"{buffer}{{0}} parameter" in x for x in c)]
    assert len(readers) >= 8  # a kernel per leaf at least
    assert 3 * distinct(readers) <= len(readers)  # at static offsets: as many as readers
