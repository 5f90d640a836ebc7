"""Program shapes chosen for XLA's kernel count: bundled output scales, values computed once
or together, the power guard's factor. Values must be exactly those of the plain
formulation (the range guard's own factors: ``test_guard_factors.py``)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import HOW, built, compiled_computations, covering, random_data, residual_loss
from jax import lax

import jax_scaled as js
from jax_scaled.engine.fusion import bundle_scales
from jax_scaled.pow2.xla import (
    computed_once,
    computed_once_as_bits,
    computed_once_per_block,
    computed_together,
    computed_together_as_bits,
    stacked_scalars,
    stored_once,
)
from jax_scaled.scales.guard import guard_band


def sgd_step(params, x):
    def loss(params):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def step_inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(keys[0], (8, 16)),
        "b1": jnp.zeros((16,)),
        "w2": jax.random.normal(keys[1], (16, 4)),
    }
    return js.as_scaled_array(params), js.as_scaled_array(jax.random.normal(keys[2], (5, 8)))


def reduces_in(jaxpr) -> list:
    return [e for e in jaxpr.eqns if e.primitive is lax.reduce_p]


def test_output_scales_of_a_train_step_come_from_one_operation():
    params, x = step_inputs()
    jaxpr = jax.make_jaxpr(js.scalify(sgd_step))(params, x).jaxpr
    (bundle,) = [e for e in reduces_in(jaxpr) if len(e.outvars) > 1]
    assert len(bundle.outvars) == 3  # one new scale per parameter
    out_scales = [v for v in jaxpr.outvars if v.aval.shape == ()]
    assert set(out_scales) == set(bundle.outvars)


def test_bundled_scales_leave_values_unchanged():
    params, x = step_inputs()
    got = jax.jit(js.scalify(sgd_step))(params, x)
    expected = sgd_step(js.asarray(params), js.asarray(x))
    eps = float(jnp.finfo(jnp.float32).eps)
    for key, value in expected.items():
        # float32 both ways, summed in another order: a few roundings of the largest terms
        bound = 8 * eps * float(jnp.max(jnp.abs(value)))
        np.testing.assert_allclose(js.asarray(got[key]), value, rtol=8 * eps, atol=bound)
        assert float(got[key].scale) == 2.0 ** np.round(np.log2(float(got[key].scale)))


def unscaled(f):
    return lambda *args: f(*[js.asarray(x) for x in args])


def total(a, b, transform=unscaled):
    """Sum of three products of ``a`` at scale 2 and ``b`` at scale 1/4 (plain data)."""
    sa, sb = js.ScaledArray(a, jnp.float32(2.0)), js.ScaledArray(b, jnp.float32(0.25))
    out = transform(lambda x, y: (x * y, x * 4.0, y * 0.5))(sa, sb)
    return sum(jnp.sum(js.asarray(o)) for o in out)


@pytest.mark.parametrize(
    "transform", [lambda f: jax.grad(f, argnums=(0, 1)), jax.vmap], ids=["grad", "vmap"]
)
def test_bundled_scales_differentiate_and_vectorize(transform):
    a, b = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
    expected = transform(total)(a, b)
    got = transform(functools.partial(total, transform=js.scalify))(a, b)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)


def test_scales_passed_through_are_not_bundled():
    def f(x, y):
        return bundle_scales([x, y, js.ScaledArray(y.data, y.scale * 2)], [x, y])

    jaxpr = jax.make_jaxpr(f)(js.scaled_array(jnp.ones(2), 1.0), js.scaled_array(jnp.ones(2), 1.0))
    assert not reduces_in(jaxpr.jaxpr)  # a single computed scale needs no bundle
    assert jaxpr.jaxpr.outvars[1] is jaxpr.jaxpr.invars[1]


def test_eager_outputs_are_not_bundled():
    x = js.scaled_array(jnp.ones(2), 1.0)
    out = bundle_scales([js.ScaledArray(x.data, x.scale * 2), js.ScaledArray(x.data, x.scale)], [])
    assert [float(o.scale) for o in out] == [2.0, 1.0]


def power_guard_reference(data: np.ndarray, y: int) -> int:
    """The exponent ``t`` the square's (or any power's) guard moves into the scale, by its
    definition: ``max |d|`` in ``[2^e, 2^(e+1))`` is moved to ``[1, 2)`` when ``y * e``
    leaves the float16 band, and nothing moves for all-zero data."""
    low, high, _ = guard_band(jnp.float16)
    largest = float(np.max(np.abs(data.astype(np.float64))))
    if largest == 0:
        return 0
    e = int(np.floor(np.log2(largest)))
    return e if y * e >= high or y * e < low else 0


@pytest.mark.parametrize("y", [2, 3, 4])
@pytest.mark.parametrize("how", ["as_scaled_array", "scaled_array", "quantize", "in_jit"])
def test_power_guard_at_every_exponent_of_the_largest_float16_datum(y, how):
    """``x ** y`` in float16 with ``max |d|`` at every binade of the format (subnormals and
    zero data included), on 64 x 128 values built four ways: the guard's power of two goes
    into the scale exactly as defined, and the value is ``x ** y`` to float16 precision."""
    values = jax.random.uniform(jax.random.key(y), (64, 128), minval=-1.0, maxval=1.0)
    power = jax.jit(js.scalify(lambda x: lax.integer_pow(x, y)))
    for e in range(-24, 16):
        scale = 2.0**-20 if e % 2 or how == "as_scaled_array" else 2.0**20  # no float16 inf
        x = built(how, values * 2.0**e, jnp.float16, scale)
        data = np.asarray(x.data)
        if not np.any(data):
            continue  # as_scaled_array's zeros: scale 2^-126, nothing to guard
        t = power_guard_reference(data, y)
        out = power(x)
        exponent = y * (int(np.log2(float(x.scale))) + t)
        kept = exponent if y < 3 else min(max(exponent, -126), 126)  # a cube's: in range
        assert float(out.scale) == 2.0**kept, (e, t)
        expected = (data.astype(np.float64) * 2.0**-t) ** y * 2.0 ** (exponent - kept)
        rtol = 4 * float(jnp.finfo(jnp.float16).eps)  # float32 products, one float16 rounding
        atol = y * float(jnp.finfo(jnp.float16).smallest_subnormal)
        got = np.asarray(out.data, np.float64)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"e={e}")


def test_a_power_guard_factor_is_computed_once_for_its_readers():
    # The guard's factor ``up`` of a float16 square (Adam's second moment, a global norm)
    # was worked out again from the largest datum's bits in every kernel reading the
    # square's data or scale: 7% of the 1-layer GPT's step with float16 master weights.
    def squared_and_read_twice(x):
        sq = x**2
        return jnp.sin(sq), jnp.exp(sq).T

    x = js.scaled_array(jax.random.normal(jax.random.key(0), (64, 64)).astype(jnp.float16), 2.0)
    lines = [line for body in compiled_computations(js.scalify(squared_and_read_twice), x).values()
             for line in body]  # fmt: skip
    assert sum(" remainder(" in line for line in lines) == 1


def test_values_computed_together_keep_their_dtypes_and_bits():
    # One reduction per dtype: XLA rejects a variadic reduction over floats of different
    # widths, and a float max must not meet a subnormal (its bits travel as an integer).
    values = [np.float32(1.5), np.float16(-2.0), np.uint32(0x00000001), np.float32(-np.inf),
              jnp.bfloat16(3.0), np.float32(np.nan)]  # fmt: skip
    got = jax.jit(lambda *xs: computed_together(list(xs)))(*values)
    for g, v in zip(got, values, strict=True):
        assert g.dtype == v.dtype and np.asarray(g).tobytes() == np.asarray(v).tobytes(), v


def test_values_of_different_dtypes_computed_together_as_bits_share_one_kernel():
    values = [np.float16(-0.5), np.float32(2.0**-140), jnp.bfloat16(np.nan), np.float32(np.inf),
              np.uint8(7), np.float16(6.0e-8)]  # fmt: skip
    jaxpr = jax.make_jaxpr(lambda *xs: computed_together_as_bits(list(xs)))(*values).jaxpr
    assert len(reduces_in(jaxpr)) == 1
    got = jax.jit(lambda *xs: computed_together_as_bits(list(xs)))(*values)
    for g, v in zip(got, values, strict=True):
        assert g.dtype == v.dtype and np.asarray(g).tobytes() == np.asarray(v).tobytes(), v


@pytest.mark.parametrize("count", [2, 16, 17, 40])
def test_many_values_are_computed_together_in_even_groups_of_at_most_16(count):
    # LLVM compiles a reduction carrying hundreds of values (a deep model's output scales)
    # far more slowly than several short ones; a group of one value would be folded away.
    values = [np.float32(2.0 ** (i - count // 2)) for i in range(count)]

    def computed(*xs):
        return computed_together(list(xs))

    sizes = [len(e.outvars) for e in reduces_in(jax.make_jaxpr(computed)(*values).jaxpr)]
    assert sum(sizes) == count and max(sizes) <= 16 and max(sizes) - min(sizes) <= 1
    got = jax.jit(computed)(*values)
    assert [float(g) for g in got] == [float(v) for v in values]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32])
def test_stacked_values_keep_their_bits(dtype):
    # Selects move bits: subnormals, signed zeros, infinities and NaN included, static and
    # traced values alike.
    specials = [2.0**-140, -0.0, np.inf, -np.inf, np.nan, 6.0e-8, 1.5, -3.0]
    raw = [7, -1, 0, 2**20] if dtype == jnp.int32 else specials
    values = [np.asarray(v, dtype) for v in raw]
    traced = jax.jit(lambda *xs: stacked_scalars([xs[0], values[1], *xs[1:]]))
    for got in (traced(values[0], *values[2:]), stacked_scalars(values)):
        assert got.dtype == dtype and np.asarray(got).tobytes() == np.stack(values).tobytes()


def test_stacked_scalar_arithmetic_shares_the_stack_s_kernel():
    # A concatenate's operands each took a kernel of their own on XLA:CPU (the 4-layer GPT's
    # step stacks 52 scales and 52 largest magnitudes, each a maximum or a product).
    def stack_of_maxima(stack):
        return lambda scales: stack([lax.max(s, np.float32(1.0)) for s in scales]) * 2.0

    scales = [np.float32(2.0 ** (i - 8)) for i in range(16)]
    entry = compiled_computations(stack_of_maxima(stacked_scalars), scales)["ENTRY"]
    assert sum(" fusion(" in line for line in entry) == 1
    expected = np.maximum(np.stack(scales), 1.0) * 2.0
    np.testing.assert_array_equal(jax.jit(stack_of_maxima(stacked_scalars))(scales), expected)


def test_computed_once_is_exact_for_every_scale():
    scales = np.concatenate([[0.0], 2.0 ** np.arange(-126, 128)]).astype(np.float32)
    got = jax.jit(jax.vmap(computed_once))(scales)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), scales.view(np.uint32))


def test_computed_once_per_block_is_exact_for_every_scale():
    scales = (2.0 ** np.arange(-126, 128)).astype(np.float32).reshape(2, 127)
    got = jax.jit(computed_once_per_block)(scales)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), scales.view(np.uint32))


def test_stored_once_keeps_every_float32_bit_pattern():
    # Every exponent field with mantissas at both ends and in between, both signs: zeros,
    # subnormals, the largest finite value, infinities, quiet and signalling NaNs.
    fields = np.arange(256, dtype=np.uint32) << 23
    mantissas = np.array([0, 1, 0x2AAAAA, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32)
    patterns = (fields[:, None] | mantissas[None, :]).ravel()
    patterns = np.concatenate([patterns, patterns | np.uint32(0x80000000)])
    got = jax.jit(stored_once)(patterns.view(np.float32))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), patterns)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_shared_scalar_computed_once_keeps_every_narrow_bit_pattern(dtype):
    width = jnp.dtype(dtype).itemsize * 8
    patterns = np.arange(2**width, dtype=np.uint32).astype(f"uint{width}")
    got = jax.jit(jax.vmap(computed_once_as_bits))(patterns.view(dtype))
    got = np.asarray(got).view(patterns.dtype)
    all_ones = patterns == np.iinfo(patterns.dtype).max  # a NaN: its sign may change
    np.testing.assert_array_equal(got[~all_ones], patterns[~all_ones])
    assert np.isnan(np.asarray(got[all_ones].view(dtype), np.float32)).all()


def test_a_shared_scalar_computed_once_keeps_every_float32_bit_pattern():
    fields = np.arange(256, dtype=np.uint32) << 23
    mantissas = np.array([0, 1, 0x2AAAAA, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32)
    patterns = (fields[:, None] | mantissas[None, :]).ravel()
    patterns = np.concatenate([patterns, patterns | np.uint32(0x80000000)])
    got = jax.jit(jax.vmap(computed_once_as_bits))(patterns.view(np.float32))
    got = np.asarray(got).view(np.uint32)
    keeps = patterns != 0xFFFFFFFF  # -NaN with every payload bit: +NaN
    np.testing.assert_array_equal(got[keeps], patterns[keeps])
    assert got[~keeps].tolist() == [0x7FFFFFFF]


def clipped_update(grads):
    """``optax.clip_by_global_norm``'s update: every leaf reads the global norm."""
    updates, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    return updates


