"""Scale rules for shape primitives: pure data movement keeps the input scale.

Ops that move one operand's elements (reshape, transpose, slice, ...) apply the primitive to
the data and keep the scale, so they are bit exact. Ops that merge several operands
(concatenate, pad with a non-zero value) first align them to the largest scale, so nothing
overflows; the smaller operands round once into the data format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled._jax_internals import Primitive, Tracer, optimization_barrier_p, split_p
from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine import estimates
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.pow2.static import is_static
from jax_scaled.rules.toolkit import align_selection
from jax_scaled.scales import (
    align,
    as_scaled,
    carry_largest_magnitude,
    guard_band,
    guarded,
    make_scale,
    max_scale,
    scale_f32,
    wide_data,
)


def _register_data_movement(primitive: Primitive, properties: Property) -> None:
    """Register a rule applying ``primitive`` to the data of its first input, scale kept."""
    keeps_magnitudes = primitive in _KEEPING_EVERY_ELEMENT

    def rule(x: ScaledArray, *args: Value, **params) -> ScaledArray:
        """Data movement: the primitive on data (extra inputs passed as is), same scale."""
        data = primitive.bind(x.data, *args, **params)
        if keeps_magnitudes:  # the same largest magnitude: a guard's record still holds
            carry_largest_magnitude(x.data, data)
        return ScaledArray(data, x.scale)

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_rule"
    register_scale_rule(primitive, properties=properties, estimate=estimates.first)(rule)


# Every element of the operand, some repeated, and nothing else (a slice drops some).
_KEEPING_EVERY_ELEMENT = frozenset(
    {lax.reshape_p, lax.squeeze_p, lax.broadcast_in_dim_p, lax.transpose_p, lax.rev_p, lax.tile_p}
)

# Reshapes keep a broadcast of a scalar one (SHAPE_ONLY); all but tile keep scale-free values.
_RESHAPE = (
    Property.SHAPE_ONLY | Property.ANY_SCALE_PRESERVING | Property.SELECTING | Property.LAYOUT
)
_DATA_MOVEMENT = {
    lax.reshape_p: _RESHAPE,
    lax.squeeze_p: _RESHAPE,
    lax.broadcast_in_dim_p: _RESHAPE,
    lax.transpose_p: Property.ANY_SCALE_PRESERVING | Property.LAYOUT,
    lax.slice_p: Property.ANY_SCALE_PRESERVING,
    lax.rev_p: Property.ANY_SCALE_PRESERVING | Property.LAYOUT,
    lax.tile_p: Property.NONE,
}
for _primitive, _properties in _DATA_MOVEMENT.items():
    _register_data_movement(_primitive, _properties)


def _joined(primitive: Primitive, xs: tuple[Value, ...], params: dict) -> ScaledArray:
    """``primitive`` (concatenate, stack) on the operands aligned to the largest scale
    (constants: ``align_selection``).

    With float16/float8 data and the range guard on, the operands are joined in float32
    and the result is range-guarded (:func:`~jax_scaled.scales.guard.guarded`): an
    operand far below the largest scale keeps its precision (``glu``'s gradient at inputs
    around 2^20 joins one at scale 1 with one that is zero at scale 2^20).
    """
    dtype = xs[0].dtype
    if guard_band(dtype) is not None and not any(is_static(as_scaled(x).scale) for x in xs):
        scale = max_scale([scale_f32(x) for x in xs])
        wide = [wide_data(x, scale, pow2_target=True) for x in xs]
        return guarded(primitive.bind(*wide, **params), scale, dtype, *xs)
    datas, scale = align_selection(*xs)
    return ScaledArray(primitive.bind(*datas, **params), make_scale(scale, *xs))


@register_scale_rule(
    lax.concatenate_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.largest
)
def concatenate_rule(*xs: Value, **params) -> ScaledArray:
    """Concatenate the operands aligned to the largest scale (see :func:`_joined`)."""
    return _joined(lax.concatenate_p, xs, params)


@register_scale_rule(lax.stack_p)
def stack_rule(*xs: Value, **params) -> ScaledArray:
    """Stack the operands aligned like concatenate's (see :func:`_joined`)."""
    return _joined(lax.stack_p, xs, params)


@register_scale_rule(lax.unstack_p)
def unstack_rule(x: ScaledArray, **params) -> list[ScaledArray]:
    """Unstack the data; every piece keeps the input scale."""
    return [ScaledArray(d, x.scale) for d in lax.unstack_p.bind(x.data, **params)]


if split_p is not None:

    @register_scale_rule(split_p)
    def split_rule(x: ScaledArray, **params) -> list[ScaledArray]:
        """Split the data; every piece keeps the input scale."""
        return [ScaledArray(d, x.scale) for d in split_p.bind(x.data, **params)]


@register_scale_rule(lax.pad_p, properties=Property.ANY_SCALE_PRESERVING, estimate=estimates.first)
def pad_rule(x: Value, padding_value: Value, **params) -> ScaledArray:
    """Pad at the operand's scale, raised to the padding value's if that is larger.

    A zero, infinite or NaN padding value is the same at any scale, so it never raises the
    scale (checked on its data too: a zero that went through ``convert_element_type`` reaches
    the rule as a plain scalar of scale 1). Padding is then bit exact.
    """
    value = as_scaled(padding_value)
    if _pads_at_operand_scale(x, value):
        data = lax.pad_p.bind(x.data, value.data, **params)
        return ScaledArray(data, make_scale(scale_f32(x), x, padding_value))
    special = (value.data == 0) | ~jnp.isfinite(value.data)
    common = jnp.where(special, scale_f32(x), jnp.maximum(scale_f32(x), scale_f32(value)))
    (data, fill), scale = align(x, value, scale=common)
    return ScaledArray(lax.pad_p.bind(data, fill, **params), make_scale(scale, x, padding_value))


def _pads_at_operand_scale(x: Value, value: ScaledArray) -> bool:
    """True where ``x``'s data pads with ``value``'s data as it is: a padding value at
    ``x``'s own scale (a zero the interpreter promoted shares the scale), or one known at trace
    time to be zero, infinite or NaN (a literal: the same at any scale). Nothing is then
    staged for the common scale, whose traced test of the value and float division XLA
    compiled in a kernel of their own (the transpose of each slice of the attention's
    ``qkv``)."""
    if not isinstance(x, ScaledArray) or getattr(value.data, "dtype", None) != x.data.dtype:
        return False
    if value.scale is x.scale:
        return True
    if isinstance(value.data, Tracer):
        return False
    fill = np.asarray(value.data)
    return bool(fill == 0 or not np.isfinite(fill))


@register_scale_rule(optimization_barrier_p)
def optimization_barrier_rule(*operands: Value) -> list[Value]:
    """The barrier applies to every data and scale array: one barrier over all of them."""
    leaves, tree = jax.tree.flatten(list(operands))
    return jax.tree.unflatten(tree, optimization_barrier_p.bind(*leaves))
