"""Scale rules for indexing primitives: gathers keep the operand scale, updates align.

Index arrays are never scaled: they are passed to the primitive as they are. Reads (gather,
dynamic_slice) are bit exact. Writes that mix operand and update values (scatter,
dynamic_update_slice, scatter_min/max) align both to the larger scale. ``scatter_add`` and
``scatter_sub`` (``x.at[i].subtract(u)``) are an add or a subtraction at the touched positions
and use the add rule's estimate, ``sqrt(so^2 + su^2)`` rounded to a power of two (with the
default round-down this is the larger scale, so nothing overflows where the add rule would
not).

The max-pooling derivatives (``select_and_gather_add`` in the JVP, ``select_and_scatter_add``
in the VJP) select with the operand's data (order is unchanged by a positive scale) and move
the tangents/cotangents, whose scale they keep.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled._jax_internals import lax_primitives
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine import estimates
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.pow2.static import static_pow2_round
from jax_scaled.scales import (
    align,
    as_scaled,
    make_scale,
    rounded_l2_scale,
    scale_f32,
    to_compute,
    wide_data,
)


@register_scale_rule(
    lax.dynamic_slice_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.first
)
def dynamic_slice_rule(x: ScaledArray, *indices: Value, **params) -> ScaledArray:
    """Slice the data at the (plain) start indices; scale kept."""
    return ScaledArray(lax.dynamic_slice_p.bind(x.data, *indices, **params), x.scale)


@register_scale_rule(lax.dynamic_update_slice_p)
def dynamic_update_slice_rule(x: Value, update: Value, *indices: Value, **params) -> ScaledArray:
    """Write the update into the operand, both aligned to the larger scale."""
    (data, new), scale = align(x, update)
    out = lax.dynamic_update_slice_p.bind(data, new, *indices, **params)
    return ScaledArray(out, make_scale(scale, x, update))


@register_scale_rule(
    lax.gather_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.first
)
def gather_rule(x: Value, indices: Value, *, fill_value=None, **params) -> ScaledArray:
    """Gather the data, scale kept; a finite non-zero fill value may raise the scale."""
    x = as_scaled(x)
    data = lax.gather_p.bind(x.data, indices, fill_value=fill_value, **params)
    if fill_value is None or fill_value == 0 or not math.isfinite(fill_value):
        return ScaledArray(data, x.scale)  # NaN/inf/zero fills are the same at any scale
    inside = lax.gather_p.bind(jnp.ones_like(x.data), indices, fill_value=0, **params)
    scale = jnp.maximum(scale_f32(x), np.float32(static_pow2_round(abs(fill_value))))
    gathered = wide_data(ScaledArray(data, x.scale), scale)
    value = jnp.where(inside != 0, gathered, fill_value / scale.astype(gathered.dtype))
    return ScaledArray(value.astype(x.dtype), make_scale(scale, x))


def _register_aligned_scatter(primitive, estimate) -> None:
    """Register a scatter rule aligning operand and updates to ``estimate(so, su)``."""

    def rule(x: Value, indices: Value, updates: Value, **params) -> ScaledArray:
        """Scatter with operand and updates aligned to one common power-of-two scale."""
        scale = estimate(scale_f32(x), scale_f32(updates))
        (data, new), scale = align(x, updates, scale=scale)
        out = primitive.bind(data, indices, new, **params)
        return ScaledArray(out, make_scale(scale, x, updates))

    rule.__name__ = rule.__qualname__ = f"{primitive.name.replace('-', '_')}_rule"
    register_scale_rule(primitive)(rule)


_register_aligned_scatter(lax.scatter_p, jnp.maximum)
_register_aligned_scatter(lax.scatter_min_p, jnp.maximum)
_register_aligned_scatter(lax.scatter_max_p, jnp.maximum)
_register_aligned_scatter(lax.scatter_add_p, rounded_l2_scale)
_register_aligned_scatter(lax.scatter_sub_p, rounded_l2_scale)


@register_scale_rule(lax.scatter_mul_p)
def scatter_mul_rule(x: Value, indices: Value, updates: Value, **params) -> ScaledArray:
    """Multiply by the represented updates in the compute dtype; the operand scale kept.

    Suited to factors of order one (masks, decays): the products are rounded once into the
    data format at the operand's scale.
    """
    x = as_scaled(x)
    params = {k: v for k, v in params.items() if k not in ("update_jaxpr", "update_consts")}
    wide = x.data.astype(compute_dtype(x.dtype))
    out = lax.scatter_mul(wide, indices, to_compute(updates).astype(wide.dtype), **params)
    return ScaledArray(out.astype(x.dtype), x.scale)


@register_scale_rule(lax_primitives.select_and_gather_add_p)
def select_and_gather_add_rule(tangents: Value, operand: Value, **params) -> ScaledArray:
    """Pick the tangent at each window's selected operand element; tangent scale kept."""
    t = as_scaled(tangents)
    out = lax_primitives.select_and_gather_add_p.bind(t.data, as_scaled(operand).data, **params)
    return ScaledArray(out, t.scale)


@register_scale_rule(lax_primitives.select_and_scatter_add_p)
def select_and_scatter_add_rule(source: Value, operand: Value, **params) -> ScaledArray:
    """Scatter-add the cotangents to each window's selected element; source scale kept."""
    s = as_scaled(source)
    out = lax_primitives.select_and_scatter_add_p.bind(s.data, as_scaled(operand).data, **params)
    return ScaledArray(out, s.scale)
