"""js.optim: optax state as scaled low-precision data, and scaled master weights."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_pow2_scales, relative_error, value64

import jax_scaled as js
from jax_scaled import optim
from jax_scaled.optim._storage import E8M0_ZERO_SCALE, promote_plain

INNER = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-1, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
}


# -- a tiny MLP classifier and its data --------------------------------------------------------


def init_mlp(key, sizes=(16, 32, 4)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in),
            "b": jnp.zeros((n_out,)),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params, x, labels):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    log_probs = jax.nn.log_softmax(h @ params[-1]["w"] + params[-1]["b"])
    one_hot = jax.nn.one_hot(labels, log_probs.shape[-1], dtype=log_probs.dtype)
    return -jnp.mean(jnp.sum(one_hot * log_probs, axis=-1))


def teacher_data(key, batch=64, features=16, classes=4):
    """Inputs and the labels of a random linear teacher: a task an MLP learns in 50 steps."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (batch, features))
    return x, jnp.argmax(x @ jax.random.normal(kw, (features, classes)), axis=-1)


def make_step(opt, apply_updates):
    def step(params, state, x, labels):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, labels)
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), state, loss

    return step


def float_state_leaves(state):
    return [x for x in js.tree.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]


# -- init and storage ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, rescale",
    [(jnp.float16, "l2"), (jnp.bfloat16, "l2"), (jnp.float8_e4m3fn, "max"), (jnp.float16, None)],
)
def test_init_stores_float_leaves_as_scaled_dtype(dtype, rescale):
    """One scale per leaf (``block_size=None``): data re-centred with ``rescale``."""
    params = init_mlp(jax.random.key(0))
    opt = optim.scaled_state(optax.adam(1e-3), dtype, rescale=rescale, block_size=None)
    state = opt.init(params)
    assert state[0].count.dtype == jnp.int32  # integer leaves untouched
    leaves = float_state_leaves(state)
    assert len(leaves) == 2 * len(jax.tree.leaves(params))
    for leaf in leaves:
        assert isinstance(leaf, js.ScaledArray) and leaf.dtype == dtype, leaf
        assert not np.any(value64(leaf))  # Adam's moments start at zero
        assert float(leaf.scale) == 2.0**-126  # negligible next to any gradient's scale
    assert_pow2_scales(state)


def test_init_of_state_that_copies_params_keeps_their_values():
    """Schedule-free SGD keeps a copy ``z`` of the parameters: it is stored faithfully, also
    from scaled master weights far outside float16's range; its scalar hyperparameters keep
    float32 data."""
    params = {"w": jax.random.normal(jax.random.key(1), (8, 8)) * 2.0**-30}
    inner = optax.contrib.schedule_free_sgd(1.0, b1=0.9)
    for given in (params, optim.as_master(params, jnp.float16)):
        state = optim.scaled_state(inner, jnp.float16).init(given)
        z = state.z["w"]
        assert isinstance(z, js.ScaledArray) and z.dtype == jnp.float16
        assert relative_error(z, params["w"]) < 2e-3
        assert state.b1.dtype == jnp.float32  # optax makes b1 in the params' lowest dtype:
        assert float(js.asarray(state.b1)) == float(jnp.asarray(0.9, given["w"].dtype))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn])
def test_init_stores_block_scaled_leaves(dtype):
    """By default every leaf has about 32 elements a scale, each block of zeros at 2^-126."""
    params = init_mlp(jax.random.key(0))
    state = optim.scaled_state(optax.adam(1e-3), dtype).init(params)
    for leaf in float_state_leaves(state):
        assert isinstance(leaf, js.ScaledArray) and leaf.dtype == dtype, leaf
        assert leaf.scale.ndim == leaf.ndim and math.prod(leaf.block_shape) <= 32
        assert not np.any(value64(leaf))
        assert np.all(np.asarray(leaf.scale) == 2.0**-126)
    assert_pow2_scales(state)


def test_state_memory_is_about_half_of_float32():
    params = init_mlp(jax.random.key(4))
    fp32 = optax.adam(1e-3).init(params)
    fp16 = optim.scaled_state(optax.adam(1e-3), jnp.float16).init(params)
    ratio = optim.state_bytes(fp16) / optim.state_bytes(fp32)
    assert ratio <= 0.55, ratio
    assert optim.state_bytes(fp32) == sum(x.nbytes for x in jax.tree.leaves(fp32))


# -- model invariance in float32 ---------------------------------------------------------------


