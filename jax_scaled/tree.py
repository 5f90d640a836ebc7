"""Pytree helpers that treat ScaledArray as a leaf."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_scaled.array import ScaledArray, cast_fitting, is_scaled_leaf

__all__ = [
    "OptimizerStateWarning",
    "astype",
    "is_scaled_leaf",
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
    (:func:`~jax_scaled.array.cast_fitting`). Integer and boolean leaves are unchanged.

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
