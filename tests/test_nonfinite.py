"""Non-finite training steps: skipping them (js.optim.skip_nonfinite) and finding the operation
that produced the first inf or NaN (js.diagnostics.first_nonfinite)."""

import linecache

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled as js
from jax_scaled import optim

STEPS, BAD_STEP, LR = 20, 5, 3e-3


# -- a regression MLP (64 -> 512 -> 10) and 20 batches, one with an inf ----------------------


def init_mlp(key, sizes=(64, 512, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)}
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def mse(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def batches(n=STEPS, batch=32, features=64, classes=10):
    """A linear teacher's batches; batch ``BAD_STEP`` has one ``inf`` input."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n, batch, features))
    y = x @ (jax.random.normal(kw, (features, classes)) / 8)
    return x.at[BAD_STEP, 3, 7].set(jnp.inf), y


def make_step(opt, scalified=True):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(mse)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(js.scalify(step) if scalified else step)


def train(opt, state, scalified=True, on_step=None):
    """``STEPS`` steps from the same initial parameters; returns parameters, state, losses."""
    params = init_mlp(jax.random.key(0))
    params = js.as_scaled_array(params) if scalified else params
    step, (xs, ys) = make_step(opt, scalified), batches()
    losses = []
    for i in range(STEPS):
        x = js.as_scaled_array(xs[i]) if scalified else xs[i]
        new_params, new_state, loss = step(params, state, x, ys[i])
        if on_step:
            on_step(i, (params, state), (new_params, new_state))
        params, state = new_params, new_state
        losses.append(float(js.asarray(loss)))
    return params, state, np.array(losses)


def all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(js.asarray(x)))) for x in js.tree.tree_leaves(tree))


def bits(tree):
    """Every array of ``tree`` (a ScaledArray's data and scale separately) as bytes."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# -- skip_nonfinite ---------------------------------------------------------------------------


def readme_state(opt):
    """The README recipe: optax state cast once to scaled float16."""
    return js.tree.astype(js.as_scaled_array(opt.init(init_mlp(jax.random.key(0)))), jnp.float16)


def test_without_skipping_one_inf_batch_makes_every_parameter_nan():
    opt = optim.scaled_state(optax.adam(LR))
    params, _, losses = train(opt, opt.init(init_mlp(jax.random.key(0))))
    assert np.isfinite(losses[:BAD_STEP]).all() and np.isnan(losses[BAD_STEP:]).all()
    assert not all_finite(params)


def plain_init(opt):
    return opt.init(init_mlp(jax.random.key(0)))


CONFIGS = {  # optimizer, initial state
    "readme_cast_state": (lambda: optim.skip_nonfinite(optax.adam(LR)), readme_state),
    "scaled_state": (
        lambda: optim.scaled_state(optim.skip_nonfinite(optax.adam(LR))),
        plain_init,
    ),
}


def test_skip_nonfinite_refuses_to_wrap_scaled_state():
    with pytest.raises(ValueError, match=r"scaled_state\(skip_nonfinite\(opt\)\)"):
        optim.skip_nonfinite(optim.scaled_state(optax.adam(LR)))


def build(name):
    make_opt, make_state = CONFIGS[name]
    opt = make_opt()
    return opt, make_state(opt)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_skip_nonfinite_skips_the_bad_step_and_training_goes_on(name):
    opt, state = build(name)
    counts = []

    def check(i, before, after):
        counts.append(int(after[1].notfinite_count))
        if i == BAD_STEP:  # skipped: parameters and inner state unchanged, bit for bit
            assert bits(after[0]) == bits(before[0])
            assert bits(after[1].inner_state) == bits(before[1].inner_state)
        else:
            assert bits(after[0]) != bits(before[0])

    params, state, losses = train(opt, state, on_step=check)
    assert counts == [int(i == BAD_STEP) for i in range(STEPS)]
    assert int(state.total_notfinite) == 1 and bool(state.last_finite)
    assert all_finite(params) and all_finite(state)
    assert not np.isfinite(losses[BAD_STEP])
    assert np.isfinite(np.delete(losses, BAD_STEP)).all()
    assert losses[-3:].mean() < 0.5 * losses[BAD_STEP - 1] < losses[0]
    moments = [x for x in js.tree.tree_leaves(state) if getattr(x, "ndim", 0) == 2]
    assert moments and all(x.dtype == jnp.float16 for x in moments)  # the state stays FP16


def test_skip_nonfinite_in_plain_jax_matches_apply_if_finite():
    plain = optax.apply_if_finite(optax.adam(LR), 5)
    ours = optim.skip_nonfinite(optax.adam(LR))
    params = init_mlp(jax.random.key(0))
    expected, _, expected_losses = train(plain, plain.init(params), scalified=False)
    got, state, losses = train(ours, ours.init(params), scalified=False)
    assert bits(got) == bits(expected)
    np.testing.assert_array_equal(losses, expected_losses)
    assert int(state.total_notfinite) == 1


def test_skip_nonfinite_outside_scalify_on_scaled_arrays():
    opt = optim.scaled_state(optim.skip_nonfinite(optax.sgd(0.1, momentum=0.9)))
    params = {"w": jnp.ones((4, 8))}
    state = opt.init(params)
    bad = js.as_scaled_array({"w": jnp.ones((4, 8)).at[0, 0].set(jnp.nan)})
    updates, new_state = opt.update(bad, state, js.as_scaled_array(params))
    assert isinstance(updates["w"], js.ScaledArray)  # scaled gradients, scaled updates
    assert not jnp.any(js.asarray(updates["w"]))
    assert int(new_state.notfinite_count) == 1
    assert bits(new_state.inner_state) == bits(state.inner_state)
    plain_updates, _ = jax.jit(opt.update)(js.asarray(bad), state)  # plain gradients
    assert isinstance(plain_updates["w"], jax.Array)


def test_skip_nonfinite_applies_the_update_after_max_consecutive_errors():
    opt = optim.skip_nonfinite(optax.sgd(1.0), max_consecutive_errors=2)
    state = opt.init({"w": jnp.ones(2)})
    applied = []
    for _ in range(4):
        updates, state = opt.update({"w": jnp.array([jnp.nan, 1.0])}, state)
        applied.append(bool(jnp.any(updates["w"] != 0)))
    assert applied == [False, False, True, True]
    assert int(state.total_notfinite) == 4


# -- first_nonfinite: which operation made the first inf / NaN --------------------------------


def small_step(loss_fn):
    params = js.as_scaled_array(init_mlp(jax.random.key(0), sizes=(16, 32, 4)))

    @jax.jit
    @js.scalify
    def step(params, x, y):
        return jax.value_and_grad(loss_fn)(params, x, y)

    return params, step


def recorded(fn, *args):
    with js.diagnostics.record_scales() as records:
        jax.block_until_ready(fn(*args))
    return records


def source_text(record):
    return linecache.getline(record.location.file, record.location.line)


def test_first_nonfinite_names_the_first_operation_that_sees_an_inf_input():
    params, step = small_step(mse)
    x = jax.random.normal(jax.random.key(2), (8, 16)).at[2, 5].set(jnp.inf)
    records = recorded(step, params, js.as_scaled_array(x), jnp.zeros((8, 4)))
    first = js.diagnostics.first_nonfinite(records)
    assert (first.primitive, first.backward) == ("dot_general", False)
    assert first.location.file == __file__ and "x @ layer" in source_text(first)
    assert records.index(first) == min(i for i, r in enumerate(records) if not r.finite)
    assert js.diagnostics.worst(records)[0] is first
    table = js.diagnostics.format_records(records).splitlines()
    assert [line for line in table if "FIRST NON-FINITE" in line] == [
        table[1 + records.index(first)]
    ]
    assert "FIRST NON-FINITE" in js.diagnostics.format_records(records, group_by="source")


def log_loss(params, x, y):
    return -jnp.mean(y * jnp.log(mlp(params, x)))  # mlp's outputs can be negative


def test_first_nonfinite_names_log_of_a_negative_number():
    params, step = small_step(log_loss)
    x = jax.random.normal(jax.random.key(2), (8, 16))
    records = recorded(step, params, js.as_scaled_array(x), jnp.ones((8, 4)))
    first = js.diagnostics.first_nonfinite(records)
    assert (first.primitive, first.backward, first.nans > 0) == ("log", False, True)
    assert "jnp.log" in source_text(first)


def test_first_nonfinite_is_none_for_a_finite_step():
    x = js.as_scaled_array(jnp.linspace(-1.0, 1.0, 8))
    records = recorded(jax.jit(js.scalify(lambda x: jnp.tanh(x @ x) * x)), x)
    assert records and js.diagnostics.first_nonfinite(records) is None
    assert "FIRST NON-FINITE" not in js.diagnostics.format_records(records)


def test_first_nonfinite_can_pass_over_intentional_infinities():
    def masked_softmax(x):
        masked = jnp.where(jnp.arange(8) < 6, x, -jnp.inf)  # an attention-style mask
        return jax.nn.softmax(masked) * jnp.log(x)

    x = js.as_scaled_array(jnp.linspace(-1.0, 1.0, 8))
    records = recorded(jax.jit(js.scalify(masked_softmax)), x)
    assert js.diagnostics.first_nonfinite(records).primitive == "select_n"
    assert js.diagnostics.first_nonfinite(records, nans_only=True).primitive == "log"
