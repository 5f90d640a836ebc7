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
from jax_scaled.pow2 import pow2_round
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import (
    as_scaled,
    make_scale,
    rescale,
    safe_ratio,
    scale_f32,
)

set_scaling_p = jxi.Primitive("set_scaling")
get_data_and_scale_p = jxi.Primitive("get_data_and_scale")
get_data_and_scale_p.multiple_results = True
stop_scaling_p = jxi.Primitive("stop_scaling")
rebalance_p = jxi.Primitive("rebalance")


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


# -- plain (outside scalify) semantics ------------------------------------------------------


def _set_scaling_impl(x, scale):
    _check_scalar("set_scaling", scale)
    return x


def _get_data_and_scale_impl(x):
    return x, jnp.ones((), jnp.float32)


def _stop_scaling_impl(x, *, dtype):
    return jnp.asarray(x).astype(dtype)


set_scaling_p.def_impl(_set_scaling_impl)
get_data_and_scale_p.def_impl(_get_data_and_scale_impl)
stop_scaling_p.def_impl(_stop_scaling_impl)
rebalance_p.def_impl(_set_scaling_impl)

set_scaling_p.def_abstract_eval(lambda x, scale: x)
rebalance_p.def_abstract_eval(lambda x, factor: x)
get_data_and_scale_p.def_abstract_eval(lambda x: (x, jxi.ShapedArray((), jnp.float32)))
stop_scaling_p.def_abstract_eval(lambda x, *, dtype: jxi.ShapedArray(x.shape, dtype))

jxi.mlir.register_lowering(set_scaling_p, jxi.mlir.lower_fun(_set_scaling_impl, False))
jxi.mlir.register_lowering(rebalance_p, jxi.mlir.lower_fun(_set_scaling_impl, False))
jxi.mlir.register_lowering(get_data_and_scale_p, jxi.mlir.lower_fun(_get_data_and_scale_impl, True))
jxi.mlir.register_lowering(stop_scaling_p, jxi.mlir.lower_fun(_stop_scaling_impl, False))


# -- differentiation: value-wise these are identities, so tangents pass through untouched ----


def _identity_jvp(primals, tangents):
    x, scale = primals
    tangent = tangents[0]
    out = set_scaling_p.bind(x, scale)
    return out, (jxi.ad.instantiate_zeros(tangent) if type(tangent) is jxi.ad.Zero else tangent)


def _rebalance_jvp(primals, tangents):
    x, factor = primals
    tangent = tangents[0]
    return rebalance_p.bind(x, factor), (
        jxi.ad.instantiate_zeros(tangent) if type(tangent) is jxi.ad.Zero else tangent
    )


def _get_data_and_scale_jvp(primals, tangents):
    (x,), (tangent,) = primals, tangents
    data, scale = get_data_and_scale_p.bind(x)
    return (data, scale), (
        tangent,
        jxi.ad.Zero(jxi.ShapedArray((), jnp.float32).to_tangent_aval()),
    )


def _stop_scaling_jvp(primals, tangents, *, dtype):
    (x,), (tangent,) = primals, tangents
    out = stop_scaling_p.bind(x, dtype=dtype)
    if type(tangent) is jxi.ad.Zero:
        return out, jxi.ad.Zero(jxi.ShapedArray(x.shape, dtype).to_tangent_aval())
    return out, tangent.astype(dtype)


jxi.ad.primitive_jvps[set_scaling_p] = _identity_jvp
jxi.ad.primitive_jvps[rebalance_p] = _rebalance_jvp
jxi.ad.primitive_jvps[get_data_and_scale_p] = _get_data_and_scale_jvp
jxi.ad.primitive_jvps[stop_scaling_p] = _stop_scaling_jvp


def _identity_transpose(cotangent, x, scale):
    return cotangent, None


def _stop_scaling_transpose(cotangent, x, *, dtype):
    return (cotangent.astype(x.aval.dtype),)


jxi.ad.primitive_transposes[set_scaling_p] = _identity_transpose
jxi.ad.primitive_transposes[rebalance_p] = _identity_transpose
jxi.ad.primitive_transposes[stop_scaling_p] = _stop_scaling_transpose


# -- batching: the scale must stay a scalar --------------------------------------------------


def _scaled_batcher(primitive):
    def batcher(args, dims):
        (x, scale), (x_dim, scale_dim) = args, dims
        if scale_dim is not jxi.NOT_MAPPED:
            raise NotImplementedError(
                f"{primitive.name} under vmap needs one scale for the whole batch; got a "
                "batched scale. Map over the scale outside vmap, or use a per-example scalify."
            )
        return primitive.bind(x, scale), x_dim

    return batcher


def _get_data_and_scale_batcher(args, dims):
    (x,), (x_dim,) = args, dims
    data, scale = get_data_and_scale_p.bind(x)
    return (data, scale), (x_dim, jxi.NOT_MAPPED)


def _stop_scaling_batcher(args, dims, *, dtype):
    return stop_scaling_p.bind(args[0], dtype=dtype), dims[0]


jxi.batching.primitive_batchers[set_scaling_p] = _scaled_batcher(set_scaling_p)
jxi.batching.primitive_batchers[rebalance_p] = _scaled_batcher(rebalance_p)
jxi.batching.primitive_batchers[get_data_and_scale_p] = _get_data_and_scale_batcher
jxi.batching.primitive_batchers[stop_scaling_p] = _stop_scaling_batcher


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


@register_scale_rule(stop_scaling_p)
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