def float16_grads(n_leaves: int, scale: float) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(1), n_leaves)
    return {
        f"w{i}": js.quantize(jax.random.normal(k, (128, 128)) * scale, jnp.float16)
        for i, k in enumerate(keys)
    }


def compiled_size(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return sum(" = " in line for line in text.splitlines())


def test_a_global_norm_is_compiled_once_not_once_per_parameter():
    # Each leaf's update reads the global norm's scale, a chain through every leaf's sum of
    # squares: copied into each reader it made the program quadratic in the leaf count.
    sizes = [compiled_size(js.scalify(clipped_update), float16_grads(n, 1.0)) for n in (8, 16)]
    assert sizes[1] < 2.2 * sizes[0], sizes


def kernel_sizes(fn, *args) -> list[int]:
    """Instruction counts of the compiled program's computations, the entry's excluded,
    largest first."""
    computations = compiled_computations(fn, *args)
    return sorted((len(v) for k, v in computations.items() if k != "ENTRY"), reverse=True)


def test_a_global_norm_is_compiled_by_one_kernel_not_two():
    # The norm's square root gets a kernel of its own, and the kernel of the root's scale,
    # which reads the sum's data, compiled the sum through every leaf again: two kernels of
    # the same size, growing with the leaf count.
    largest, second = kernel_sizes(js.scalify(clipped_update), float16_grads(16, 1.0))[:2]
    assert second < largest / 2, (largest, second)


def test_a_global_norm_is_compiled_by_kernels_that_do_not_grow_with_the_leaf_count():
    # The norm adds the leaves' squared norms one after the other: one scalar kernel that
    # grew with the leaf count (5,016 instructions in the 8-layer mxfp8 GPT's step, which
    # LLVM compiled in over a minute, into code that ran for seconds). Doubling the leaves
    # doubled it; the chain is now stored every few additions.
    sizes = [kernel_sizes(js.scalify(clipped_update), float16_grads(n, 1.0))[0] for n in (24, 48)]
    assert sizes[1] < 1.5 * sizes[0], sizes


def norm_of_sums(xs: list) -> jax.Array:
    """A chain of 0-d additions longer than the one stored every 16 rules, then a root."""
    total = 0.0
    for x in xs:
        total = total + jnp.sum(x * x)
    return jnp.sqrt(total)


@pytest.mark.parametrize("transform", [jax.grad, jax.vmap], ids=["grad", "vmap"])
def test_a_stored_scalar_chain_differentiates_and_vectorizes(transform):
    xs = [jnp.linspace(-1.0, 2.0, 64).reshape(2, 32) * 2.0 ** (i - 10) for i in range(20)]

    def scalified(xs):
        out = js.scalify(norm_of_sums)([js.as_scaled_array(x) for x in xs])
        return js.asarray(out, jnp.float32)

    expected, got = transform(norm_of_sums)(xs), transform(scalified)(xs)
    eps = float(jnp.finfo(jnp.float32).eps)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(g, e, rtol=4 * eps)


@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20], ids=["2^-20", "1", "2^20"])
def test_a_global_norm_clip_keeps_its_values(scale):
    grads = float16_grads(8, scale)
    got = jax.jit(js.scalify(clipped_update))(grads)
    reference = js.tree.tree_map(
        lambda g: np.asarray(js.asarray(g, jnp.float32), np.float64), grads
    )
    expected = clipped_update(reference)
    eps = float(jnp.finfo(jnp.float16).eps)
    for key, value in expected.items():
        # float16 data under one scale per tensor: a few roundings in the norm (squares,
        # sums, root) and in the division, relative to each value and to the tensor's largest
        # (the smallest data are subnormal: their spacing is fixed by the largest's scale).
        actual = np.asarray(js.asarray(got[key], jnp.float32), np.float64)
        largest = float(np.max(np.abs(value)))
        np.testing.assert_allclose(actual, value, rtol=8 * eps, atol=eps * largest)


