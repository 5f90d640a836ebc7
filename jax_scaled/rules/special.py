"""Scale rules: special functions and random sampling with float parameters.

The incomplete gamma and beta functions (``igamma``, ``igammac``, ``igamma_grad_a``,
``regularized_incomplete_beta``), the Hurwitz zeta function (``zeta``) and the exponentially
scaled Bessel functions (``bessel_i0e``, ``bessel_i1e``) have no scale structure: ``f(d * s)``
is not ``f(d) * g(s)``, and none of them has a simple asymptotic that would give an output
scale from the input scales. Each rule therefore binds the primitive on the represented
values in the compute dtype (float32, or wider for wider data; :func:`to_compute`), so that
no ``data * scale`` is ever formed in a narrow dtype, and returns the result at scale 1 in
the program's dtype through the range guard (:func:`guarded`): float16 and 8-bit results
outside the format's range (``zeta`` near its pole, ``igamma_grad_a``, tiny tails of
``igamma``) come back as a ScaledArray instead of overflowing or flushing to zero.

``random_gamma`` (``jax.random.gamma``) samples ``Gamma(a)`` with the same rule: the key
passes through, and float32 (or float64) ``a`` gives bit-identical samples to the unscaled
program. Narrow ``a`` is sampled in float32, a more accurate sampler than the narrow one
JAX would run, so its samples differ from the unscaled program's.

``rng_uniform`` (``lax.rng_uniform``) does have scale structure: ``a + (b - a) u`` commutes
with multiplication by a power of two. Its (scalar) bounds' values go through the range
guard together, and the draw is made in the data dtype between the guarded bounds, at their
scale: in the data format's range (scale 1) this is the very draw of the unscaled program;
out of it (or with plain and scaled bounds of very different magnitudes) the bounds move
into the format at a common power-of-two scale instead of overflowing or underflowing.

``random_gamma_grad`` is a function, not a primitive, in this JAX (``lax.random_gamma_grad``
expands into ordinary lax primitives, each with its own rule): it needs no rule here.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.scales import as_scaled, guarded, to_compute


def _evaluate(primitive, *operands: Value, **params) -> ScaledArray:
    """Bind ``primitive`` on the represented values of ``operands`` (all of one floating dtype,
    scaled or plain) in the compute dtype; the result at scale 1, range-guarded."""
    dtype = as_scaled(operands[0]).dtype
    value = primitive.bind(*[to_compute(x) for x in operands], **params)
    return guarded(value, np.float32(1.0), dtype, *operands)


@register_scale_rule(lax.igamma_p, properties=Property.POINTWISE)
def igamma_rule(a: Value, x: Value, **params) -> ScaledArray:
    """igamma(a, x), the regularized lower incomplete gamma P(a, x), on the values."""
    return _evaluate(lax.igamma_p, a, x, **params)


@register_scale_rule(lax.igammac_p, properties=Property.POINTWISE)
def igammac_rule(a: Value, x: Value, **params) -> ScaledArray:
    """igammac(a, x), the regularized upper incomplete gamma Q(a, x), on the values."""
    return _evaluate(lax.igammac_p, a, x, **params)


@register_scale_rule(lax.igamma_grad_a_p, properties=Property.POINTWISE)
def igamma_grad_a_rule(a: Value, x: Value, **params) -> ScaledArray:
    """igamma_grad_a(a, x), dP(a, x)/da, on the values."""
    return _evaluate(lax.igamma_grad_a_p, a, x, **params)


@register_scale_rule(lax.regularized_incomplete_beta_p, properties=Property.POINTWISE)
def regularized_incomplete_beta_rule(a: Value, b: Value, x: Value, **params) -> ScaledArray:
    """regularized_incomplete_beta(a, b, x), I_x(a, b) (``lax.betainc``), on the values."""
    return _evaluate(lax.regularized_incomplete_beta_p, a, b, x, **params)


@register_scale_rule(lax.zeta_p, properties=Property.POINTWISE)
def zeta_rule(x: Value, q: Value, **params) -> ScaledArray:
    """zeta(x, q), the Hurwitz zeta function, on the values (guarded: it has a pole at q=0)."""
    return _evaluate(lax.zeta_p, x, q, **params)


@register_scale_rule(lax.bessel_i0e_p, properties=Property.POINTWISE)
def bessel_i0e_rule(x: Value, **params) -> ScaledArray:
    """bessel_i0e(x) = exp(-|x|) I0(x), on the value (in (0, 1], ~1/sqrt(2 pi |x|) for large x)."""
    return _evaluate(lax.bessel_i0e_p, x, **params)


@register_scale_rule(lax.bessel_i1e_p, properties=Property.POINTWISE)
def bessel_i1e_rule(x: Value, **params) -> ScaledArray:
    """bessel_i1e(x) = exp(-|x|) I1(x), on the value (|i1e| < 0.22; ~x/2 near 0)."""
    return _evaluate(lax.bessel_i1e_p, x, **params)


if jxi.random_gamma_p is not None:

    @register_scale_rule(jxi.random_gamma_p)
    def random_gamma_rule(key: Any, a: Value, **params) -> ScaledArray:
        """random_gamma(key, a): Gamma(a) samples (or their logs) drawn on the value of ``a``
        in the compute dtype; the key passes through; the samples at scale 1, guarded."""
        a = as_scaled(a)
        value = jxi.random_gamma_p.bind(key, to_compute(a), **params)
        return guarded(value, np.float32(1.0), a.dtype, a)


@register_scale_rule(lax.rng_uniform_p)
def rng_uniform_rule(a: Value, b: Value, **params) -> ScaledArray:
    """rng_uniform(a, b, shape): uniform in [a, b), drawn in the data dtype between the bounds'
    values range-guarded together; the output has the guarded bounds' scale (exact: the draw
    commutes with power-of-two scaling)."""
    dtype = as_scaled(a).dtype
    bounds = guarded(jnp.stack([to_compute(a), to_compute(b)]), np.float32(1.0), dtype, a, b)
    data = lax.rng_uniform_p.bind(bounds.data[0], bounds.data[1], **params)
    return ScaledArray(data, bounds.scale)
