"""custom_scale: the rule replaces propagation under scalify, the body runs outside it."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js


def _counted_double():
    calls = []

    @js.custom_scale
    def double(x):
        return 2 * x

    @double.defscale
    def rule(x):
        calls.append(x)
        return js.ScaledArray(x.data, x.scale * 2)

    return double, calls


def test_outside_scalify_the_body_runs_and_the_rule_does_not():
    double, calls = _counted_double()
    np.testing.assert_array_equal(double(jnp.arange(3.0)), [0.0, 2.0, 4.0])
    assert calls == []


class TestUnderScalify(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_the_rule_runs(self):
        double, calls = _counted_double()
        x = js.scaled_array(jnp.array([1.0, -3.0], jnp.float16), 2.0**-20)
        out = self.variant(js.scalify(double))(x)
        assert len(calls) == 1
        np.testing.assert_array_equal(out.data, x.data)  # the rule's output: data untouched
        assert float(out.scale) == 2.0**-19


def test_plain_inputs_under_scalify_run_the_body():
    double, calls = _counted_double()
    np.testing.assert_array_equal(js.scalify(double)(jnp.ones(2)), [2.0, 2.0])
    assert calls == []


def test_gradient_traced_inside_scalify_uses_the_rule_forward_and_is_correct():
    calls = []

    @js.custom_scale
    def swish(x):
        return x * jax.nn.sigmoid(x)

    @swish.defscale
    def rule(x):
        calls.append(1)
        data = x.data.astype(jnp.float32)
        return js.ScaledArray((data * jax.nn.sigmoid(data * x.scale)).astype(x.dtype), x.scale)

    x = jax.random.normal(jax.random.PRNGKey(0), (16,))
    w = jax.random.normal(jax.random.PRNGKey(1), (16,))

    def loss(x):
        return jnp.sum(swish(x) * w)

    grad = jax.jit(js.scalify(jax.grad(loss)))(js.as_scaled_array(x))
    assert calls, "the forward rule did not run"
    np.testing.assert_allclose(js.asarray(grad), jax.grad(loss)(x), rtol=1e-6, atol=1e-7)
    silu_grad = jax.grad(lambda x: jnp.sum(jax.nn.silu(x) * w))(x)
    np.testing.assert_allclose(jax.grad(loss)(x), silu_grad, rtol=1e-6)


def test_static_arguments_and_pytrees_reach_body_and_rule():
    @js.custom_scale
    def scaled_sum(xs, factor):
        return {"out": (xs[0] + xs[1]) * factor}

    scaled_sum = js.custom_scale(scaled_sum.fun, static_argnums=(1,))

    @scaled_sum.defscale
    def rule(xs, factor):
        a, b = xs
        assert factor == 4.0
        return {"out": js.ScaledArray(a.data + b.data, a.scale * factor)}

    a = js.scaled_array(jnp.array([1.0, 2.0]), 0.5)
    b = js.scaled_array(jnp.array([3.0, 4.0]), 0.5)
    out = js.scalify(lambda a, b: scaled_sum((a, b), 4.0))(a, b)
    np.testing.assert_array_equal(js.asarray(out["out"]), [8.0, 12.0])
    np.testing.assert_array_equal(scaled_sum((jnp.ones(2), jnp.ones(2)), 4.0)["out"], [8.0, 8.0])


def test_vmap_batches_the_body():
    double, calls = _counted_double()
    x = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(jax.vmap(double)(x), 2 * x)
    out = js.scalify(jax.vmap(double))(js.as_scaled_array(x))
    np.testing.assert_array_equal(js.asarray(out), 2 * x)


def test_missing_rule_is_a_clear_error():
    @js.custom_scale
    def f(x):
        return x

    with pytest.raises(TypeError, match="no scale rule"):
        f(jnp.ones(2))


def test_rule_with_wrong_output_shape_is_reported():
    @js.custom_scale
    def f(x):
        return x

    @f.defscale
    def rule(x):
        return js.ScaledArray(x.data[:1], x.scale)

    with pytest.raises(RuntimeError, match="custom_scale_call"):
        js.scalify(f)(js.as_scaled_array(jnp.ones(2)))
