"""Block scales through scalify: how a scale rule meets block-scaled operands.

When an operand of an equation has block scales (:mod:`jax_scaled.scales.geometry`), the
interpreter hands the equation to :func:`apply_rule` instead of the rule itself:

* a primitive whose record has a block rule (``register_block_rule``: layout ops,
  reductions, contractions) runs it;
* a ``POINTWISE`` primitive (each output element a function of the same element of its
  operands: arithmetic, selections, activations, casts) runs its own per-tensor rule on every
  block: the operands are put on a common grid, laid out block-major, and the rule is mapped
  over the blocks (``jax.vmap``), each block a per-tensor ScaledArray. Block scales combine
  block by block, sums align each block to its larger scale, nonlinear functions and the
  range guard work per block, and the output keeps the grid;
* anything else falls back to one scale per tensor: the largest block scale, the data shifted
  to it (exact unless a block's data underflows). The fallback is never silent: it warns once
  per primitive and source line (:class:`BlockScaleFallbackWarning`), and
  :func:`~jax_scaled.diagnostics.record_scales` marks its outputs (``ScaleRecord.block_fallback``).

Per-tensor operands never reach this module: their rules run exactly as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine import recording
from jax_scaled.engine.facts import Slot
from jax_scaled.engine.registry import PrimitiveRecord, Property
from jax_scaled.scales import geometry, make_scale, per_tensor_scale, rescale, scale_f32
from jax_scaled.scales.geometry import is_blocked


class Unsupported(Exception):
    """Raised by a block rule for operands it cannot keep in blocks (a slice across a block,
    a reshape that splits blocks): :func:`apply_rule` falls back to one scale per tensor."""


class BlockScaleFallbackWarning(UserWarning):
    """An operation without a block rule met block-scaled operands: they fell back to one
    scale per tensor (the same values; the block structure is lost from there on)."""


def apply_rule(
    found: PrimitiveRecord, eqn: jxi.JaxprEqn, invals: list[Value], where: str
) -> tuple[Any, bool]:
    """``(outputs, fell back)`` of ``eqn``'s scale rule on operands of which some have block
    scales. ``where`` is the user's source line, for the fallback's warning.
    """
    if found.block_rule is not None:
        try:
            return found.block_rule(*invals, **eqn.params), False
        except Unsupported:
            reason = "cannot keep these blocks (it would split one)"
            return _fallback(found, eqn, invals, where, reason), True
    if found.has(Property.POINTWISE):
        return map_blocks(found.rule, invals, eqn.params, eqn.primitive.multiple_results), False
    return _fallback(found, eqn, invals, where, "has no block-scale rule"), True


def map_blocks(
    rule: Callable,
    invals: Sequence[Value],
    params: dict,
    multiple: bool,
    reduced: Sequence[int] = (),
) -> Any:
    """``rule`` (a per-tensor rule) applied to every block of the operands' common grid: a
    pointwise primitive's, or a reduction's over ``reduced`` axes (each one block wide).

    Example:
        >>> from jax import lax
        >>> from jax_scaled.engine.registry import record
        >>> x = ScaledArray(jnp.ones((2, 4)), jnp.array([[1.0], [4.0]], jnp.float32))
        >>> out = map_blocks(record(lax.mul_p).rule, [x, x], {}, False)
        >>> out.scale.tolist(), out.data.tolist()[1]
        ([[1.0], [16.0]], [1.0, 1.0, 1.0, 1.0])
    """
    shaped = [np.shape(v) for v in invals if np.ndim(v) > 0]
    shape = tuple(max(sizes) for sizes in zip(*shaped, strict=True))
    invals = [_broadcast(v, shape) for v in invals]
    blocks = geometry.common_blocks(invals)
    mapped = [_block_major(v, blocks) for v in invals]
    axes = [axis for _, axis in mapped]
    outs = jax.vmap(lambda *vs: rule(*vs, **params), in_axes=axes)(*[v for v, _ in mapped])
    outs = list(outs) if multiple else [outs]
    counts = [c for d, c in enumerate(geometry.grid(shape, blocks)) if d not in reduced]
    merged = [_from_block_major(out, counts) for out in outs]
    return merged if multiple else merged[0]


def _broadcast(value: Value, shape: tuple[int, ...]) -> Value:
    """``value`` broadcast along its size-1 axes to ``shape`` (lax's implicit broadcasting of
    elementwise operands): a block scale keeps one scale across such an axis."""
    if np.ndim(value) == 0 or np.shape(value) == shape:
        return value
    if isinstance(value, ScaledArray):
        return ScaledArray._trusted(_broadcast(value.data, shape), value.scale)
    return lax.broadcast_in_dim(value, shape, tuple(range(len(shape))))


def _block_major(value: Value, blocks: geometry.Blocks) -> tuple[Any, Any]:
    """``(value laid out block-major, its vmap axes)``; 0-d values are not mapped."""
    if np.ndim(value) == 0:
        return value, None
    if isinstance(value, ScaledArray):
        data = geometry.to_block_major(value.data, blocks)
        if np.ndim(value.scale) == 0:
            return ScaledArray._trusted(data, value.scale), ScaledArray._trusted(0, None)
        scale = geometry.scale_on_grid(value, blocks).reshape(-1)
        return ScaledArray._trusted(data, scale), 0
    return geometry.to_block_major(value, blocks), 0


def _from_block_major(out: Value, counts: Sequence[int]) -> Value:
    """A block-major output ``(blocks, *block)`` on a grid of ``counts`` blocks per axis."""
    data = out.data if isinstance(out, ScaledArray) else out
    block = tuple(data.shape[1:])
    shape = tuple(c * b for c, b in zip(counts, block, strict=True))
    data = geometry.from_block_major(data, shape, block)
    if isinstance(out, ScaledArray):
        return ScaledArray(data, lax.reshape(out.scale, tuple(counts)))
    return data


def per_tensor(x: Value) -> Value:
    """``x`` with one scale: the largest of its block scales, the data shifted to it
    (exact unless a block's shifted data underflows). Other values are returned as they are.

    Example:
        >>> x = ScaledArray(jnp.ones((2, 2)), jnp.array([[1.0], [4.0]], jnp.float32))
        >>> y = per_tensor(x)
        >>> y.data.tolist(), float(y.scale)
        ([[0.25, 0.25], [1.0, 1.0]], 4.0)
    """
    if not is_blocked(x):
        return x
    data, largest = _coarsened_f32(x, tuple(range(x.ndim)))
    return ScaledArray(data, per_tensor_scale(lax.reshape(largest, ())))


def coarsened(x: ScaledArray, axes: Sequence[int]) -> ScaledArray:
    """``x`` with each block widened to the whole of ``axes``: the largest block scale along
    them, each block's data shifted to it (exact unless shifted data underflows).

    Example:
        >>> x = ScaledArray(jnp.ones((2, 4)), jnp.array([[1.0, 2.0], [4.0, 8.0]], jnp.float32))
        >>> y = coarsened(x, (1,))
        >>> y.scale.tolist(), y.data.tolist()[0]
        ([[2.0], [8.0]], [0.5, 0.5, 1.0, 1.0])
    """
    if not any(np.shape(x.scale)[a] > 1 for a in axes):
        return x
    data, largest = _coarsened_f32(x, axes)
    return ScaledArray(data, make_scale(largest, x))


def _coarsened_f32(x: ScaledArray, axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """The data of :func:`coarsened` and its float32 scale (size 1 along ``axes``)."""
    scale = scale_f32(x)
    axes = tuple(a for a in axes if scale.shape[a] > 1)
    if not axes:
        return x.data, scale
    largest, ratio = geometry.split_at_largest(scale, axes)
    ratio = ratio.reshape(-1, *[1] * x.ndim)  # powers of two: exact
    blocks = x.block_shape
    shifted = rescale(geometry.to_block_major(x.data, blocks), ratio)
    data = geometry.from_block_major(shifted, x.shape, blocks)
    coarse = [1 if d in axes else n for d, n in enumerate(scale.shape)]
    return data, lax.reshape(largest, coarse)


def per_tensor_slots(eqn: jxi.JaxprEqn, in_slots: list[Slot], where: str) -> list[Slot]:
    """The operand slots of a higher-order ``eqn`` without ``BLOCKS_INSIDE`` (a loop,
    ``cond``, ``shard_map``): block-scaled ones at one scale per tensor, warned and recorded
    (as the outputs of ``eqn``'s primitive, marked ``block_fallback``)."""
    _warn_fallback(eqn, where, "does not carry block scales through its body")
    slots = [Slot(per_tensor(s.value)) if is_blocked(s.value) else s for s in in_slots]
    if recording.is_recording():
        converted = [s.value for s, old in zip(slots, in_slots, strict=True) if s is not old]
        recording.observe(eqn.primitive.name, where, jxi.eqn_name_stack(eqn), converted, True)
    return slots


def _fallback(
    found: PrimitiveRecord, eqn: jxi.JaxprEqn, invals: list[Value], where: str, reason: str
) -> Any:
    _warn_fallback(eqn, where, reason)
    return found.rule(*[per_tensor(v) for v in invals], **eqn.params)


def _warn_fallback(eqn: jxi.JaxprEqn, where: str, reason: str) -> None:
    warnings.warn(
        f"scalify: '{eqn.primitive.name}' at {where} {reason}: its block-scaled operands fall "
        "back to one scale per tensor (same values, the block structure is lost from there "
        "on).",
        BlockScaleFallbackWarning,
        stacklevel=3,
    )
