"""ANY_SCALE: scale-independent values (zeros, infinities, NaNs and masks) take the other scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jax_scaled as js
from tests.helpers import assert_close, reference64

MASK = jnp.tril(jnp.ones((4, 8), bool))


def _data(shape=(4, 8)):
    return jax.random.normal(jax.random.PRNGKey(0), shape).astype(jnp.float16)


@pytest.mark.parametrize("exponent", [-20, 20])
def test_additive_mask_built_by_jnp_where_keeps_the_input_scale(exponent):
    def f(x):
        return x + jnp.where(MASK, 0.0, -jnp.inf).astype(x.dtype)

    x = js.scaled_array(_data(), 2.0**exponent)
    out = jax.jit(js.scalify(f))(x)
    assert float(out.scale) == 2.0**exponent
    np.testing.assert_array_equal(out.data, jnp.where(MASK, x.data, -jnp.inf))


@pytest.mark.parametrize("exponent", [-20, 20])
@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jax.nn.logsumexp(jnp.where(MASK, x, -jnp.inf), axis=-1),
        lambda x: jax.nn.softmax(jnp.where(MASK, x, -jnp.inf)),
        lambda x: jax.nn.softmax(x, where=MASK),
        lambda x: jax.nn.log_softmax(x + jnp.where(MASK, 0.0, -jnp.inf).astype(x.dtype)),
        lambda x: jax.nn.logsumexp(x, axis=-1),
    ],
    ids=["masked_logsumexp", "masked_softmax", "softmax_where", "additive_mask", "logsumexp"],
)
def test_masked_softmax_and_logsumexp_are_finite_and_accurate_in_float16(fn, exponent):
    x = js.scaled_array(_data(), 2.0**exponent)
    out = jax.jit(js.scalify(fn))(x)
    want = reference64(fn, x)
    got = js.asarray(out, jnp.float32)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    assert_close(out, want, jnp.float16, ulps=8, normwise=True)


def test_a_rule_can_return_any_scale():
    blank_p = Primitive("blank_like_test")
    blank_p.def_abstract_eval(lambda x: x)
    blank_p.def_impl(lambda x: jnp.full(x.shape, -jnp.inf, x.dtype))

    @js.register_scale_rule(blank_p)
    def blank_rule(x):
        return js.ANY_SCALE(jnp.full(x.shape, -jnp.inf, x.dtype))

    def f(x, y):
        return jnp.maximum(blank_p.bind(x), y)

    x = js.scaled_array(jnp.ones(3, jnp.float16), 2.0**-30)
    y = js.scaled_array(jnp.array([1.0, 2.0, 3.0], jnp.float16), 2.0**10)
    out = js.scalify(f)(x, y)
    assert float(out.scale) == 2.0**10
    np.testing.assert_array_equal(out.data, y.data)


def test_any_scale_marker_repr_and_idempotence():
    marked = js.ANY_SCALE(jnp.zeros(2))
    assert js.ANY_SCALE(marked) is marked
    assert repr(js.ANY_SCALE) == "ANY_SCALE"
