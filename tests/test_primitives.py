"""Scaling primitives: identities outside scalify, exact re-scaling inside, and JAX transforms."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js


class TestIdentities(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_identities(self):
        x = jnp.array([1.0, -2.0, 3.0])
        np.testing.assert_array_equal(self.variant(js.set_scaling)(x, 4.0), x)
        np.testing.assert_array_equal(self.variant(js.rebalance)(x, 4.0), x)
        data, scale = self.variant(js.get_data_and_scale)(x)
        np.testing.assert_array_equal(data, x)
        assert float(scale) == 1.0 and scale.dtype == jnp.float32
        stopped = self.variant(lambda v: js.stop_scaling(v, jnp.float16))(x)
        assert stopped.dtype == jnp.float16


class TestOutsideScalify:
    def test_gradients_flow_through_unchanged(self):
        def f(x):
            data, _ = js.get_data_and_scale(js.rebalance(js.set_scaling(x, 2.0), 4.0))
            return jnp.sum(js.stop_scaling(data) ** 2)

        x = jnp.array([1.0, 2.0])
        np.testing.assert_allclose(jax.grad(f)(x), 2 * x)
        np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * x)

    def test_vmap(self):
        x = jnp.ones((3, 2))
        out = jax.vmap(lambda v: js.rebalance(js.set_scaling(v, 2.0), 2.0))(x)
        np.testing.assert_array_equal(out, x)
        data, scale = jax.vmap(js.get_data_and_scale)(x)
        assert data.shape == (3, 2) and scale.shape == (3,)

    def test_batched_scale_is_refused(self):
        with pytest.raises(NotImplementedError, match="batched scale"):
            jax.vmap(js.set_scaling)(jnp.ones((3, 2)), jnp.ones(3))

    def test_linear_transpose(self):
        transpose = jax.linear_transpose(lambda v: js.set_scaling(v, 2.0), jnp.ones(2))
        np.testing.assert_array_equal(transpose(jnp.array([1.0, 5.0]))[0], [1.0, 5.0])


class TestInsideScalify:
    def test_set_scaling_on_plain_and_scaled(self):
        out = js.scalify(js.set_scaling)(jnp.array([8.0, 2.0]), jnp.float32(4.0))
        assert isinstance(out, js.ScaledArray) and float(out.scale) == 4.0
        np.testing.assert_array_equal(out.data, [2.0, 0.5])
        x = js.scaled_array([1.0, 3.0], 2.0**-20, dtype=jnp.float16)
        out = jax.jit(js.scalify(js.set_scaling))(x, jnp.float32(2.0**-18))
        np.testing.assert_array_equal(np.asarray(out.data, np.float32), [0.25, 0.75])

    def test_get_data_and_scale(self):
        x = js.scaled_array([3.0], 2.0**-30, dtype=jnp.float16)
        data, scale = jax.jit(js.scalify(js.get_data_and_scale))(x)
        assert not isinstance(data, js.ScaledArray) and data.dtype == jnp.float16
        assert float(scale) == 2.0**-30
        data, scale = js.scalify(js.get_data_and_scale)(jnp.ones(2))
        assert float(scale) == 1.0

    def test_stop_scaling_unscales(self):
        x = js.scaled_array([3.0], 2.0**-30, dtype=jnp.float16)
        out = js.scalify(lambda v: js.stop_scaling(v, jnp.float32))(x)
        assert not isinstance(out, js.ScaledArray)
        assert float(out[0]) == 3.0 * 2.0**-30

    def test_rebalance_moves_powers_of_two(self):
        x = js.scaled_array([4.0, 8.0], 1.0, dtype=jnp.float16)
        out = jax.jit(js.scalify(js.rebalance))(x, jnp.float32(4.0))
        np.testing.assert_array_equal(np.asarray(out.data, np.float32), [1.0, 2.0])
        assert float(out.scale) == 4.0
        plain = js.scalify(js.rebalance)(jnp.ones(2), jnp.float32(4.0))
        assert not isinstance(plain, js.ScaledArray)

    def test_e8m0_scales_kept(self):
        x = js.as_scaled_array(jnp.ones(2), scale_dtype=jnp.float8_e8m0fnu)
        with js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu):
            out = js.scalify(js.rebalance)(x, jnp.float32(2.0**-10))
            set_out = js.scalify(js.set_scaling)(jnp.ones(2), jnp.float32(8.0))
        assert out.scale.dtype == jnp.float8_e8m0fnu and set_out.scale.dtype == jnp.float8_e8m0fnu
        np.testing.assert_array_equal(js.asarray(out), [1.0, 1.0])

    def test_gradient_of_a_rescaled_model_under_scalify(self):
        def loss(w, x):
            h = js.rebalance(x * w, jnp.float32(2.0**-4))
            return jnp.sum(js.stop_scaling(h) * 3.0)

        w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
        grads = jax.jit(js.scalify(jax.grad(loss)))(js.as_scaled_array(w), js.as_scaled_array(x))
        np.testing.assert_allclose(js.asarray(grads), 3 * x)
