"""Pytree helpers that treat ScaledArray as a leaf."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_scaled.array import ScaledArray, cast_fitting, is_scaled_leaf


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


def astype(tree: Any, dtype) -> Any:
    """Cast every floating leaf to ``dtype``; ScaledArrays cast their data.

    A ScaledArray keeps its scale unless its data would not fit ``dtype`` (an ``inf``, or a
    value lost to subnormals): that data is re-centred on its RMS first, the value unchanged
    (:func:`~jax_scaled.array.cast_fitting`). Integer and boolean leaves are unchanged.

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

    return tree_map(cast, tree)
