"""js.optim.scaled_state computing in float32: the inner update runs on plain values.

A format with float32's exponent range holds any value a float32 scale can, so the update
needs no scale of its own: the stored state, the gradients and the parameters are unscaled
on the way in (block scales included), optax runs as it would on float32 arrays, and only
storage (and the updates, at scale 1) goes back to ScaledArrays.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FLOAT_DTYPES, compiled_computations, relative_error, scaled_arrays, value64
from hypothesis import given
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled import optim
from jax_scaled.engine.block_dispatch import BlockScaleFallbackWarning
from jax_scaled.optim._storage import centred, computes_plain, unit_scaled

SHAPE = (64, 512)  # 32,768 elements: block storage of 32 along the last axis


def params_of(count):
    keys = jax.random.split(jax.random.key(0), count)
    return {f"w{i}": jax.random.normal(k, SHAPE) * 0.05 for i, k in enumerate(keys)}


def floating_scalar_equations(jaxpr) -> int:
    """0-d floating equations of ``jaxpr``: scale arithmetic, in a scalified program."""
    return sum(
        all(v.aval.ndim == 0 for v in eqn.outvars)
        and any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars)
        for eqn in jaxpr.eqns
    )


def scalar_equations_per_leaf(trace) -> int:
    """Scalar equations ``trace(params)`` adds for one more parameter leaf, from two (with one
    leaf, a value every leaf reads has one reader; with two, scalify computes it once)."""
    two, three = (floating_scalar_equations(trace(params_of(n)).jaxpr) for n in (2, 3))
    return three - two


# Optimizers whose state leaves are shaped like the parameters: stored in blocks, which take
# no scalar arithmetic (a one-element leaf, such as adafactor's unused moment, is re-centred
# by its statistic: a few scalars of storage, not of the update).
INNER = {
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(INNER))
def test_the_update_adds_no_scale_arithmetic_per_parameter(name, dtype):
    """The scalified update of a parameter leaf has as many scalar equations as plain optax's:
    no scale is carried through the inner update. Before, every leaf cost 50 to 80 (the
    scales of Adam's moments, bias corrections and update)."""

    def plain(params):
        opt = INNER[name]()
        return jax.make_jaxpr(opt.update)(params, opt.init(params), params)

    def scalified(params):
        opt = optim.scaled_state(INNER[name](), dtype)
        scaled = js.as_scaled_array(params)
        return jax.make_jaxpr(js.scalify(opt.update))(scaled, opt.init(params), scaled)

    assert scalar_equations_per_leaf(scalified) == scalar_equations_per_leaf(plain)


@pytest.mark.parametrize("exponent", [-20, 0, 20])
@pytest.mark.parametrize("build", ["as_scaled_array", "scaled_array", "quantize", "in_jit"])
def test_float16_state_update_matches_plain_optax_on_the_same_values(build, exponent):
    """Adam on scaled float16 state, gradients at ``2^exponent`` built every way the API
    allows: the updates and the stored state are plain float32 Adam's on the values the
    state and gradients hold, up to float32 rounding and float16 storage of the new state."""
    params = params_of(1)
    raw = {k: jax.random.normal(jax.random.key(1), SHAPE) * 2.0**exponent for k in params}
    grads = {
        "as_scaled_array": lambda: js.as_scaled_array(raw),
        "scaled_array": lambda: jax.tree.map(
            lambda g: js.scaled_array((g * 2.0**-exponent).astype(jnp.float16), 2.0**exponent),
            raw,
        ),
        "quantize": lambda: jax.tree.map(lambda g: js.quantize(g, jnp.float16), raw),
        "in_jit": lambda: jax.jit(lambda t: js.as_scaled_array(t))(raw),
    }[build]()
    opt = optim.scaled_state(optax.adam(1e-3), jnp.float16)
    state = opt.init(params)
    updates, new_state = jax.jit(js.scalify(opt.update))(grads, state, js.as_scaled_array(params))

    plain = optax.adam(1e-3)
    plain_state = jax.tree.map(
        lambda x: js.asarray(x, jnp.float32), state, is_leaf=js.is_scaled_leaf
    )
    want_updates, want_state = jax.jit(plain.update)(js.asarray(grads, jnp.float32), plain_state)
    float32_rounding = 2.0**-22  # XLA may contract a product and a sum differently
    for got, want in zip(optim_leaves(updates), jax.tree.leaves(want_updates), strict=True):
        assert relative_error(got, want) <= float32_rounding, relative_error(got, want)
    half_ulp = 2.0**-11  # float16 storage, rounded to nearest within each block
    for got, want in zip(optim_leaves(new_state), optim_leaves(want_state), strict=True):
        assert relative_error(got, want) <= half_ulp, relative_error(got, want)


def optim_leaves(state):
    return [x for x in js.tree.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]


def test_updates_leave_at_scale_one_outside_scalify():
    """Called outside scalify with ScaledArray gradients, the updates are ScaledArrays (at
    scale 1: their data is the update); with plain gradients, plain arrays."""
    params = params_of(1)
    opt = optim.scaled_state(optax.adam(1e-3), jnp.float16)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: p * 2.0**-20, params)
    scaled, _ = opt.update(js.as_scaled_array(grads), state, params)
    plain, _ = opt.update(grads, state, params)
    assert isinstance(scaled["w0"], js.ScaledArray) and float(scaled["w0"].scale) == 1.0
    assert not isinstance(plain["w0"], js.ScaledArray)
    np.testing.assert_array_equal(scaled["w0"].data, plain["w0"])


