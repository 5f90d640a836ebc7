"""transpose(dot_general) bound as one swapped contraction: found where it computes the same
value, left alone elsewhere, and checked against a float64 reference."""

import jax
import jax.numpy as jnp
import pytest
from helpers import FLOAT_DTYPES, check_scaled, scaled_arrays
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled.engine.peephole import transposed_contractions

few = settings(max_examples=max(3, settings.default.max_examples // 3))

# name -> (x shape, y shape, dimension numbers, permutation that swaps the free dimensions)
SWAP_CASES = {
    "matmul": lambda m, n, k, b: ((m, k), (k, n), (((1,), (0,)), ((), ())), (1, 0)),
    "weight_gradient": lambda m, n, k, b: ((k, m), (k, n), (((0,), (0,)), ((), ())), (1, 0)),
    "batched": lambda m, n, k, b: (
        (b, m, k),
        (b, k, n),
        (((2,), (1,)), ((0,), (0,))),
        (0, 2, 1),
    ),
    "two_lhs_free": lambda m, n, k, b: (
        (m, b, k),
        (k, n),
        (((2,), (0,)), ((), ())),
        (2, 0, 1),
    ),
}


def _transposed_dot(dimension_numbers, permutation):
    def fn(x, y):
        return lax.transpose(lax.dot_general(x, y, dimension_numbers), permutation)

    return fn


def _pairs(fn, *shapes) -> dict:
    jaxpr = jax.make_jaxpr(fn)(*[jnp.ones(s) for s in shapes]).jaxpr
    return transposed_contractions(jaxpr)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(SWAP_CASES))
@few
@given(data=st.data())
def test_swapped_contraction_matches_reference(name, dtype, data):
    sizes = [data.draw(st.integers(1, 6)) for _ in range(4)]
    x_shape, y_shape, dn, permutation = SWAP_CASES[name](*sizes)
    fn = _transposed_dot(dn, permutation)
    assert len(_pairs(fn, x_shape, y_shape)) == 1  # the interpreter takes the swapped path
    x = data.draw(scaled_arrays(x_shape, dtype))
    y = data.draw(scaled_arrays(y_shape, dtype))
    k = x_shape[dn[0][0][0]]
    out = check_scaled(fn, [x, y], dtype, ulps=2 * k + 4, normwise=True)
    assert out.dtype == dtype


def test_other_permutations_are_left_alone():
    dn = (((2,), (1,)), ((0,), (0,)))
    fn = _transposed_dot(dn, (2, 1, 0))  # moves the batch dimension: not a swapped dot
    assert _pairs(fn, (2, 3, 4), (2, 4, 5)) == {}


def test_a_dot_with_other_uses_is_left_alone():
    def fn(x, y):
        product = x @ y
        return product.T, product

    assert _pairs(fn, (3, 4), (4, 5)) == {}


def test_scalified_weight_gradient_has_no_transpose():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    x = js.as_scaled_array(jnp.ones((8, 16), jnp.float16))
    w = js.as_scaled_array(jnp.ones((16, 4), jnp.float16))
    grad = jax.jit(js.scalify(jax.grad(loss)))
    assert "transpose" in str(jax.make_jaxpr(jax.grad(loss))(w.to_array(), x.to_array()))
    assert "stablehlo.transpose" not in grad.lower(w, x).as_text()
    expected = jax.grad(loss)(w.to_array(jnp.float32), x.to_array(jnp.float32))
    assert jnp.allclose(js.asarray(grad(w, x), jnp.float32), expected, rtol=1e-2)
