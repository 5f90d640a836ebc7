"""Scale rules for add, sub, mul, div, neg and dot_general against a float64 reference, and
the range guard on sums (``ScalifyConfig(guard_sums=True)``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FLOAT_DTYPES, check_e8m0_matches, check_scaled, scaled_arrays, shapes
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled._jax_internals import lax_primitives


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


@given(data=st.data())
def test_a_product_of_a_quotient_stays_finite_and_within_rounding(data):
    """A quotient of in-band float16 data reaches 2^15 (large over small, as ``rsqrt(v) / v``
    in a layer norm's gradient with ``v``'s data at the bottom of the band): it is
    range-guarded, so the product after it neither overflows nor loses precision."""
    shape = data.draw(shapes())
    large = data.draw(scaled_arrays(shape, jnp.float16, low=2.0**4, high=2.0**7))
    small = data.draw(scaled_arrays(shape, jnp.float16, low=2.0**-8, high=2.0**-6))
    cotangent = data.draw(scaled_arrays(shape, jnp.float16, low=2.0**4, high=2.0**7))
    check_scaled(lambda a, v, g: a / v * g, [large, small, cotangent], jnp.float16)


# --- ScalifyConfig(guard_sums=True) ---------------------------------------------------------

GUARDED_SUMS = {
    "add": lax.add,
    "sub": lax.sub,
    "add_any": lambda a, b: lax_primitives.add_jaxvals_p.bind(a, b),
    "concatenate": lambda a, b: lax.concatenate([a, b], 0),
    "stack": lambda a, b: jnp.stack([a, b]),
}


@pytest.mark.parametrize("dtype", [jnp.float16])
@pytest.mark.parametrize("name", sorted(GUARDED_SUMS))
@given(data=st.data())
def test_guarded_sums_match_float64(name, dtype, data):
    """Sums formed in float32 and range-guarded: within format rounding at any scales."""
    shape = data.draw(shapes())
    x = data.draw(scaled_arrays(shape, dtype))
    y = data.draw(scaled_arrays(shape, dtype))
    with js.ScalifyConfig(guard_sums=True):
        check_scaled(GUARDED_SUMS[name], [x, y], dtype, normwise=True)


def _with_zero_at_a_large_scale(name: str, config: js.ScalifyConfig) -> tuple:
    """``GUARDED_SUMS[name]`` of float16 values at scale 1 and zeros at scale 2^20 (the
    ``x * sigmoid'(x)`` term of an activation gradient at inputs around 2^20): the result
    and the exact values."""
    values = jnp.asarray([0.7, -1.3, 0.01, 2.5], jnp.float16)
    x = js.ScaledArray(values, jnp.float32(1.0))
    # A rule's run-time zero keeps its scale (a zero the user builds takes the smallest scale
    # instead: test_user_values.py); _trusted builds it as a rule would.
    zero = js.ScaledArray._trusted(jnp.zeros(4, jnp.float16), jnp.float32(2.0**20))
    fn = GUARDED_SUMS[name]
    out = jax.jit(js.scalify(fn, config=config))(x, zero)
    expected = np.asarray(fn(values, jnp.zeros(4, jnp.float16)), np.float64)
    return np.asarray(js.asarray(out, jnp.float32), np.float64), expected


@pytest.mark.parametrize("name", ["add", "sub"])
def test_add_and_sub_keep_a_term_whose_partner_is_zero_at_a_large_scale_with_guard_sums(name):
    """The zeros' scale 2^20 is the common scale: the other operand's float16 data
    underflows by default; ``guard_sums`` re-centres the float32 sum and keeps it exact."""
    default, expected = _with_zero_at_a_large_scale(name, js.ScalifyConfig())
    assert np.max(np.abs(default - expected)) > 1e-3  # underflowed
    guarded, expected = _with_zero_at_a_large_scale(name, js.ScalifyConfig(guard_sums=True))
    np.testing.assert_array_equal(guarded, expected)


@pytest.mark.parametrize("name", ["add_any", "concatenate", "stack"])
def test_accumulations_and_joins_keep_a_term_whose_partner_is_zero_at_a_large_scale(name):
    """Gradient accumulation and joins are range-guarded whenever ``guard`` is on."""
    out, expected = _with_zero_at_a_large_scale(name, js.ScalifyConfig())
    np.testing.assert_array_equal(out, expected)
    unguarded, expected = _with_zero_at_a_large_scale(name, js.ScalifyConfig(guard=False))
    assert np.max(np.abs(unguarded - expected)) > 1e-3  # underflowed
