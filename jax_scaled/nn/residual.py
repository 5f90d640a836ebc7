"""Residual connections weighted by ``tau``, as unit scaling does them (Blake et al. 2023,
§5.3; ``residual_split`` / ``residual_add`` of the ``unit-scaling`` library).

A plain residual layer ``x + f(x)`` adds two unit-scale terms into a sum of variance 2, and
the variance grows with depth. Unit scaling uses a weighted add instead:

    ``y = a * f(x) + b * x``,  ``a = tau / sqrt(1 + tau^2)``,  ``b = 1 / sqrt(1 + tau^2)``,

so ``a^2 + b^2 = 1`` (unit-variance ``y`` for independent unit-variance terms) and ``tau``
is the weight of the residual branch relative to the skip connection. (The paper's
fixed(τ') layer ``sqrt(1 - τ') x + sqrt(τ') f(x)`` is the same with ``τ' = tau^2 / (1 + tau^2)``.)

The weights are applied where unit scaling puts them, so that the branch's backward pass
stays unit-scaled too: :func:`residual_add` weights the forward pass only (cotangents go
through unweighted) and :func:`residual_split` weights the backward pass only. Used together,

    ``residual, skip = residual_split(x, tau)``
    ``y = residual_add(f(residual), skip, tau)``

compute ``y = a f(x) + b x`` and its exact gradient with respect to ``x``; inside ``f``, the
cotangent is not multiplied by ``a`` (the paper's rewrite of ``γ f(x)`` as
``id(f(id(x, 1, γ)), γ, 1)``), so the gradients of ``f``'s parameters are ``1 / a`` times
their true values: unit-scaled, as in unit scaling.

Outside scalify both are plain JAX. Under :func:`jax_scaled.scalify` both weighted sums (the
forward of :func:`residual_add`, the backward of :func:`residual_split`) get a scale of
``sqrt((a s1)^2 + (b s2)^2)``, the unit-scaling estimate for independent terms, rounded to a
power of two, with the data formed in float32: unit-scale data in, unit-scale data out.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.scales import (
    as_scaled,
    guarded,
    make_scale,
    round_scale,
    safe_ratio,
    scale_f32,
    sums_guarded,
)


def residual_weights(tau: float) -> tuple[float, float]:
    """``(tau / sqrt(1 + tau^2), 1 / sqrt(1 + tau^2))``: the weights of the residual branch
    and of the skip connection.

    Args:
        tau: weight of the residual branch relative to the skip connection (``>= 0``).

    Returns:
        The two weights, whose squares sum to 1.

    Example:
        >>> js.nn.residual_weights(1.0)
        (0.7071067811865475, 0.7071067811865475)
    """
    tau = float(tau)
    if not tau >= 0:
        raise ValueError(f"tau must be a non-negative number, got {tau}.")
    norm = math.sqrt(1 + tau * tau)
    return tau / norm, 1 / norm


def residual_split(x: jax.Array, tau: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(residual, skip)``, two copies of ``x`` whose cotangents are weighted on the way back.

    Forward: both outputs are ``x``. Backward: ``x``'s cotangent is
    ``a * g_residual + b * g_skip`` with ``(a, b) = residual_weights(tau)``. Use it with
    :func:`residual_add` (see the module notes). Under scalify that backward sum gets the
    unit-scaling scale estimate ``sqrt((a s_residual)^2 + (b s_skip)^2)``.

    Args:
        x: the input of the residual layer.
        tau: weight of the residual branch relative to the skip connection.

    Returns:
        ``(residual, skip)``: ``residual`` feeds the branch ``f``, ``skip`` goes to
        :func:`residual_add`.

    Example:
        >>> f = lambda x: jnp.sum(js.nn.residual_split(x, tau=1.0)[0])  # the branch only
        >>> jax.grad(f)(jnp.ones(2))  # its cotangent times 1/sqrt(2)
        Array([0.70710677, 0.70710677], dtype=float32)
    """
    residual_weights(tau)  # checks tau
    return _split(x, float(tau))


