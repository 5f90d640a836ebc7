"""Constants that a narrow trace rounds away (``eps=1e-8`` in float16) are recovered.

JAX gives a Python number the dtype of the array it meets while it traces: in a float16
program ``1e-8`` becomes ``0.0`` and ``1e5`` becomes ``inf``. scalify traces the function a
second time on float32 inputs and takes those constants' values from there
(:mod:`jax_scaled.engine.constants`). These tests check the values against a float64 reference of
the program as written, at random power-of-two input scales, in every narrow float format.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HOW, assert_close, built, random_data, reference64, scaled_arrays, value64
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled.engine import constants

# bfloat16 has float32's exponent range: no constant that float32 holds is rounded away there.
NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


@st.composite
def rounded_away_constants(draw, dtype) -> float:
    """A constant below the smallest subnormal of ``dtype`` (or above its largest value), such
    that its square stays within float32's range (scales are float32)."""
    info = jnp.finfo(dtype)
    tiny_exponent = int(np.log2(float(info.smallest_subnormal))) - 1
    huge_exponent = int(np.log2(float(info.max))) + 2
    exponent = draw(
        st.one_of(st.integers(-60, tiny_exponent), st.integers(huge_exponent, huge_exponent + 30))
    )
    mantissa = draw(st.sampled_from([1.0, 1.25, 1.5, -1.75, 1.1]))
    return mantissa * 2.0**exponent


PROGRAMS = {
    "add": lambda x, c: x + c,
    "mul": lambda x, c: x * c,
    "div": lambda x, c: x / c,
    "sqrt_plus_eps": lambda x, c: jnp.sqrt(jnp.abs(x)) + abs(c),
    "maximum": lambda x, c: jnp.maximum(jnp.abs(x), abs(c)),
    "where": lambda x, c: jnp.where(x > 0, x, c),
    "full_like": lambda x, c: x * 0.5 + jnp.full_like(x, c),
    "folded": lambda x, c: x + c * c / c,
}


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_rounded_away_constants_keep_their_value(name, dtype, data):
    constant = data.draw(rounded_away_constants(dtype))
    # The input at the constant's magnitude: where the constant matters to the result.
    exponent = int(np.floor(np.log2(abs(constant))))
    x = data.draw(scaled_arrays((6,), dtype, min_exp=exponent - 2, max_exp=exponent + 2))

    def fn(x):
        return PROGRAMS[name](x, constant)

    out = jax.jit(js.scalify(fn))(x)
    expected = reference64(fn, x)
    assert np.all(np.isfinite(value64(out)))
    assert_close(out, expected, dtype, ulps=8, normwise=True)


def test_eps_below_float16_range_changes_adam_like_update():
    """``g / (sqrt(v) + 1e-8)`` at gradient scale 2^-20: eps is 6% of sqrt(v), and float16
    rounds it to 0 (the raw trace computes another function)."""

    def update(g, v):
        return g / (jnp.sqrt(v) + 1e-8)

    g = js.ScaledArray(jnp.full((4,), 1.0, jnp.float16), jnp.float32(2.0**-24))
    v = js.ScaledArray(jnp.full((4,), 1.0, jnp.float16), jnp.float32(2.0**-48))
    out = js.asarray(jax.jit(js.scalify(update))(g, v), jnp.float32)
    expected = 2.0**-24 / (2.0**-24 + 1e-8)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-3)
    assert abs(expected - 1.0) > 0.05


def test_genuine_zeros_stay_zero():
    """A ReLU's 0 is 0 in the float32 trace too: nothing changes."""
    x = js.ScaledArray(jnp.array([-1.0, 2.0], jnp.float16), jnp.float32(2.0**-20))
    out = jax.jit(js.scalify(jax.nn.relu))(x)
    np.testing.assert_array_equal(value64(out), [0.0, 2.0**-19])


def test_float32_programs_are_traced_once():
    traces = []

    def fn(x):
        traces.append(x.dtype)
        return x + 1e-30

    js.scalify(fn)(js.as_scaled_array(jnp.ones(2, jnp.float32)))
    assert traces == [jnp.float32]
    js.scalify(fn)(js.as_scaled_array(jnp.ones(2, jnp.float16)))
    assert traces[1:] == [jnp.float16, jnp.float32]  # the narrow program, then its float32 twin


def test_programs_without_rounded_constants_are_traced_once():
    traces = []

    def fn(x):
        traces.append(x.dtype)
        return x * 2.0 + 1.0

    js.scalify(fn)(js.as_scaled_array(jnp.ones(2, jnp.float16)))
    assert traces == [jnp.float16]


def test_typed_keys_and_integer_inputs_are_left_alone():
    def fn(x, key, n):
        return x * jax.random.uniform(key, x.shape, x.dtype) + n.astype(x.dtype) * 1e-9

    x = js.as_scaled_array(jnp.ones(3, jnp.float16))
    out = jax.jit(js.scalify(fn))(x, jax.random.key(0), jnp.int32(1))
    assert np.all(np.isfinite(value64(out)))


def test_unmatched_constant_warns_with_its_source_line():
    """A program whose float32 trace has another structure: its constant cannot be checked."""

    def fn(x):
        if x.dtype == jnp.float16:
            x = jnp.sin(x)  # only in the narrow program: the equations do not line up
            return jnp.exp(x) + 1e-9
        return jnp.cos(x)

    x = js.as_scaled_array(jnp.ones(3, jnp.float16))
    with pytest.warns(constants.ConstantPrecisionWarning, match="test_constants.py"):
        js.scalify(fn)(x)


