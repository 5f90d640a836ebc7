"""Scale rules for complex numbers and the FFT: plain complex results, exact from the data.

``lax.complex``, ``lax.conj`` and the FFT only take float32 or float64 real parts (XLA has no
complex type for narrower formats, and ``jnp.fft.rfft`` of float16 data is a dtype error), so
narrow data is cast to float32 first in these tests: the cast keeps the scale exactly.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FLOAT_DTYPES, eps, reference64, scaled_arrays, shapes, value64
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

# Every example compiles two or three programs: a third of the profile's examples per test.
few = settings(max_examples=max(3, settings.default.max_examples // 3))


def _assert_plain_complex_equal(got, want) -> None:
    """``got`` is a plain complex array whose real and imaginary parts equal ``want``'s."""
    assert not isinstance(got, js.ScaledArray) and jnp.iscomplexobj(got), type(got)
    np.testing.assert_array_equal(np.real(got), np.real(want))
    np.testing.assert_array_equal(np.imag(got), np.imag(want))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_complex_and_conj_of_scaled_reals(dtype, data):
    shape = data.draw(shapes())
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))

    def fn(x, y):
        x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
        return {"complex": lax.complex(x32, y32), "conj": lax.conj(x32), "jnp_conj": jnp.conj(x)}

    out = jax.jit(js.scalify(fn))(x, y)
    expected = reference64(fn, x, y)
    # Represented values of narrow data at |log2 s| <= 40 are exact float32 numbers.
    _assert_plain_complex_equal(out["complex"], expected["complex"])
    _assert_plain_complex_equal(out["conj"], expected["conj"])
    # jnp.conj of a real array is the array itself (no conj primitive): it stays scaled.
    assert isinstance(out["jnp_conj"], js.ScaledArray) and out["jnp_conj"].scale == x.scale
    np.testing.assert_array_equal(value64(out["jnp_conj"]), value64(x))


def _ffts(x):
    return {
        "rfft": jnp.fft.rfft(x),
        "rfftn": jnp.fft.rfftn(x),
        "fft": jnp.fft.fft(x),  # casts to complex first: a plain FFT
        "roundtrip": jnp.fft.irfft(jnp.fft.rfft(x), n=x.shape[-1]),
    }


@few
@given(data=st.data())
def test_fft_of_a_scaled_real_input(data):
    """float32 only: the FFT takes float32 or float64 inputs (float64 needs x64)."""
    shape = data.draw(shapes(max_side=8))
    x = data.draw(scaled_arrays(shape, jnp.float32))
    out = jax.jit(js.scalify(_ffts))(x)
    # fft(data) * s is bit-identical to the FFT of the represented values in float32 ...
    plain = jax.jit(_ffts)(jnp.asarray(value64(x), jnp.float32))
    for name, value in out.items():
        assert not isinstance(value, js.ScaledArray), name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(plain[name]), err_msg=name)
    # ... and within a few roundings per FFT stage of the float64 transform (normwise).
    expected = reference64(_ffts, x)
    tolerance = (2 * math.log2(math.prod(shape)) + 2) * eps(jnp.float32)
    for name, value in out.items():
        want = np.asarray(expected[name])
        error = np.max(np.abs(np.asarray(value, want.dtype) - want))
        assert error <= tolerance * np.max(np.abs(want)), (name, error)


@few
@given(data=st.data())
def test_rfft_of_narrow_data_cast_to_float32(data):
    x = data.draw(scaled_arrays(data.draw(shapes(max_dims=2, max_side=8)), jnp.float16))
    out = jax.jit(js.scalify(lambda x: jnp.fft.rfft(x.astype(jnp.float32))))(x)
    expected = jnp.fft.rfft(jnp.asarray(value64(x), jnp.float32))
    _assert_plain_complex_equal(out, expected)
