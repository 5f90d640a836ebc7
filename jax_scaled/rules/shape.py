"""Scale rules for shape primitives: pure data movement keeps the input scale.

Ops that move one operand's elements (reshape, transpose, slice, ...) apply the primitive to
the data and keep the scale, so they are bit exact. Ops that merge several operands
(concatenate, pad with a non-zero value) first align them to the largest scale, so nothing
overflows; the smaller operands round once into the data format.
"""

from __future__ import annotations

from jax import lax

from jax_scaled._jax_internals import Primitive, split_p
from jax_scaled.array import ScaledArray
from jax_scaled.registry import register_scale_rule
from jax_scaled.rules._common import Value, align, make_scale


def _register_data_movement(primitive: Primitive) -> None:
    """Register a rule applying ``primitive`` to the data of its first input, scale kept."""

    def rule(x: ScaledArray, *args: Value, **params) -> ScaledArray:
        """Data movement: the primitive on data (extra inputs passed as is), same scale."""
        return ScaledArray(primitive.bind(x.data, *args, **params), x.scale)

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_rule"
    register_scale_rule(primitive)(rule)


for _primitive in (
    lax.reshape_p,
    lax.squeeze_p,
    lax.broadcast_in_dim_p,
    lax.transpose_p,
    lax.slice_p,
    lax.rev_p,
):
    _register_data_movement(_primitive)


@register_scale_rule(lax.concatenate_p)
def concatenate_rule(*xs: Value, **params) -> ScaledArray:
    """Concatenate the operands aligned to the largest scale."""
    datas, scale = align(*xs)
    return ScaledArray(lax.concatenate_p.bind(*datas, **params), make_scale(scale, *xs))


if split_p is not None:

    @register_scale_rule(split_p)
    def split_rule(x: ScaledArray, **params) -> list[ScaledArray]:
        """Split the data; every piece keeps the input scale."""
        return [ScaledArray(d, x.scale) for d in split_p.bind(x.data, **params)]


@register_scale_rule(lax.pad_p)
def pad_rule(x: Value, padding_value: Value, **params) -> ScaledArray:
    """Pad at max(operand, padding value) scale: the operand's for a zero or non-finite pad.

    The interpreter gives a zero/inf/nan padding value the operand's scale, so the common case
    is bit exact; a larger non-zero padding value raises the scale instead of overflowing.
    """
    (data, value), scale = align(x, padding_value)
    return ScaledArray(lax.pad_p.bind(data, value, **params), make_scale(scale, x, padding_value))

