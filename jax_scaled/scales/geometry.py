"""Block-scale geometry: the blocks of a ScaledArray, a common grid, and block-major layouts.

A ScaledArray's scale is 0-d (one block: the whole tensor) or has the data's rank, each data
axis a multiple of the scale's: ``block_shape = data.shape // scale.shape``. Rules on blocks
bring their operands onto a common grid (per axis, the greatest common divisor of their block
sizes: a coarser operand's scale is repeated onto the finer grid, exactly) and work on a
block-major layout, ``(blocks, *block_shape)``, where every block is a per-tensor
ScaledArray.

Example:
    >>> x = ScaledArray(jnp.ones((4, 64)), jnp.full((1, 2), 2.0, jnp.float32))
    >>> x.block_shape, common_blocks([x, ScaledArray(jnp.ones((4, 64)), jnp.float32(1))])
    ((4, 32), (4, 32))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray

Blocks = tuple[int, ...]


def is_blocked(x: Any) -> bool:
    """True for a ScaledArray with block scales (a scale of the data's rank, not 0-d).

    Example:
        >>> is_blocked(ScaledArray(jnp.ones(4), jnp.float32(1))), is_blocked(jnp.ones(4))
        (False, False)
    """
    return isinstance(x, ScaledArray) and np.ndim(x.scale) > 0


def common_blocks(values: Sequence[Any]) -> Blocks:
    """The finest grid every full-rank operand fits: per axis, the gcd of their block sizes
    (per-tensor ScaledArrays and plain arrays count as one block). 0-d operands are ignored.

    Example:
        >>> a = ScaledArray(jnp.ones((64,)), jnp.ones((2,), jnp.float32))  # blocks of 32
        >>> b = ScaledArray(jnp.ones((64,)), jnp.ones((4,), jnp.float32))  # blocks of 16
        >>> common_blocks([a, b])
        (16,)
    """
    shaped = [v for v in values if np.ndim(v) > 0]
    sizes = [v.block_shape if isinstance(v, ScaledArray) else tuple(v.shape) for v in shaped]
    return tuple(math.gcd(*axis) for axis in zip(*sizes, strict=True))


def grid(shape: Sequence[int], blocks: Blocks) -> tuple[int, ...]:
    """The number of blocks along each axis."""
    return tuple(d // b for d, b in zip(shape, blocks, strict=True))


def scale_on_grid(x: ScaledArray, blocks: Blocks) -> jax.Array:
    """``x``'s scale repeated onto the grid of ``blocks`` (exact: only copies).

    Example:
        >>> x = ScaledArray(jnp.ones((4,)), jnp.array([1.0, 2.0], jnp.float32))
        >>> scale_on_grid(x, (1,)).tolist()
        [1.0, 1.0, 2.0, 2.0]
    """
    scale = x.scale
    if np.ndim(scale) == 0:
        return lax.broadcast(scale, grid(x.shape, blocks))
    for axis, (own, target) in enumerate(zip(x.block_shape, blocks, strict=True)):
        if own != target:
            scale = lax.broadcast_in_dim(
                scale, (*scale.shape[: axis + 1], own // target, *scale.shape[axis + 1 :]),
                tuple(i for i in range(scale.ndim + 1) if i != axis + 1),
            ).reshape(*scale.shape[:axis], -1, *scale.shape[axis + 1 :])  # fmt: skip
    return scale


def split_at_largest(scale: jax.Array, axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """``(largest, ratios)`` of a float32 grid of power-of-two block scales: the largest
    along ``axes`` (those axes reduced) and every scale divided by its largest (exact powers
    of two, at most 1).

    Example:
        >>> largest, ratios = split_at_largest(jnp.array([[1.0, 4.0], [2.0, 2.0]]), (1,))
        >>> largest.tolist(), ratios.tolist()
        ([4.0, 2.0], [[0.25, 1.0], [1.0, 1.0]])
    """
    largest = lax.reduce_max(scale, tuple(axes))
    kept = tuple(d for d in range(scale.ndim) if d not in axes)
    return largest, lax.div(scale, lax.broadcast_in_dim(largest, scale.shape, kept))


def to_block_major(data: jax.Array, blocks: Blocks) -> jax.Array:
    """``data`` as ``(number of blocks, *blocks)``, blocks in row-major grid order.

    Example:
        >>> to_block_major(jnp.arange(8.0).reshape(2, 4), (1, 2)).shape
        (4, 1, 2)
    """
    counts = grid(data.shape, blocks)
    interleaved = data.reshape([n for pair in zip(counts, blocks, strict=True) for n in pair])
    rank = data.ndim
    order = [2 * i for i in range(rank)] + [2 * i + 1 for i in range(rank)]
    return lax.transpose(interleaved, order).reshape(math.prod(counts), *blocks)


def from_block_major(blockwise: jax.Array, shape: Sequence[int], blocks: Blocks) -> jax.Array:
    """The inverse of :func:`to_block_major`: data of ``shape`` from its blocks.

    Example:
        >>> x = jnp.arange(8.0).reshape(2, 4)
        >>> bool((from_block_major(to_block_major(x, (1, 2)), (2, 4), (1, 2)) == x).all())
        True
    """
    counts = grid(shape, blocks)
    rank = len(shape)
    blocked = blockwise.reshape(*counts, *blocks)
    order = [i // 2 if i % 2 == 0 else rank + i // 2 for i in range(2 * rank)]
    return lax.transpose(blocked, order).reshape(shape)
