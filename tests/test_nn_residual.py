"""Unit-scaled building blocks: tau-weighted residual split/add and the μP readout, plain and
under scalify (float16 at scales 2^-20 and 2^20), against float64 references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_pow2_scales, random_data, reference64, value64
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_scaled as js

SCALES = [2.0**-20, 2.0**20]
TAUS = [0.25, 1.0, 3.0]


def unit(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(random_data(seed, shape, dtype))


def scaled(seed: int, shape, scale: float) -> js.ScaledArray:
    """Unit-normal float16 data at a power-of-two scale."""
    return js.ScaledArray(unit(seed, shape, jnp.float16), jnp.float32(scale))


def data_rms(x: js.ScaledArray) -> float:
    return float(np.sqrt(np.mean(np.asarray(x.data, np.float64) ** 2)))


def weights64(tau: float) -> tuple[float, float]:
    return tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)


# --- residual weights, values and gradients outside scalify -------------------------------


@settings(max_examples=20)
@given(tau=st.floats(0, 1e3))
def test_weights_have_unit_norm_and_ratio_tau(tau):
    a, b = js.nn.residual_weights(tau)
    assert math.isclose(a * a + b * b, 1.0, rel_tol=1e-12)
    assert math.isclose(a, tau * b, rel_tol=1e-12)


@pytest.mark.parametrize("tau", [-1.0, float("nan")])
def test_invalid_tau_is_an_error(tau):
    with pytest.raises(ValueError, match="tau"):
        js.nn.residual_add(jnp.ones(2), jnp.ones(2), tau)


@pytest.mark.parametrize("tau", TAUS)
def test_plain_values_are_the_weighted_sum(tau):
    r, s = unit(0, (4, 8)), unit(1, (4, 8))
    a, b = js.nn.residual_weights(tau)
    residual, skip = js.nn.residual_split(r, tau)
    np.testing.assert_array_equal(np.asarray(residual), np.asarray(r))
    np.testing.assert_array_equal(np.asarray(skip), np.asarray(r))
    y = js.nn.residual_add(r, s, tau)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(a * r + b * s))  # plain JAX
    assert_close(y, reference64(lambda r, s: a * r + b * s, r, s), jnp.float32, normwise=True)


@pytest.mark.parametrize("tau", TAUS)
def test_split_weights_the_backward_and_add_passes_it_unweighted(tau):
    a, b = weights64(tau)
    x, g1, g2 = unit(2, (3, 5)), unit(3, (3, 5)), unit(4, (3, 5))
    _, split_vjp = jax.vjp(lambda x: js.nn.residual_split(x, tau), x)
    np.testing.assert_allclose(split_vjp((g1, g2))[0], a * g1 + b * g2, rtol=1e-6)
    _, add_vjp = jax.vjp(lambda r, s: js.nn.residual_add(r, s, tau), x, x)
    for grad in add_vjp(g1):
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(g1))


@pytest.mark.parametrize("tau", TAUS)
def test_split_then_add_has_the_exact_gradient_of_the_weighted_layer(tau):
    """``residual_add(f(residual), skip)`` is ``a f(x) + b x`` with its true x-gradient; the
    branch's parameter gradient is 1/a times its true value (unit-scaled)."""
    a, b = weights64(tau)
    x, w = unit(5, (4, 6)), unit(6, (6, 6)) / math.sqrt(6)

    def layer(x, w):
        residual, skip = js.nn.residual_split(x, tau)
        return js.nn.residual_add(jnp.tanh(residual @ w), skip, tau)

    def reference(x, w):
        return a * jnp.tanh(x @ w) + b * x

    np.testing.assert_allclose(layer(x, w), reference(x, w), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * jnp.cos(x))  # noqa: E731
    dx, dw = jax.grad(loss(layer), argnums=(0, 1))(x, w)
    dx64, dw64 = reference64(jax.grad(loss(reference), argnums=(0, 1)), x, w)
    np.testing.assert_allclose(dx, dx64, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, dw64 / a, rtol=1e-4, atol=1e-5)


def test_add_promotes_dtypes_and_checks_shapes():
    y = js.nn.residual_add(jnp.ones(3, jnp.float16), jnp.ones(3, jnp.float32))
    assert y.dtype == jnp.float32
    with pytest.raises(ValueError, match="same shape"):
        js.nn.residual_add(jnp.ones(3), jnp.ones((2, 3)))


# --- residual under scalify: float16 at extreme scales ------------------------------------


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("tau", TAUS)
def test_scalified_add_matches_float64_with_unit_scale_data(tau, scale):
    r, s = scaled(7, (64, 32), scale), scaled(8, (64, 32), scale)
    add = lambda r, s: js.nn.residual_add(r, s, tau)  # noqa: E731
    out = jax.jit(js.scalify(add))(r, s)
    assert isinstance(out, js.ScaledArray) and out.dtype == jnp.float16
    assert_pow2_scales(out)
    assert_close(out, reference64(add, r, s), jnp.float16, ulps=4, normwise=True)
    assert 0.5 <= data_rms(out) <= 2.0, data_rms(out)
    raw = add(r.to_array(), s.to_array())  # plain float16 under- or overflows
    assert not np.allclose(value64(raw), reference64(add, r, s), rtol=0.1)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("tau", TAUS)
