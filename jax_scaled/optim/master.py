"""Scaled master weights: parameters kept as FP16 (or FP8) ScaledArrays across steps."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from jax_scaled.dtypes import float_dtype
from jax_scaled.optim._storage import (
    call_scaled,
    check_rescale,
    like_reference,
    rescaled,
    to_storage,
)
from jax_scaled.rules.casts import saturate


def as_master(
    params: Any,
    dtype: DTypeLike = jnp.float16,
    *,
    rescale: str | None = "l2",
    scale_dtype: DTypeLike | None = None,
) -> Any:
    """Parameters as master weights: every floating leaf a ScaledArray with ``dtype`` data.

    Each array is split at the power of two below its RMS (as
    :func:`~jax_scaled.as_scaled_array` does), re-centred with the ``rescale`` statistic
    (``"max"`` puts the largest magnitude in ``[1, 2)``: the safe choice for float8 formats,
    whose range is small), clipped to the finite range of ``dtype`` and cast to it. Integer
    leaves are unchanged. Call it once, outside the jitted step.

    Example:
        >>> from jax_scaled.optim import as_master
        >>> w = as_master({"w": jnp.full((2, 2), 2.0**-20)}, jnp.float16)["w"]
        >>> w.data.dtype, w.data[0, 0].item(), float(w.scale) == 2.0**-20
        (dtype('float16'), 1.0, True)
    """
    return to_storage(params, dtype, rescale, scale_dtype)


def apply_updates(
    params: optax.Params,
    updates: optax.Updates,
    *,
    dtype: DTypeLike | None = None,
    rescale: str | None = "l2",
) -> optax.Params:
    """``optax.apply_updates`` for scaled master weights: ``params + updates`` per leaf.

    Each new parameter keeps its parameter's representation: a ScaledArray parameter stays a
    ScaledArray (its scale follows the add rule: the parameter's own scale unless the update
    is as large), with data in ``dtype`` (default: the parameter's data dtype, clipped to its
    finite range); a plain parameter stays plain. ``rescale`` (``"l2"`` by default, ``"max"``,
    ``"l1"``) then re-centres every new scaled parameter's data from its statistics (one
    reduction per parameter and step). ``None`` relies on the propagated scale alone, as the
    scalify paper's GPT did; but the add rule only tracks the larger of the two scales, so
    the data of a parameter that grows (a zero-initialised bias, from its first update on)
    drifts up with it, and in float16 reaches the format's end within tens of steps.

    Use it inside the scalified step, or outside on ScaledArrays (it then applies ``scalify``
    itself). ``None`` updates leave their parameter unchanged, as in optax.

    Example:
        >>> from jax_scaled.optim import apply_updates
        >>> params = {"w": scaled_array(jnp.ones(2, jnp.float16), 2.0**-20)}
        >>> updates = {"w": scaled_array(jnp.ones(2, jnp.float16), 2.0**-30)}
        >>> new = apply_updates(params, updates)["w"]
        >>> new.data.dtype, float(new.scale) == 2.0**-20, new.data[0].item()
        (dtype('float16'), True, 1.0009765625)
    """
    dtype = None if dtype is None else float_dtype(dtype)
    check_rescale(rescale)

    def apply(params, updates):
        leaves, tree = jax.tree.flatten(params, is_leaf=lambda x: x is None)
        updates = tree.flatten_up_to(updates)
        new = list(leaves)
        dtypes = {
            i: dtype or p.dtype
            for i, (p, u) in enumerate(zip(leaves, updates, strict=True))
            if p is not None and u is not None
        }
        floating = [i for i, d in dtypes.items() if jnp.issubdtype(d, jnp.floating)]
        # Each stage for every parameter before the next, so that the parameters' rescales
        # and their casts' range guards share kernels (jax_scaled.engine.together).
        for i in dtypes:
            new[i] = jnp.asarray(leaves[i] + updates[i])
        for i in floating:
            new[i] = rescaled(new[i], rescale)
        for i in floating:
            new[i] = saturate(new[i], dtypes[i])
        for i, d in dtypes.items():
            new[i] = new[i].astype(d)
        return jax.tree.unflatten(tree, new)

    return like_reference(params, call_scaled(apply, params, updates))
