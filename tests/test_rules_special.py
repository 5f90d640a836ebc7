"""Scale rules for the special functions (incomplete gamma and beta, zeta, scaled Bessel) and
for random sampling with float parameters (random_gamma, rng_uniform).

The special functions are evaluated on the represented values in float32 and returned at
scale 1 through the range guard, so the reference is the float64 function of the represented
values: SciPy's (an independent implementation, and no compilation), or JAX's in float64 for
``igamma_grad_a``, which SciPy lacks. The tolerance is a few ulps of the data dtype, plus
XLA's own float32 inaccuracy (``LIBRARY_ULPS32``, measured: the incomplete gamma and beta
functions lose hundreds of float32 ulps), plus the smallest spacing of the data dtype at the
output scale (and float32's flush-to-zero limit), below which no rule can represent a result.

Every dtype the primitives accept (float32, float16, bfloat16) is tested. Each function is
compiled once per dtype and input structure (:func:`helpers.scalified_jit`, fixed shapes):
the scales are runtime values, so hypothesis examples do not recompile.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special
from helpers import (
    FLOAT_DTYPES,
    assert_close,
    assert_pow2_scales,
    check_e8m0_matches,
    eps,
    reference64,
    scaled_arrays,
    scalified_jit,
    value64,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

few = settings(max_examples=max(3, settings.default.max_examples // 3))
SHAPE = (4, 6)

# name: (fn, [(data low, data high, min scale exponent, max scale exponent) per operand]).
# Represented values: gamma shapes a in [2^-4, 32], zeta's q >= 1/8 so that zeta(x, q) <=
# 2^48 (past float16's range: the guard must step in), betainc's x in (0, 1).
POSITIVE = (0.5, 4.0, -3, 3)
FUNCTIONS = {
    "igamma": (lax.igamma, [POSITIVE, POSITIVE]),
    "igammac": (lax.igammac, [POSITIVE, POSITIVE]),
    "igamma_grad_a": (lax.igamma_grad_a, [POSITIVE, POSITIVE]),
    "betainc": (lax.betainc, [(0.5, 4.0, -2, 2), (0.5, 4.0, -2, 2), (0.05, 0.95, -3, 0)]),
    "zeta": (lax.zeta, [(1.5, 4.0, 0, 2), (0.5, 4.0, -2, 2)]),
    "bessel_i0e": (lax.bessel_i0e, [(-4.0, 4.0, -40, 40)]),
    "bessel_i1e": (lax.bessel_i1e, [(-4.0, 4.0, -40, 40)]),
}
# XLA's float32 kernels against float64 (SciPy's and XLA's) on these domains: max elementwise
# error over 200k draws (igamma 172 ulps, igammac 440, igamma_grad_a 165, betainc 1155, zeta
# 5.4, bessel_i0e 3, bessel_i1e 8.6), with a margin. Negligible next to a float16 or bfloat16 ulp.
LIBRARY_ULPS32 = {
    "igamma": 256,
    "igammac": 640,
    "igamma_grad_a": 256,
    "betainc": 1600,
    "zeta": 8,
    "bessel_i0e": 4,
    "bessel_i1e": 12,
}
FTZ = 2.0**-126  # float32 results below this flush to zero on CPU
SCIPY = {
    lax.igamma: scipy.special.gammainc,
    lax.igammac: scipy.special.gammaincc,
    lax.betainc: scipy.special.betainc,
    lax.zeta: scipy.special.zeta,
    lax.bessel_i0e: scipy.special.i0e,
    lax.bessel_i1e: scipy.special.i1e,
}


def _atol(out, dtype) -> float:
    """Smallest spacing of ``dtype`` data at ``out``'s scale, or float32's flush limit."""
    scale = float(out.scale) if isinstance(out, js.ScaledArray) else 1.0
    spacing = float(ml_dtypes.finfo(jnp.dtype(dtype)).smallest_subnormal)
    return spacing * scale + FTZ


def _ulps(name: str, dtype) -> float:
    return 2 + LIBRARY_ULPS32[name] * eps(jnp.float32) / eps(dtype)


def _reference(fn, inputs) -> np.ndarray:
    """``fn`` in float64 on the represented values of ``inputs``."""
    if fn in SCIPY:
        return SCIPY[fn](*[value64(x) for x in inputs])
    return reference64(fn, *inputs)


def _check(fn, inputs, dtype, ulps: float):
    """``jit(scalify(fn))`` (compiled once per fn) against ``fn`` in float64."""
    out = scalified_jit(fn)(*inputs)
    assert_pow2_scales(out)
    assert out.dtype == dtype and out.shape == np.shape(value64(inputs[0]))
    assert_close(out, _reference(fn, inputs), dtype, ulps=ulps, atol=_atol(out, dtype))
    return out


def _draw_operands(data, name: str, dtype) -> list[js.ScaledArray]:
    return [
        data.draw(scaled_arrays(SHAPE, dtype, low=lo, high=hi, min_exp=e0, max_exp=e1))
        for lo, hi, e0, e1 in FUNCTIONS[name][1]
    ]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@few
@given(data=st.data())
def test_special_function(name, dtype, data):
    inputs = _draw_operands(data, name, dtype)
    _check(FUNCTIONS[name][0], inputs, dtype, _ulps(name, dtype))


@pytest.mark.parametrize("name", ["betainc", "zeta"])
@few
@given(data=st.data())
def test_mixed_scaled_and_plain_operands(name, data):
    """A plain operand (its data alone, scale 1) next to scaled ones, in float16."""
    inputs = _draw_operands(data, name, jnp.float16)
    inputs[0] = inputs[0].data
    _check(FUNCTIONS[name][0], inputs, jnp.float16, _ulps(name, jnp.float16))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_bessel_huge_scale(dtype):
    """1.5·2^30 overflows float16: naive float16 gives i0e(inf) = 0. The rule evaluates in
    float32, and in float16 the guard keeps the ~1e-5 results (float16 subnormals at scale 1)
    at full precision."""
    x = js.ScaledArray(jnp.asarray([1.5, -1.5, 0.25, 3.0], dtype), jnp.float32(2.0**30))
    for fn in (lax.bessel_i0e, lax.bessel_i1e):
        out = _check(fn, [x], dtype, ulps=1)
        assert np.all(np.abs(value64(out)) > 5e-6)
        if dtype == jnp.float16:
            assert float(out.scale) < 2.0**-14  # the guard moved the small result into the scale
            assert np.all(np.abs(np.asarray(out.data, np.float64)) >= 1)  # normal float16 data
    if dtype == jnp.float16:
        naive = x.data * jnp.float16(2.0**15) * jnp.float16(2.0**15)  # data * scale: inf
        assert np.all(np.asarray(lax.bessel_i0e(naive)) == 0.0)


def test_zeta_pole_guarded():
    """zeta(4, q) ~ q^-4 near q = 0: 2^48 at q = 2^-12 overflows float16 at scale 1."""
    x = jnp.full((3,), 4.0, jnp.float16)
    q = js.ScaledArray(jnp.asarray([1.0, 1.5, 3.0], jnp.float16), jnp.float32(2.0**-12))
    out = _check(lax.zeta, [x, q], jnp.float16, ulps=2)
    assert float(out.scale) > 2.0**30


def test_tiny_bessel_i1e_keeps_relative_precision():
    """i1e(x) ~ x/2 near 0: at scale 2^-40 the guard keeps every float16 bit."""
    data = jnp.asarray(np.linspace(-4, 4, 33), jnp.float16)
    out = _check(lax.bessel_i1e, [js.ScaledArray(data, jnp.float32(2.0**-40))], jnp.float16, 1)
    np.testing.assert_array_equal(value64(out), np.asarray(data, np.float64) * 2.0**-41)


def test_special_e8m0_bit_identical():
    """E8M0 scales in, E8M0 scales out, same values (zeta's result is guarded: scale 2^41)."""
    a = js.ScaledArray(jnp.asarray([0.5, 1.0, 3.0], jnp.float16), jnp.float32(8.0))
    q = js.ScaledArray(jnp.asarray([0.25, 2.0, 3.5], jnp.float16), jnp.float32(2.0**-6))
    check_e8m0_matches(lambda a, q: (lax.zeta(a, q), lax.bessel_i1e(q)), [a, q])


def test_plain_inputs_run_untouched():
    x = jnp.asarray([0.5, 2.0], jnp.float32)
    np.testing.assert_array_equal(js.scalify(lax.bessel_i0e)(x), lax.bessel_i0e(x))


# --- random sampling ----------------------------------------------------------------------


@jax.jit
def _gamma(key, a):
    """Gamma(a) samples in ``a``'s dtype (jit: the unscaled program compiles once)."""
    return jax.random.gamma(key, a, dtype=a.dtype)


def test_random_gamma_bit_identical_to_plain():
    """float32: a scaled ``a`` samples exactly what the unscaled program does on the same key
    (0.08 is below 1: the sampler's boost path)."""
    key = jax.random.key(7)
    a = js.ScaledArray(jnp.asarray([[0.125, 0.5, 1.5], [0.02, 3.0, 0.75]]), jnp.float32(4.0))
    out = jax.jit(js.scalify(_gamma))(key, a)
    expected = _gamma(key, js.asarray(a))
    assert out.dtype == jnp.float32 and out.shape == a.shape
    np.testing.assert_array_equal(value64(out), np.asarray(expected, np.float64))


def test_random_gamma_narrow_samples_in_float32():
    """float16 ``a`` beyond the format's range (2^20 and up) is sampled by the float32 sampler
    on its value (more accurate than JAX's float16 one, so not the unscaled float16 program's
    samples); the samples (~2^20: past float16's range) come back rounded to float16,
    guarded."""
    key = jax.random.key(3)
    data = jnp.asarray([[0.125, 0.5, 1.5], [0.25, 3.0, 0.75]], jnp.float16)
    a = js.ScaledArray(data, jnp.float32(2.0**23))
    out = jax.jit(js.scalify(_gamma))(key, a)
    expected = _gamma(key, jnp.asarray(value64(a), jnp.float32))
    assert out.dtype == jnp.float16 and float(out.scale) > 1
    assert_close(out, np.asarray(expected, np.float64), jnp.float16, ulps=0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rng_uniform_scaled_bounds(dtype):
    """Bounds at scale 2^30 (past float16's range): uniform samples in [a, b), drawn in the
    data dtype at the bounds' scale. rng_uniform is stateful (no key: two programs never
    draw the same numbers), so the test checks the range and the mean of 2048 draws
    (standard error 0.64% of b - a; the bound is 3%)."""
    a = js.ScaledArray(jnp.asarray(1.0, dtype), jnp.float32(2.0**30))
    b = js.ScaledArray(jnp.asarray(0.75, dtype), jnp.float32(2.0**32))  # 3 * 2^30
    out = jax.jit(js.scalify(lambda a, b: lax.rng_uniform(a, b, (2048,))))(a, b)
    assert isinstance(out, js.ScaledArray) and out.dtype == dtype and out.shape == (2048,)
    assert np.all(np.isfinite(np.asarray(out.data, np.float64)))
    assert (float(out.scale) > 1) == (dtype == jnp.float16)  # guarded past float16's range
    values = value64(out) / 2.0**30
    top = values < 3 if dtype == jnp.float32 else values <= 3  # narrow draws round up to b,
    assert np.all((values >= 1) & top), (values.min(), values.max())  # as unscaled ones do
    assert abs(values.mean() - 2) < 0.06, values.mean()
    assert len(np.unique(values)) > 64


def test_rng_uniform_plain_lower_bound():
    """A plain lower bound (0) with a scaled upper one at 2^-20 (float16 subnormal at scale 1:
    16 values): the guard draws between normal float16 bounds, with full resolution."""
    b = js.ScaledArray(jnp.asarray(1.0, jnp.float16), jnp.float32(2.0**-20))
    out = jax.jit(js.scalify(lambda b: lax.rng_uniform(jnp.float16(0), b, (512,))))(b)
    values = value64(out) * 2.0**20
    assert np.all((values >= 0) & (values <= 1)) and abs(values.mean() - 0.5) < 0.06
    assert len(np.unique(values)) > 256