NORM_INPUTS = [
    (jnp.float16, 2.0**-20), (jnp.float16, 2.0**20), (jnp.float32, 2.0**-7), (jnp.float32, 2.0**9)
]  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "scale", "leaves", "how"),
    covering([(*inputs, leaves) for inputs in NORM_INPUTS for leaves in (3, 20)], HOW),
)
def test_a_global_norm_through_its_root_kernel_keeps_its_value(how, dtype, scale, leaves):
    # The square root's 0-d operand (the sum of squares of every leaf) travels as its bits
    # through a reduction of its own, and with 20 leaves the running sum is stored that way
    # on the way too (every 16 rules): the norm must be the float64 reference's.
    keys = jax.random.split(jax.random.PRNGKey(3), leaves)
    tree = {f"w{i}": built(how, jax.random.normal(k, (128, 256)), dtype, scale)
            for i, k in enumerate(keys)}  # fmt: skip
    got = float(js.asarray(jax.jit(js.scalify(optax.global_norm))(tree), jnp.float32))
    leaves = [np.asarray(js.asarray(x, jnp.float32), np.float64) for x in tree.values()]
    expected = float(np.sqrt(sum(np.sum(x * x) for x in leaves)))
    # the squares and the sum in float32 accumulators, the root in the data's dtype
    np.testing.assert_allclose(got, expected, rtol=4 * float(jnp.finfo(dtype).eps))


