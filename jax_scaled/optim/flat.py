"""Optimizer state stored flat: the block-quantized leaves of a state that share a block
length kept as one buffer per length (:func:`~jax_scaled.optim.scaled_state`'s ``flat``).

A stored leaf's blocks are contiguous runs of its row-major elements
(:func:`~jax_scaled.optim._storage.storage_blocks` splits only its outermost split axis), so
the blocks of a buffer that concatenates such leaves are the leaves' own blocks: the buffer
holds the same data and scales, bit for bit. What changes is the program: a train step writes
each output array with a kernel of its own, and the largest magnitudes of its blocks with
another, so a state of many small leaves costs kernels per leaf; a buffer costs them once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_scaled.optim._storage import call_scaled, is_float, storage_blocks


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class InBuffer:
    """A leaf of a :class:`FlatState`'s ``tree`` kept in a buffer: which one, where, and its
    shape (static: a pytree node without children)."""

    buffer: int
    offset: int
    shape: tuple[int, ...]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class FlatState:
    """An optimizer state whose block-quantized leaves live in ``buffers``.

    ``tree`` is the inner transformation's state with each of those leaves replaced by an
    :class:`InBuffer` that says where it lives (its counts, hyperparameters and scalars stay
    there, readable by name). :meth:`expanded` gives the state with its leaves back.

    Example:
        >>> import optax
        >>> opt = js.optim.scaled_state(optax.adam(1e-3), jnp.float16, flat=True)
        >>> state = opt.init({"w": jnp.ones((4, 32)), "b": jnp.ones(32)})
        >>> [b.shape for b in state.buffers], state.tree[0].count.dtype
        ([(320,)], dtype('int32'))
        >>> state.tree[0].mu["w"]
        InBuffer(buffer=0, offset=32, shape=(4, 32))
        >>> state.expanded()[0].mu["w"].shape
        (4, 32)
    """

    tree: Any
    buffers: tuple[Any, ...]

    def tree_flatten(self):
        return (self.tree, self.buffers), None

    @classmethod
    def tree_unflatten(cls, _, children):
        tree, buffers = children
        return cls(tree, tuple(buffers))

    def expanded(self) -> Any:
        """The state as the inner transformation keeps it: every leaf in place (slices of
        the buffers, exact; works under ``scalify``, ``jit`` and eagerly)."""
        return call_scaled(expanded, self)


def _in_buffer(x: Any) -> bool:
    return isinstance(x, InBuffer)


def expanded(state: FlatState) -> Any:
    """:meth:`FlatState.expanded` of a traced state (inside ``scalify``)."""

    def leaf(x: Any) -> Any:
        if not isinstance(x, InBuffer):
            return x
        part = state.buffers[x.buffer][x.offset : x.offset + math.prod(x.shape)]
        return part.reshape(x.shape)

    return jax.tree.map(leaf, state.tree, is_leaf=_in_buffer)


def block_length(x: Any, block_size: int | None) -> int | None:
    """The length of a stored leaf's (contiguous) blocks; None for a leaf stored alone
    (scalars, integers, one scale per leaf).

    Example:
        >>> block_length(jnp.ones((16, 8)), 32), block_length(jnp.ones(()), 32)
        (32, None)
    """
    if not is_float(x) or jnp.ndim(x) == 0:
        return None
    blocks = storage_blocks(jnp.shape(x), block_size)
    return None if blocks is None else math.prod(blocks)


def flattened(
    tree: Any, block_size: int | None, store: Callable[[Any, int | None], Any]
) -> FlatState:
    """``tree`` (a state's new values, traced) as a :class:`FlatState`: its leaves of each
    block length concatenated and stored by ``store(buffer, block_length)``; the other
    floating leaves stored by ``store(leaf, None)``."""
    leaves, treedef = jax.tree.flatten(tree)
    lengths = [block_length(x, block_size) for x in leaves]
    order = sorted({n for n in lengths if n is not None})
    parts: dict[int, list[Any]] = {n: [] for n in order}
    offsets = dict.fromkeys(order, 0)
    for i, (leaf, n) in enumerate(zip(leaves, lengths, strict=True)):
        if n is None:
            leaves[i] = store(leaf, None) if is_float(leaf) else leaf
            continue
        leaves[i] = InBuffer(order.index(n), offsets[n], tuple(jnp.shape(leaf)))
        offsets[n] += math.prod(jnp.shape(leaf))
        parts[n].append(jnp.reshape(leaf, (-1,)))
    buffers = tuple(store(_joined(parts[n]), n) for n in order)
    return FlatState(jax.tree.unflatten(treedef, leaves), buffers)


def _joined(parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
