"""``merge_blocks``: leave block scales on purpose, keeping the values.

Example:
    >>> x = ScaledArray(jnp.ones((2, 4)), jnp.array([[1.0], [8.0]], jnp.float32))  # per row
    >>> y = scalify(merge_blocks)(x)
    >>> float(y.scale), y.data[:, 0].tolist()
    (8.0, [0.125, 1.0])
"""

from __future__ import annotations

from typing import Any

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.engine.block_dispatch import per_tensor
from jax_scaled.engine.registry import register_block_rule, register_scale_rule


def merge_blocks(x: Any) -> Any:
    """``x`` with one scale per tensor under scalify: the largest of its block scales, every
    block's data shifted to it (exact unless a block's data underflows there). An identity
    outside scalify and on per-tensor values, and for gradients (straight-through).

    Where a block-scaled value is about to meet operations that would each fall back (loops,
    ``custom_scale`` functions) or run once per block, merging once is cheaper and says so in
    the code: :func:`jax_scaled.nn.block_linear` merges its matmul outputs this way.

    Example:
        >>> merge_blocks(jnp.ones(3)).tolist()
        [1.0, 1.0, 1.0]
    """
    return merge_blocks_p.bind(x)


def _identity(x):
    return x


merge_blocks_p = jxi.define_primitive("merge_blocks", _identity, straight_through=True)


@register_scale_rule(merge_blocks_p)
def _merge_per_tensor(x: ScaledArray) -> ScaledArray:
    return x


@register_block_rule(merge_blocks_p, behaviour="consumes")
def _merge_blocks(x: ScaledArray) -> ScaledArray:
    return per_tensor(x)


__all__ = ["merge_blocks", "merge_blocks_p"]