def residual_add(residual: jax.Array, skip: jax.Array, tau: float = 1.0) -> jax.Array:
    """``a * residual + b * skip`` with ``(a, b) = residual_weights(tau)``; the cotangent goes
    to both operands unweighted.

    ``residual`` is the output of the residual branch and ``skip`` the skip connection from
    :func:`residual_split` (see the module notes); both must have the same shape. Under
    scalify the output scale is ``sqrt((a s_residual)^2 + (b s_skip)^2)``, rounded to a power
    of two, and the data is formed in float32.

    Args:
        residual: output of the residual branch.
        skip: the skip connection, of the same shape.
        tau: weight of the residual branch relative to the skip connection.

    Returns:
        The weighted sum, in the promoted dtype of ``residual`` and ``skip``.

    Example:
        >>> x = jnp.array([1.0, -1.0])
        >>> residual, skip = js.nn.residual_split(x, tau=0.5)
        >>> y = js.nn.residual_add(2 * residual, skip, tau=0.5)  # f(x) = 2x: (2a + b) x
        >>> y
        Array([ 1.7888544, -1.7888544], dtype=float32)
        >>> out = js.scalify(js.nn.residual_add)(*js.as_scaled_array((x, x)))  # tau = 1
        >>> out.data, out.scale  # sqrt(2) x, unit-scale data
        (Array([ 1.4142135, -1.4142135], dtype=float32), Array(1., dtype=float32))
    """
    residual_weights(tau)  # checks tau
    if jnp.shape(residual) != jnp.shape(skip):
        raise ValueError(
            f"residual and skip need the same shape, got {jnp.shape(residual)} and "
            f"{jnp.shape(skip)}."
        )
    dtype = jnp.result_type(residual, skip)
    return _add(jnp.asarray(residual, dtype), jnp.asarray(skip, dtype), float(tau))


# -- the weighted sum and its scale rule ---------------------------------------------------


@functools.partial(custom_scale, static_argnums=(2, 3))
def _weighted_sum(u: jax.Array, v: jax.Array, a: float, b: float) -> jax.Array:
    return a * u + b * v


@_weighted_sum.defscale
def _weighted_sum_rule(u, v, a: float, b: float) -> ScaledArray:
    """Scale ``sqrt((a su)^2 + (b sv)^2)`` (independent terms), pow2-rounded; data in float32."""
    u, v = as_scaled(u), as_scaled(v)
    dtype = jnp.result_type(u.data, v.data)
    su, sv = scale_f32(u), scale_f32(v)
    largest = lax.max(jnp.float32(su), jnp.float32(sv))  # a power of two: ratios are exact
    ratio_u, ratio_v = safe_ratio(su, largest), safe_ratio(sv, largest)
    # sqrt((a ratio_u)^2 + (b ratio_v)^2) written as a deficit from a^2 + b^2 = 1, so that
    # equal scales give exactly 1 (a float32 0.99999994 would round down to 1/2).
    deficit = a * a * (1 - ratio_u * ratio_u) + b * b * (1 - ratio_v * ratio_v)
    scale = round_scale(lax.mul(largest, lax.sqrt(1 - deficit)))
    work = compute_dtype(dtype)
    weight_u = (a * safe_ratio(su, scale)).astype(work)
    weight_v = (b * safe_ratio(sv, scale)).astype(work)
    wide = u.data.astype(work) * weight_u + v.data.astype(work) * weight_v
    if sums_guarded(dtype):
        return guarded(wide, scale, dtype, u, v)
    return ScaledArray(wide.astype(dtype), make_scale(scale, u, v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _split(x: jax.Array, tau: float) -> tuple[jax.Array, jax.Array]:
    return x, x


def _split_fwd(x: jax.Array, tau: float) -> tuple:
    return (x, x), None


def _split_bwd(tau: float, _, cotangents: tuple) -> tuple:
    g_residual, g_skip = cotangents
    return (_weighted_sum(g_residual, g_skip, *residual_weights(tau)),)


_split.defvjp(_split_fwd, _split_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add(residual: jax.Array, skip: jax.Array, tau: float) -> jax.Array:
    return _weighted_sum(residual, skip, *residual_weights(tau))


def _add_fwd(residual: jax.Array, skip: jax.Array, tau: float) -> tuple:
    return _add(residual, skip, tau), None


def _add_bwd(tau: float, _, g: jax.Array) -> tuple:
    return g, g


_add.defvjp(_add_fwd, _add_bwd)
