"""Scaling primitives: the explicit switches between scaled and unscaled representations.

Outside ``scalify`` they are identities (``get_data_and_scale`` returns scale 1), so a model
that uses them runs unchanged without scalify. They are real JAX primitives (abstract
evaluation, lowering, JVP, transpose, batching), so they survive ``jit``, ``grad`` and
``vmap`` traced inside scalify. Tangents and cotangents flow through them untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.engine.registry import Property, register_block_rule, register_scale_rule
from jax_scaled.pow2.traced import pow2_round
from jax_scaled.scales import as_scaled, make_scale, rescale, safe_ratio, scale_f32


def set_scaling(x, scale) -> jax.Array:
    """Give ``x`` the (power-of-two) ``scale``; its value is unchanged.

    Under scalify the result is a ScaledArray with this scale, rounded down to a power of two
    if it is not one (a plain ``x`` becomes ``ScaledArray(x / scale, scale)``). Outside
    scalify it returns ``x``.

    Example:
        >>> out = scalify(lambda x: set_scaling(x, jnp.float32(4.0)))(jnp.array([8.0]))
        >>> out.data, out.scale
        (Array([2.], dtype=float32), Array(4., dtype=float32))
    """
    return set_scaling_p.bind(x, jnp.asarray(scale, dtype=_scale_dtype(scale)))


def get_data_and_scale(x) -> tuple[jax.Array, jax.Array]:
    """Unbundle ``x`` into ``(data, scale)``, both plain arrays; scale 1 for unscaled ``x``.

    The scale is returned as float32 (exact for E8M0 scales). Outside scalify: ``(x, 1.0)``.

    Example:
        >>> data, scale = scalify(get_data_and_scale)(scaled_array([3.0], 0.5))
        >>> float(data[0]), float(scale)
        (3.0, 0.5)
    """
    data, scale = get_data_and_scale_p.bind(x)
    return data, scale


def stop_scaling(x, dtype=None) -> jax.Array:
    """Turn ``x`` back into a plain array of its value (cast to ``dtype`` if given).

    Under scalify this forms ``data * scale``; outside it is ``x.astype(dtype)``.

    Example:
        >>> scalify(stop_scaling)(scaled_array([3.0], 0.5))
        Array([1.5], dtype=float32)
    """
    dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(x)
    return stop_scaling_p.bind(x, dtype=dtype)


def rebalance(x, factor) -> jax.Array:
    """Move the power of two ``factor`` from data to scale: scale * factor, data / factor.

    A ``factor`` that is not a power of two is rounded down to one.

    The value is unchanged; outside scalify (or on a plain array) it returns ``x``.

    Example:
        >>> out = scalify(rebalance)(scaled_array([4.0], 1.0), jnp.float32(4.0))
        >>> out.data, out.scale
        (Array([1.], dtype=float32), Array(4., dtype=float32))
    """
    return rebalance_p.bind(x, jnp.asarray(factor, dtype=_scale_dtype(factor)))


def _scale_dtype(scale) -> jnp.dtype:
    dtype = jnp.result_type(scale)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(jnp.float32)


def _check_scalar(name: str, scale) -> None:
    if jnp.ndim(scale) != 0:
        raise ValueError(f"{name} needs a scalar scale, got shape {jnp.shape(scale)}.")


# -- the primitives: their plain (outside scalify) semantics --------------------------------


def _set_scaling_impl(x, scale):
    _check_scalar("set_scaling", scale)
    return x


def _get_data_and_scale_impl(x):
    return [x, jnp.ones((), jnp.float32)]


def _stop_scaling_impl(x, *, dtype):
    return jnp.asarray(x).astype(dtype)


def _get_data_and_scale_jvp(primals, tangents):
    (x,), (tangent,) = primals, tangents
    data, scale = get_data_and_scale_p.bind(x)
    return (data, scale), (tangent, jxi.zero_tangent(scale))


def _get_data_and_scale_batcher(args, dims):
    (x,), (x_dim,) = args, dims
    data, scale = get_data_and_scale_p.bind(x)
    return (data, scale), (x_dim, jxi.NOT_MAPPED)


# Value-wise identities (a cast for stop_scaling): tangents and cotangents pass through.
set_scaling_p = jxi.define_primitive("set_scaling", _set_scaling_impl, straight_through=True)
rebalance_p = jxi.define_primitive("rebalance", _set_scaling_impl, straight_through=True)
stop_scaling_p = jxi.define_primitive("stop_scaling", _stop_scaling_impl, straight_through=True)
get_data_and_scale_p = jxi.define_primitive(
    "get_data_and_scale",
    _get_data_and_scale_impl,
    multiple_results=True,
    jvp=_get_data_and_scale_jvp,
    batcher=_get_data_and_scale_batcher,
)


# -- scale rules (under scalify) -------------------------------------------------------------


@register_scale_rule(set_scaling_p, applies_to_unscaled=True)
def _set_scaling_rule(x, scale):
    scale = scale.to_array() if isinstance(scale, ScaledArray) else scale
    target = pow2_round(scale.astype(jnp.float32))  # scales must be powers of two
    data = rescale(as_scaled(x).data, safe_ratio(scale_f32(x), target))
    return ScaledArray(data, make_scale(target, x))


@register_scale_rule(get_data_and_scale_p)
def _get_data_and_scale_rule(x):
    return [as_scaled(x).data, scale_f32(x)]


# Block scales are repeated onto the data's grid: one exact multiplication per element.
@register_block_rule(stop_scaling_p, behaviour="consumes")
@register_scale_rule(stop_scaling_p, properties=Property.READS_FINER_SCALES)
def _stop_scaling_rule(x, *, dtype):
    return as_scaled(x).to_array(dtype)


@register_scale_rule(rebalance_p)
def _rebalance_rule(x, factor):
    if not isinstance(x, ScaledArray):
        return x
    factor = (factor.to_array() if isinstance(factor, ScaledArray) else factor).astype(jnp.float32)
    factor = pow2_round(factor)  # scales must stay powers of two
    data = rescale(x.data, 1 / factor)
    return ScaledArray(data, make_scale(scale_f32(x) * factor, x))
