"""Pytree helpers that treat ScaledArray as a leaf."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled.array import ScaledArray
from jax_scaled.construction import cast_fitting, is_scaled_leaf

__all__ = [
    "OptimizerStateWarning",
    "astype",
    "is_scaled_leaf",
    "rebuild_like",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
]


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    """``jax.tree.map`` that hands ScaledArrays to ``fn`` whole.

    Example:
        >>> tree_map(lambda x: x.shape, {"w": scaled_array(jnp.ones(3), 1.0)})
        {'w': (3,)}
    """
    return jax.tree.map(fn, tree, *rest, is_leaf=is_scaled_leaf)


def tree_flatten(tree: Any) -> tuple[list, Any]:
    """``jax.tree.flatten`` stopping at ScaledArrays: ``(leaves, treedef)``.

    Example:
        >>> leaves, _ = tree_flatten([scaled_array(jnp.ones(3), 1.0), jnp.zeros(2)])
        >>> len(leaves)
        2
    """
    return jax.tree.flatten(tree, is_leaf=is_scaled_leaf)


def tree_leaves(tree: Any) -> list:
    """``jax.tree.leaves`` stopping at ScaledArrays.

    Example:
        >>> len(tree_leaves({"a": scaled_array(jnp.ones(3), 1.0)}))
        1
    """
    return jax.tree.leaves(tree, is_leaf=is_scaled_leaf)


class OptimizerStateWarning(UserWarning):
    """Optax state cast to a narrow format with one scale per tensor (:func:`astype`)."""


def astype(tree: Any, dtype) -> Any:
    """Cast every floating leaf to ``dtype``; ScaledArrays cast their data.

    A ScaledArray keeps its scale unless its data would not fit ``dtype`` (an ``inf``, or a
    value lost to subnormals): that data is re-centred on its RMS first, the value unchanged
    (:func:`~jax_scaled.construction.cast_fitting`). Integer and boolean leaves are unchanged.

    Casting optax state to a format with float16's range or less warns once
    (:class:`OptimizerStateWarning`, naming the leaves): one scale per tensor cannot hold a
    realistic second moment; :func:`jax_scaled.optim.scaled_state` stores it robustly.

    Example:
        >>> astype({"w": scaled_array(jnp.ones(2), 4.0)}, jnp.float16)["w"].dtype
        dtype('float16')
    """

    def cast(x):
        if isinstance(x, ScaledArray):
            return cast_fitting(x, dtype)
        if hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return x.astype(dtype)
        return x

    _warn_on_optimizer_state(tree, dtype)
    return tree_map(cast, tree)


def _warn_on_optimizer_state(tree: Any, dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).maxexp > 64:
        return  # bfloat16 and wider have float32's range: nothing flushes
    leaves = _optax_state_leaves(tree)
    if leaves:
        warnings.warn(
            f"casting optax state to {jnp.dtype(dtype).name} with one scale per tensor "
            f"(leaves {', '.join(leaves[:3])}{', ...' if len(leaves) > 3 else ''}): a second "
            "moment (g**2) spans twice the binades of the gradients, more than one "
            f"{jnp.dtype(dtype).name} scale holds on tensors of realistic size, so its small "
            "entries flush to zero and Adam-like updates become m / eps. Store the state with "
            "js.optim.scaled_state(opt) (one scale per 32 elements), or cast it to bfloat16.",
            OptimizerStateWarning,
            stacklevel=3,
        )


def _optax_state_leaves(tree: Any) -> list[str]:
    """Key paths of the floating array leaves (more than one element) inside optax states."""
    found = []

    def is_optax_state(x: Any) -> bool:
        return isinstance(x, tuple) and type(x).__module__.startswith("optax")

    outer = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_optax_state)[0]
    for path, node in outer:
        if not is_optax_state(node):
            continue
        for inner, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=is_scaled_leaf)[0]:
            is_float = jnp.issubdtype(getattr(leaf, "dtype", int), jnp.floating)
            if is_float and math.prod(getattr(leaf, "shape", ())) > 1:
                found.append(jax.tree_util.keystr(path + inner))
    return found


_RESTORE_FIX = (
    "restore with a target instead, e.g. checkpointer.restore(path, "
    "jax.tree.map(ocp.utils.to_shape_dtype_struct, state)) (docs/index.md#checkpoints)"
)


def rebuild_like(restored: Any, target: Any) -> Any:
    """Give a tree restored without a target the structure of ``target``, checking each leaf.

    Orbax restores a checkpoint without a target as plain containers: a ScaledArray comes
    back as a list ``[data, scale]`` and an optax state (a namedtuple) as a dict of its fields,
    which a train step cannot use. This looks every leaf of ``target`` (arrays, or the
    ``jax.ShapeDtypeStruct`` of ``jax.eval_shape``) up in ``restored`` by its key path and
    rebuilds ``target``'s containers around the restored arrays, unchanged (bit-identical).
    A tree that already has ``target``'s structure is only checked. Raises ``TypeError``
    naming the first leaf path that is missing, or whose shape or dtype differs.

    Example:
        >>> target = {"w": scaled_array(jnp.ones(2), 4.0)}
        >>> raw = {"w": [jnp.ones(2), jnp.array(4.0)]}  # what orbax restores with no target
        >>> w = rebuild_like(raw, target)["w"]
        >>> type(w).__name__, w.scale.item()
        ('ScaledArray', 4.0)
        >>> try:
        ...     rebuild_like({"w": [jnp.ones(3), jnp.array(4.0)]}, target)
        ... except TypeError as error:
        ...     print(str(error).split(":")[0])
        restored leaf ['w'][0] has shape (3,) float32, the target (2,) float32
    """
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    if jax.tree.structure(restored) == treedef:
        leaves = jax.tree.leaves(restored)
    else:
        leaves = [_lookup(restored, path) for path, _ in paths]
    extra = len(jax.tree.leaves(restored)) - len(leaves)
    if extra:
        raise TypeError(f"restored tree has {extra} more leaves than the target: {_RESTORE_FIX}")
    for (path, expected), leaf in zip(paths, leaves):
        _check_leaf(_keystr(path), leaf, expected)
    return jax.tree.unflatten(treedef, leaves)


def _lookup(node: Any, path: tuple) -> Any:
    """The element of plain containers (dicts, lists) that ``path`` names in the target."""
    for depth, key in enumerate(path):
        # Orbax stores attribute names (namedtuple fields) as dict keys, indices as list ones.
        name = _key_name(key)
        try:
            node = node[name] if isinstance(node, (dict, list, tuple)) else getattr(node, name)
        except (KeyError, IndexError, TypeError, AttributeError):
            where = _keystr(path[: depth + 1])
            raise TypeError(f"restored tree has no leaf at {where}: {_RESTORE_FIX}") from None
    return node


def _check_leaf(where: str, leaf: Any, expected: Any) -> None:
    """Refuse a restored leaf whose shape or dtype differs from the target's."""
    got = (np.shape(leaf), getattr(leaf, "dtype", None))
    want = (np.shape(expected), getattr(expected, "dtype", got[1]))
    if got != want:
        raise TypeError(
            f"restored leaf {where} has shape {got[0]} {got[1]}, the target {want[0]} {want[1]}: "
            "is this the checkpoint of this state?"
        )


def _key_name(key: Any) -> Any:
    """The dict key, attribute name or index of one key-path entry."""
    return next(getattr(key, a) for a in ("key", "name", "idx") if hasattr(key, a))


def _keystr(path: tuple) -> str:
    """``jax.tree_util.keystr`` with a ScaledArray's children as ``[0]``, ``[1]`` (data, scale)."""
    return "".join(
        f".{key.name}" if hasattr(key, "name") else f"[{_key_name(key)!r}]" for key in path
    )