def test_block_scaled_value_is_unscaled_without_falling_back():
    """``stop_scaling`` of block-scaled data repeats each block's scale over its elements:
    the exact value, with no warning of a fall back to one scale per tensor."""
    x = jax.random.normal(jax.random.key(2), SHAPE) * jnp.logspace(-6, 6, SHAPE[1])
    q = js.quantize(x, jnp.float16, block_shape=(1, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockScaleFallbackWarning)
        out = jax.jit(js.scalify(lambda v: js.stop_scaling(v, jnp.float32)))(q)
    np.testing.assert_array_equal(out, q.to_array(jnp.float32))


@pytest.mark.parametrize("norm", ["l2", "max", None])
@pytest.mark.parametrize("exponent", [-20, 20])
def test_centred_gives_plain_values_a_scale_from_their_statistic(norm, exponent):
    """A plain value stored by ``centred`` becomes a ScaledArray with data near unit scale
    (its scale in the requested dtype); a ScaledArray keeps its scale when ``norm`` is None."""
    x = jax.random.normal(jax.random.key(3), SHAPE) * 2.0**exponent
    out = jax.jit(js.scalify(lambda v: centred(v, norm, jnp.float8_e8m0fnu)))(x)
    assert isinstance(out, js.ScaledArray) and out.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(value64(out), np.asarray(x, np.float64))
    assert 2.0**-4 <= float(jnp.max(jnp.abs(out.data))) <= 2.0**4
    kept = js.scalify(lambda v: centred(v, None))(js.scaled_array(jnp.ones(4), 2.0**exponent))
    assert float(kept.scale) == 2.0**exponent


def test_unit_scaled_keeps_the_value_at_scale_one():
    x = jax.random.normal(jax.random.key(4), (8,)) * 2.0**-20
    out = js.scalify(lambda v: unit_scaled(v, jnp.float32))(js.as_scaled_array(x))
    assert float(out.scale) == 1.0
    np.testing.assert_array_equal(out.data, x)
    assert unit_scaled(x, jnp.float16).dtype == jnp.float16  # outside scalify: a cast


@pytest.mark.parametrize(
    "dtype, plain",
    [(jnp.float32, True), (jnp.bfloat16, True), (jnp.float16, False), (None, False)],
)
def test_which_compute_dtypes_run_plain(dtype, plain):
    assert computes_plain(dtype) is plain


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_storage_rules_keep_the_value_at_any_scale(dtype, data):
    """``stop_scaling`` (block scales included), ``unit_scaled`` and ``centred`` return the
    float64 value of their operand exactly, at random power-of-two scales over a wide range."""
    x = data.draw(scaled_arrays((8, 64), dtype, min_exp=-60, max_exp=60))
    want = value64(x)
    blocks = js.quantize(x.to_array(jnp.float32), dtype, block_shape=(1, 32))
    for fn, operand in [
        (lambda v: js.stop_scaling(v, jnp.float32), x),
        (lambda v: js.stop_scaling(v, jnp.float32), blocks),
        (lambda v: unit_scaled(v, jnp.float32), x),
        (lambda v: unit_scaled(v, jnp.float32), blocks),
        (lambda v: centred(v, "l2"), x),
        (lambda v: centred(v, "max"), x.to_array(jnp.float32)),
    ]:
        got = jax.jit(js.scalify(fn))(operand)
        np.testing.assert_array_equal(value64(got), value64(operand))
    np.testing.assert_array_equal(value64(blocks), want)


def readers_of_the_gradient(step, *args) -> int:
    """Instructions of ``step``'s compiled program that read the float32 output of its
    weight gradient's contraction (shaped like the parameter)."""
    entry = compiled_computations(step, *args)["ENTRY"]
    shape = f"f32[{SHAPE[0]},{SHAPE[1]}]"
    (dot,) = [line.split(" = ")[0] for line in entry if f"= {shape}" in line and " dot(" in line]
    return sum(f"{dot}," in line or f"{dot})" in line for line in entry)


def test_a_plain_gradient_is_computed_once_for_the_update_s_readers():
    """The plain float32 gradient the inner update reads (float16 data times its scale) is
    stored once: XLA computed it again, with the range-guarded gradient's own arithmetic, in
    every kernel of the update that read it (the global norm, the two moments)."""
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    opt = optim.scaled_state(inner, jnp.float16)
    x = js.as_scaled_array(jax.random.normal(jax.random.key(2), (32, SHAPE[0]), jnp.float16))
    dy = js.as_scaled_array(jax.random.normal(jax.random.key(3), (32, SHAPE[1]), jnp.float16))
    params = params_of(1)

    def step(params, state, x, dy):
        grads = {"w0": x.T @ dy}  # a float16 contraction, range-guarded
        return opt.update(grads, state, params)

    scaled = js.as_scaled_array(params)
    readers = readers_of_the_gradient(js.scalify(step), scaled, opt.init(params), x, dy)
    assert readers == 2  # the range guard's reduction, and the kernel storing the gradient
