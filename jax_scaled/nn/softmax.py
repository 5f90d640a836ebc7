"""Scale-aware softmax, log-softmax, cross-entropy and attention.

Under scalify every function here is computed in float32 from the data and the scale
(``exp((d - max d) * s)``: nothing overflows at any scale), and its output is given the
power-of-two scale that the unit-scaling assumptions predict for it. The logits ``x = d * s``
are taken to be independent with unit-normal data, so of standard deviation ``s``; ``N`` is the
size of the softmax axis. Each estimate depends on shapes and input scales only (no statistic
of the data is gathered) and is rounded with the configured rounding:

* ``softmax``: for unit-normal logits a row sums to about ``N e^{1/2}`` (``E[e^x] = e^{1/2}``),
  so probabilities are about ``1/N`` with RMS ``sqrt(E[e^{2x}]) / (N e^{1/2}) = e^{1/2} / N``:
  scale ``e^{1/2} / N`` (see :func:`_probability_scale`, which also handles masked rows and
  keeps a probability of 1 finite in the data format). Its gradient
  ``p * (g - sum(p * g))`` has RMS about ``RMS(p) * RMS(g)``: scale ``scale(p) * scale(g)``.
* ``log_softmax``: ``x - logsumexp(x)``, which is about ``-log N`` for tiny logits and about
  ``x - max x`` (RMS ``s sqrt(1 + 2 log N)``) for large ones (see :func:`_log_softmax_scale`).
  Its gradient ``g - softmax * sum(g)`` keeps the cotangent's scale (automatic propagation).
* ``softmax_cross_entropy``: the loss ``logsumexp(x) - x_label`` has the size of a
  log-probability: the log-softmax estimate. Its gradient with respect to the logits,
  ``g * (softmax - labels)``, is unit-scaled (unit scaling paper, §5): its data is multiplied
  by ``sqrt(N)`` and its scale divided by it, so that the gradient of a mean loss, ``1/batch``
  times values of RMS ``1/sqrt(N)``, travels with data of RMS about 1.
* ``dot_product_attention``: the softmax estimate, with the rows of a causal mask counted
  (a row ``i`` of a causal mask has ``i + 1`` entries, so larger probabilities).

Masked entries (``where=False``) are excluded as in ``jax.nn.softmax``; rows with no entry
left give NaN in ``softmax`` as in ``jax.nn``. Functions with a scaled backward (``softmax``,
``softmax_cross_entropy``) are ``jax.custom_vjp`` functions: reverse mode only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.pow2.static import is_static
from jax_scaled.scales import (
    as_scaled,
    from_compute,
    guard_band,
    guard_factors,
    make_scale,
    round_scale,
    scale_f32,
    scale_mul,
    times_scalar,
    to_compute,
)


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


# ---------------------------------------------------------------------------------------
# Scale estimates
# ---------------------------------------------------------------------------------------


def _largest_probability_datum(dtype) -> float:
    """The largest power of two that ``dtype`` holds: the most a probability (at most 1) may
    be divided by and still be finite data.

    Example:
        >>> [_largest_probability_datum(d) for d in (jnp.float16, jnp.float8_e4m3fn)]
        [32768.0, 256.0]
    """
    return 2.0 ** (jnp.finfo(dtype).maxexp - 1)


def _probability_scale(size: int, dtype, fill: float = 1.0) -> np.float32:
    """The power-of-two scale of softmax probabilities over ``size`` entries, ``dtype`` data.

    Unit-normal logits: a row of ``n`` unmasked entries has probabilities
    ``e^x / (n e^{1/2})``, of mean square ``e / n^2`` there and 0 at its masked entries. Over
    the rows, ``E[p^2] = e / (size^2 fill)`` where ``fill = 1 / mean(size / n)`` is the
    (harmonic) mean fraction of a row left unmasked: 1 with no mask, about
    ``1 / log(size)`` for a causal one. So the RMS is ``e^{1/2} / (size sqrt(fill))``,
    rounded with the configured rounding.

    A trained attention row is nearly one-hot: its probability 1 becomes data
    ``1 / scale``, about ``size``. The scale is therefore never below
    ``1 / _largest_probability_datum(dtype)``: float16 and E5M2 hold probabilities of
    softmaxes up to ``2^15`` entries at the estimate and larger ones at ``2^-15``; E4M3
    (largest finite 448) holds up to 256 entries at the estimate and larger ones at
    ``2^-8``, their small probabilities nearer E4M3's subnormals.

    Example:
        >>> float(_probability_scale(1024, jnp.float16))  # e^0.5 / 1024 = 2^-9.3, rounded down
        0.0009765625
        >>> float(_probability_scale(1024, jnp.float8_e4m3fn))  # a probability 1 is data 256
        0.00390625
    """
    estimate = math.exp(0.5) / (max(size, 1) * math.sqrt(fill))
    return np.float32(max(round_scale(estimate), 1 / _largest_probability_datum(dtype)))


def _causal_fill(q_len: int, k_len: int) -> float:
    """The ``fill`` of :func:`_probability_scale` for a causal mask (``jnp.tril``) of
    ``q_len`` rows over ``k_len`` keys: row ``i`` keeps ``min(i + 1, k_len)`` entries.

    Example:
        >>> round(_causal_fill(1024, 1024), 4)  # 1 / H_1024, H the harmonic number
        0.1332
    """
    crowding = sum(k_len / min(i + 1, k_len) for i in range(max(q_len, 1)))
    return max(q_len, 1) / crowding if k_len else 1.0


def _log_softmax_scale(scale: jax.Array, size: int) -> jax.Array:
    """The power-of-two scale of ``log_softmax`` over ``size`` logits of scale ``scale``.

    ``log_softmax(x) = (x - mean x) - (logsumexp x - mean x)``. The first term has RMS
    ``s``; the second is ``log N`` for ``s -> 0`` (``N`` equal logits) and the gap to the
    largest logit, about ``s sqrt(2 log N)``, for large ``s``. Both limits are kept by
    ``RMS^2 ~ (log N)^2 + (1 + 2 log N) s^2``: for unit-normal logits (``s = 1``) that is
    5.2 at ``N = 64`` (measured 4.8) and 7.9 at ``N = 1024`` (7.5). Static when ``scale`` is.

    Example:
        >>> float(_log_softmax_scale(np.float32(1.0), 1024))  # 7.9, rounded down
        4.0
        >>> float(_log_softmax_scale(np.float32(2.0**20), 1024))  # 3.9 * 2^20
        2097152.0
    """
    log_n = math.log(max(size, 1))
    spread = scale_mul(scale, np.float32(math.sqrt(1 + 2 * log_n)))
    if is_static(spread):
        return round_scale(math.hypot(log_n, float(spread)))
    return round_scale(jnp.hypot(np.float32(log_n), spread))  # no overflow at any scale


def _overflow_guarded(wide: jax.Array, scale: jax.Array, dtype, *like) -> ScaledArray:
    """``wide * scale`` as ``dtype`` data, range-guarded only where it would leave the format.

    Used for data whose static estimate is right on average but whose tail is heavy (a
    product of lognormal probabilities and Gaussian cotangents): the guard band's upper end
    (:func:`~jax_scaled.scales.guard.guard_band`) is raised to the largest power of two of
    ``dtype``, so that healthy data keeps the static scale; the lower end and the target
    are the guard's. No guard when the guard is off, as elsewhere.
    """
    band = guard_band(dtype)
    factors = None
    if band is not None:
        low, _, target = band
        factors = guard_factors(wide, dtype, band=(low, jnp.finfo(dtype).maxexp - 1, target))
    if factors is None:
        return ScaledArray(wide.astype(dtype), make_scale(scale, *like))
    down, up = factors
    data = times_scalar(wide, down).astype(dtype)
    return ScaledArray(data, make_scale(scale_mul(scale, up), *like))


# ---------------------------------------------------------------------------------------
# softmax: a custom_scale forward and a custom_scale backward, joined by a custom_vjp
# ---------------------------------------------------------------------------------------


def _softmax_body(x: jax.Array, where: jax.Array | None, fill: float) -> jax.Array:
    return _softmax_value(x, _unit(x), where).astype(x.dtype)


_softmax_forward = custom_scale(_softmax_body, static_argnums=(2,))


@_softmax_forward.defscale
def _softmax_rule(x: ScaledArray, where: jax.Array | None, fill: float) -> ScaledArray:
    """The probabilities at :func:`_probability_scale`."""
    x = as_scaled(x)
    value = _softmax_value(x.data, scale_f32(x), where)
    return from_compute(value, _probability_scale(x.shape[-1], x.dtype, fill), x.dtype, x)


def _softmax_grad_body(
    x: jax.Array, where: jax.Array | None, g: jax.Array, fill: float
) -> jax.Array:
    p = _softmax_value(x, _unit(x), where)
    g = g.astype(p.dtype)
    return (p * (g - jnp.sum(p * g, axis=-1, keepdims=True))).astype(x.dtype)


_softmax_grad = custom_scale(_softmax_grad_body, static_argnums=(3,))


@_softmax_grad.defscale
def _softmax_grad_rule(
    x: ScaledArray, where: jax.Array | None, g: ScaledArray, fill: float
) -> ScaledArray:
    """``p * (g - sum(p * g))`` at scale ``scale(p) * scale(g)``, ``p`` recomputed from ``x``.

    With ``g`` independent of ``p`` and ``sum(p * g)`` small against ``g`` (its variance is
    ``sum(p^2) <= 1`` times ``g``'s), the RMS is ``RMS(p) RMS(g)``. Whatever ``p``, each
    entry is at most ``max|g| / 2`` (``p (1 - p) <= 1/4``), but that is ``size / 2`` times
    the estimate for a half-and-half row: the data is guarded against overflow
    (:func:`_overflow_guarded`). ``p`` is recomputed in float32 rather than read from the
    forward's narrow output: a peaked row's gradient is a small difference of its terms.
    """
    x, g = as_scaled(x), as_scaled(g)
    p = _softmax_value(x.data, scale_f32(x), where)
    p_scale = _probability_scale(x.shape[-1], x.dtype, fill)
    g_data = g.data.astype(p.dtype)
    out = (p * (1 / p_scale)) * (g_data - jnp.sum(p * g_data, axis=-1, keepdims=True))
    return _overflow_guarded(out, scale_mul(p_scale, scale_f32(g)), x.dtype, x, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(x: jax.Array, where: jax.Array | None, fill: float) -> jax.Array:
    return _softmax_forward(x, where, fill)


def _softmax_fwd(x, where, fill):
    return _softmax_forward(x, where, fill), (x, where)


def _softmax_bwd(fill, residuals, g):
    x, where = residuals
    return _softmax_grad(x, where, g, fill), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


# ---------------------------------------------------------------------------------------
# log_softmax
# ---------------------------------------------------------------------------------------


@custom_scale
def _log_softmax(x: jax.Array, where: jax.Array | None) -> jax.Array:
    return _log_softmax_value(x, _unit(x), where).astype(x.dtype)


@_log_softmax.defscale
def _log_softmax_rule(x: ScaledArray, where: jax.Array | None) -> ScaledArray:
    """The log-probabilities at :func:`_log_softmax_scale`."""
    x = as_scaled(x)
    scale = scale_f32(x)
    value = _log_softmax_value(x.data, scale, where)
    return from_compute(value, _log_softmax_scale(scale, x.shape[-1]), x.dtype, x)


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
    """Softmax over ``axis``; entries where ``where`` is False are excluded (output 0).

    Under scalify the probabilities get the scale ``e^{1/2} / N`` (rows taken as unmasked)
    and their gradient ``scale(p) * scale(g)``: see the module docstring.

    Example:
        >>> js.nn.softmax(jnp.array([0.0, 0.0, 1e9]), where=jnp.array([True, True, False]))
        Array([0.5, 0.5, 0. ], dtype=float32)
    """
    return _along(lambda x, where: _softmax(x, where, 1.0), x, axis, where)


def log_softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
    """Log-softmax over ``axis``; entries where ``where`` is False give ``-inf``.

    Under scalify the result gets the scale of a log-probability (module docstring).

    Example:
        >>> [round(v, 4) for v in js.nn.log_softmax(jnp.array([0.0, 0.0])).tolist()]
        [-0.6931, -0.6931]
    """
    return _along(_log_softmax, x, axis, where)


def _along(fn, x: jax.Array, axis: int, where: jax.Array | None) -> jax.Array:
    """``fn(x, where)`` over the last axis, for a function of ``axis``."""
    x, where = _to_last(x, axis), None if where is None else _to_last(where, axis)
    out = fn(x, where)
    return out if axis in (-1, out.ndim - 1) else jnp.moveaxis(out, -1, axis)


def _to_last(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.asarray(x)
    return x if axis in (-1, x.ndim - 1) else jnp.moveaxis(x, axis, -1)


# ---------------------------------------------------------------------------------------
# softmax_cross_entropy
# ---------------------------------------------------------------------------------------


@custom_scale
def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return -jnp.sum(labels * log_softmax(logits), axis=-1)


@_cross_entropy.defscale
def _cross_entropy_rule(logits: ScaledArray, labels) -> ScaledArray:
    """``-sum(labels * log_softmax(logits))`` at :func:`_log_softmax_scale`.

    ``labels`` are probabilities (each row sums to 1): the loss is a weighted mean of
    log-probabilities, ``logsumexp(x) - x_label`` for one-hot labels, of the size of one.
    """
    logits = as_scaled(logits)
    scale = scale_f32(logits)
    log_probs = _log_softmax_value(logits.data, scale, None)
    loss = -jnp.sum(to_compute(labels).astype(log_probs.dtype) * log_probs, axis=-1)
    dtype = jnp.result_type(logits.dtype, labels.dtype)
    return from_compute(loss, _log_softmax_scale(scale, logits.shape[-1]), dtype, logits)


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

    ``labels`` are probabilities over the last axis (e.g. one-hot). Under scalify the loss
    gets the scale of a log-probability and the gradient with respect to ``logits`` is
    unit-scaled (see the module docstring).

    Example:
        >>> logits = jnp.array([[0.0, 0.0]])
        >>> [round(v, 4) for v in js.nn.softmax_cross_entropy(logits, jnp.eye(2)[:1]).tolist()]
        [0.6931]
    """
    return _cross_entropy(logits, labels)


def _cross_entropy_fwd(logits, labels):
    return softmax_cross_entropy(logits, labels), (logits, labels)


def _cross_entropy_bwd(residuals, g):
    logits, labels = residuals
    probs = softmax(logits)
    grad_logits = _cross_entropy_grad(g, probs, labels)
    grad_labels = -g[..., None] * log_softmax(logits)
    return grad_logits, grad_labels.astype(labels.dtype)


softmax_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# ---------------------------------------------------------------------------------------
# dot_product_attention
# ---------------------------------------------------------------------------------------


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
    attend); ``is_causal`` adds a lower-triangular mask. Under scalify the weights' scale
    counts the causal mask's shorter rows; a ``mask`` is taken as leaving rows full.

    Example:
        >>> q = jnp.ones((1, 3, 1, 4))
        >>> out = js.nn.dot_product_attention(q, q, q, is_causal=True)
        >>> out.shape
        (1, 3, 1, 4)
    """
    head_dim = query.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) * (1 / math.sqrt(head_dim))
    fill = 1.0
    if is_causal:
        causal = jnp.tril(jnp.ones((query.shape[1], key.shape[1]), bool))
        mask = causal if mask is None else mask & causal
        fill = _causal_fill(query.shape[1], key.shape[1])
    if mask is not None:
        mask = jnp.broadcast_to(mask, logits.shape)
    weights = _softmax(logits, mask, fill).astype(value.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value)
