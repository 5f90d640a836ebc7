"""Scale rules for complex numbers and the FFT: their results are plain complex arrays.

A ScaledArray holds real floating-point data times a positive power-of-two scale (array.py
refuses anything else), so complex values are never scaled: a rule that turns real scaled
inputs into a complex result returns it as a plain array, computed from the represented
values. These rules are exact: multiplying a float32 (or float64) datum by a power of two
only changes its exponent, so the result is the one the program computes on the represented
values, as long as those fit the format (``lax.complex``, ``conj`` and the FFT only accept
float32 and float64 real parts; narrow data is cast to float32 first, which keeps its scale).

* ``complex(re, im)``: the complex number of the two represented values.
* ``conj`` of a real ``x`` (``lax.conj``; ``jnp.conj`` returns a real input unchanged): the
  complex number ``x + 0j``.
* ``fft`` of a real input (``jnp.fft.rfft``, ``rfftn``, ...): the FFT is linear, so
  ``fft(d * s) = fft(d) * s``: the transform of the data, multiplied by the scale in the
  complex dtype. Floating-point FFTs commute with a power-of-two factor too (every step is an
  addition or a multiplication by a twiddle factor): the result is bit-identical to the FFT of
  the represented values while they stay in range. ``jnp.fft.fft`` of a real input first
  casts it to complex (a plain value), so its FFT runs untouched.
"""

from __future__ import annotations

import jax
from jax import lax

from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine.registry import register_scale_rule
from jax_scaled.scales import scale_f32, to_compute


@register_scale_rule(lax.complex_p)
def complex_rule(real: Value, imag: Value) -> jax.Array:
    """Plain complex: ``real + 1j * imag`` of the represented values (float32 or wider)."""
    return lax.complex_p.bind(to_compute(real), to_compute(imag))


@register_scale_rule(lax.conj_p)
def conj_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain complex: the conjugate of a real value is that value, with a zero imaginary part.

    Only real operands can be ScaledArrays, so this rule only meets ``lax.conj`` of a real
    array (whose result JAX types as complex).
    """
    return lax.conj_p.bind(to_compute(x), **params)


@register_scale_rule(lax.fft_p)
def fft_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain complex ``fft(data) * s`` (a real input: RFFT); exact, the FFT being linear."""
    out = lax.fft_p.bind(x.data, **params)
    return out * scale_f32(x).astype(out.dtype)
