"""Casts and precision reductions applied to one pass only: forward or backward.

Four operations, for any float format (``float8_e4m3fn``, ``float8_e5m2``,
``float8_e4m3fnuz``, ``float8_e5m2fnuz``, ``float8_e3m4``, ``float4_e2m1fn``, ``float16``,
``bfloat16``, ...):

* :func:`cast_on_forward`: the forward value is cast to the format (the dtype changes); the
  backward pass only widens the cotangent back to the input's dtype.
* :func:`reduce_precision_on_forward`: the forward value is rounded to the format's values,
  the dtype is kept; the cotangent passes untouched.
* :func:`cast_on_backward`, :func:`reduce_precision_on_backward`: identity forward; the
  cotangent is rounded to the format's values (in its own dtype: see below).

**Semantics of the rounding.** Rounding is exactly ``x.astype(format).astype(x.dtype)``, the
ml_dtypes / XLA conversion: round to nearest even, the format's subnormals kept, and
out-of-range values become what the format has for them: ``inf`` for formats with
infinities (``float8_e5m2``, ``float8_e3m4``, ``float16``, ``bfloat16``), ``NaN`` for the
``fn``/``fnuz`` float8 formats (no infinities), and the largest value ``±6`` for
``float4_e2m1fn`` (no infinities nor NaN; a NaN input becomes ``-0``). With
``saturate=True``, values beyond the format's largest finite value (``±inf`` included) are
first clipped to it, so nothing overflows (NaN stays NaN).

**Stochastic rounding.** Every function takes ``rounding="nearest"`` (the default: the cast
above, unchanged) or ``rounding="stochastic"`` with a PRNG ``key``: ``x`` then rounds to one
of its two neighbouring values of the format, the upper one with probability proportional
to the distance from the lower one, so that the rounding is unbiased (its mean is ``x``),
subnormals included (:mod:`jax_scaled.ops.stochastic`). Saturation and overflow follow the
format's conventions as above. The result is deterministic for a given key: split the key
for every call (and every step) whose rounding must be independent. The key is not used by
round-to-nearest.

``jax.lax.reduce_precision`` with the format's exponent and mantissa bits is **not** used:
it emulates an IEEE-style format, which differs from these formats in measurable ways
(XLA CPU, JAX 0.10): it flushes the format's subnormals to zero (``1e-5`` in E5M2 gives 0,
not ``1.5e-5``), it overflows to ``inf`` above ``240`` for ``float8_e4m3fn`` (whose largest
value is 448) where a cast gives ``NaN`` above 464, it puts the smallest normal of the
``fnuz`` formats a factor two too high (their exponent bias is one larger) and overflows them
to ``inf`` where a cast gives ``NaN``. Formats without infinities have no IEEE counterpart.

**Under scalify** a ScaledArray's *data* is cast or rounded and its scale is kept: the value
``data * scale`` is quantised relative to its scale, which is why scaled FP8 works where raw
FP8 underflows. Data far from unit scale can still overflow the format: rescale it first
(:func:`~jax_scaled.ops.dynamic_rescale_max`, :class:`~jax_scaled.ops.DelayedScaling`).

**Cotangent dtypes.** JAX gives a cotangent the dtype of its primal. So the cotangent of
``cast_on_forward(x, fmt)`` arrives in ``fmt``, rounded there by whatever consumed the cast
(e.g. a matmul's transpose), and the backward variants cannot hand back a cotangent of
another dtype: they round it to the format's values in the input's dtype. To keep a whole
backward pass wide while quantising the forward, use :func:`reduce_precision_on_forward`.

**Differentiation.** The ``*_on_forward`` functions are ``jax.custom_jvp`` (forward and
reverse mode), the ``*_on_backward`` ones ``jax.custom_vjp`` (reverse mode only). Trace
``jax.grad`` *inside* ``scalify`` (as in a scalified train step) for the backward variants to
act on scaled cotangents.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.typing import DTypeLike

from jax_scaled.dtypes import float_dtype
from jax_scaled.ops.stochastic import RoundingMode, check_rounding, stochastic_round
from jax_scaled.rules import casts as cast_rules


def cast_on_forward(
    x: jax.Array,
    dtype: DTypeLike,
    *,
    saturate: bool = False,
    rounding: RoundingMode = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Cast ``x`` to ``dtype`` on the forward pass; the backward pass does not round.

    The result has dtype ``dtype``. Its cotangent (of dtype ``dtype``, as JAX types it) is
    cast back to ``x``'s dtype, a widening that adds no rounding. Under scalify only the
    data of a ScaledArray is cast; the scale is kept.

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the format to cast to, e.g. ``jnp.float8_e4m3fn``.
        saturate: clip values beyond the format's largest finite value to it first (else
            they overflow to ``inf`` or ``NaN``, as the format defines).
        rounding: ``"nearest"`` (round to nearest even) or ``"stochastic"`` (unbiased
            stochastic rounding, which needs ``key``).
        key: the PRNG key of stochastic rounding (``jax.random.key``); unused by
            ``"nearest"``.

    Returns:
        ``x`` cast to ``dtype``.

    Example:
        >>> from jax_scaled.ops import cast_on_forward
        >>> cast_on_forward(jnp.array([1.1, 500.0]), jnp.float8_e4m3fn, saturate=True)
        Array([1.125, 448], dtype=float8_e4m3fn)
        >>> jax.grad(lambda x: cast_on_forward(x, jnp.float16).astype(float))(1 / 3)
        Array(1., dtype=float32, weak_type=True)
        >>> x = jnp.full(6, 1.1)  # E4M3 neighbours 1 and 1.125: 1.125 with probability 0.8
        >>> cast_on_forward(x, jnp.float8_e4m3fn, rounding="stochastic", key=jax.random.key(0))
        Array([1, 1, 1.125, 1.125, 1.125, 1.125], dtype=float8_e4m3fn)
    """
    if check_rounding(rounding, key):
        return _stochastic_on_forward(x, key, float_dtype(dtype), saturate, False)
    return _quantize_on_forward(x, float_dtype(dtype), saturate, False)


