"""The scalify transform: forwarding, composition with JAX transforms, nested calls, errors."""

import functools
import gc

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import jax_scaled as js


def scaled(x, scale=1.0, dtype=jnp.float32):
    return js.scaled_array(jnp.asarray(x, dtype) / scale, scale, dtype=dtype)


def affine(w, x):
    return x @ w * 2.0 + 1.0


class TestForwarding:
    def test_plain_inputs_give_the_same_graph(self):
        def f(x, w):
            return jnp.sum(jax.nn.relu(jax.jit(affine)(w, x)))

        x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
        assert str(jax.make_jaxpr(js.scalify(f))(x, w)) == str(jax.make_jaxpr(f)(x, w))

    def test_unscaled_branches_of_a_mixed_program_are_untouched(self):
        def f(x, y):
            return x * 3.0, jnp.sin(y)  # no rule is needed for sin on a plain y

        out_x, out_y = js.scalify(f)(scaled([1.0, 2.0], 0.5), jnp.ones(2))
        assert isinstance(out_x, js.ScaledArray) and not isinstance(out_y, js.ScaledArray)
        np.testing.assert_allclose(js.asarray(out_x), [3.0, 6.0])


class TestJitAndEager(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager(self):
        f = self.variant(js.scalify(affine))
        out = f(js.as_scaled_array(jnp.ones((3, 2))), js.as_scaled_array(jnp.ones((4, 3))))
        assert isinstance(out, js.ScaledArray)
        np.testing.assert_allclose(js.asarray(out), affine(jnp.ones((3, 2)), jnp.ones((4, 3))))


class TestComposition:
    def test_pytrees_and_keyword_arguments(self):
        def f(params, *, x):
            return {"y": params["w"] * x, "n": params["n"] + 1}

        params = {"w": scaled([2.0], 4.0), "n": jnp.int32(1)}
        out = js.scalify(f)(params, x=scaled([3.0]))
        assert float(js.asarray(out["y"])[0]) == 6.0 and int(out["n"]) == 2

    def test_static_python_arguments(self):
        def f(x, power, name="unused"):
            return x**power

        out = js.scalify(f)(scaled([3.0], 2.0), 2, name="static")
        assert float(js.asarray(out)[0]) == 9.0
        jitted = jax.jit(js.scalify(f), static_argnums=1)
        assert float(js.asarray(jitted(scaled([3.0], 2.0), 3))[0]) == 27.0
        partial = jax.jit(js.scalify(functools.partial(f, power=2)))
        assert float(js.asarray(partial(scaled([3.0], 2.0)))[0]) == 9.0

    @pytest.mark.parametrize("transform", [jax.grad, jax.value_and_grad])
    def test_scalify_of_grad(self, transform):
        def loss(w, x):
            return jnp.sum(affine(w, x) ** 2)

        w, x = jnp.full((3, 2), 0.5), jnp.ones((4, 3))
        out = jax.jit(js.scalify(transform(loss)))(js.as_scaled_array(w), js.as_scaled_array(x))
        chex.assert_trees_all_close(js.asarray(out), transform(loss)(w, x), rtol=1e-6)

    def test_vmap_of_scalify_with_shared_scale(self):
        x = scaled(np.arange(6.0).reshape(2, 3), 2.0)
        in_axes = jax.tree.unflatten(jax.tree.structure(x), [0, None])
        f = jax.vmap(js.scalify(lambda v: v * 2.0), in_axes=(in_axes,), out_axes=in_axes)
        out = f(x)
        assert out.scale.shape == ()
        np.testing.assert_allclose(js.asarray(out), np.arange(6.0).reshape(2, 3) * 2)

    def test_vmap_of_scalify_with_per_example_scales(self):
        x = jax.vmap(js.as_scaled_array)(jnp.array([1.5, 96.0]))  # scalars split per example
        assert x.scale.shape == (2,)
        out = jax.vmap(lambda v: js.asarray(js.scalify(lambda a: a * a)(v)))(x)
        np.testing.assert_allclose(out, [2.25, 9216.0])

    def test_nested_scalify(self):
        f = js.scalify(js.scalify(affine))
        out = f(js.as_scaled_array(jnp.ones((3, 2))), js.as_scaled_array(jnp.ones((4, 3))))
        np.testing.assert_allclose(js.asarray(out), 7.0)

    def test_scalify_inside_jit_inside_scalify(self):
        inner = jax.jit(js.scalify(lambda x: x * 4.0))
        out = js.scalify(lambda x: inner(x) + x)(scaled([1.0, 2.0], 2.0**-10))
        np.testing.assert_allclose(js.asarray(out, jnp.float32), [5.0, 10.0])


class TestHigherOrder:
    def test_nested_jit_is_interpreted_and_keeps_its_name(self):
        @jax.jit
        def my_inner_block(x):
            return x * x

        f = js.scalify(lambda x: my_inner_block(x) + 1.0)
        x = scaled([2.0**-10, 3 * 2.0**-10], 2.0**-10)
        jaxpr = jax.make_jaxpr(f)(x)
        jit_eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
        assert "my_inner_block" in [e.params["name"] for e in jit_eqns]
        out = jax.jit(f)(x)
        np.testing.assert_allclose(js.asarray(out, jnp.float32), [1 + 2.0**-20, 1 + 9 * 2.0**-20])

    def test_nested_jit_keeps_donation(self):
        inner = jax.jit(lambda x: x * 2.0, donate_argnums=0)
        jaxpr = jax.make_jaxpr(js.scalify(lambda x: inner(x)))(scaled([1.0]))
        (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
        assert all(eqn.params["donated_invars"])  # data and scale

    def test_nested_jit_keeps_shardings(self):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        inner = jax.jit(lambda a: a * 2.0, in_shardings=sharding, out_shardings=sharding)
        f = js.scalify(lambda a: inner(a) * 3.0)
        x = js.as_scaled_array(jnp.arange(8.0))
        jaxpr = jax.make_jaxpr(f)(x)
        (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
        data_in, scale_in = eqn.params["in_shardings"]
        assert data_in.spec == sharding.spec and scale_in.spec == jax.sharding.PartitionSpec()
        data_out, _ = eqn.params["out_shardings"]
        assert data_out.spec == sharding.spec
        np.testing.assert_array_equal(js.asarray(jax.jit(f)(x)), np.arange(8.0) * 6)

    def test_custom_jvp_functions_run_their_forward(self):
        x = js.scaled_array([-2.0, 0.5, 3.0], 2.0**-20, dtype=jnp.float16)
        out = jax.jit(js.scalify(jax.nn.relu))(x)
        assert isinstance(out, js.ScaledArray) and float(out.scale) == 2.0**-20
        np.testing.assert_array_equal(np.asarray(out.data), [0.0, 0.5, 3.0])

    def test_custom_vjp_forward_and_user_backward(self):
        @jax.custom_vjp
        def clip_gradient(x):
            return x

        clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

        def loss(x):
            return jnp.sum(clip_gradient(x) * 10.0)

        x = js.as_scaled_array(jnp.array([1.0, 2.0]))
        value = js.scalify(loss)(x)
        assert float(js.asarray(value)) == 30.0
        grads = jax.jit(js.scalify(jax.grad(loss)))(x)
        np.testing.assert_allclose(js.asarray(grads), [1.0, 1.0])  # the user's backward ran


class TestErrors:
    def test_unsupported_primitive_names_itself_and_the_line(self):
        mystery_p = Primitive("mystery_op")  # a primitive no rule knows
        mystery_p.def_impl(lambda x: x)
        mystery_p.def_abstract_eval(lambda x: x)

        def uses_mystery(x):
            return mystery_p.bind(x)  # MARKER: the line the error must point to

        with pytest.raises(NotImplementedError) as info:
            js.scalify(uses_mystery)(scaled([1.0, 2.0]))
        message = str(info.value)
        assert "'mystery_op'" in message
        assert "test_interpreter.py" in message
        line = uses_mystery.__code__.co_firstlineno + 1
        assert f":{line}" in message

    def test_per_axis_scales_flow_and_broadcast_scales_are_refused(self):
        x = js.ScaledArray(jnp.ones((2, 3)), jnp.array([[1.0], [4.0]]))  # one per row
        out = js.scalify(lambda v: v * 2.0)(x)
        assert out.block_shape == (1, 3) and js.asarray(out).tolist() == [[2.0] * 3, [8.0] * 3]
        with pytest.raises(ValueError, match="does not tile"):  # broadcastable, not a block
            js.ScaledArray(jnp.ones((2, 3)), jnp.ones((3,)))


class TestConfig:
    def test_rounding_modes_change_estimated_scales(self):
        x = scaled(np.ones(3), 1.0)

        def add(a):
            return a + a  # scale estimate sqrt(2)

        down = js.scalify(add)(x)
        with js.ScalifyConfig(rounding="up"):
            up = js.scalify(add)(x)
        nearest = js.scalify(add, config=js.ScalifyConfig(rounding="nearest"))(x)
        assert (float(down.scale), float(up.scale), float(nearest.scale)) == (1.0, 2.0, 2.0)
        for out in (down, up, nearest):
            np.testing.assert_array_equal(js.asarray(out), 2 * np.ones(3))

    def test_config_is_validated(self):
        with pytest.raises(ValueError):
            js.ScalifyConfig(rounding="sideways")
        with pytest.raises(ValueError):
            js.ScalifyConfig(scale_dtype=jnp.float16)

    def test_e8m0_scales_propagate(self):
        x = js.as_scaled_array(
            jnp.array([1.0, 2.0]) * 2.0**-30, scale=2.0**-30, scale_dtype=jnp.float8_e8m0fnu
        )
        with js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu):
            out = jax.jit(js.scalify(lambda a: a * a + 1.0))(x)
        assert out.scale.dtype == jnp.float8_e8m0fnu
        np.testing.assert_allclose(
            js.asarray(out, jnp.float32), 1.0 + np.array([1.0, 4.0]) * 2.0**-60
        )


def test_e8m0_scales_win_over_promoted_float32_ones():
    x = js.as_scaled_array(jnp.array([1.0, 2.0]), scale_dtype=jnp.float8_e8m0fnu)
    out = js.scalify(lambda a, b: b * a)(x, jnp.array([3.0, 4.0]))  # b is plain
    assert out.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(js.asarray(out, jnp.float32), [3.0, 8.0])


def test_traced_zero_scalar_takes_the_other_operands_scale():
    """``jnp.clip(var, 0)`` inside a jit (jax.nn.standardize): the 0 reaches max as a traced
    float; promoted at scale 1 it would flush a float16 variance of 2^-40 to zero."""
    clip_at = jax.jit(lambda x, low: jnp.maximum(low.astype(x.dtype), x))
    x = js.scaled_array(jnp.array([1.0, 3.0], jnp.float16), 2.0**-40)
    out = jax.jit(js.scalify(lambda x: clip_at(x, 0)))(x)
    assert float(out.scale) == 2.0**-40
    np.testing.assert_array_equal(js.asarray(out, jnp.float32), np.array([1.0, 3.0]) * 2.0**-40)


def test_python_float_literal_carry_is_promoted():
    """A while loop started from ``1.0`` (a TypedFloat literal in the jaxpr) times a scaled
    value: the literal carry is promoted to a ScaledArray (optax's lbfgs linesearch)."""

    def cube(x):
        body = lambda c: (c[0] * x, c[1] + 1)  # noqa: E731
        return lax.while_loop(lambda c: c[1] < 3, body, (1.0, 0))[0]

    out = jax.jit(js.scalify(cube))(js.scaled_array(jnp.float16(1.5), 2.0**-20))
    assert out.dtype == jnp.float16 and float(out.scale) == 2.0**-60
    assert float(out.data) == 1.5**3


def test_run_time_zero_scalar_takes_the_smallest_scale():
    """prodigy's first step: a vdot with a zero parameter difference is 0 at the scale of its
    estimate; the max with its running estimate then took that scale (2^40 here) and left the
    estimate's float16 data subnormal. A one-element zero gets the smallest scale instead."""

    def running_max(estimate, g, difference):
        return jnp.maximum(estimate, jnp.vdot(g, difference) * 2.0**40)

    estimate = js.scaled_array(jnp.float16(1.0), 2.0**-20)
    g = js.as_scaled_array(jnp.ones(8, jnp.float16))
    zero = js.ScaledArray(jnp.zeros(8, jnp.float16), jnp.float32(1.0))
    out = jax.jit(js.scalify(running_max))(estimate, g, zero)
    assert float(out.scale) == 2.0**-20 and float(out.data) == 1.0


def test_scalar_zero_inputs_take_the_smallest_scale():
    """An ``inject_hyperparams`` state holds ``eps_root = 0.0``; split at scale 1 it would set
    the scale of ``nu + eps_root`` and flush ``nu``'s float16 data."""
    nu = js.ScaledArray(jnp.full(4, 1.0, jnp.float16), jnp.float32(2.0**-40))
    eps_root = js.as_scaled_array(jnp.float16(0.0))
    assert float(eps_root.scale) == 2.0**-126
    at_scale_one = js.ScaledArray(eps_root.data, jnp.float32(1.0))  # a zero built by hand
    out = jax.jit(js.scalify(lambda nu, e: jnp.sqrt(nu + e)))(nu, at_scale_one)
    np.testing.assert_allclose(np.asarray(js.asarray(out, jnp.float32)) * 2.0**20, 1.0)


def test_product_with_a_constant_zero_is_scale_free():
    """dpsgd adds ``noise_multiplier * noise`` with noise_multiplier 0: that zero must take
    the gradient's scale, not the noise's estimate of 1."""

    def add_noise(g, key):
        return g + 0.0 * jax.random.normal(key, g.shape, g.dtype)

    g = js.ScaledArray(jnp.array([1.0, -1.5], jnp.float16), jnp.float32(2.0**-24))
    out = jax.jit(js.scalify(add_noise))(g, jax.random.key(0))
    assert float(out.scale) == 2.0**-24
    np.testing.assert_array_equal(out.data, g.data)


def test_scalify_of_a_non_function_fails_at_once():
    with pytest.raises(TypeError, match="scalify expects a function, got int"):
        js.scalify(3)


def test_a_non_array_output_names_the_users_function():
    def returns_text(x):
        return "hello"

    with pytest.raises(TypeError, match="returns_text returned a str"):
        js.scalify(returns_text)(jnp.ones(2))


class TestGarbageCollector:
    """A scalified call traces and interprets with Python's cyclic collector paused."""

    @staticmethod
    def collector_state_inside(*args):
        seen = []

        def f(x):
            seen.append(gc.isenabled())
            return js.scalify(lambda y: y * 2.0)(x) + 1.0  # a nested call

        out = js.scalify(f)(*args)
        return seen, out

    def test_paused_during_the_call_and_on_after_it(self):
        seen, out = self.collector_state_inside(scaled([1.0, 2.0], 2.0**-20))
        assert seen == [False] and gc.isenabled()
        np.testing.assert_allclose(js.asarray(out), [3.0, 5.0])

    def test_a_collector_the_user_turned_off_stays_off(self):
        gc.disable()
        try:
            self.collector_state_inside(scaled([1.0], 0.5))
            assert not gc.isenabled()
        finally:
            gc.enable()

    def test_on_again_after_a_failing_call(self):
        with pytest.raises(TypeError, match="returned a str"):
            js.scalify(lambda x: "text")(scaled([1.0]))
        assert gc.isenabled()
