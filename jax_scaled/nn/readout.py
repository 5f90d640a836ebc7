"""The μP readout: the network's last linear layer, with output multiplier ``1 / fan_in``.

In μP (and u-μP), hidden layers get a ``1 / sqrt(fan_in)`` multiplier but the readout gets
``1 / fan_in``: during training its input becomes correlated with its weights, so ``x @ w``
grows like ``fan_in`` rather than ``sqrt(fan_in)``, and the larger divisor keeps the logits'
scale independent of the width. At initialisation (independent unit-scale ``x`` and ``w``)
the output is therefore ``1 / sqrt(fan_in)``-scaled, on purpose.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.nn.linear import linear
from jax_scaled.scales import as_scaled, make_scale, scale_f32, scale_mul, sqrt_pow2, times_scalar


def linear_readout(
    x: jax.Array, w: jax.Array, b: jax.Array | None = None, **linear_kwargs: Any
) -> jax.Array:
    """``(x @ w) / fan_in + b``: the μP readout layer, ``fan_in = w.shape[0]``.

    Forward: :func:`~jax_scaled.nn.linear` (so ``x_dtype``, ``w_dtype``, ``grad_dtype``,
    ``wgrad_dtype``, ``preferred_element_type``, ``grad_rounding`` and ``key`` choose its
    FP8 formats, passed as ``linear_kwargs``), times the μP multiplier ``1 / fan_in``, plus
    the bias (not scaled).

    Backward: the exact derivative, so both gradients carry the ``1 / fan_in`` too:
    ``grad_x = (g / fan_in) @ w.T`` and ``grad_w = x.T @ (g / fan_in)``; the bias gradient is
    ``g`` summed. unit-scaling's ``linear_readout`` instead rescales them to unit variance
    (``grad_x`` by ``fan_out^-1/2``, ``grad_w`` by ``batch^-1/2``), which changes their values
    (a loss-scale-like constant that its optimizer rules must then undo). jax_scaled has no
    need to: under :func:`jax_scaled.scalify` a gradient's magnitude lives in its scale and
    the dot_general rule keeps both gradients' data at unit scale whatever the multiplier,
    so the optimizer sees μP's true gradient and the data stays representable in FP16/FP8.

    Under scalify, with unit-scale data in, the output data is unit-scale: the matmul's rule
    divides its data by ``sqrt(fan_in)`` rounded to a power of two, and the multiplier's rule
    moves the power of two nearest to ``1 / fan_in`` times that rounding's remainder into the
    scale, the rest (a factor within ``sqrt(2)`` of 1) into the data.

    Args:
        x: input activations, shape ``(..., fan_in)``.
        w: readout weights, shape ``(fan_in, ...)`` (unit-variance initialisation, as in u-μP).
        b: optional bias, broadcastable to the output.
        **linear_kwargs: format arguments of :func:`~jax_scaled.nn.linear`.

    Returns:
        The logits, of shape ``x.shape[:-1] + w.shape[1:]``.

    Example:
        >>> x, w = jnp.ones((2, 64)), jnp.ones((64, 3))
        >>> js.nn.linear_readout(x, w)  # 64 / 64
        Array([[1., 1., 1.],
               [1., 1., 1.]], dtype=float32)
        >>> jax.grad(lambda w: js.nn.linear_readout(x, w).sum())(w)[0]  # 2 / 64
        Array([0.03125, 0.03125, 0.03125], dtype=float32)
    """
    fan_in = w.shape[0]
    y = _readout_multiplier(linear(x, w, **linear_kwargs), fan_in)
    return y if b is None else y + b


@functools.partial(custom_scale, static_argnums=(1,))
def _readout_multiplier(y: jax.Array, fan_in: int) -> jax.Array:
    return y * (1.0 / fan_in)


@_readout_multiplier.defscale
def _readout_multiplier_rule(y, fan_in: int) -> ScaledArray:
    """``y / fan_in`` for ``y`` from the dot_general rule, whose data has RMS
    ``sqrt(fan_in) / sqrt_pow2(fan_in)`` for unit-scale operands: the power of two nearest to
    that RMS over ``fan_in`` goes to the scale, the remaining factor to the data."""
    y = as_scaled(y)
    data_rms = math.sqrt(max(fan_in, 1)) / sqrt_pow2(fan_in)
    shift = 2.0 ** round(math.log2(data_rms / fan_in))
    wide = y.data.astype(compute_dtype(y.dtype))
    data = times_scalar(wide, np.float32(1.0 / fan_in / shift)).astype(y.dtype)
    return ScaledArray(data, make_scale(scale_mul(scale_f32(y), np.float32(shift)), y))