SCHEDULED_ADAM = optax.adam(optax.cosine_decay_schedule(1e-3, decay_steps=100))


def scheduled_adam_step(grads, state, params):
    updates, state = SCHEDULED_ADAM.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def params_and_grads(n_leaves: int, grad_scale: float, seed: int) -> tuple[dict, dict]:
    """``n_leaves`` float32 parameters of 128 x 128 and their gradients at ``grad_scale``."""
    keys = jax.random.split(jax.random.PRNGKey(seed), n_leaves)
    params = {f"w{i}": jax.random.normal(k, (128, 128)) / 16 for i, k in enumerate(keys)}
    grads = {
        key: js.scaled_array(jax.random.normal(jax.random.fold_in(k, 1), p.shape), grad_scale)
        for (key, p), k in zip(params.items(), keys, strict=True)
    }
    return params, grads


def scheduled_adam_inputs(n_leaves: int, grad_scale: float) -> tuple:
    params, grads = params_and_grads(n_leaves, grad_scale, seed=3)
    state = SCHEDULED_ADAM.init(params)
    return grads, js.as_scaled_array(state), js.as_scaled_array(params)


def test_a_scheduled_learning_rate_is_compiled_once_not_once_per_parameter():
    # optax computes the rate once and scalify splits it once into a mantissa and a power of
    # two, but XLA copied the schedule (its cosine) and the split into every leaf's kernels.
    for n_leaves in (2, 8):
        inputs = scheduled_adam_inputs(n_leaves, 1.0)
        text = jax.jit(js.scalify(scheduled_adam_step)).lower(*inputs).compile().as_text()
        assert text.count(" cosine(") == 1, n_leaves


