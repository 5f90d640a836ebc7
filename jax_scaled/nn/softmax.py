"""Scale-aware softmax, log-softmax, cross-entropy and attention.

Under scalify:

* ``softmax`` is computed in float32 from the data and the scale (``exp((d - max d) * s)``:
  nothing overflows at any scale) and returned at scale ``2^-round(log2 sqrt(N))``, the RMS of
  a softmax over ``N`` entries between uniform (``1/N``) and one-hot (``1/sqrt(N)``).
* ``log_softmax`` likewise, at scale ``max(s, 1)``: it is about ``-log N`` for tiny inputs and
  about ``x - max x`` for large ones.
* ``softmax_cross_entropy``'s gradient with respect to the logits, ``g * (softmax - labels)``,
  is unit-scaled (unit scaling paper, §5): its data is multiplied by ``sqrt(N)`` and its scale
  divided by it, so that the gradient of a mean loss, ``1/batch`` times values of RMS
  ``1/sqrt(N)``, travels with data of RMS about 1 instead of shrinking in the data format.

Masked entries (``where=False``) are excluded as in ``jax.nn.softmax``; rows with no entry
left give NaN in ``softmax`` as in ``jax.nn``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.scales.values import as_scaled, make_scale, round_scale, scale_f32


def _shifted(x: jax.Array, scale: jax.Array, where: jax.Array | None) -> jax.Array:
    """``(x - max x) * scale`` over the last axis in float32, masked entries at -inf."""
    wide = x.astype(compute_dtype(x.dtype))
    if where is not None:
        wide = jnp.where(where, wide, -jnp.inf)
    peak = lax.stop_gradient(jnp.max(wide, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    return (wide - peak) * scale.astype(wide.dtype)


def _softmax_value(x: jax.Array, scale: jax.Array, where: jax.Array | None) -> jax.Array:
    exps = jnp.exp(_shifted(x, scale, where))
    return exps / jnp.sum(exps, axis=-1, keepdims=True)


def _log_softmax_value(x: jax.Array, scale: jax.Array, where: jax.Array | None) -> jax.Array:
    shifted = _shifted(x, scale, where)
    out = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    return out if where is None else jnp.where(where, out, -jnp.inf)


def _unit(x: jax.Array) -> jax.Array:
    return jnp.ones((), compute_dtype(x.dtype))


@custom_scale
def _softmax(x: jax.Array, where: jax.Array | None) -> jax.Array:
    return _softmax_value(x, _unit(x), where).astype(x.dtype)


@_softmax.defscale
def _softmax_rule(x: ScaledArray, where: jax.Array | None) -> ScaledArray:
    x = as_scaled(x)
    out_scale = jnp.float32(2.0 ** -round(math.log2(math.sqrt(x.shape[-1]))))
    value = _softmax_value(x.data, scale_f32(x), where)
    data = (value * (1 / out_scale)).astype(x.dtype)
    return ScaledArray(data, make_scale(out_scale, x))


@custom_scale
def _log_softmax(x: jax.Array, where: jax.Array | None) -> jax.Array:
    return _log_softmax_value(x, _unit(x), where).astype(x.dtype)


@_log_softmax.defscale
def _log_softmax_rule(x: ScaledArray, where: jax.Array | None) -> ScaledArray:
    x = as_scaled(x)
    scale = scale_f32(x)
    out_scale = round_scale(lax.max(scale, jnp.float32(1)))
    value = _log_softmax_value(x.data, scale, where)
    data = (value / out_scale.astype(value.dtype)).astype(x.dtype)
    return ScaledArray(data, make_scale(out_scale, x))


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
    """Softmax over ``axis``; entries where ``where`` is False are excluded (output 0).

    Example:
        >>> js.nn.softmax(jnp.array([0.0, 0.0, 1e9]), where=jnp.array([True, True, False]))
        Array([0.5, 0.5, 0. ], dtype=float32)
    """
    x, where = _to_last(x, axis), None if where is None else _to_last(where, axis)
    out = _softmax(x, where)
    return out if axis in (-1, out.ndim - 1) else jnp.moveaxis(out, -1, axis)


def log_softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
    """Log-softmax over ``axis``; entries where ``where`` is False give ``-inf``.

    Example:
        >>> [round(v, 4) for v in js.nn.log_softmax(jnp.array([0.0, 0.0])).tolist()]
        [-0.6931, -0.6931]
    """
    x, where = _to_last(x, axis), None if where is None else _to_last(where, axis)
    out = _log_softmax(x, where)
    return out if axis in (-1, out.ndim - 1) else jnp.moveaxis(out, -1, axis)


def _to_last(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.asarray(x)
    return x if axis in (-1, x.ndim - 1) else jnp.moveaxis(x, axis, -1)


def _cross_entropy_grad_body(g: jax.Array, probs: jax.Array, labels: jax.Array) -> jax.Array:
    return (g[..., None] * (probs - labels)).astype(probs.dtype)


_cross_entropy_grad = custom_scale(_cross_entropy_grad_body)


@_cross_entropy_grad.defscale
def _cross_entropy_grad_rule(g, probs, labels) -> ScaledArray:
    """Unit-scaled ``g * (p - y)``: data times ``sqrt(N)``, scale divided by it."""
    g, probs = as_scaled(g), as_scaled(probs)
    classes = probs.shape[-1]
    unit = jnp.float32(2.0 ** round(math.log2(math.sqrt(classes))))
    wide = compute_dtype(probs.dtype)
    p = probs.data.astype(wide) * scale_f32(probs).astype(wide)
    y = labels.to_array(wide) if isinstance(labels, ScaledArray) else labels.astype(wide)
    data = g.data.astype(wide)[..., None] * (p - y) * unit.astype(wide)
    return ScaledArray(data.astype(probs.dtype), make_scale(scale_f32(g) / unit, g, probs))


@jax.custom_vjp
def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross-entropy ``-sum(labels * log_softmax(logits), -1)`` per example, like optax's.

    ``labels`` are probabilities over the last axis (e.g. one-hot). Under scalify the
    gradient with respect to ``logits`` is unit-scaled (see the module docstring).

    Example:
        >>> logits = jnp.array([[0.0, 0.0]])
        >>> [round(v, 4) for v in js.nn.softmax_cross_entropy(logits, jnp.eye(2)[:1]).tolist()]
        [0.6931]
    """
    return -jnp.sum(labels * log_softmax(logits), axis=-1)