def reduce_precision_on_forward(
    x: jax.Array,
    dtype: DTypeLike,
    *,
    saturate: bool = False,
    rounding: RoundingMode = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Round ``x`` to the values of ``dtype`` on the forward pass; the dtype of ``x`` is kept.

    Equal to ``x.astype(dtype).astype(x.dtype)`` (see the module notes for the exact
    semantics). The cotangent passes untouched (straight-through), so the backward pass
    stays in ``x``'s precision. Under scalify the data of a ScaledArray is rounded.

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the format whose values to round to, e.g. ``jnp.float8_e4m3fn``.
        saturate: clip values beyond the format's largest finite value to it first.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased, needs ``key``).
        key: the PRNG key of stochastic rounding; unused by ``"nearest"``.

    Returns:
        ``x`` rounded to the values of ``dtype``, in ``x``'s dtype.

    Example:
        >>> from jax_scaled.ops import reduce_precision_on_forward
        >>> f = lambda x: jnp.sum(reduce_precision_on_forward(x, jnp.float8_e4m3fn) * x)
        >>> x = jnp.array([1.1, 3.3])
        >>> f(x), jax.grad(f)(x)  # forward rounds 1.1 -> 1.125, 3.3 -> 3.25; grad = x + rp(x)
        (Array(11.9625, dtype=float32), Array([2.225, 6.55 ], dtype=float32))
    """
    if check_rounding(rounding, key):
        return _stochastic_on_forward(x, key, float_dtype(dtype), saturate, True)
    return _quantize_on_forward(x, float_dtype(dtype), saturate, True)


def cast_on_backward(
    x: jax.Array,
    dtype: DTypeLike,
    *,
    saturate: bool = False,
    rounding: RoundingMode = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Identity on the forward pass; the cotangent is cast to ``dtype`` on the backward pass.

    A cotangent keeps its primal's dtype in JAX, so the cast cotangent is returned in
    ``x``'s dtype, holding the values of ``dtype``: the same numbers as
    :func:`reduce_precision_on_backward`. Under scalify the cotangent's data is cast (its
    scale is kept), so a well-scaled gradient survives an FP8 format such as E5M2.

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the backward format, e.g. ``jnp.float8_e5m2``.
        saturate: clip cotangent values beyond the format's largest finite value to it.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased rounding of the cotangent,
            needs ``key``).
        key: the PRNG key of stochastic rounding; unused by ``"nearest"``.

    Returns:
        ``x`` (its cotangent is cast on the backward pass).

    Example:
        >>> from jax_scaled.ops import cast_on_backward
        >>> x = jnp.array([1.0, 2.0])
        >>> jax.grad(lambda x: jnp.sum(cast_on_backward(x, jnp.float8_e5m2) * 0.3))(x)
        Array([0.3125, 0.3125], dtype=float32)
        >>> sr = dict(rounding="stochastic", key=jax.random.key(2))  # 0.25 or 0.3125
        >>> f = lambda x: jnp.sum(cast_on_backward(x, jnp.float8_e5m2, **sr) * 0.3)
        >>> jax.grad(f)(jnp.ones(4))
        Array([0.3125, 0.25  , 0.3125, 0.25  ], dtype=float32)
    """
    if check_rounding(rounding, key):
        return _stochastic_on_backward(x, key, float_dtype(dtype), saturate)
    return _quantize_on_backward(x, float_dtype(dtype), saturate)


def reduce_precision_on_backward(
    x: jax.Array,
    dtype: DTypeLike,
    *,
    saturate: bool = False,
    rounding: RoundingMode = "nearest",
    key: jax.Array | None = None,
) -> jax.Array:
    """Identity on the forward pass; the cotangent is rounded to the values of ``dtype``.

    The cotangent becomes ``ct.astype(dtype).astype(ct.dtype)``. Under scalify the
    cotangent's data is rounded and its scale kept.

    Args:
        x: a floating-point array (or ScaledArray under scalify).
        dtype: the format whose values to round the cotangent to.
        saturate: clip cotangent values beyond the format's largest finite value to it.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased, needs ``key``).
        key: the PRNG key of stochastic rounding; unused by ``"nearest"``.

    Returns:
        ``x`` (its cotangent is rounded on the backward pass).

    Example:
        >>> from jax_scaled.ops import reduce_precision_on_backward
        >>> f = lambda x: jnp.sum(reduce_precision_on_backward(x, jnp.float8_e4m3fn) * 1.1)
        >>> f(jnp.ones(2)), jax.grad(f)(jnp.ones(2))
        (Array(2.2, dtype=float32), Array([1.125, 1.125], dtype=float32))
    """
    if check_rounding(rounding, key):
        return _stochastic_on_backward(x, key, float_dtype(dtype), saturate)
    return _quantize_on_backward(x, float_dtype(dtype), saturate)


def _quantize(
    x: jax.Array, dtype, saturating: bool, keep_dtype: bool, key: jax.Array | None = None
) -> jax.Array:
    """``x`` cast to ``dtype`` (clipped to its range first if ``saturating``), rounded
    stochastically with ``key`` if given; cast back if ``keep_dtype``."""
    if saturating:
        x = cast_rules.saturate(x, dtype)
    out = lax.convert_element_type(x, dtype) if key is None else stochastic_round(x, dtype, key)
    return lax.convert_element_type(out, x.dtype) if keep_dtype else out


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _quantize_on_forward(x, dtype, saturating: bool, keep_dtype: bool):
    return _quantize(x, dtype, saturating, keep_dtype)


@_quantize_on_forward.defjvp
def _quantize_on_forward_jvp(dtype, saturating, keep_dtype, primals, tangents):
    (x,), (tangent,) = primals, tangents
    out = _quantize(x, dtype, saturating, keep_dtype)
    # The tangent map is the identity (up to the dtype change), whose transpose widens the
    # cotangent back to x's dtype: no rounding on the backward pass.
    return out, (tangent if keep_dtype else lax.convert_element_type(tangent, dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _quantize_on_backward(x, dtype, saturating: bool):
    return x


def _quantize_on_backward_fwd(x, dtype, saturating):
    return x, None


def _quantize_on_backward_bwd(dtype, saturating, _, cotangent):
    return (_quantize(cotangent, dtype, saturating, keep_dtype=True),)


_quantize_on_backward.defvjp(_quantize_on_backward_fwd, _quantize_on_backward_bwd)


# -- stochastic rounding: the same passes, with the PRNG key as an operand -----------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _stochastic_on_forward(x, key, dtype, saturating: bool, keep_dtype: bool):
    return _quantize(x, dtype, saturating, keep_dtype, key)


@_stochastic_on_forward.defjvp
def _stochastic_on_forward_jvp(dtype, saturating, keep_dtype, primals, tangents):
    (x, key), (tangent, _) = primals, tangents
    out = _quantize(x, dtype, saturating, keep_dtype, key)
    return out, (tangent if keep_dtype else lax.convert_element_type(tangent, dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _stochastic_on_backward(x, key, dtype, saturating: bool):
    return x


def _stochastic_on_backward_fwd(x, key, dtype, saturating):
    return x, key  # the key, not random bits: nothing of x's size is kept for the backward


def _stochastic_on_backward_bwd(dtype, saturating, key, cotangent):
    return _quantize(cotangent, dtype, saturating, True, key), None


_stochastic_on_backward.defvjp(_stochastic_on_backward_fwd, _stochastic_on_backward_bwd)
