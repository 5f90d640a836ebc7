"""Optax optimizer state stored as ScaledArray in a narrow format (float16, bfloat16, float8)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from jax_scaled.array import ScaledArray
from jax_scaled.dtypes import float_dtype
from jax_scaled.optim._storage import (
    SCALED_STATE_UPDATES,
    call_scaled,
    check_rescale,
    computes_plain,
    is_float,
    like_reference,
    loaded,
    plain_tree,
    promote_plain,
    rescaled,
    stored,
    stored_tree,
    stores_in_blocks,
    to_storage,
    unit_scaled,
    wider_dtype,
)
from jax_scaled.optim.flat import (
    FlatState,
    block_length,
    expanded,
    expanded_plain,
    flattened,
)
from jax_scaled.pow2.xla import stored_once
from jax_scaled.tree import tree_leaves, tree_map

F32 = jnp.dtype(jnp.float32)


def scaled_state(
    inner: optax.GradientTransformation,
    dtype: DTypeLike = jnp.float16,
    *,
    rescale: str | None = "l2",
    rescale_grads: bool = False,
    compute_dtype: DTypeLike | None = jnp.float32,
    scale_dtype: DTypeLike | None = None,
    block_size: int | None = 32,
    flat: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its state is kept as scaled ``dtype`` data.

    ``init`` runs ``inner.init`` and returns its state with every floating leaf turned into a
    ScaledArray whose data has ``dtype`` (integer leaves, such as Adam's step count, are
    unchanged; scalar floating leaves keep float32 data). Each state leaf has one
    power-of-two scale per block of about ``block_size`` elements along its last axis
    (:func:`~jax_scaled.optim._storage.storage_blocks`), placed by
    :func:`~jax_scaled.quantize.quantize`: a second moment (``g**2``, twice the binades of the
    gradients) keeps, in every block, float16's range below its own largest element, where
    one scale per tensor flushes the small moments of a realistic gradient to zero (Adam's
    update is then ``m / eps``). A float32 state needs no scale: it is stored at scale 1.

    ``update`` computes in ``compute_dtype``. With float32 (the default; any format with
    float32's exponent range), it runs ``inner.update`` on plain values: the state's, the
    gradients' and the parameters' values (``data * scale``, block scales included: exact)
    go in as float32 arrays, optax computes what it computes on float32 arrays, and only the
    new state is stored scaled. A float32 scale would add arithmetic, not range, to a float32
    value: the update of a parameter costs what plain optax's does (no scalar arithmetic per
    parameter, where propagating scales through Adam took 50 to 80 scalar operations each).
    The updates come back at scale 1. With a narrower ``compute_dtype`` (float16, or
    ``None``: the stored dtype, as plain optax on a cast state computes) the update runs
    with scale propagation on the data widened to it (each state leaf's blocks merged to one
    scale, exactly). The state keeps ``dtype`` across steps, whatever dtypes optax's
    arithmetic gives it (one compilation).

    Call ``init`` outside ``scalify`` (plain or under ``jax.jit``). ``update`` works inside
    ``scalify`` (the usual case: the whole train step is scalified and
    jitted) and outside it: given ScaledArray arguments outside scalify, it applies
    ``scalify`` itself. Plain floating gradients are first given a scale from their RMS (a
    plain array carries none, and the rules would assume unit scale). Updates come back plain
    where the gradients were plain, so a plain optax loop (plain float32 parameters and
    gradients) only changes how its state is stored.

    Args:
        inner: any optax ``GradientTransformation`` (``optax.adam(1e-3)``, a chain, ...).
        dtype: the data format of the state: ``jnp.float16`` (default), ``jnp.bfloat16``,
            ``jnp.float8_e4m3fn``, ... (``jnp.float32`` keeps full precision: the state is
            then numerically the same as ``inner``'s).
        rescale: with ``block_size=None``, the statistic that re-centres each state leaf's
            data after every update:
            ``"l2"`` (RMS, default), ``"max"`` (largest magnitude in ``[1, 2)``: the choice for
            float8 formats, whose maximum is small), ``"l1"``, or ``None`` (no statistics: the
            scale follows the rules' static estimates).
        rescale_grads: also re-centre each incoming gradient (with ``rescale``'s statistic,
            ``"l2"`` if it is ``None``), for gradient data far from unit scale, where the
            update runs with scale propagation (a float32 update takes the gradients' values
            and needs none). It matters most with ``compute_dtype=None``, where e.g. Adam
            squares float16 gradient data (the scalify paper's FP16-state experiment rescales
            gradients this way).
        compute_dtype: the data dtype the inner update computes in (default float32, on plain
            values, as a fused kernel would in registers; only storage is narrow), or ``None``
            to compute in the stored dtype with scales, as plain optax on a cast state does
            (optax's constants, such as Adam's ``eps=1e-8``, keep their values: see
            :mod:`jax_scaled.engine.constants`).
        scale_dtype: dtype of the state's scales: float32 (default) or ``jnp.float8_e8m0fnu``.
        block_size: elements per scale along each state leaf's last axis (32, the MX block
            size, by default: a float32 scale costs 1/16 of float16 data's memory, an E8M0
            one 1/64); ``None`` stores one scale per leaf, data re-centred with ``rescale``
            (the layout of jax_scaled before block storage; it flushes second moments of
            large, heavy-tailed gradients).
        flat: keep the leaves stored in blocks of the same length as one buffer per length
            (a :class:`~jax_scaled.optim.flat.FlatState`; its ``expanded()`` gives the state
            tree back, leaf for leaf). The same data and scales, bit for bit, written by a few
            kernels for the whole state where it took two per moment and leaf
            (``docs/index.md``, "Flat state"). For one device or a replicated state: the
            buffers join leaves that a sharded model would shard apart. Counts, scalars and
            hyperparameters stay in the tree, readable by name.

    Returns:
        An optax ``GradientTransformationExtraArgs`` (extra arguments of ``update`` are passed
        to ``inner.update``).

    Example:
        >>> from jax_scaled.optim import scaled_state
        >>> import optax
        >>> opt = scaled_state(optax.adam(1e-3), jnp.float16)
        >>> params = {"w": jnp.full(4, 0.5)}
        >>> state = opt.init(params)
        >>> state[0].nu["w"].dtype, type(state[0].nu["w"]).__name__, state[0].count.dtype
        (dtype('float16'), 'ScaledArray', dtype('int32'))
        >>> grads = {"w": jnp.full(4, 2.0**-12, jnp.float32)}  # g^2 = 2^-24: underflows raw fp16
        >>> updates, state = jax.jit(opt.update)(grads, state)
        >>> nu = state[0].nu["w"]
        >>> float(nu.to_array(jnp.float32)[0] / 2.0**-24), nu.data.dtype  # (1 - b2) * g^2
        (0.0010004043579101562, dtype('float16'))
        >>> round(float(updates["w"][0]), 6)  # Adam's first step: -lr * sign(g)
        -0.001
    """
    inner = optax.with_extra_args_support(inner)
    dtype = float_dtype(dtype)
    compute_dtype = None if compute_dtype is None else float_dtype(compute_dtype)
    check_rescale(rescale)
    grad_rescale = (rescale or "l2") if rescale_grads else None
    joined_blocks = block_size if stores_in_blocks(dtype) else None  # what flat joins

    def init(params: optax.Params) -> optax.OptState:
        state = call_scaled(inner.init, params)
        state = to_storage(state, dtype, rescale, scale_dtype, block_size)
        if not flat:
            return state
        state = call_scaled(flattened, state, joined_blocks, _kept)
        return dataclasses.replace(state, offsets=tuple(map(jnp.asarray, state.offsets)))

    def store(tree: Any, offsets: tuple[Any, ...] | None) -> Any:
        # The new state is the update's float32 arithmetic: no subnormal where it flushes.
        if not flat:
            return stored_tree(
                tree, dtype, rescale, block_size, scale_dtype, exact_subnormals=False
            )

        def joinable(x: Any) -> Any:  # narrow data would lose its leaf's scale in a join
            return _widened(x, F32) if block_length(x, joined_blocks) else x

        def leaf(x: Any, length: int | None) -> Any:  # a buffer's blocks are its leaves' own
            return stored(
                x, dtype, rescale, length or block_size, scale_dtype, exact_subnormals=False
            )

        return flattened(tree_map(joinable, tree), joined_blocks, leaf, offsets)

    def traced_update(grads, state, params, extra_args):
        if flat != isinstance(state, FlatState):
            raise TypeError(
                f"scaled_state(flat={flat}) was given a state of the other layout "
                f"({type(state).__name__}): pass the state its own init returned."
            )
        plain, offsets = computes_plain(compute_dtype), state.offsets if flat else None
        if flat:
            state = expanded_plain(state, compute_dtype) if plain else expanded(state)
        if plain:
            grads, state, params = (plain_tree(t, compute_dtype) for t in (grads, state, params))
            # Read by every stage of the update (the global norm, each moment): stored once,
            # not recomputed by each reader with the guarded gradient's own arithmetic.
            grads = tree_map(lambda g: stored_once(g) if is_float(g) else g, grads)
            updates, new_state = inner.update(grads, state, params, **extra_args)
            # At scale 1, not at the static estimates scalify keeps of plain values.
            updates = tree_map(lambda u: unit_scaled(u, u.dtype) if is_float(u) else u, updates)
        else:
            grads = tree_map(lambda g: _incoming(g, grad_rescale, compute_dtype), grads)
            state = tree_map(lambda x: loaded(x, compute_dtype), state)
            # Optax casts some state to the parameters' dtype (adafactor's second moment):
            # wide parameters keep that computation in compute_dtype as well.
            params = tree_map(lambda p: _widened(p, compute_dtype), params)
            updates, new_state = inner.update(grads, state, params, **extra_args)
        return updates, store(new_state, offsets)

    def update(grads, state, params=None, **extra_args):
        updates, new_state = call_scaled(traced_update, grads, state, params, extra_args)
        return like_reference(grads, updates), new_state

    SCALED_STATE_UPDATES.add(update)
    return optax.GradientTransformationExtraArgs(init, update)


