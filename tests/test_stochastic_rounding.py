"""Stochastic rounding (rounding="stochastic" of js.ops.cast_on_* / reduce_precision_on_* and
js.nn.linear's gradient cast): unbiased, within the two neighbours, deterministic per key,
under jit, vmap, grad and scalify. References: the formats' values enumerated with ml_dtypes."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import random_data, value64
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled import ops
from jax_scaled.nn.linear import linear
from jax_scaled.ops.stochastic import round_with_bits, stochastic_round

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = [
    jnp.float16,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e3m4,
    jnp.float8_e4m3,
    jnp.float8_e4m3b11fnuz,
    jnp.float4_e2m1fn,
]
FORWARD_OPS = [ops.cast_on_forward, ops.reduce_precision_on_forward]
BACKWARD_OPS = [ops.cast_on_backward, ops.reduce_precision_on_backward]
ALL_OPS = FORWARD_OPS + BACKWARD_OPS
SAMPLES = 2048


@functools.cache
def format_values(fmt) -> np.ndarray:
    """Every finite value of ``fmt``, sorted, in float64 (formats of at most 16 bits)."""
    codes = np.arange(2**16, dtype=np.uint16) if ml_dtypes.finfo(fmt).bits > 8 else None
    if codes is None:
        codes = np.arange(2**8, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        values = codes.view(jnp.dtype(fmt)).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


def neighbours(x: np.ndarray, fmt) -> tuple[np.ndarray, np.ndarray]:
    """The largest value of ``fmt`` at most ``x`` and the smallest at least ``x``."""
    values, x = format_values(fmt), np.asarray(x, np.float64)
    low = values[np.searchsorted(values, x, side="right") - 1]
    high = values[np.searchsorted(values, x, side="left")]
    return low, high


def sr(x, fmt, key, op=ops.cast_on_forward, **kwargs):
    return op(x, fmt, rounding="stochastic", key=key, **kwargs)


def as64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def in_range_values(fmt, seed: int, size: int = 16) -> np.ndarray:
    """float32 values of both signs from 1/8 of ``fmt``'s smallest subnormal (not below
    2^-126: XLA CPU flushes float32 subnormals) to just under its largest value."""
    info = ml_dtypes.finfo(fmt)
    low = max(int(np.log2(float(info.smallest_subnormal))) - 3, -126)
    high = int(np.floor(np.log2(float(info.max))))
    rng = np.random.default_rng(seed)
    exponents = rng.integers(low, high, size)
    signs = rng.choice([-1.0, 1.0], size)
    return (signs * rng.uniform(1, 2, size) * 2.0**exponents).astype(np.float32)


def assert_unbiased(samples: np.ndarray, x: np.ndarray, fmt, z: float) -> None:
    """Every sample is a neighbour of ``x`` and the mean over axis 0 is within ``z``
    standard errors of ``x`` (exactly ``x`` where ``x`` is a value of ``fmt``)."""
    x = np.asarray(x, np.float64)
    low, high = neighbours(x, fmt)
    assert np.all((samples == low) | (samples == high)), "a result is not a neighbour"
    standard_error = np.sqrt((high - x) * (x - low) / samples.shape[0])
    error = np.abs(samples.mean(axis=0) - x)
    assert np.all(error <= z * standard_error), (error / np.maximum(standard_error, 1e-300)).max()


# --- the acceptance check and round-to-nearest unchanged ----------------------------------


def test_mean_of_1e5_casts_of_1_plus_2m5_to_e4m3_is_within_3_standard_errors():
    x = 1 + 2.0**-5  # between the E4M3 values 1 and 1.125, a quarter of the way up
    y = as64(sr(jnp.full(10**5, x, jnp.float32), E4M3, jax.random.key(0)))
    assert set(np.unique(y)) == {1.0, 1.125}
    standard_error = 0.125 * np.sqrt(0.25 * 0.75 / y.size)
    assert abs(y.mean() - x) <= 3 * standard_error


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("op", ALL_OPS)
def test_nearest_is_the_default_and_ignores_the_key(op, saturate):
    """Same jaxpr (values, gradients) with or without rounding="nearest" and a key."""

    def loss(rounding_kwargs):
        return lambda x: jnp.sum(op(x, E4M3, saturate=saturate, **rounding_kwargs) * 1.1)

    x = jnp.ones(3)
    explicit = dict(rounding="nearest", key=jax.random.key(0))
    for transform in [jax.make_jaxpr, lambda f: jax.make_jaxpr(jax.grad(f))]:
        default, nearest = transform(loss({}))(x), transform(loss(explicit))(x)
        assert str(default) == str(nearest)
        assert "stochastic_round" not in str(default) and "random" not in str(default)


@pytest.mark.parametrize("fmt", [E4M3, E5M2, jnp.float4_e2m1fn, jnp.float16])
def test_nearest_is_the_ml_dtypes_cast_of_every_float16(fmt):
    x = np.arange(2**16, dtype=np.uint16).view(np.float16)
    x = x[~np.isnan(x)]  # NaN payloads and signs are the backend's
    got = as64(ops.cast_on_forward(jnp.asarray(x), fmt))
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(jnp.dtype(fmt)).astype(np.float64)
    np.testing.assert_array_equal(got, want)  # NaN matches NaN
    number = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[number]), np.signbit(want[number]))


# --- neighbours, unbiasedness, exact probabilities ----------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1))
def test_unbiased_within_the_two_neighbours(fmt, seed):
    x = in_range_values(fmt, seed)
    keyed = jax.random.key(seed)
    samples = as64(
        jax.jit(sr, static_argnums=1)(jnp.broadcast_to(x, (SAMPLES, x.size)), fmt, keyed)
    )
    assert_unbiased(samples, x, fmt, z=5.0)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=6)
@given(seed=st.integers(0, 2**32 - 1))
def test_probability_of_rounding_away_from_zero_is_exactly_the_fraction(fmt, seed):
    """With the random integer ``t - 1`` the magnitude rounds up, with ``t`` down, where
    ``t = 2^32 (|x| - |low|) / spacing``: an integer (the rounding is exactly unbiased)."""
    x = in_range_values(fmt, seed)
    low, high = neighbours(np.abs(x), fmt)
    spacing = np.where(high > low, high - low, 1.0)
    threshold = (np.abs(x) - low) / spacing * 2.0**32
    np.testing.assert_array_equal(threshold, np.floor(threshold))
    between = threshold > 0
    x, low, high, threshold = x[between], low[between], high[between], threshold[between]
    below = jnp.asarray(threshold - 1, jnp.uint32)
    at = jnp.asarray(threshold, jnp.uint32)
    np.testing.assert_array_equal(np.abs(as64(round_with_bits(x, fmt, below))), high)
    np.testing.assert_array_equal(np.abs(as64(round_with_bits(x, fmt, at))), low)


@pytest.mark.parametrize(
    "source, fmt",
    [(jnp.float16, E4M3), (jnp.float16, E5M2), (jnp.bfloat16, jnp.float16), (jnp.bfloat16, E4M3)],
)
def test_unbiased_from_narrow_inputs(source, fmt):
    x = in_range_values(fmt, 3, size=32).astype(jnp.dtype(source))
    x = x[np.isfinite(x.astype(np.float32))]
    samples = as64(sr(jnp.broadcast_to(jnp.asarray(x), (SAMPLES, x.size)), fmt, jax.random.key(3)))
    assert_unbiased(samples, x.astype(np.float64), fmt, z=5.0)


def test_formats_holding_every_input_value_are_a_plain_cast():
    x = jnp.asarray(np.arange(256, dtype=np.uint8).view(E4M3))
    for seed in range(3):
        y = sr(x, jnp.float16, jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(jnp.float16)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_overflow_and_specials_follow_the_format(fmt):
    """Between the largest value and the next binade step the result is the largest value or
    what the format makes of an overflow; saturate clips first; inf, NaN, -0 as a cast."""
    info = ml_dtypes.finfo(fmt)
    top_spacing = 2.0 ** (np.floor(np.log2(float(info.max))) - info.nmant)
    beyond = np.full(512, float(info.max) + top_spacing / 2, np.float32)
    overflow = as64(ops.cast_on_forward(jnp.float32(np.finfo(np.float32).max), fmt))
    y = as64(sr(beyond, fmt, jax.random.key(0)))
    largest = (y == float(info.max)) | (y == overflow) | (np.isnan(y) & np.isnan(overflow))
    assert np.all(largest) and np.any(y == float(info.max))
    np.testing.assert_array_equal(as64(sr(beyond, fmt, jax.random.key(0), saturate=True)),
                                  float(info.max))  # fmt: skip
    specials = jnp.array([np.inf, -np.inf, np.nan, 0.0, -0.0], jnp.float32)
    got, want = as64(sr(specials, fmt, jax.random.key(1))), as64(specials.astype(fmt))
    np.testing.assert_array_equal(got, want)  # NaN == NaN for assert_array_equal
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


# --- keys, errors, jit and vmap -----------------------------------------------------------


def test_deterministic_for_a_key_and_different_across_keys():
    x = jnp.asarray(random_data(0, (256,), jnp.float32))
    first, again = (
        sr(x, E5M2, jax.random.key(4)),
        jax.jit(sr, static_argnums=1)(x, E5M2, jax.random.key(4)),
    )
    np.testing.assert_array_equal(as64(first), as64(again))
    assert not np.array_equal(as64(first), as64(sr(x, E5M2, jax.random.key(5))))
    legacy = jax.random.PRNGKey(4)  # raw uint32 keys work too
    np.testing.assert_array_equal(as64(sr(x, E5M2, legacy)), as64(sr(x, E5M2, legacy)))


def test_vmap_over_keys_and_over_inputs():
    x = jnp.asarray(random_data(1, (3, 64), jnp.float32))
    keys = jax.random.split(jax.random.key(6), 3)
    mapped = jax.jit(jax.vmap(lambda x, k: sr(x, E4M3, k)))(x, keys)
    for row, (xi, ki) in enumerate(zip(x, keys, strict=True)):
        np.testing.assert_array_equal(as64(mapped[row]), as64(sr(xi, E4M3, ki)))
    shared = jax.vmap(lambda x: sr(x, E4M3, keys[0]))(x)  # one key: the same bits per row
    for row in range(3):
        np.testing.assert_array_equal(as64(shared[row]), as64(sr(x[row], E4M3, keys[0])))


@pytest.mark.parametrize("op", ALL_OPS)
def test_a_missing_key_or_an_unknown_mode_is_a_clear_error(op):
    with pytest.raises(ValueError, match="needs a PRNG key"):
        op(jnp.ones(2), E4M3, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding must be one of"):
        op(jnp.ones(2), E4M3, rounding="down", key=jax.random.key(0))


# --- differentiation ----------------------------------------------------------------------


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_forward_variants_are_straight_through(op):
    """The cotangent passes unrounded (cast_on_forward's arrives in the format, as JAX types
    it, and is widened back)."""
    x, w = jnp.asarray(random_data(2, (64,), jnp.float32)), jnp.linspace(-1, 1, 64)
    grad = jax.grad(lambda x: jnp.sum(sr(x, E4M3, jax.random.key(0), op).astype(float) * w))(x)
    arrived = w.astype(E4M3) if op is ops.cast_on_forward else w
    np.testing.assert_array_equal(as64(grad), as64(arrived))


@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_backward_variants_round_the_cotangent_unbiasedly(op):
    x = jnp.asarray(random_data(3, (SAMPLES, 8), jnp.float32))
    w = in_range_values(E5M2, 4, size=8)  # the cotangent of every row
    key = jax.random.key(7)
    y, vjp = jax.vjp(lambda x: sr(x, E5M2, key, op), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # identity forward
    (grad,) = jax.jit(vjp)(jnp.broadcast_to(w, x.shape))
    assert grad.dtype == jnp.float32
    assert_unbiased(np.asarray(grad, np.float64), w, E5M2, z=5.0)


# --- under scalify: the data is rounded, the scale kept -----------------------------------


def scaled_unit(seed: int, scale: float, shape=(4, 32)) -> js.ScaledArray:
    return js.ScaledArray(jnp.asarray(random_data(seed, shape, jnp.float16)), jnp.float32(scale))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("op", FORWARD_OPS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2, jnp.float4_e2m1fn])
def test_scalified_forward_rounds_the_data_and_keeps_the_scale(fmt, op, scale):
    x, key = scaled_unit(5, scale), jax.random.key(8)
    y = jax.jit(js.scalify(lambda x: sr(x, fmt, key, op)))(x)
    assert isinstance(y, js.ScaledArray) and float(y.scale) == scale
    assert y.dtype == (jnp.dtype(fmt) if op is ops.cast_on_forward else jnp.float16)
    np.testing.assert_array_equal(as64(y.data), as64(sr(x.data, fmt, key, op)))
    low, high = neighbours(as64(x.data), fmt)  # of the data: the value rounded at its scale
    assert np.all((as64(y.data) == low) | (as64(y.data) == high))
    if fmt != jnp.float4_e2m1fn:  # raw FP8 at these magnitudes underflows or overflows
        raw = as64(sr(x.to_array(), fmt, key, op))
        assert not np.allclose(raw, value64(x), rtol=0.5)


def test_scalified_key_as_an_argument_and_vmap_inside_scalify():
    x, key = scaled_unit(6, 2.0**-20), jax.random.PRNGKey(9)
    y = jax.jit(js.scalify(lambda x, k: sr(x, E4M3, k)))(x, key)
    np.testing.assert_array_equal(as64(y.data), as64(sr(x.data, E4M3, key)))
    typed = jax.random.key(9)
    rows = jax.jit(js.scalify(jax.vmap(lambda row: sr(row, E4M3, typed))))(x)
    assert isinstance(rows, js.ScaledArray) and float(rows.scale) == 2.0**-20
    plain = jax.vmap(lambda row: sr(row, E4M3, typed))(x.data)
    np.testing.assert_array_equal(as64(rows.data), as64(plain))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("op", BACKWARD_OPS)
def test_scalified_backward_rounds_the_cotangent_data(op, scale):
    key = jax.random.key(10)

    def grad(x, w):
        return jax.grad(lambda x: jnp.sum(sr(x, E5M2, key, op) * w))(x)

    x, w = js.as_scaled_array(scaled_unit(7, 1.0).to_array()), scaled_unit(8, scale)
    g = jax.jit(js.scalify(grad))(x, w)
    assert isinstance(g, js.ScaledArray) and float(g.scale) == scale and g.dtype == jnp.float16
    np.testing.assert_array_equal(as64(g.data), as64(grad(x.data, w.data)))
    low, high = neighbours(as64(w.data), E5M2)
    assert np.all((as64(g.data) == low) | (as64(g.data) == high))


# --- nn.linear's gradient cast ------------------------------------------------------------


def test_linear_stochastic_gradient_cast_is_unbiased():
    sr_grad = dict(grad_dtype=E5M2, grad_rounding="stochastic", key=jax.random.key(11))
    x, w = jnp.ones((2**14, 1)), jnp.ones((1, 1))
    dx = jax.grad(lambda x: jnp.sum(linear(x, w, **sr_grad) * 0.3))(x)  # cotangent 0.3
    values = np.asarray(dx, np.float64).ravel()
    assert set(np.unique(values)) == {0.25, 0.3125}
    cotangent = float(np.float32(0.3))
    p_up = (cotangent - 0.25) / 0.0625
    assert abs(values.mean() - cotangent) <= 3 * 0.0625 * np.sqrt(p_up * (1 - p_up) / values.size)


def test_linear_nearest_default_unchanged_and_errors():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 2))

    def loss(**kwargs):
        return lambda x: jnp.sum(linear(x, w, grad_dtype=E5M2, **kwargs) * 0.3)

    explicit = loss(grad_rounding="nearest", key=jax.random.key(0))
    assert str(jax.make_jaxpr(jax.grad(loss()))(x)) == str(jax.make_jaxpr(jax.grad(explicit))(x))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        linear(x, w, grad_dtype=E5M2, grad_rounding="stochastic")
    with pytest.raises(ValueError, match="grad_dtype"):
        linear(x, w, grad_rounding="stochastic", key=jax.random.key(0))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_scalified_linear_gradient_rounds_the_cotangent_data(scale):
    key = jax.random.key(12)
    formats = dict(x_dtype=E4M3, w_dtype=E4M3, grad_dtype=E5M2)

    def grads(x, w, g):
        _, vjp = jax.vjp(
            lambda x, w: linear(x, w, grad_rounding="stochastic", key=key, **formats), x, w
        )
        return vjp(g)

    x, w, g = (
        scaled_unit(13, 1.0, (8, 32)),
        scaled_unit(14, 1.0, (32, 4)),
        scaled_unit(15, scale, (8, 4)),
    )
    dx, dw = jax.jit(js.scalify(grads))(x, w, g)
    rounded = as64(stochastic_round(g.data.astype(jnp.float32), E5M2, key)) * scale
    xq, wq = as64(x.data.astype(E4M3)), as64(w.data.astype(E4M3))
    for got, want in [(dx, rounded @ wq.T), (dw, xq.T @ rounded)]:
        assert isinstance(got, js.ScaledArray)
        error = np.max(np.abs(value64(got) - want)) / np.max(np.abs(want))
        assert error < 2.0**-9, error  # float16 output rounding of exact FP8 products
