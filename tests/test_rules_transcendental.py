"""Scale rules for exp, log, sin, tanh, atan2, pow, ... against a float64 reference.

The tolerance is relative (a few ulps of the data dtype) plus, where a result may land below
the data format's normal range at the rule's output scale, the format's smallest spacing
there (``_atol``): the representation limit of that scale, which the test computes itself.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    check_e8m0_matches,
    check_scaled,
    eps,
    scaled_arrays,
    scales,
    shapes,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.scipy import special

import jax_scaled as js

# Each example compiles a fresh program: the wide parametrized sweeps draw a third of the
# profile's examples (4 in CI, more under HYPOTHESIS_PROFILE=thorough).
few_examples = settings(max_examples=max(3, settings.default.max_examples // 3))


def _unit(s: float, dtype) -> float:
    return 1.0


def _linear(s: float, dtype) -> float:
    return min(s, 1.0)


def _floored(estimate, bound: float):
    """``estimate`` floored so that ``bound / scale`` fits the data dtype (as the rules do)."""
    return lambda s, dtype: max(
        estimate(s, dtype),
        2.0 ** math.ceil(math.log2(bound / float(ml_dtypes.finfo(jnp.dtype(dtype)).max))),
    )


def _atol(dtype, out_scale: float, ulps: float = 1.0) -> float:
    """Smallest spacing of ``dtype`` data at ``out_scale`` (float32 subnormals flush on CPU)."""
    spacing = max(float(ml_dtypes.finfo(jnp.dtype(dtype)).smallest_subnormal), 2.0**-126)
    return ulps * spacing * out_scale


# name: (fn, output-scale estimate, data range (None: normal), scale exponent range).
# Exp-like functions get |value| <= 8, so the result fits float16 at scale 1. XLA's float32
# erfc is off by up to ~32 float32 ulps in its tail (erfc(4) ~ 1e-8), whatever the scale.
LIBRARY_ULPS32 = {"erfc": 40}
UNARY = {
    "exp": (jnp.exp, _unit, (-2, 2), (-40, 2)),
    "exp2": (jnp.exp2, _unit, (-2, 2), (-40, 2)),
    "cosh": (jnp.cosh, _unit, (-2, 2), (-40, 2)),
    "cos": (jnp.cos, _unit, None, (-40, 40)),
    "logistic": (jax.nn.sigmoid, _unit, None, (-40, 40)),
    "erfc": (special.erfc, _unit, None, (-40, 40)),
    "sin": (jnp.sin, _linear, None, (-40, 40)),
    "tan": (jnp.tan, _linear, None, (-40, 40)),
    "tanh": (jnp.tanh, _linear, None, (-40, 40)),
    "atan": (jnp.arctan, _linear, None, (-40, 40)),
    "erf": (special.erf, _linear, None, (-40, 40)),
    "sinh": (jnp.sinh, _linear, (-2, 2), (-40, 2)),
    "expm1": (jnp.expm1, _linear, (-2, 2), (-40, 2)),
    "log1p": (jnp.log1p, _linear, None, (-40, 40)),
    "erf_inv": (special.erfinv, _floored(_linear, 6.0), (-0.99, 0.99), (-40, 0)),
    "asin": (jnp.arcsin, _floored(_linear, math.pi / 2), (-0.99, 0.99), (-40, 0)),
    "atanh": (jnp.arctanh, _linear, (-0.99, 0.99), (-40, 0)),
    "asinh": (jnp.arcsinh, _linear, None, (-40, 40)),
    "acos": (jnp.arccos, _floored(_unit, math.pi), (-0.99, 0.99), (-40, 0)),
    "acosh": (jnp.arccosh, _unit, (1.01, 4.0), (0, 40)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(UNARY))
@few_examples
@given(data=st.data())
def test_unary(name, dtype, data):
    fn, estimate, domain, (min_exp, max_exp) = UNARY[name]
    low, high = domain or (None, None)
    x = data.draw(
        scaled_arrays(
            data.draw(shapes()), dtype, min_exp=min_exp, max_exp=max_exp, low=low, high=high
        )
    )
    out_scale = estimate(float(x.scale), dtype)
    ulps = 4 + LIBRARY_ULPS32.get(name, 0) * eps(jnp.float32) / eps(dtype)
    out = check_scaled(fn, [x], dtype, ulps=ulps, atol=_atol(dtype, out_scale))
    assert out.dtype == dtype
    assert float(out.scale) == out_scale


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", ["sin", "tan", "tanh", "atan", "sinh", "expm1", "log1p"])
def test_tiny_inputs_keep_relative_precision(name, dtype):
    """At scale 2^-40 the represented values underflow float16; f(x) ~ x keeps every bit."""
    data = jnp.asarray(np.linspace(-4, 4, 33), dtype)
    x = js.ScaledArray(data, jnp.float32(2.0**-40))
    out = check_scaled(UNARY[name][0], [x], dtype, ulps=1)
    np.testing.assert_array_equal(np.asarray(out.data, np.float64), np.asarray(data, np.float64))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_log(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype))  # negatives give NaN, as in f64
    check_scaled(jnp.log, [x], dtype, ulps=2)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("exponent", [-100, -40, 40, 100])
def test_log_extreme_scales(dtype, exponent):
    """log(d·2^e) = log(d) + e·ln2 without forming d·2^e; values near 1 keep full precision."""
    data = jnp.asarray([0.0, 2.0**-24, 0.3, 1.0, 1.5, 1000.0, -1.0, np.inf], dtype)
    x = js.ScaledArray(data, jnp.float32(2.0**exponent))
    out = check_scaled(jnp.log, [x], dtype, ulps=1)
    assert float(out.scale) == 2.0 ** math.floor(math.log2(abs(exponent) * math.log(2)))
    near_one = js.ScaledArray(jnp.asarray([1 - 2.0**-11, 1 + 2.0**-10], dtype), jnp.float32(1))
    check_scaled(jnp.log, [near_one], dtype, ulps=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_log_of_subnormal_data(dtype):
    """Subnormal data (float32's, and bfloat16's, which stay subnormal in float32) is split
    with integer operations: XLA:CPU flushes subnormal operands of float arithmetic."""
    data = jnp.asarray([1e-40, 2.0**-133, 3 * 2.0**-140, -(2.0**-130), 0.5], dtype)
    x = js.ScaledArray(data, jnp.float32(2.0**100))
    check_scaled(jnp.log, [x], dtype, ulps=1)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_atan2(dtype, data):
    shape = data.draw(shapes())
    y, x = (data.draw(scaled_arrays(shape, dtype)) for _ in range(2))
    estimate = _floored(lambda s, _: min(1.0, s), math.pi)  # pi / scale must fit the format
    out_scale = estimate(float(y.scale) / float(x.scale), dtype)
    out = check_scaled(jnp.arctan2, [y, x], dtype, atol=_atol(dtype, out_scale))
    assert float(out.scale) == out_scale


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("exponent", [2.0, 0.5, -1.0, 3.0, -0.5])
@few_examples
@given(data=st.data())
def test_pow_constant_exponent(exponent, dtype, data):
    """x ** c at scales 2^-40..2^40 (2^-20..2^20 for |c| = 3: the result must fit float32)."""
    limit = 20 if abs(exponent) > 2 else 40
    base = data.draw(
        scaled_arrays(data.draw(shapes()), dtype, low=0.25, high=4, min_exp=-limit, max_exp=limit)
    )
    sign = data.draw(st.sampled_from([1, -1]))
    base = js.ScaledArray(sign * base.data, base.scale)  # negative base: NaN unless c integral
    check_scaled(lambda a: a**exponent, [base], dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few_examples
@given(data=st.data())
def test_pow_array_exponent(dtype, data):
    shape = data.draw(shapes())
    base = data.draw(scaled_arrays(shape, dtype, low=0.5, high=2, min_exp=-4, max_exp=4))
    exponent = data.draw(scaled_arrays(shape, dtype, low=-2, high=2, min_exp=-2, max_exp=0))
    check_scaled(lax.pow, [base, exponent], dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few_examples
@given(data=st.data())
def test_pow_integer_and_scalar_operands(dtype, data):
    shape = data.draw(shapes())
    base = data.draw(scaled_arrays(shape, dtype, low=0.5, high=3, min_exp=-2, max_exp=2))
    n = np.arange(np.prod(shape)).reshape(shape) % 7 - 3  # -3..3, odd and even, both signs
    base = js.ScaledArray(jnp.where(n % 2 == 0, -1, 1).astype(dtype) * base.data, base.scale)
    check_scaled(lax.pow, [base, jnp.asarray(n, jnp.int32)], dtype)
    power = data.draw(scaled_arrays(shape, dtype, low=-3, high=3, min_exp=-4, max_exp=0))
    check_scaled(lambda p: lax.pow(jnp.full_like(p, 2.0), p), [power], dtype)


def test_rules_keep_accuracy_param():
    x = js.ScaledArray(jnp.asarray([0.5, -1.0], jnp.float16), jnp.float32(2.0**-30))
    fn = lambda a: lax.tanh(a, accuracy=lax.Tolerance(atol=0.0, rtol=1e-3))  # noqa: E731
    check_scaled(fn, [x], jnp.float16, ulps=1)


@few_examples
@given(data=st.data(), s=scales())
def test_transcendental_e8m0_bit_identical(data, s):
    x = data.draw(scaled_arrays((3, 4), jnp.float16, low=0.1, high=4))
    x = js.ScaledArray(x.data, jnp.float32(s))
    y = data.draw(scaled_arrays((3, 4), jnp.float16))
    check_e8m0_matches(lambda a: jnp.exp(a * 2.0**-40), [x])
    check_e8m0_matches(lambda a, b: (jnp.log(a), jnp.tanh(b), jnp.arctan2(b, a), a**-0.5), [x, y])


def test_plain_inputs_run_untouched():
    x = jnp.asarray([0.5, 2.0], jnp.float32)
    np.testing.assert_array_equal(js.scalify(jnp.log)(x), jnp.log(x))


def _log_of_scale(s: float) -> float:
    return abs(math.log2(s)) * math.log(2.0)


def _pow2_floor(value: float) -> float:
    return 2.0 ** math.floor(math.log2(value))


GAMMA_LIKE = {  # name: (fn, output-scale estimate before rounding)
    "lgamma": (special.gammaln, lambda s: max(1.0, _log_of_scale(s) * max(1.0, s))),
    "digamma": (special.digamma, lambda s: 1 / s if s < 1 else max(1.0, _log_of_scale(s))),
    "trigamma": (lambda x: special.polygamma(1, x), lambda s: s**-2 if s < 1 else 1 / s),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(GAMMA_LIKE))
@few_examples
@given(data=st.data())
def test_gamma_like(name, dtype, data):
    """Normwise: lgamma and digamma have roots (1 and 2; 1.46) where relative error is moot.
    XLA's float32 lgamma, digamma and polygamma are off by tens of float32 ulps."""
    fn, estimate = GAMMA_LIKE[name]
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype, low=0.05, high=4.0))
    ulps = 4 + 48 * eps(jnp.float32) / eps(dtype)
    out = check_scaled(fn, [x], dtype, ulps=ulps, normwise=True)
    assert float(out.scale) == _pow2_floor(estimate(float(x.scale)))


@pytest.mark.parametrize(
    "fn", [jnp.exp, jnp.exp2, jnp.cos, jnp.cosh, jax.nn.sigmoid, special.erfc, jnp.arccos]
)
def test_a_unit_scale_estimate_is_a_trace_time_constant(fn):
    # A traced 1 once kept scale chains from running uncut through softmax; the remainders
    # that compute shared scales once cut them now, and XLA folded the traced 1 anyway.
    x = js.scaled_array(jnp.linspace(1.0, 2.0, 64, dtype=jnp.float16), 2.0**-3)
    outvars = jax.make_jaxpr(js.scalify(fn))(x).jaxpr.outvars
    assert isinstance(outvars[1], jax.extend.core.Literal) and outvars[1].val == 1.0