def _cross_entropy_fwd(logits, labels):
    return softmax_cross_entropy(logits, labels), (logits, labels)


def _cross_entropy_bwd(residuals, g):
    logits, labels = residuals
    probs = softmax(logits)
    grad_logits = _cross_entropy_grad(g, probs, labels)
    grad_labels = -g[..., None] * log_softmax(logits)
    return grad_logits, grad_labels.astype(labels.dtype)


softmax_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
) -> jax.Array:
    """Scaled dot-product attention, ``softmax(q k^T / sqrt(d)) v``, with this softmax.

    Shapes follow ``jax.nn.dot_product_attention``: ``[batch, seq, heads, head_dim]``.
    ``mask`` is a boolean array broadcastable to ``[batch, heads, q_seq, kv_seq]`` (True:
    attend); ``is_causal`` adds a lower-triangular mask.

    Example:
        >>> q = jnp.ones((1, 3, 1, 4))
        >>> out = js.nn.dot_product_attention(q, q, q, is_causal=True)
        >>> out.shape
        (1, 3, 1, 4)
    """
    head_dim = query.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) * (1 / math.sqrt(head_dim))
    if is_causal:
        causal = jnp.tril(jnp.ones((query.shape[1], key.shape[1]), bool))
        mask = causal if mask is None else mask & causal
    if mask is not None:
        mask = jnp.broadcast_to(mask, logits.shape)
    weights = softmax(logits, where=mask).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)