def gradient_steps(exponents=(-3, -10, 5)):
    """One gradient tree per step, each at its own magnitude ``2^exponent`` (plain float32)."""
    keys = iter(jax.random.split(jax.random.key(5), 2 * len(exponents)))
    return [
        {name: jax.random.normal(next(keys), shape) * 2.0**e for name, shape in PARAM_SHAPES}
        for e in exponents
    ]


PARAM_SHAPES = (("b", (8,)), ("w", (16, 8)))


def make_update_step(opt, apply_updates):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("name", sorted(INNER))
def test_float32_scaled_state_matches_plain_optax(name):
    """float32 data: scaled state and scaled master weights compute what plain optax does,
    over 3 steps of gradients at magnitudes 2^-3, 2^-10 and 2^5."""
    params = {"w": jax.random.normal(jax.random.key(6), (16, 8)), "b": jnp.zeros(8)}
    plain_opt = INNER[name]()
    plain_step = jax.jit(make_update_step(plain_opt, optax.apply_updates))
    scaled_opt = optim.scaled_state(INNER[name](), jnp.float32)
    scaled_step = jax.jit(js.scalify(make_update_step(scaled_opt, optim.apply_updates)))

    plain = (params, plain_opt.init(params))
    scaled = (optim.as_master(params, jnp.float32), scaled_opt.init(params))
    for grads in gradient_steps():
        plain = plain_step(*plain, grads)
        scaled = scaled_step(*scaled, js.as_scaled_array(grads))
    assert_pow2_scales(scaled)
    for got, want in zip(js.tree.tree_leaves(scaled), jax.tree.leaves(plain), strict=True):
        assert isinstance(got, js.ScaledArray) or not jnp.issubdtype(got.dtype, jnp.floating)
        assert relative_error(got, want) <= 1e-5, (name, relative_error(got, want))


# -- low-precision fidelity --------------------------------------------------------------------


def tiny_gradients(steps=4, shape=(16, 8), exponent=-12):
    """Random gradients of magnitude ``2^exponent``, one per step (plain float32)."""
    keys = jax.random.split(jax.random.key(6), steps)
    return [{"w": jax.random.normal(k, shape) * 2.0**exponent} for k in keys]


def adam_reference64(grads_per_step, params):
    """Adam's updates and final state in float64."""
    with jax.enable_x64(True):
        opt = optax.adam(1e-3)
        params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
        state, updates = opt.init(params), []
        for grads in grads_per_step:
            grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float64), grads)
            update, state = opt.update(grads, state)
            updates.append(jax.tree.map(np.asarray, update))
        return updates, jax.tree.map(np.asarray, state)


@functools.cache
def jitted_update(opt):
    return jax.jit(js.scalify(opt.update))


def run_updates(opt, grads_per_step, params, *, cast=None):
    """Updates of ``opt`` for each step's gradients (jit + scalify), and the final state."""
    state, updates = opt.init(params), []
    state = state if cast is None else cast(state)
    for grads in grads_per_step:
        update, state = jitted_update(opt)(grads, state)
        updates.append(update)
    return updates, state


def test_float16_state_is_accurate_where_raw_float16_underflows():
    """Gradients ~2^-12: Adam's nu = (1 - b2) g^2 ~ 2^-34 is lost by a raw float16 state, not
    by a scaled one (float16 rounding of a float64 reference)."""
    grads = tiny_gradients()
    params = {"w": jnp.zeros((16, 8))}
    expected_updates, expected_state = adam_reference64(grads, params)

    opt = optim.scaled_state(optax.adam(1e-3), jnp.float16)
    updates, state = run_updates(opt, grads, params)
    for got, want in zip(updates, expected_updates, strict=True):
        assert relative_error(got["w"], want["w"]) < 5e-3, relative_error(got["w"], want["w"])
    for moment in ("mu", "nu"):
        got, want = getattr(state[0], moment)["w"], getattr(expected_state[0], moment)["w"]
        assert got.dtype == jnp.float16 and relative_error(got, want) < 2e-3, moment

    raw = optax.adam(1e-3)
    raw_grads = [jax.tree.map(lambda g: g.astype(jnp.float16), g) for g in grads]
    raw_cast = functools.partial(js.tree.astype, dtype=jnp.float16)
    raw_updates, _ = run_updates(raw, raw_grads, params, cast=raw_cast)
    assert relative_error(raw_updates[-1]["w"], expected_updates[-1]["w"]) > 0.5


