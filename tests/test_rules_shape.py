"""Scale rules for shape primitives (reshape, transpose, slice, concatenate, split, pad, ...).

Related front-ends share one jitted function per example (a dict of outputs), to keep the
number of compilations small; failures name the output that disagrees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    HOW,
    all_eqns,
    built,
    check_e8m0_matches,
    check_named,
    covering,
    random_data,
    scaled_arrays,
    shapes,
    value64,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend.core import Literal

import jax_scaled as js

few = settings(max_examples=max(3, settings.default.max_examples // 3))


def _data_movement(x):
    """Every pure data-movement front-end on ``x``: each must be bit exact."""
    n = x.ndim
    return {
        "reshape": x.reshape(-1),
        "transpose": jnp.transpose(x),
        "moveaxis": jnp.moveaxis(x, 0, -1),
        "slice": x[1:][..., ::2],
        "lax.slice": lax.slice(x, (0,) * n, x.shape, (2,) * n),
        "squeeze": jnp.squeeze(x[None], 0),
        "expand_dims": jnp.expand_dims(x, -1),
        "broadcast_to": jnp.broadcast_to(x, (2, *x.shape)),
        "flip": jnp.flip(x),
        "tile": jnp.tile(x, 2),
        "repeat": jnp.repeat(x, 2, axis=0),
        "lax.rev": lax.rev(x, (0,)),
        "split": jnp.split(x, [1], axis=-1),
        "array_split": jnp.array_split(x, 2, axis=0),
        "pad": jnp.pad(x, 2),
        "pad_edge": jnp.pad(x, ((1, 0),) * n, mode="edge"),
        "pad_reflect": jnp.pad(x, 2, mode="reflect"),
        "pad_wrap": jnp.pad(x, 3, mode="wrap"),
        "lax.pad": lax.pad(x, jnp.zeros((), x.dtype), [(2, -1, 1)] + [(0, 1, 0)] * (n - 1)),
    }


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_data_movement_bit_exact(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes(max_side=4)), dtype))
    out = check_named(_data_movement, [x], dtype, ulps=0)
    for y in js.tree.tree_leaves(out):
        assert y.scale == x.scale  # the scale passes through untouched


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_concatenate_aligns_to_largest_scale(dtype, data):
    shape = data.draw(shapes(max_dims=2))
    small = data.draw(scaled_arrays(shape, dtype, min_exp=-40, max_exp=-20))
    large = data.draw(scaled_arrays(shape, dtype, min_exp=20, max_exp=40))
    y = js.ScaledArray(small.data[::-1], small.scale * 2.0 ** data.draw(st.integers(-3, 3)))
    plain = data.draw(scaled_arrays(shape, dtype, min_exp=0, max_exp=0)).data  # scale 1

    def fn(small, large, y, plain):
        return {
            "far_apart": jnp.concatenate([small, large, jnp.zeros_like(small)], axis=0),
            "close": lax.concatenate([small, y], dimension=small.ndim - 1),
            "with_plain": jnp.hstack([small, plain]),
        }

    # The smaller operands round once at the common scale: compare against the largest value.
    out = check_named(fn, [small, large, y, plain], dtype, ulps=1, normwise=True)
    assert out["far_apart"].scale == large.scale
    far_apart = value64(out["far_apart"])  # the operand at the common scale moves bit for bit
    np.testing.assert_array_equal(far_apart[shape[0] : 2 * shape[0]], value64(large))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_stack_aligns_and_unstack_keeps_the_scale(dtype, data):
    shape = data.draw(shapes(max_dims=2))
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))

    def fn(x, y):
        return {"stack": jnp.stack([x, y], axis=-1), "unstack": jnp.unstack(x, axis=0)}

    out = check_named(fn, [x, y], dtype, ulps=1, normwise=True)
    assert float(out["stack"].scale) == max(float(x.scale), float(y.scale))
    for i, piece in enumerate(out["unstack"]):  # bit exact, at x's scale
        assert piece.scale == x.scale
        np.testing.assert_array_equal(value64(piece), value64(x)[i])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data(), value=st.sampled_from([3.0, -0.375, 1e4, -jnp.inf, jnp.nan]))
def test_pad_nonzero_value(dtype, data, value):
    x = data.draw(scaled_arrays(data.draw(shapes(max_dims=2)), dtype))
    fn = lambda x: {"pad": jnp.pad(x, ((1, 2),) * x.ndim, constant_values=value)}  # noqa: E731
    # A pad value far above x's scale raises the common scale: x rounds relative to it.
    out = check_named(fn, [x], dtype, ulps=1, normwise=True)
    assert float(out["pad"].scale) >= float(x.scale)


def test_pad_value_above_operand_raises_scale_instead_of_overflowing():
    x = js.scaled_array(jnp.ones((3,), jnp.float16), 2.0**-12)
    out = jax.jit(js.scalify(lambda x: jnp.pad(x, 1, constant_values=1.5 * 2**12)))(x)
    assert float(out.scale) == 2.0**12  # at x's scale the pad value, 1.5 * 2^24, overflows
    np.testing.assert_array_equal(value64(out), [1.5 * 2**12] + [2.0**-12] * 3 + [1.5 * 2**12])


def test_pad_with_zero_literal():
    """``lax.pad(x, 0.0, ...)``: the zero literal is promoted at x's scale."""
    x = js.scaled_array(jnp.array([1.0, -2.0], jnp.float32), 2.0**-20)
    out = jax.jit(js.scalify(lambda x: lax.pad(x, 0.0, [(1, 1, 1)])))(x)
    assert float(out.scale) == 2.0**-20
    np.testing.assert_array_equal(value64(out), [0, 2.0**-20, 0, -(2.0**-19), 0])


