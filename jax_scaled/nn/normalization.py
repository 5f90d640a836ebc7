"""Scale-aware layer and RMS normalisation (scalify paper, Appendix C.2).

Normalising ``x = d * s`` gives the same result as normalising the data ``d`` with the
stabiliser ``eps`` moved to the data's units (``eps / s**2``). Under scalify the rule does
exactly that, in float32, and returns the normalised data at scale 1 (smaller only when
``eps`` dominates a tiny variance): no statistic of the represented value is ever formed, so
a tiny variance neither underflows nor loses digits.

The backward pass has its own rule too (a ``jax.custom_vjp``, so reverse mode only): the
input gradient ``(g - mean g - y mean(g y)) / sigma`` (no ``mean g`` for RMS norm) is about
``g / sigma``, so it gets the scale ``scale(g) / s`` (times the forward's factor when ``eps``
dominates) and its data is formed from ``g``'s data and the normalised ``y``, like the
forward. Left to automatic propagation through the normalisation's body, the estimates of
its mean and variance reductions drift by about ``-log2(N) / 4`` bits.
The affine part (``* weight + bias``) is ordinary code that scalify propagates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.pow2.traced import pow2_reciprocal
from jax_scaled.scales import as_scaled, make_scale, round_scale, scale_f32, scale_mul


def _centered(x: jax.Array, center: bool) -> jax.Array:
    wide = x.astype(compute_dtype(x.dtype))
    return wide - jnp.mean(wide, axis=-1, keepdims=True) if center else wide


def _normalize_plain(x: jax.Array, eps: float, center: bool) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (no centering for RMS norm)."""
    wide = _centered(x, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    return (wide * lax.rsqrt(second_moment + eps)).astype(x.dtype)


_normalize_scaled = custom_scale(_normalize_plain, static_argnums=(1, 2))


def _data_normalizer(
    x: ScaledArray, eps: float, center: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(c, r, r0)``: the centred data ``c`` (float32), the factor ``r`` with ``y = c * r``
    (``r = s / sqrt(s^2 m + eps)``, ``m`` the data's second moment; about 1 for unit data)
    and ``r0``, the power-of-two estimate of ``r`` for unit data.

    ``r`` is written for ``s >= 1`` as ``1 / sqrt(m + eps / s^2)`` and for ``s < 1`` as is,
    so no term overflows. ``r0`` takes ``m = 1`` and the larger of the variance and ``eps``:
    ``min(1, s / sqrt(eps))``, exactly 1 unless ``eps`` dominates a tiny variance (where the
    result is ``x / sqrt(eps)``, small but still represented with unit data). The larger
    rather than the sum: ``1 / sqrt(1 + eps / s^2)``, a hair below 1, would round down to
    1/2 and leave the data at RMS 2.
    """
    s = scale_f32(x)
    large = s >= 1
    a = jnp.where(large, 1, lax.square(s))
    b = jnp.where(large, eps * lax.square(pow2_reciprocal(s)), eps)
    k = jnp.where(large, 1, s)
    wide = _centered(x.data, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    r = k * lax.rsqrt(a * second_moment + b)
    r0 = round_scale(lax.max(k * lax.rsqrt(lax.max(a, b)), jnp.float32(2.0**-126)))
    return wide, r, r0


@_normalize_scaled.defscale
def _normalize_rule(x: ScaledArray, eps: float, center: bool) -> ScaledArray:
    """Normalise the data, with ``eps`` in the data's units, without overflow at any scale.

    Unit-scaling assumption: the normalised value has RMS ``sqrt(var / (var + eps))``, 1
    unless ``eps`` dominates; the output scale is its power-of-two estimate ``r0``
    (:func:`_data_normalizer`).
    """
    x = as_scaled(x)
    wide, r, r0 = _data_normalizer(x, eps, center)
    data = (wide * (r * pow2_reciprocal(r0))).astype(x.dtype)
    return ScaledArray(data, make_scale(r0, x))


def _normalize_grad_plain(x: jax.Array, g: jax.Array, eps: float, center: bool) -> jax.Array:
    """The input gradient ``(g - mean g - y mean(g y)) / sigma``, ``mean g`` if ``center``."""
    wide = _centered(x, center)
    inverse_sigma = lax.rsqrt(jnp.mean(lax.square(wide), axis=-1, keepdims=True) + eps)
    y = wide * inverse_sigma
    g = g.astype(wide.dtype)
    inner = _centered(g, center) - y * jnp.mean(g * y, axis=-1, keepdims=True)
    return (inner * inverse_sigma).astype(x.dtype)


_normalize_grad = custom_scale(_normalize_grad_plain, static_argnums=(2, 3))


@_normalize_grad.defscale
def _normalize_grad_rule(x: ScaledArray, g: ScaledArray, eps: float, center: bool) -> ScaledArray:
    """The input gradient at scale ``scale(g) * r0 / s``.

    ``1 / sigma = r / s`` (:func:`_data_normalizer`), so the gradient is
    ``(scale(g) / s) * r * (g_d - mean g_d - y mean(g_d y))`` with ``g_d`` the cotangent's
    data. For unit-normal ``g_d`` independent of ``y``, the bracket has RMS about 1 (its two
    corrections are ``O(1 / sqrt(N))``); ``r`` is about ``r0``, the forward's output scale.
    """
    x, g = as_scaled(x), as_scaled(g)
    wide, r, r0 = _data_normalizer(x, eps, center)
    y = wide * r
    g_data = g.data.astype(wide.dtype)
    inner = _centered(g_data, center) - y * jnp.mean(g_data * y, axis=-1, keepdims=True)
    data = (inner * (r * pow2_reciprocal(r0))).astype(x.dtype)
    scale = round_scale(scale_mul(scale_mul(scale_f32(g), r0), pow2_reciprocal(scale_f32(x))))
    return ScaledArray(data, make_scale(scale, x, g))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _normalize(x: jax.Array, eps: float, center: bool) -> jax.Array:
    return _normalize_scaled(x, eps, center)


def _normalize_fwd(x, eps, center):
    return _normalize_scaled(x, eps, center), x


def _normalize_bwd(eps, center, x, g):
    return (_normalize_grad(x, g, eps, center),)


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


def _affine(y: jax.Array, weight: jax.Array | None, bias: jax.Array | None) -> jax.Array:
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-6,
) -> jax.Array:
    """Layer normalisation over the last axis, then ``* weight + bias`` when given.

    Under scalify the data is normalised directly and the result has scale 1; the input
    gradient gets the cotangent's scale divided by the input's (module docstring).

    Example:
        >>> y = js.nn.layer_norm(jnp.array([1.0, 2.0, 3.0]), eps=0.0)
        >>> [round(v, 4) for v in y.tolist()]
        [-1.2247, 0.0, 1.2247]
    """
    return _affine(_normalize(x, float(eps), True), weight, bias)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """RMS normalisation over the last axis, then ``* weight`` when given.

    Under scalify the data is normalised directly and the result has scale 1; the input
    gradient gets the cotangent's scale divided by the input's (module docstring).

    Example:
        >>> js.nn.rms_norm(jnp.array([3.0, -3.0]), eps=0.0).tolist()
        [1.0, -1.0]
    """
    return _affine(_normalize(x, float(eps), False), weight, None)
