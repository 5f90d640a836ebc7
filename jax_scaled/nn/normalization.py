"""Scale-aware layer and RMS normalisation (scalify paper, Appendix C.2).

Normalising ``x = d * s`` gives the same result as normalising the data ``d`` with the
stabiliser ``eps`` moved to the data's units (``eps / s**2``). Under scalify the rule does
exactly that, in float32, and returns the normalised data at scale 1 (smaller only when
``eps`` dominates a tiny variance): no statistic of the represented value is ever formed, so
a tiny variance neither underflows nor loses digits.
The affine part (``* weight + bias``) is ordinary code that scalify propagates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.scales.traced import pow2_reciprocal
from jax_scaled.scales.values import as_scaled, make_scale, round_scale, scale_f32


def _centered(x: jax.Array, center: bool) -> jax.Array:
    wide = x.astype(compute_dtype(x.dtype))
    return wide - jnp.mean(wide, axis=-1, keepdims=True) if center else wide


def _normalize_plain(x: jax.Array, eps: float, center: bool) -> jax.Array:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (no centering for RMS norm)."""
    wide = _centered(x, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    return (wide * lax.rsqrt(second_moment + eps)).astype(x.dtype)


_normalize_scaled = custom_scale(_normalize_plain, static_argnums=(1, 2))


@_normalize_scaled.defscale
def _normalize_rule(x: ScaledArray, eps: float, center: bool) -> ScaledArray:
    """Normalise the data, with ``eps`` in the data's units, without overflow at any scale.

    The value is ``y = d s / sqrt(s^2 m + eps)`` (``m`` the data's second moment), written
    for ``s >= 1`` as ``d / sqrt(m + eps / s^2)`` and for ``s < 1`` as is, so no term
    overflows. The output scale is ``y``'s size for unit data, ``1 / sqrt(1 + eps / s^2)``
    (power-of-two rounded): 1 unless ``eps`` dominates a tiny variance, where the result is
    ``x / sqrt(eps)``, small but still represented with unit data.
    """
    x = as_scaled(x)
    s = scale_f32(x)
    large = s >= 1
    inverse = pow2_reciprocal(s)
    a = jnp.where(large, 1, lax.square(s))
    b = jnp.where(large, eps * lax.square(inverse), eps)
    k = jnp.where(large, 1, s)
    wide = _centered(x.data, center)
    second_moment = jnp.mean(lax.square(wide), axis=-1, keepdims=True)
    value = wide * (k * lax.rsqrt(a * second_moment + b))
    out_scale = round_scale(lax.max(k * lax.rsqrt(a + b), jnp.float32(2.0**-126)))
    data = (value * pow2_reciprocal(out_scale)).astype(x.dtype)
    return ScaledArray(data, make_scale(out_scale, x))


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

    Under scalify the data is normalised directly and the result has scale 1.

    Example:
        >>> y = js.nn.layer_norm(jnp.array([1.0, 2.0, 3.0]), eps=0.0)
        >>> [round(v, 4) for v in y.tolist()]
        [-1.2247, 0.0, 1.2247]
    """
    return _affine(_normalize_scaled(x, float(eps), True), weight, bias)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """RMS normalisation over the last axis, then ``* weight`` when given.

    Under scalify the data is normalised directly and the result has scale 1.

    Example:
        >>> js.nn.rms_norm(jnp.array([3.0, -3.0]), eps=0.0).tolist()
        [1.0, -1.0]
    """
    return _affine(_normalize_scaled(x, float(eps), False), weight, None)