def test_matched_program_does_not_warn():
    x = js.as_scaled_array(jnp.ones(3, jnp.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", constants.ConstantPrecisionWarning)
        js.scalify(lambda x: jnp.maximum(x, 0.0) + 1e-9)(x)


def test_constant_cast_into_narrow_dtype_keeps_its_range():
    """``jnp.where(m, x, 1e-8)`` passes 1e-8 as a float32 operand of a nested jit that casts
    it to float16 (0 there): the cast of a constant keeps its exponent under scalify."""
    x = js.ScaledArray(jnp.array([1.0, -1.0], jnp.float16), jnp.float32(2.0**-27))
    out = jax.jit(js.scalify(lambda x: jnp.where(x > 0, x, 1e-8)))(x)
    np.testing.assert_allclose(value64(out), [2.0**-27, 1e-8], rtol=1e-3)


def test_rounded_to_precision_keeps_the_exponent():
    assert constants.rounded_to_precision(1e-8, jnp.float16) == pytest.approx(1e-8, rel=1e-3)
    assert constants.rounded_to_precision(1e6, jnp.float16) == pytest.approx(1e6, rel=1e-3)
    assert constants.rounded_to_precision(0.1, jnp.float16) == float(np.float16(0.1))


def sliced_and_gathered(x):
    """The structure of a GPT's attention and embedding: a split, an indexed slice, a take
    and a dynamic slice, whose transposes pad and fill with zeros of the narrow dtype."""
    first, _ = jnp.split(x, 2)
    rows = jnp.take(x, jnp.array([0, 3, 3]), axis=0)
    window = jax.lax.dynamic_slice(x, (1, 0), (2, x.shape[1]))
    return jnp.sum(x[:, 1] * first[0]) + jnp.sum(rows**2) + jnp.sum(window**2)


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20], ids=["2^-20", "2^20"])
@pytest.mark.parametrize("how", HOW)
def test_zeros_written_by_differentiation_need_no_float32_trace(how, scale):
    # A 4-layer GPT in float16 had only these zeros to recover, and its float32 trace was
    # 40% of its step's trace (1.3 s of 3.2 s with js.dot_formats).
    traces = []

    def fn(x):
        traces.append(x.dtype)
        return sliced_and_gathered(x)

    values = jnp.asarray(random_data(21, (4, 4), jnp.float32))
    x = built(how, values, jnp.float16, scale)
    grad = jax.jit(js.scalify(jax.grad(fn)))(x)
    assert traces == [jnp.float16]
    want = jax.grad(sliced_and_gathered)(np.asarray(value64(x), np.float64))
    assert_close(grad, want, jnp.float16)


def test_a_user_s_fill_beside_differentiation_zeros_is_still_recovered():
    """``jnp.full`` of 1e-8 (0 in float16) in a program whose backward pass also pads: the
    user's fill names jax.lax's ``full``, and the float32 trace still gives its value."""
    traces = []

    def fn(x):
        traces.append(x.dtype)
        return jnp.sum(x[1:] ** 2 * jnp.full((3, 4), 1e-8, x.dtype))

    x = js.ScaledArray(jnp.ones((4, 4), jnp.float16), jnp.float32(2.0**-20))
    grad = jax.jit(js.scalify(jax.grad(fn)))(x)
    assert traces == [jnp.float16, jnp.float32]
    want = np.zeros((4, 4))
    want[1:] = 2.0**-19 * 1e-8  # the gradient's rows padded by a zero row
    np.testing.assert_allclose(value64(grad), want, rtol=2.0**-10)


CONSTANT_OUTPUTS = {
    # The gradient of a linear term is its coefficient everywhere: no input reaches it.
    "grad_of_linear": lambda x, c: jax.grad(lambda y: jnp.sum(y * c))(x),
    "fill_beside_input": lambda x, c: (x, jnp.full_like(x, c)),
    "folded_zeros_plus_c": lambda x, c: jnp.zeros_like(x) + c * 0.5,
}


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", sorted(CONSTANT_OUTPUTS))
@pytest.mark.parametrize("how", HOW)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_an_output_that_is_a_rounded_away_constant_keeps_its_value(how, name, dtype, data):
    """``jax.grad(lambda x: jnp.sum(x * 1e-8))`` of a float16 ScaledArray is ``1e-8`` (a
    ScaledArray), not float16's 0: an output computed from constants alone was returned as
    the narrow program's rounded array."""
    constant = data.draw(rounded_away_constants(dtype))
    scale = data.draw(st.sampled_from([2.0**-20, 2.0**20]))
    x = built(how, jnp.asarray(random_data(3, (256,), jnp.float32)), dtype, scale)

    def fn(x):
        return CONSTANT_OUTPUTS[name](x, constant)

    is_scaled = lambda v: isinstance(v, js.ScaledArray)  # noqa: E731
    outs = jax.tree.leaves(jax.jit(js.scalify(fn))(x), is_leaf=is_scaled)
    wants = jax.tree.leaves(CONSTANT_OUTPUTS[name](value64(x), constant))
    for out, want in zip(outs, wants, strict=True):
        assert out.dtype == dtype
        assert_close(out, want, dtype)


def test_a_plain_call_keeps_a_plain_constant_output():
    """Without a ScaledArray argument scalify runs the program as it is: its outputs stay the
    arrays the program computes, rounded constants included (as jax.grad gives them)."""
    out = js.scalify(jax.grad(lambda y: jnp.sum(y * 1e-8)))(jnp.ones(4, jnp.float16))
    assert not isinstance(out, js.ScaledArray)
    np.testing.assert_array_equal(out, np.zeros(4, np.float16))
