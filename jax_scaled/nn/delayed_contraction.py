"""A cast contraction with delayed scaling: each operand's scale from its amax history.

:func:`delayed_contraction` is :func:`~jax_scaled.nn.cast_contraction.cast_contraction` with
the scale of each cast (``lhs`` and ``rhs`` forward, the cotangent backward) taken from the
amax of previous steps (:class:`~jax_scaled.ops.DelayedScaling`, Transformer Engine's recipe)
instead of the current value's. A cast saturates: a value beyond the history's range is
clipped to the format's largest, as Transformer Engine's casts are.

The histories are an input, and their next values come back as its gradient: ``jax.grad``
with respect to a :class:`ContractionHistory` returns the histories with this step's amax of
each operand and of the cotangent pushed in (flax's FP8 ops keep theirs the same way). A
history that holds no amax yet (all zeros: the first step) falls back to current scaling.

Under :func:`jax_scaled.scalify` a ScaledArray operand is not rescaled (its scale already
keeps its data in range, as with current scaling); its amax is still recorded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes

from jax_scaled.array import ScaledArray
from jax_scaled.construction import asarray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.nn.cast_contraction import (
    CastFormats,
    Contraction,
    backward_contractions,
    fitting_scale,
    has_float32_range,
    unscale,
)
from jax_scaled.ops.delayed import DelayedScaling, DelayedScalingState, amax


class ContractionHistory(NamedTuple):
    """The amax histories of one contraction: float32 arrays of shape ``(history_len,)``,
    most recent first, of its left operand, right operand and output cotangent.

    Example:
        >>> from jax_scaled.nn.delayed_contraction import ContractionHistory
        >>> ContractionHistory.zeros(4).grad
        Array([0., 0., 0., 0.], dtype=float32)
    """

    lhs: jax.Array
    rhs: jax.Array
    grad: jax.Array

    @classmethod
    def zeros(cls, history_len: int) -> ContractionHistory:
        """Empty histories: the first step scales as current scaling does."""
        return cls(*(jnp.zeros((history_len,), jnp.float32) for _ in range(3)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def delayed_contraction(
    lhs: jax.Array,
    rhs: jax.Array,
    history: ContractionHistory,
    contraction: Contraction,
    formats: CastFormats,
    recipe: DelayedScaling,
) -> jax.Array:
    """``contraction(lhs, rhs)`` with narrow operands scaled from their amax histories.

    Args:
        lhs: the left operand.
        rhs: the right operand.
        history: the amax histories of the operands and the cotangent.
        contraction: which contraction (:class:`~jax_scaled.nn.cast_contraction.Contraction`).
        formats: the casts, accumulation and result dtypes.
        recipe: history length, margin and amax rule (its ``dtype`` is replaced by each
            cast's format).

    Returns:
        The contraction of the cast operands, in ``formats.output``. Under ``jax.grad`` the
        gradient with respect to ``history`` is the next history.

    Example:
        >>> from jax_scaled.nn.cast_contraction import CastFormats, Contraction
        >>> from jax_scaled.nn.delayed_contraction import ContractionHistory, delayed_contraction
        >>> from jax_scaled.ops import DelayedScaling
        >>> e4m3, e5m2, f32 = (jnp.dtype(d) for d in ("float8_e4m3fn", "float8_e5m2", "float32"))
        >>> formats = CastFormats(e4m3, e4m3, e5m2, f32, f32, f32, f32, "delayed")
        >>> matmul = Contraction.dot_general((((1,), (0,)), ((), ())))
        >>> x, w = jnp.full((2, 3), 2.0**-20), jnp.full((3, 2), 1.5)
        >>> def loss(history, x, w):
        ...     y = delayed_contraction(x, w, history, matmul, formats, DelayedScaling(2))
        ...     return jnp.sum(y)
        >>> history = jax.grad(loss)(ContractionHistory.zeros(2), x, w)  # the next history
        >>> [h.tolist() for h in (history.lhs * 2**20, history.rhs, history.grad)]
        [[1.0, 0.0], [1.5, 0.0], [1.0, 0.0]]
        >>> float(loss(history, x, w)) * 2**20  # 4 sums of 3 products 1.5 * 2^-20: exact
        18.0
    """
    return _forward(lhs, rhs, history, contraction, formats, recipe)[0]


def _forward(lhs, rhs, history, contraction: Contraction, formats: CastFormats, recipe) -> tuple:
    seen = (_amax_of(lhs, formats.lhs), _amax_of(rhs, formats.rhs))
    lhs_q, lhs_scale = _quantize(lhs, seen[0], formats.lhs, history.lhs, recipe)
    rhs_q, rhs_scale = _quantize(rhs, seen[1], formats.rhs, history.rhs, recipe)
    out = contraction(lhs_q, rhs_q, formats.accumulation)
    out = unscale(out, (lhs_scale, rhs_scale), formats.output)
    return out, ((lhs_q, rhs_q, lhs_scale, rhs_scale), seen, history)


def _backward(contraction: Contraction, formats: CastFormats, recipe, residuals, cotangent):
    cast, (lhs_amax, rhs_amax), history = residuals
    grad_amax = _amax_of(cotangent, formats.grad)

    def quantize(dtype: jnp.dtype | None) -> tuple:
        return _quantize(cotangent, grad_amax, dtype, history.grad, recipe)

    d_lhs, d_rhs = backward_contractions(contraction, formats, cast, quantize)
    next_history = ContractionHistory(
        _pushed(history.lhs, lhs_amax),
        _pushed(history.rhs, rhs_amax),
        _pushed(history.grad, grad_amax),
    )
    return d_lhs, d_rhs, next_history


delayed_contraction.defvjp(_forward, _backward)


def _amax_of(x: Any, dtype: jnp.dtype | None) -> jax.Array:
    """The amax recorded for a cast to ``dtype`` (0 where nothing is cast)."""
    return jnp.float32(0) if dtype is None else amax(x)


def _pushed(history: jax.Array, amax: jax.Array) -> jax.Array:
    return DelayedScalingState(asarray(history)).pushed(amax).amax_history


def _quantize(x: Any, amax: jax.Array, dtype: jnp.dtype | None, history, recipe) -> tuple:
    """``(x cast to dtype, its scale)``; the scale is None when ``x`` is not rescaled.
    ``amax``: the largest magnitude of ``x``'s value (reduced once, recorded too)."""
    if dtype is None:
        return x, None
    if has_float32_range(dtype):
        return x.astype(dtype), None
    scale = delayed_scale(x, amax, history, dtype, recipe)
    return _saturated(x.astype(compute_dtype(x.dtype)) / scale, dtype).astype(dtype), scale


@functools.partial(custom_scale, static_argnums=(3, 4))
def delayed_scale(
    x: jax.Array, amax: jax.Array, history: jax.Array, dtype: jnp.dtype, recipe: DelayedScaling
) -> jax.Array:
    """The power of two ``x`` is divided by before its cast to ``dtype``: from the amax
    ``history`` (:meth:`~jax_scaled.ops.DelayedScaling.scale`), or, while the history is
    empty, current scaling's (from ``amax``, the largest magnitude of ``x``). Under
    scalify, 1 for a ScaledArray ``x`` (its scale keeps it in range).

    Example:
        >>> from jax_scaled.nn.delayed_contraction import delayed_scale
        >>> from jax_scaled.ops import DelayedScaling
        >>> e4m3, x, amax = jnp.dtype(jnp.float8_e4m3fn), jnp.array([3.0]), jnp.float32(3)
        >>> float(delayed_scale(x, amax, jnp.array([900.0, 0.0]), e4m3, DelayedScaling(2)))
        4.0
        >>> float(delayed_scale(x, amax, jnp.zeros(2), e4m3, DelayedScaling(2)))  # 3 * 2^7
        0.0078125
    """
    state = DelayedScalingState(asarray(history).astype(jnp.float32))
    return dataclasses.replace(recipe, dtype=dtype).scale(state, fitting_scale(amax, dtype))


@delayed_scale.defscale
def _scaled_data_needs_no_scale(x: Any, amax: Any, history: Any, dtype, recipe) -> Any:
    if isinstance(x, ScaledArray):
        return jnp.ones((), jnp.float32)
    return delayed_scale.fun(x, asarray(amax), history, dtype, recipe)


@functools.partial(custom_scale, static_argnums=(1,))
def _saturated(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``x`` clipped to ``dtype``'s finite range: an amax above the history's saturates."""
    largest = float(ml_dtypes.finfo(dtype).max)
    return jnp.clip(x, -largest, largest)


@_saturated.defscale
def _scaled_data_is_kept_in_range(x: Any, dtype: jnp.dtype) -> Any:
    return x if isinstance(x, ScaledArray) else _saturated.fun(x, dtype)