@pytest.mark.parametrize(
    "fill",
    [lambda x: 0.0, lambda x: jnp.zeros((), x.dtype), lambda x: -jnp.inf, lambda x: jnp.nan],
    ids=["literal zero", "traced zero", "-inf", "nan"],
)
def test_pad_with_a_value_of_any_scale_stages_the_pad_alone(fill):
    """A padding value that is the same at every scale (or a promoted zero at the operand's
    scale) pads the data as it is: no scale is worked out, no data rescaled."""
    x = js.scaled_array(jnp.array([1.0, -2.0], jnp.float16), 2.0**-20)
    pad = lambda x: lax.pad(x, jnp.asarray(fill(x), x.dtype), [(1, 2, 1)])  # noqa: E731
    jaxpr = jax.make_jaxpr(js.scalify(pad))(x).jaxpr
    staged = [e.primitive.name for e in jaxpr.eqns if e.primitive.name != "broadcast_in_dim"]
    assert staged == ["pad"]
    out = jax.jit(js.scalify(pad))(x)
    assert float(out.scale) == 2.0**-20
    np.testing.assert_array_equal(value64(out), value64(jax.jit(pad)(js.asarray(x, jnp.float32))))


@pytest.mark.parametrize(
    ("how", "dtype", "scale"),
    covering(HOW, [(jnp.float16, 2.0**-20), (jnp.float16, 2.0**20), (jnp.float32, 2.0**-3)]),
)
def test_gradients_of_attention_slices_pad_exactly_at_their_scale(how, dtype, scale):
    """The gradient of slicing ``q, k, v`` out of a fused projection (a transformer's
    ``qkv[:, :, i]``) is a pad of each slice's cotangent with a zero literal: exact, one
    ``pad`` each (49k elements, the value built every way)."""
    qkv = built(how, random_data(0, (8, 64, 3, 32), jnp.float32), dtype, scale)

    def loss(qkv):
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return 0.5 * jnp.sum(q * q) + jnp.sum(k) * 0.0 + 0.5 * jnp.sum(v * v)

    grad = js.scalify(jax.grad(loss))
    pads = [e for e in all_eqns(jax.make_jaxpr(grad)(qkv).jaxpr) if e.primitive.name == "pad"]
    assert len(pads) == 3 and all(isinstance(e.invars[1], Literal) for e in pads)
    expected = value64(qkv) * np.array([1.0, 0.0, 1.0])[:, None]  # d/dq = q, d/dv = v
    np.testing.assert_array_equal(value64(jax.jit(grad)(qkv)), expected)


@few  # bit identity does not depend on the values drawn
@given(data=st.data())
def test_shape_rules_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((3, 4), jnp.float16))
    y = data.draw(scaled_arrays((2, 4), jnp.float16))

    def fn(x, y):
        joined = jnp.concatenate([x, y, jnp.zeros_like(y)], axis=0)
        return jnp.pad(joined, 1, constant_values=0.75), jnp.pad(x.T, 2, mode="reflect")

    check_e8m0_matches(fn, [x, y])


def test_optimization_barrier_keeps_scaled_values():
    x = js.scaled_array(jnp.array([1.0, -2.0], jnp.float16), 2.0**-20)
    y = jnp.arange(3.0)
    out_x, out_y = jax.jit(js.scalify(lambda x, y: jax.lax.optimization_barrier((x, y))))(x, y)
    assert isinstance(out_x, js.ScaledArray) and float(out_x.scale) == 2.0**-20
    np.testing.assert_array_equal(out_x.data, x.data)
    np.testing.assert_array_equal(out_y, y)
