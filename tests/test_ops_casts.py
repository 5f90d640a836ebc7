"""Casts on one pass (js.ops.cast_on_*, reduce_precision_on_*) vs ml_dtypes references."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_data, value64
from jax import lax

import jax_scaled as js
from jax_scaled import ops

FORMATS = [
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e3m4,
    jnp.float4_e2m1fn,
    jnp.float16,
    jnp.bfloat16,
]
FP8_SCALIFY_FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn]
BACKWARD_OPS = [ops.cast_on_backward, ops.reduce_precision_on_backward]


def probe(fmt) -> np.ndarray:
    """float32 values exercising ``fmt``: random magnitudes, its edges, specials."""
    info = ml_dtypes.finfo(fmt)
    big, tiny = float(info.max), float(info.smallest_subnormal)
    edges = [big, big * 1.03, big * 1.07, big * 2]
    if tiny >= np.finfo(np.float32).smallest_normal:  # XLA CPU flushes float32 subnormals
        edges += [tiny * 0.4, tiny * 0.6, tiny * 1.5]
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan]
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(64) * 2.0 ** rng.integers(-20, 20, 64)
    values = np.concatenate([spread, edges, np.negative(edges), specials])
    with np.errstate(over="ignore"):
        return values.astype(np.float32)


def expected(x: np.ndarray, fmt, saturate: bool) -> np.ndarray:
    """ml_dtypes cast of ``x`` to ``fmt`` (clipped to the finite range first if saturating)."""
    if saturate:
        big = np.float32(ml_dtypes.finfo(fmt).max)
        x = np.where(np.isnan(x), x, np.clip(x, -big, big))
    with np.errstate(over="ignore"):  # overflow to inf is what is being checked
        return np.asarray(x).astype(jnp.dtype(fmt))


def assert_identical(got, want) -> None:
    """Same values bit for bit (NaN matches NaN, -0 matches -0)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


# --- forward values ------------------------------------------------------------------------


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_on_forward_matches_ml_dtypes(fmt, saturate):
    x = probe(fmt)
    y = jax.jit(functools.partial(ops.cast_on_forward, dtype=fmt, saturate=saturate))(x)
    assert y.dtype == jnp.dtype(fmt)
    assert_identical(y, expected(x, fmt, saturate))


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reduce_precision_on_forward_matches_ml_dtypes_round_trip(fmt, saturate):
    x = probe(fmt)
    cast = functools.partial(ops.reduce_precision_on_forward, dtype=fmt, saturate=saturate)
    y = jax.jit(cast)(x)
    assert y.dtype == x.dtype
    assert_identical(y, expected(x, fmt, saturate).astype(np.float32))


def test_overflow_semantics_by_format():
    """Without saturation each format does what it defines; with it, the largest value."""
    big = np.float32(1e6)
    got = {f: float(ops.cast_on_forward(big, f)) for f in FORMATS}
    assert np.isnan(got[jnp.float8_e4m3fn]) and np.isnan(got[jnp.float8_e5m2fnuz])
    assert got[jnp.float8_e5m2] == np.inf and got[jnp.float16] == np.inf
    assert got[jnp.float4_e2m1fn] == 6.0  # no inf nor NaN: ml_dtypes saturates
    for fmt in FORMATS:
        largest = ml_dtypes.finfo(fmt).max
        beyond = [np.inf, 2 * float(largest)] if fmt != jnp.bfloat16 else [np.inf]
        for value in beyond:
            assert float(ops.cast_on_forward(np.float32(value), fmt, saturate=True)) == largest


def test_lax_reduce_precision_differs_where_documented():
    """Why reduce_precision_on_* cast round trip instead of lax.reduce_precision."""
    x = jnp.array([300.0, 1e-5], jnp.float32)
    e4m3 = lax.reduce_precision(x[:1], exponent_bits=4, mantissa_bits=3)
    e5m2 = lax.reduce_precision(x[1:], exponent_bits=5, mantissa_bits=2)
    assert float(e4m3[0]) == np.inf and float(e5m2[0]) == 0.0
    assert float(ops.reduce_precision_on_forward(x[0], jnp.float8_e4m3fn)) == 288.0
    assert float(ops.reduce_precision_on_forward(x[1], jnp.float8_e5m2)) == 2.0**-16


# --- the other pass is untouched -----------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_ops_leave_the_backward_pass_untouched(fmt):
    x = probe(fmt)[:-5]  # finite values, some beyond the format's range
    w = random_data(1, x.shape, jnp.float32)  # not representable in fmt
    rounded = functools.partial(ops.reduce_precision_on_forward, dtype=fmt, saturate=True)
    grad = jax.grad(lambda x: jnp.sum(rounded(x) * w))(x)
    np.testing.assert_array_equal(np.asarray(grad), w)  # straight-through, clip included
    y, vjp = jax.vjp(lambda x: ops.cast_on_forward(x, fmt, saturate=True), x)
    cotangent = np.asarray(random_data(2, x.shape, jnp.float32)).astype(jnp.dtype(fmt))
    (back,) = vjp(jnp.asarray(cotangent))
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(back), cotangent.astype(np.float32))


