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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.pow2.static import MAX_SCALE_EXPONENT, MIN_SCALE_EXPONENT, is_static
from jax_scaled.pow2.traced import as_float32, pow2_reciprocal
from jax_scaled.pow2.xla import computed_once
from jax_scaled.scales import (
    as_scaled,
    make_scale,
    ratio_to_pow2,
    round_scale,
    scale_f32,
    scale_mul,
)


def _centered(x: jax.Array, center: bool) -> jax.Array:
    wide = x.astype(compute_dtype(x.dtype))
    return wide - jnp.mean(wide, axis=-1, keepdims=True) if center else wide


def _normalize_plain(x: jax.Array, eps: float, center: bool) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (no centering for RMS norm)."""
    wide = _centered(x, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    return (wide * lax.rsqrt(second_moment + eps)).astype(x.dtype)


_normalize_scaled = custom_scale(_normalize_plain, static_argnums=(1, 2))


_MIN_SCALE = np.float32(2.0**MIN_SCALE_EXPONENT)
_MAX_SCALE = np.float32(2.0**MAX_SCALE_EXPONENT)


class _Normalizer(NamedTuple):
    """The normalisation of data ``d`` at scale ``s``: ``y = centred * r`` with the per-row
    factor ``r = k * rows`` (``r = s / sqrt(s^2 m + eps)``, ``m`` the data's second moment;
    about 1 for unit data), and ``r0``, the power-of-two estimate of ``r`` for unit data
    (:func:`_unit_estimate`).

    ``r`` is written for ``s >= 1`` as ``1 / sqrt(m + eps / s^2)`` (``k = 1``) and for
    ``s < 1`` as ``s / sqrt(s^2 m + eps)`` (``k = s``), so no term overflows; with no ``eps``
    it is ``1 / sqrt(m)``, which no ``s`` can flush.
    """

    centred: jax.Array  # float32
    rows: jax.Array
    k: jax.Array
    r0: jax.Array

    @property
    def r(self) -> jax.Array:
        return self.rows if is_static(self.k) else self.k * self.rows

    @property
    def data_factor(self) -> jax.Array:
        """``r / r0``, with the exact power of two ``k / r0`` formed first: ``r`` alone can be
        below float32's normal range (``s = 2^-126``, ``eps = 4``) where ``r / r0`` is not."""
        if is_static(self.r0):
            return self.rows
        return self.rows * computed_once(ratio_to_pow2(self.k, self.r0))


def _data_normalizer(x: ScaledArray, eps: float, center: bool) -> _Normalizer:
    s = scale_f32(x)
    wide = _centered(x.data, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    if np.float32(eps) == 0:
        one = np.float32(1)
        return _Normalizer(wide, lax.rsqrt(second_moment), one, one)
    k = lax.min(s, np.float32(1))
    stabiliser = eps * lax.square(pow2_reciprocal(lax.max(s, np.float32(1))))
    rows = lax.rsqrt(lax.square(k) * second_moment + stabiliser)
    return _Normalizer(wide, rows, k, _unit_estimate(s, eps))


def _unit_estimate(s, eps: float):
    """``min(1, s / sqrt(eps))`` as a power of two, at least ``2^-126``: the RMS of the
    normalised unit data (scale ``s``) whose variance 1 and ``eps / s^2`` add up, the larger
    term taken rather than the sum: ``1 / sqrt(1 + eps / s^2)``, a hair below 1, would round
    down to 1/2 and leave the data at RMS 2. ``1 / sqrt(eps)`` is rounded at trace time, so
    for a power of two ``s`` the estimate is one product and a clamp, computed once
    (:func:`~jax_scaled.pow2.xla.computed_once`, as is ``k / r0``): XLA copied both into each
    kernel that reads the output's scale or data, forward and backward.
    """
    inverse_root = round_scale(np.float32(1) / np.sqrt(np.float32(eps)))
    return computed_once(lax.clamp(_MIN_SCALE, scale_mul(s, inverse_root), np.float32(1)))


def _in_scale_range(product: jax.Array) -> jax.Array:
    """A product of powers of two, a power of two itself: clamped into the scales' range
    (what :func:`round_scale` would give, without its rounding)."""
    return lax.clamp(_MIN_SCALE, as_float32(product), _MAX_SCALE)


@_normalize_scaled.defscale
def _normalize_rule(x: ScaledArray, eps: float, center: bool) -> ScaledArray:
    """Normalise the data, with ``eps`` in the data's units, without overflow at any scale.

    Unit-scaling assumption: the normalised value has RMS ``sqrt(var / (var + eps))``, 1
    unless ``eps`` dominates; the output scale is its power-of-two estimate ``r0``
    (:class:`_Normalizer`).
    """
    x = as_scaled(x)
    norm = _data_normalizer(x, eps, center)
    data = (norm.centred * norm.data_factor).astype(x.dtype)
    return ScaledArray(data, make_scale(norm.r0, x))


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

    ``1 / sigma = r / s`` (:class:`_Normalizer`), so the gradient is
    ``(scale(g) / s) * r * (g_d - mean g_d - y mean(g_d y))`` with ``g_d`` the cotangent's
    data. For unit-normal ``g_d`` independent of ``y``, the bracket has RMS about 1 (its two
    corrections are ``O(1 / sqrt(N))``); ``r`` is about ``r0``, the forward's output scale.
    """
    x, g = as_scaled(x), as_scaled(g)
    norm = _data_normalizer(x, eps, center)
    y = norm.centred * norm.r
    g_data = g.data.astype(y.dtype)
    inner = _centered(g_data, center) - y * jnp.mean(g_data * y, axis=-1, keepdims=True)
    data = (inner * norm.data_factor).astype(x.dtype)
    scale = _in_scale_range(scale_mul(scale_f32(g), ratio_to_pow2(norm.r0, scale_f32(x))))
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
