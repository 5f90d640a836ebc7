"""Optimizer state stored flat: the block-quantized leaves of a state that share a block
length kept as one buffer per length (:func:`~jax_scaled.optim.scaled_state`'s ``flat``).

A stored leaf's blocks are contiguous runs of its row-major elements
(:func:`~jax_scaled.optim._storage.storage_blocks` splits only its outermost split axis), so
the blocks of a buffer that concatenates such leaves are the leaves' own blocks: the buffer
holds the same data and scales, bit for bit. What changes is the program: a train step writes
each output array with a kernel of its own, and the largest magnitudes of its blocks with
another, so a state of many small leaves costs kernels per leaf; a buffer costs them once.
The update still reads each leaf on its own, at an offset the step is given
(:func:`expanded_plain`), so that the reading kernels of equal-shaped leaves stay one
computation for XLA to compile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jax_scaled.optim._storage import call_scaled, is_float, storage_blocks, wider_dtype
from jax_scaled.primitives import stop_scaling


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
    ``offsets`` holds each ``InBuffer``'s offset again, as an int32 array (see
    :func:`expanded_plain`).

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
    offsets: tuple[Any, ...]

    def tree_flatten(self):
        return (self.tree, self.buffers, self.offsets), None

    @classmethod
    def tree_unflatten(cls, _, children):
        tree, buffers, offsets = children
        return cls(tree, tuple(buffers), tuple(offsets))

    def expanded(self) -> Any:
        """The state as the inner transformation keeps it: every leaf in place (slices of
        the buffers, exact; works under ``scalify``, ``jit`` and eagerly)."""
        return call_scaled(expanded, self)


def _in_buffer(x: Any) -> bool:
    return isinstance(x, InBuffer)


def expanded(state: FlatState) -> Any:
    """:meth:`FlatState.expanded` of a traced state (inside ``scalify``)."""

    def read(x: InBuffer) -> Any:
        return state.buffers[x.buffer][x.offset : x.offset + math.prod(x.shape)]

    return _read_back(state, read)


def expanded_plain(state: FlatState, dtype: DTypeLike) -> Any:
    """The state's leaves as plain values in (at least) ``dtype`` (traced, inside
    ``scalify``), each read from its buffer at its offset in ``state.offsets``.

    XLA:CPU compiles a kernel once for all kernels of the same computation, and a static
    slice's offset is part of the computation: read at static offsets, each leaf's kernels
    were kernels of their own to compile (an 8-layer GPT step compiled 15% slower than with
    per-leaf storage). Read at an offset that the step is given, the kernels of leaves of
    one shape are one computation again, compiled once.
    """
    plain = [stop_scaling(b, wider_dtype(b.dtype, dtype)) for b in state.buffers]
    offsets = iter(state.offsets)

    def read(x: InBuffer) -> Any:
        size = math.prod(x.shape)
        return lax.dynamic_slice_in_dim(
            plain[x.buffer], next(offsets), size, allow_negative_indices=False
        )

    return _read_back(state, read)


def _read_back(state: FlatState, read: Callable[[InBuffer], Any]) -> Any:
    """``state.tree`` with each :class:`InBuffer` replaced by ``read(slot)`` in its shape
    (in flattening order, the order of ``state.offsets``)."""

    def leaf(x: Any) -> Any:
        return read(x).reshape(x.shape) if isinstance(x, InBuffer) else x

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
    tree: Any,
    block_size: int | None,
    store: Callable[[Any, int | None], Any],
    offsets: tuple[Any, ...] | None = None,
) -> FlatState:
    """``tree`` (a state's new values, traced) as a :class:`FlatState`: its leaves of each
    block length concatenated and stored by ``store(buffer, block_length)``; the other
    floating leaves stored by ``store(leaf, None)``. ``offsets``: the previous state's, kept
    (the same layout; passed through, they are not constants of the step)."""
    leaves, treedef = jax.tree.flatten(tree)
    lengths = [block_length(x, block_size) for x in leaves]
    order = sorted({n for n in lengths if n is not None})
    parts: dict[int, list[Any]] = {n: [] for n in order}
    ends = dict.fromkeys(order, 0)
    for i, (leaf, n) in enumerate(zip(leaves, lengths, strict=True)):
        if n is None:
            leaves[i] = store(leaf, None) if is_float(leaf) else leaf
            continue
        leaves[i] = InBuffer(order.index(n), ends[n], tuple(jnp.shape(leaf)))
        ends[n] += math.prod(jnp.shape(leaf))
        parts[n].append(jnp.reshape(leaf, (-1,)))
    buffers = tuple(store(_joined(parts[n]), n) for n in order)
    if offsets is None:
        offsets = tuple(jnp.int32(x.offset) for x in leaves if isinstance(x, InBuffer))
    return FlatState(jax.tree.unflatten(treedef, leaves), buffers, offsets)


def _joined(parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