def test_lax_reduce_precision_would_round_the_backward_pass():
    """The baseline: without the custom derivative the cotangent is rounded too."""
    w = random_data(3, (8,), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(lax.reduce_precision(x, 5, 2) * w))(jnp.ones(8))
    assert not np.array_equal(np.asarray(grad), w)


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_backward_ops_round_the_cotangent_only(fmt, op, saturate):
    x = random_data(4, (72,), jnp.float32)  # not representable in fmt
    w = probe(fmt)[:72]  # the cotangent: finite, some beyond the format's range
    y, vjp = jax.vjp(lambda x: op(x, fmt, saturate=saturate), jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(y), x)
    (grad,) = vjp(jnp.asarray(w))
    assert grad.dtype == jnp.float32
    assert_identical(grad, expected(w, fmt, saturate).astype(np.float32))


def test_forward_mode_tangents():
    x, t = jnp.array([1.1, 3.3]), jnp.array([0.3, 0.7])
    _, tangent = jax.jvp(lambda x: ops.reduce_precision_on_forward(x, jnp.float8_e5m2), (x,), (t,))
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(t))
    _, tangent = jax.jvp(lambda x: ops.cast_on_forward(x, jnp.float16), (x,), (t,))
    assert tangent.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(tangent), np.asarray(t).astype(np.float16))


def test_casts_compose_with_jit_and_vmap():
    x = random_data(5, (3, 4), jnp.float32)
    y = jax.jit(jax.vmap(lambda x: ops.cast_on_forward(x, jnp.float8_e5m2, saturate=True)))(x)
    assert_identical(y, expected(x, jnp.float8_e5m2, True))
    z = jax.vmap(lambda x: ops.cast_on_backward(x, jnp.float8_e5m2))(x)
    np.testing.assert_array_equal(np.asarray(z), x)


def test_casts_refuse_non_float_formats():
    for op in [ops.cast_on_forward, ops.reduce_precision_on_forward, *BACKWARD_OPS]:
        with pytest.raises(TypeError, match="floating-point"):
            op(jnp.ones(2), jnp.int8)


# --- under scalify: the data is quantised at its scale ---------------------------------------


def unit_data(seed: int, shape=(4, 8)) -> jnp.ndarray:
    return jnp.asarray(random_data(seed, shape, jnp.float32))


@pytest.mark.parametrize("fmt", FP8_SCALIFY_FORMATS)
def test_scaled_cast_on_forward_casts_data_and_keeps_scale(fmt):
    x = js.ScaledArray(unit_data(6), jnp.float32(2.0**-40))
    y = jax.jit(js.scalify(lambda x: ops.cast_on_forward(x, fmt)))(x)
    assert isinstance(y, js.ScaledArray) and y.dtype == jnp.dtype(fmt)
    assert float(y.scale) == 2.0**-40
    assert_identical(y.data, expected(np.asarray(x.data), fmt, False))
    raw = ops.cast_on_forward(x.to_array(), fmt)  # unscaled: everything underflows
    assert relative_error(raw, x) == 1.0 and relative_error(y, x) < 0.2


def relative_error(y, x) -> float:
    return float(np.linalg.norm(value64(y) - value64(x)) / np.linalg.norm(value64(x)))


@pytest.mark.parametrize("saturate", [False, True])
def test_scaled_saturation_clips_the_data_not_the_value(saturate):
    data = jnp.array([1000.0, -1000.0, 3.0, 0.1], jnp.float32)
    x = js.ScaledArray(data, jnp.float32(2.0**-30))  # values far below 448
    cast = functools.partial(ops.reduce_precision_on_forward, dtype=jnp.float8_e4m3fn)
    unguarded = js.ScalifyConfig(guard=False)  # the guard would move 2^7 into the scale
    y = js.scalify(functools.partial(cast, saturate=saturate), config=unguarded)(x)
    assert float(y.scale) == 2.0**-30
    assert_identical(
        y.data, expected(np.asarray(data), jnp.float8_e4m3fn, saturate).astype(np.float32)
    )
    if not saturate:  # with the default range guard, the data is shifted before the cast
        guarded = js.scalify(functools.partial(cast, saturate=saturate))(x)
        np.testing.assert_allclose(js.asarray(guarded), data * 2.0**-30, rtol=2**-3)


@pytest.mark.parametrize("op", BACKWARD_OPS)
@pytest.mark.parametrize("fmt", FP8_SCALIFY_FORMATS)
def test_scaled_backward_ops_round_cotangent_data(fmt, op):
    def grad(x, w):
        return jax.grad(lambda x: jnp.sum(op(x, fmt) * w))(x)

    x = js.as_scaled_array(unit_data(7).astype(jnp.float16))
    w = js.ScaledArray(unit_data(8).astype(jnp.float16), jnp.float32(2.0**-30))
    g = jax.jit(js.scalify(grad))(x, w)
    assert isinstance(g, js.ScaledArray) and g.dtype == jnp.float16
    assert float(g.scale) == 2.0**-30
    assert_identical(g.data, expected(np.asarray(w.data), fmt, False).astype(np.float16))
    raw = grad(x.to_array(), w.to_array())  # unscaled float16: underflows
    assert not np.any(np.asarray(raw))


def test_scaled_forward_rounding_leaves_scaled_gradient_untouched():
    def loss(x, w):
        return jnp.sum(ops.reduce_precision_on_forward(x, jnp.float8_e4m3fn) * w)

    x = js.ScaledArray(unit_data(9), jnp.float32(2.0**20))
    w = js.ScaledArray(unit_data(10), jnp.float32(2.0**-20))
    g = jax.jit(js.scalify(jax.grad(loss)))(x, w)
    np.testing.assert_array_equal(value64(g), value64(w))