@pytest.mark.parametrize("rescale_grads", [False, True])
def test_gradient_rescaling_keeps_squared_gradient_data_in_range(rescale_grads):
    """Scaled float16 gradients whose data sits at 2^-11 (far from unit scale), computed on in
    float16 (``compute_dtype=None``, as in the scalify paper): squaring the data underflows
    float16 unless the gradients are rescaled first or the square's range guard is on."""
    grads = tiny_gradients(exponent=-20)
    scaled_grads = [
        {"w": js.ScaledArray((g["w"] * 2.0**9).astype(jnp.float16), jnp.float32(2.0**-29))}
        for g in grads
    ]
    params = {"w": jnp.zeros((16, 8))}
    _, expected_state = adam_reference64([js.asarray(g, jnp.float32) for g in scaled_grads], params)
    inner = optax.adam(1e-3)
    opt = optim.scaled_state(inner, jnp.float16, rescale_grads=rescale_grads, compute_dtype=None)
    _, state = run_updates(opt, scaled_grads, params)
    error = relative_error(state[0].nu["w"], expected_state[0].nu["w"])
    assert error < 2e-3, error  # rescaled gradients, or the range guard of the square
    unguarded = jax.jit(js.scalify(opt.update, config=js.ScalifyConfig(guard=False)))
    state = opt.init(params)
    for g in scaled_grads:
        _, state = unguarded(g, state)
    error = relative_error(state[0].nu["w"], expected_state[0].nu["w"])
    if rescale_grads:
        assert error < 2e-3, error
    else:
        assert error > 2e-2, error  # shows the test can tell the two apart


def test_float8_state_with_max_rescaling_stays_finite_and_close():
    grads = tiny_gradients(exponent=-16)
    params = {"w": jnp.zeros((16, 8))}
    expected_updates, _ = adam_reference64(grads, params)
    opt = optim.scaled_state(optax.adam(1e-3), jnp.float8_e4m3fn, rescale="max")
    updates, state = run_updates(opt, grads, params)
    assert all(leaf.dtype == jnp.float8_e4m3fn for leaf in float_state_leaves(state))
    assert relative_error(updates[-1]["w"], expected_updates[-1]["w"]) < 0.15  # e4m3: 3 bits


@pytest.mark.parametrize("block_size, zero_scale", [(32, 2.0**-126), (None, E8M0_ZERO_SCALE)])
def test_e8m0_scales_are_kept_and_give_the_same_values(block_size, zero_scale):
    grads = tiny_gradients(steps=2)
    params = {"w": jnp.zeros((16, 8))}
    f32 = optim.scaled_state(optax.adam(1e-3), jnp.float16, block_size=block_size)
    e8m0 = optim.scaled_state(
        optax.adam(1e-3), jnp.float16, scale_dtype=jnp.float8_e8m0fnu, block_size=block_size
    )
    updates32, state32 = run_updates(f32, grads, params)
    updates8, state8 = run_updates(e8m0, grads, params)
    assert np.all(np.asarray(e8m0.init(params)[0].mu["w"].scale, np.float32) == zero_scale)
    for leaf in float_state_leaves(state8):
        assert leaf.scale.dtype == jnp.float8_e8m0fnu, leaf.scale.dtype
    for a, b in zip(js.tree.tree_leaves(state32), js.tree.tree_leaves(state8), strict=True):
        np.testing.assert_array_equal(value64(a), value64(b))
    np.testing.assert_array_equal(value64(updates32[-1]["w"]), value64(updates8[-1]["w"]))


# -- training with FP16 master weights and FP16 state ----------------------------------------


FP32_ADAM = optax.adam(3e-3)
FP32_STEP = jax.jit(make_step(FP32_ADAM, optax.apply_updates))


def noisy_teacher_data(key, flip=0.3):
    """Teacher labels with a fraction ``flip`` replaced at random: the loss stays well above 0."""
    x, labels = teacher_data(key)
    k1, k2 = jax.random.split(key)
    noise = jax.random.randint(k1, labels.shape, 0, 4)
    return x, jnp.where(jax.random.uniform(k2, labels.shape) < flip, noise, labels)


def train(step, params, state, batches):
    losses = []
    for x, labels in batches:
        params, state, loss = step(params, state, x, labels)
        losses.append(float(js.asarray(loss)))
    return losses


