"""Scale rules for add, sub, mul, div, neg and dot_general against a float64 reference."""

import jax.numpy as jnp
import pytest
from helpers import FLOAT_DTYPES, check_e8m0_matches, check_scaled, scaled_arrays, shapes
from hypothesis import given
from hypothesis import strategies as st
from jax import lax


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", [lax.add, lax.sub, lax.mul, lax.div])
@given(data=st.data())
def test_binary_arithmetic(op, dtype, data):
    shape = data.draw(shapes())
    x = data.draw(scaled_arrays(shape, dtype))
    y = data.draw(scaled_arrays(shape, dtype))
    normwise = op in (lax.add, lax.sub)  # cancellation: compare against the largest value
    check_scaled(op, [x, y], dtype, normwise=normwise)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_neg(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype))
    check_scaled(lax.neg, [x], dtype, ulps=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_dot_general_batched(dtype, data):
    b, m, k, n = (data.draw(st.integers(1, 6)) for _ in range(4))
    x = data.draw(scaled_arrays((b, m, k), dtype))
    y = data.draw(scaled_arrays((b, n, k), dtype))
    out = check_scaled(
        lambda x, y: jnp.einsum("bmk,bnk->bmn", x, y), [x, y], dtype, ulps=2 * k + 4, normwise=True
    )
    assert out.dtype == dtype


@given(data=st.data())
def test_arithmetic_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((3, 4), jnp.float16))
    y = data.draw(scaled_arrays((3, 4), jnp.float16))
    check_e8m0_matches(lambda a, b: lax.add(a, b) * b, [x, y])