def test_a_plain_scheduled_learning_rate_is_compiled_once_not_once_per_parameter():
    # js.optim.scaled_state computes the update on plain float32 values: the schedule is a
    # plain scalar chain read by every leaf's update, which XLA copied into each of them,
    # as it does in the program without scalify.
    for n_leaves in (2, 8):
        inputs = scaled_state_inputs(n_leaves, 1.0)
        text = jax.jit(js.scalify(scaled_state_step)).lower(*inputs).compile().as_text()
        assert text.count(" cosine(") == 1, n_leaves


SCALED_STATE_ADAM = js.optim.scaled_state(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(optax.cosine_decay_schedule(1e-3, 100)))
)


def scaled_state_step(grads, state, params):
    updates, state = SCALED_STATE_ADAM.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def scaled_state_inputs(n_leaves: int, grad_scale: float) -> tuple:
    params, grads = params_and_grads(n_leaves, grad_scale, seed=4)
    return grads, SCALED_STATE_ADAM.init(params), params


@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20], ids=["2^-20", "1", "2^20"])
def test_a_scheduled_adam_update_keeps_its_values(scale):
    grads, state, params = scheduled_adam_inputs(3, scale)
    plain_grads, plain_state, plain_params = js.asarray((grads, state, params))
    step, steps = jax.jit(js.scalify(scheduled_adam_step)), 3
    for _ in range(steps):
        params, state = step(grads, state, params)
        plain_params, plain_state = scheduled_adam_step(plain_grads, plain_state, plain_params)
    eps = float(jnp.finfo(jnp.float32).eps)
    # float32 both ways: each step's update (at most the rate, 1e-3, in magnitude) may differ
    # by a few roundings (moments, bias corrections, root, quotient, rate), and the sum with
    # the parameter by one of the parameter's, in each step
    update_error = steps * 4 * eps * 1e-3
    for key, value in plain_params.items():
        actual = js.asarray(params[key])
        np.testing.assert_allclose(actual, value, rtol=steps * eps, atol=update_error)