def test_fp16_master_weights_and_state_train_like_float32():
    """50 Adam steps of a small MLP: float16 scaled master weights and Adam state reach the
    float32 loss within a few percent, and the state stays scaled float16 near unit scale."""
    params = init_mlp(jax.random.key(7))
    x, labels = noisy_teacher_data(jax.random.key(8))
    fp32_losses = train(FP32_STEP, params, FP32_ADAM.init(params), [(x, labels)] * 50)

    opt = optim.scaled_state(optax.adam(3e-3), jnp.float16)
    step = jax.jit(js.scalify(make_step(opt, optim.apply_updates)))
    x16 = js.tree.astype(js.as_scaled_array(x), jnp.float16)
    master, state = optim.as_master(params, jnp.float16), opt.init(params)
    fp16_losses = []
    for _ in range(50):
        master, state, loss = step(master, state, x16, labels)
        fp16_losses.append(float(js.asarray(loss)))

    assert fp32_losses[-1] < 0.7 * fp32_losses[0], fp32_losses  # it does learn
    error = abs(fp16_losses[-1] - fp32_losses[-1]) / fp32_losses[-1]
    assert error <= 0.03, (fp16_losses[-1], fp32_losses[-1])
    assert all(leaf.dtype == jnp.float16 for leaf in js.tree.tree_leaves(master))
    assert_pow2_scales((master, state))
    for leaf in float_state_leaves(state):
        assert isinstance(leaf, js.ScaledArray) and leaf.dtype == jnp.float16, leaf
        assert_blocks_at_the_top(leaf)


def assert_blocks_at_the_top(leaf):
    """Every non-zero block's largest datum at or above 1, far from the subnormals (js.quantize
    places it near the top of the format), and finite."""
    top = float(jnp.finfo(leaf.dtype).max)
    data = np.abs(np.asarray(leaf.data, np.float64))
    grid = [n // b for n, b in zip(leaf.shape, leaf.block_shape)]
    pairs = [n for pair in zip(grid, leaf.block_shape) for n in pair]
    largest = data.reshape(pairs).max(axis=tuple(range(1, 2 * leaf.ndim, 2)))
    nonzero = largest[largest > 0]
    assert np.all(nonzero <= top) and np.all(nonzero >= 1), (leaf.shape, nonzero)


def test_plain_optax_with_cast_state_as_in_design():
    """DESIGN.md's user example: plain optax, state cast once to scaled float16."""
    params = init_mlp(jax.random.key(9))
    x, labels = teacher_data(jax.random.key(10))
    fp32_params, *_ = FP32_STEP(params, FP32_ADAM.init(params), x, labels)

    step = jax.jit(js.scalify(make_step(FP32_ADAM, optax.apply_updates)))
    state = js.tree.astype(js.as_scaled_array(FP32_ADAM.init(params)), jnp.float16)
    new_params, state, _ = step(js.as_scaled_array(params), state, js.as_scaled_array(x), labels)
    assert all(isinstance(leaf, js.ScaledArray) for leaf in float_state_leaves(state))
    assert all(leaf.dtype == jnp.float16 for leaf in float_state_leaves(state[0].nu))
    for got, want in zip(js.tree.tree_leaves(new_params), jax.tree.leaves(fp32_params)):
        assert relative_error(got, want) < 1e-3, relative_error(got, want)


# -- outside scalify -------------------------------------------------------------------------


def test_update_outside_scalify_with_plain_params_and_gradients():
    """A plain optax loop (jitted, no scalify): only the state is scaled; updates come back
    as plain arrays and optax.apply_updates keeps working."""
    params = init_mlp(jax.random.key(11))
    x, labels = teacher_data(jax.random.key(12))
    grads = jax.jit(jax.grad(mlp_loss))(params, x, labels)
    want, _ = jax.jit(optax.adam(1e-2).update)(grads, optax.adam(1e-2).init(params))

    opt = optim.scaled_state(optax.adam(1e-2), jnp.float16)
    updates, state = jax.jit(opt.update)(grads, opt.init(params))
    for got, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(want), strict=True):
        assert not isinstance(got, js.ScaledArray) and got.dtype == jnp.float32
        assert relative_error(got, expected) < 1e-5  # computed in float32 from a zero state
    assert all(isinstance(leaf, js.ScaledArray) for leaf in float_state_leaves(state))
    new_params = optax.apply_updates(params, updates)
    assert jax.tree.structure(new_params) == jax.tree.structure(params)