def _kept(x: Any, _: int | None) -> Any:
    return x


def _widened(x: Any, compute_dtype: jnp.dtype | None) -> Any:
    """A floating ``x`` with its data cast to at least ``compute_dtype`` (scale kept)."""
    if compute_dtype is None or not is_float(x):
        return x
    return x.astype(wider_dtype(x.dtype, compute_dtype))


def _incoming(grad: Any, rescale: str | None, compute_dtype: jnp.dtype | None) -> Any:
    """A gradient as the inner update sees it: scaled (plain ones at their RMS), rescaled,
    widened."""
    if not is_float(grad):
        return grad
    return _widened(rescaled(promote_plain(grad), rescale), compute_dtype)


def state_bytes(tree: Any) -> int:
    """Bytes held by the arrays of ``tree``: for a ScaledArray, its data plus its scale.

    Example:
        >>> from jax_scaled.optim import state_bytes
        >>> state_bytes({"m": scaled_array(jnp.zeros(8, jnp.float16), 1.0), "n": jnp.int32(0)})
        24
    """
    return sum(_leaf_bytes(leaf) for leaf in tree_leaves(tree))


def _leaf_bytes(leaf: Any) -> int:
    if isinstance(leaf, ScaledArray):
        return _leaf_bytes(leaf.data) + _leaf_bytes(leaf.scale)
    if isinstance(leaf, jax.Array) or hasattr(leaf, "nbytes"):
        return int(leaf.nbytes)
    return 0