def test_a_moment_stored_in_blocks_is_computed_once_for_its_store_and_its_update():
    # The new second moment is read by the update (m / (sqrt(v) + eps)) and by its storage in
    # float16 blocks, which reads it twice (the blocks' maxima, the elements): XLA computed it
    # in three kernels. Stored once for the storage's two reads, it was computed again by the
    # update, which did not read that copy. XLA stores a value with three readers itself.
    opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16)
    params = {"w": jax.random.normal(jax.random.PRNGKey(4), (256, 512)) / 16}
    grads = {"w": js.scaled_array(jax.random.normal(jax.random.PRNGKey(5), (256, 512)), 2.0**-8)}
    state = opt.init(params)

    def step(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    computations = compiled_computations(js.scalify(step), grads, state, params)
    squaring = [
        name
        for name, lines in computations.items()
        if any("f32[256,512]" in line and "integer_pow" in line for line in lines)
    ]
    assert len(squaring) == 1, squaring


def residual_inputs(depth: int) -> tuple:
    keys = jax.random.split(jax.random.PRNGKey(2), depth + 1)
    weights = [js.quantize(jax.random.normal(k, (128, 128)) / 16, jnp.float16) for k in keys[1:]]
    x = js.quantize(jax.random.normal(keys[0], (256, 128)), jnp.float16)
    return weights, x


def test_a_residual_stream_is_computed_once_not_once_per_reader():
    # Each float16 sum is converted back by its readers, and XLA fused the whole stream,
    # from the input on, into every reader: the gradient program was quadratic in depth.
    # Linear in depth: each block adds the same instructions (it did: 6.9k, then 8.4k).
    grad = js.scalify(jax.value_and_grad(residual_loss))
    sizes = [compiled_size(grad, *residual_inputs(depth)) for depth in (2, 4, 6)]
    assert sizes[2] - sizes[1] <= 1.05 * (sizes[1] - sizes[0]), sizes


def shared_and_single_sums(x, y):
    shared = x + y
    return shared * 2.0, jnp.abs(shared), x - y


def test_a_shared_sum_is_range_guarded_and_a_single_one_is_not():
    """The residual stream's guard (a sum of two tensors read twice) re-centres the float32
    sum: a term whose partner is zero at 2^20 keeps its value. A sum read once keeps the
    default (its float16 data underflows at the zeros' scale)."""
    values = jnp.asarray([0.7, -1.3, 0.01, 2.5], jnp.float16)
    x = js.ScaledArray(values, jnp.float32(1.0))
    zero = js.ScaledArray._trusted(jnp.zeros(4, jnp.float16), jnp.float32(2.0**20))
    doubled, magnitude, single = jax.jit(js.scalify(shared_and_single_sums))(x, zero)
    exact = np.asarray(values, np.float64)
    np.testing.assert_array_equal(np.asarray(js.asarray(doubled, jnp.float32)), 2 * exact)
    np.testing.assert_array_equal(np.asarray(js.asarray(magnitude, jnp.float32)), np.abs(exact))
    assert np.max(np.abs(np.asarray(js.asarray(single, jnp.float32)) - exact)) > 1e-3


def stacked(xs: jax.Array, w: jax.Array) -> jax.Array:
    """A scan's stacked float16 contractions: a scale per row under scalify."""
    return lax.scan(lambda carry, x: (carry, x @ w), 0.0, xs)[1]


def stacked_and_read_twice(xs: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    ys = stacked(xs, w)
    return jnp.sin(ys), jnp.exp(ys).T


def test_a_scan_s_rows_are_brought_to_one_scale_by_ratios_computed_once():
    # The rows' exponent arithmetic was copied into each kernel reading the stacked data: the
    # stacked gradients of a scanned GPT, 23 instructions a parameter leaf.
    keys = jax.random.split(jax.random.key(0))
    xs = js.as_scaled_array(jax.random.normal(keys[0], (4, 8, 16)).astype(jnp.float16))
    w = js.as_scaled_array(jax.random.normal(keys[1], (16, 16)).astype(jnp.float16))
    bodies = compiled_computations(js.scalify(stacked_and_read_twice), xs, w).values()
    row_arithmetic = [b for b in bodies if any(re.search(r"= [su]32\[4\]", line) for line in b)]
    assert len(row_arithmetic) == 1
    ys = js.asarray(js.scalify(stacked)(xs, w), jnp.float32)  # one rounding to float16
    reference = stacked(*js.asarray((xs, w), jnp.float32))
    np.testing.assert_allclose(ys, reference, rtol=2.0**-11, atol=2.0**-24)


@pytest.mark.parametrize(("how", "exponent"), covering(HOW, [-20, 20]))
def test_a_scan_s_stacked_rows_keep_their_values_however_built(how, exponent):
    """The stacked float16 contractions of a scan (64k elements, a scale per row brought to
    the largest) for inputs built every way the API allows, at ``2^-20`` and ``2^20``: each
    element within two float16 roundings (the row's and the common scale's) of float32."""
    values = jnp.asarray(random_data(7, (4, 128, 128), jnp.float32))
    xs = built(how, values * jnp.arange(1.0, 5.0)[:, None, None], jnp.float16, 2.0**exponent)
    w = js.as_scaled_array(jnp.asarray(random_data(8, (128, 128), jnp.float16)) / 16)
    ys = js.scalify(stacked)(xs, w)
    got = np.asarray(js.asarray(ys, jnp.float32), np.float64)
    want = np.asarray(stacked(*js.asarray((xs, w), jnp.float32)), np.float64)
    spacing = 2.0**-24 * float(ys.scale)  # float16's smallest step at the common scale
    assert np.all(np.abs(got - want) <= 2.0**-10 * np.abs(want) + spacing)