def test_apply_updates_keeps_each_parameter_representation():
    scale = 2.0**-24  # value far below float16's normal range
    params = {
        "scaled": js.scaled_array(jnp.linspace(-1, 1, 8, dtype=jnp.float16), scale),
        "plain": jnp.linspace(-1, 1, 8),
        "frozen": jnp.ones(3),
    }
    updates = {
        "scaled": js.scaled_array(jnp.full(8, 1.0, jnp.float16), scale / 64),
        "plain": js.scaled_array(jnp.full(8, 1.0), 2.0**-6),
        "frozen": None,
    }
    new = optim.apply_updates(params, updates, rescale=None)
    assert isinstance(new["scaled"], js.ScaledArray) and new["scaled"].dtype == jnp.float16
    assert float(new["scaled"].scale) == scale  # the parameter's scale, as the add rule keeps it
    want = value64(params["scaled"]) + value64(updates["scaled"])
    assert relative_error(new["scaled"], want) < 2**-10
    assert not isinstance(new["plain"], js.ScaledArray) and new["plain"].dtype == jnp.float32
    np.testing.assert_allclose(new["plain"], np.linspace(-1, 1, 8) + 2.0**-6, rtol=1e-6)
    assert new["frozen"] is params["frozen"]


def test_apply_updates_rescales_a_growing_parameter_by_default():
    """A zero-initialised float16 parameter takes its first update's scale; as updates
    accumulate, its data grows with its value (the add rule keeps the larger scale) and
    saturates float16 within 100 steps. The default l2 rescale keeps the data's RMS in
    [1, 2) and the value right."""
    step = jax.jit(js.scalify(optim.apply_updates), static_argnames="rescale")
    update = {"b": js.scaled_array(jnp.linspace(500, 1000, 8, dtype=jnp.float16), 2.0**-30)}
    want = 100 * np.linspace(500, 1000, 8) * 2.0**-30
    for rescale in (None, "l2"):
        params = {"b": js.scaled_array(jnp.zeros(8, jnp.float16), 2.0**-126)}
        for _ in range(100):
            params = step(params, update, rescale=rescale)
        if rescale is None:
            assert relative_error(params["b"], want) > 0.1
        else:
            data = np.asarray(params["b"].data, np.float64)
            assert 1.0 <= np.sqrt(np.mean(data**2)) < 2.0
            assert relative_error(params["b"], want) < 2**-5  # 100 float16 roundings


def test_apply_updates_casts_and_rescales_on_request():
    params = {"w": js.scaled_array(jnp.full(4, 300.0, jnp.float16), 1.0)}
    updates = {"w": jnp.full(4, 2.0, jnp.float16)}
    new = optim.apply_updates(params, updates, dtype=jnp.float8_e4m3fn, rescale="max")["w"]
    assert new.dtype == jnp.float8_e4m3fn and 1.0 <= float(jnp.max(new.data)) < 2.0
    np.testing.assert_allclose(value64(new), 302.0, rtol=2**-3)


def test_promote_plain_is_the_identity_outside_scalify():
    x = jnp.array([1.0, -2.0])
    np.testing.assert_array_equal(jax.jit(promote_plain)(x), x)
    assert float(jax.grad(lambda x: jnp.sum(promote_plain(x) ** 2))(x)[1]) == -4.0
    out = js.scalify(promote_plain)(x * 2.0**-20)
    assert isinstance(out, js.ScaledArray) and float(out.scale) == 2.0**-20


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="rescale"):
        optim.scaled_state(optax.adam(1e-3), rescale="rms")
    with pytest.raises(TypeError, match="floating"):
        optim.scaled_state(optax.adam(1e-3), jnp.int8)
    with pytest.raises(ValueError, match="rescale"):
        optim.apply_updates({"w": jnp.ones(2)}, {"w": jnp.ones(2)}, rescale="mean")


def test_state_keeps_float16_and_the_step_compiles_once_with_float32_gradients():
    """The README's recipe: float32 parameters (hence gradients), float16 state: optax would
    promote Adam's first moment to float32 after one step (a second compilation)."""
    params = init_mlp(jax.random.key(11))
    x, labels = teacher_data(jax.random.key(12))
    opt = optim.scaled_state(optax.adam(1e-3))
    step = jax.jit(js.scalify(make_step(opt, optax.apply_updates)))
    params, state = js.as_scaled_array(params), opt.init(params)
    for _ in range(3):
        params, state, _ = step(params, state, x, labels)
    assert step._cache_size() == 1
    assert all(leaf.dtype == jnp.float16 for leaf in float_state_leaves(state) if leaf.ndim)