def test_scalified_split_backward_matches_float64_with_unit_scale_data(tau, scale):
    def split_vjp(x, g_residual, g_skip):
        _, vjp = jax.vjp(lambda x: js.nn.residual_split(x, tau), x)
        return vjp((g_residual, g_skip))[0]

    x = scaled(9, (64, 32), 1.0)
    g_residual, g_skip = scaled(10, (64, 32), scale), scaled(11, (64, 32), scale / 4)
    out = jax.jit(js.scalify(split_vjp))(x, g_residual, g_skip)
    assert isinstance(out, js.ScaledArray) and out.dtype == jnp.float16
    assert_pow2_scales(out)
    a, b = weights64(tau)
    want = a * value64(g_residual) + b * value64(g_skip)
    assert_close(out, want, jnp.float16, ulps=4, normwise=True)
    assert 0.5 <= data_rms(out) <= 2.0, data_rms(out)


def test_scalified_residual_layer_gradient_and_equal_scales_keep_the_scale():
    """A whole layer, gradient traced inside scalify; tau=1 on equal scales: scale kept."""
    x, w = scaled(12, (16, 32), 2.0**-20), scaled(13, (32, 32), 2.0**-3)

    def loss(x, w):
        residual, skip = js.nn.residual_split(x)
        return jnp.sum(js.nn.residual_add(residual @ w, skip) ** 2)

    grads = jax.jit(js.scalify(jax.grad(loss, argnums=(0, 1))))(x, w)
    want = reference64(jax.grad(loss, argnums=(0, 1)), x, w)
    for got, expected in zip(grads, want, strict=True):
        assert_close(got, expected, jnp.float16, ulps=16, normwise=True)
    same = jax.jit(js.scalify(js.nn.residual_add))(x, x)
    assert float(same.scale) == 2.0**-20


# --- the μP readout -----------------------------------------------------------------------


@pytest.mark.parametrize("fan_in", [48, 64])
def test_readout_is_linear_over_fan_in_with_exact_gradients(fan_in):
    x, w, b = unit(14, (8, fan_in)), unit(15, (fan_in, 5)), unit(16, (5,))

    def reference(x, w, b):
        return (x @ w) / fan_in + b

    y = js.nn.linear_readout(x, w, b)
    np.testing.assert_allclose(y, reference64(reference, x, w, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(y), np.asarray((x @ w) * (1.0 / fan_in) + b))
    loss = lambda f: lambda x, w, b: jnp.sum(f(x, w, b) * jnp.sin(jnp.arange(5.0)))  # noqa: E731
    grads = jax.grad(loss(js.nn.linear_readout), argnums=(0, 1, 2))(x, w, b)
    grads64 = reference64(jax.grad(loss(reference), argnums=(0, 1, 2)), x, w, b)
    for got, want in zip(grads, grads64, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_readout_passes_the_linear_formats():
    x, w = unit(17, (4, 32)), unit(18, (32, 3))
    fp8 = dict(x_dtype=jnp.float8_e4m3fn, w_dtype=jnp.float8_e4m3fn)
    y = js.nn.linear_readout(x, w, **fp8)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(js.nn.linear(x, w, **fp8) / 32))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("fan_in", [48, 64, 128])
def test_scalified_readout_matches_float64_with_unit_scale_data(fan_in, scale):
    x, w = scaled(19, (64, fan_in), scale), scaled(20, (fan_in, 32), 1.0)
    y = jax.jit(js.scalify(js.nn.linear_readout))(x, w)
    assert isinstance(y, js.ScaledArray) and y.dtype == jnp.float16
    assert_pow2_scales(y)
    assert_close(y, reference64(js.nn.linear_readout, x, w), jnp.float16, ulps=8, normwise=True)
    assert 0.5 <= data_rms(y) <= 2.0, data_rms(y)


@pytest.mark.parametrize("scale", SCALES)
def test_scalified_readout_gradients_match_float64(scale):
    def grads(x, w, g):
        return jax.vjp(js.nn.linear_readout, x, w)[1](g)

    x, w, g = (
        scaled(21, (64, 48), scale),
        scaled(22, (48, 32), 1.0),
        scaled(23, (64, 32), 1 / scale),
    )
    out = jax.jit(js.scalify(grads))(x, w, g)
    for got, want in zip(out, reference64(grads, x, w, g), strict=True):
        assert isinstance(got, js.ScaledArray) and got.dtype == jnp.float16
        assert_close(got, want, jnp.float16, ulps=8, normwise=True)
        assert 0.25 <= data_rms(got) <= 4.0, data_rms(got)  # automatic rules: within 2 bits
