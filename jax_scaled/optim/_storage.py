"""Shared machinery of js.optim: storing floating leaves as scaled narrow data, and running a
function under scalify only when it is handed ScaledArrays."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled import ops
from jax_scaled.array import ScaledArray
from jax_scaled.construction import as_scaled_array
from jax_scaled.dtypes import float_dtype
from jax_scaled.engine.interpreter import scalify
from jax_scaled.engine.registry import register_block_rule, register_scale_rule
from jax_scaled.ops.blocks import merge_blocks
from jax_scaled.ops.rescale import dynamic_rescale_rule
from jax_scaled.primitives import stop_scaling
from jax_scaled.quantize import quantize_read_elsewhere
from jax_scaled.rules.casts import saturate
from jax_scaled.scales import as_scaled
from jax_scaled.tree import tree_leaves, tree_map

# The update functions of scaled_state transformations (to refuse wrapping them in a cond).
SCALED_STATE_UPDATES: weakref.WeakSet = weakref.WeakSet()

RESCALES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "l1": ops.dynamic_rescale_l1,
    "l2": ops.dynamic_rescale_l2,
    "max": ops.dynamic_rescale_max,
}


def wider_dtype(dtype: DTypeLike, other: DTypeLike) -> jnp.dtype:
    """The wider of two floating dtypes (``dtype`` on a tie); no implicit promotion involved,
    which JAX refuses for float8 formats."""
    dtype, other = jnp.dtype(dtype), jnp.dtype(other)
    return other if jnp.finfo(other).bits > jnp.finfo(dtype).bits else dtype


def check_rescale(rescale: str | None) -> str | None:
    """``rescale`` validated: ``None`` or one of the dynamic rescale statistics."""
    if rescale is not None and rescale not in RESCALES:
        raise ValueError(f"rescale must be None or one of {sorted(RESCALES)}, got {rescale!r}.")
    return rescale


def is_float(x: Any) -> bool:
    """True for a floating array or ScaledArray (the leaves js.optim stores scaled)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def has_scaled_leaf(*trees: Any) -> bool:
    """True when any leaf of ``trees`` is a ScaledArray."""
    return any(isinstance(x, ScaledArray) for x in tree_leaves(trees))


def call_scaled(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``scalify(fn)(*args, **kwargs)`` if the arguments hold a ScaledArray, else ``fn(...)``.

    Inside an enclosing ``scalify`` the arguments are plain tracers: ``fn`` is then traced
    into the enclosing transform, which applies the scale rules itself.
    """
    if has_scaled_leaf(args, kwargs):
        return scalify(fn)(*args, **kwargs)
    return fn(*args, **kwargs)


def rescaled(x: jax.Array, rescale: str | None) -> jax.Array:
    """``x`` dynamically rescaled with the ``rescale`` statistic (no-op for ``None``)."""
    return x if rescale is None else RESCALES[rescale](x)


# -- plain compute: float32 arithmetic needs no scale ----------------------------------------


def computes_plain(compute_dtype: DTypeLike | None) -> bool:
    """True when an update computing in ``compute_dtype`` runs on plain values: a format with
    float32's exponent range (float32, bfloat16, float64) holds any value a float32 scale
    can, so a scale would only add arithmetic. Narrower formats (float16, ``None``: the
    stored dtype) keep their scales.

    Example:
        >>> computes_plain(jnp.float32), computes_plain(jnp.float16), computes_plain(None)
        (True, False, False)
    """
    if compute_dtype is None:
        return False
    info, wide = jnp.finfo(compute_dtype), jnp.finfo(jnp.float32)
    return info.maxexp >= wide.maxexp and info.minexp <= wide.minexp


def plain_tree(tree: Any, compute_dtype: DTypeLike) -> Any:
    """Every floating leaf of ``tree`` as the plain value it represents (``data * scale``,
    block scales included: exact), in the wider of its dtype and ``compute_dtype``; other
    leaves unchanged."""

    def plain(x: Any) -> Any:
        return stop_scaling(x, wider_dtype(x.dtype, compute_dtype)) if is_float(x) else x

    return tree_map(plain, tree)


# -- centred: a plain array gets a scale from its statistics ----------------------------------


def promote_plain(x: jax.Array) -> jax.Array:
    """Under scalify: a plain floating ``x`` becomes a ScaledArray at the power of two below
    its RMS (its data near unit scale); a ScaledArray is returned as is. Outside scalify: ``x``.

    A plain array carries no scale, so the rules assume unit scale for it: gradients of
    magnitude 2^-12 mixed into scaled float16 state would be stored with data near 2^-24.
    """
    return centred(x, None)


def centred(x: jax.Array, rescale: str | None, scale_dtype: DTypeLike | None = None) -> jax.Array:
    """Under scalify: ``x`` re-centred on the ``rescale`` statistic of its data. A plain
    floating ``x`` becomes a ScaledArray at that statistic (at its RMS for ``None``: see
    :func:`promote_plain`), its scale in ``scale_dtype``; a ScaledArray keeps its scale with
    ``None``. Outside scalify: ``x``."""
    scale_dtype = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return centred_p.bind(x, norm=rescale, scale_dtype=scale_dtype)


def _identity(x, **_):
    return x


centred_p = jxi.define_primitive("centred", _identity, straight_through=True)


@register_scale_rule(centred_p, applies_to_unscaled=True)
def _centred_rule(x: jax.Array, *, norm: str | None, scale_dtype: Any) -> jax.Array:
    if not jnp.issubdtype(x.dtype, jnp.floating) or norm is None and isinstance(x, ScaledArray):
        return x
    out = dynamic_rescale_rule(as_scaled(x), norm=norm or "l2")
    if isinstance(x, ScaledArray) or scale_dtype is None:
        return out
    return ScaledArray(out.data, out.scale.astype(scale_dtype))


def unit_scaled(x: jax.Array, dtype: DTypeLike, scale_dtype: DTypeLike | None = None) -> jax.Array:
    """Under scalify: the value of ``x`` as ``dtype`` data at scale 1 (a trace-time constant,
    free at run time), for storage in a format that needs no scale (float32, float64).
    Outside scalify: ``x`` cast to ``dtype``."""
    scale_dtype = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return unit_scaled_p.bind(x, dtype=jnp.dtype(dtype), scale_dtype=scale_dtype)


def _cast(x, *, dtype, scale_dtype):
    return x.astype(dtype)


unit_scaled_p = jxi.define_primitive("unit_scaled", _cast, straight_through=True)


@register_block_rule(unit_scaled_p, behaviour="consumes")  # block scales expand exactly
@register_scale_rule(unit_scaled_p, applies_to_unscaled=True)
def _unit_scaled_rule(x: jax.Array, *, dtype: jnp.dtype, scale_dtype: Any) -> ScaledArray:
    unit = np.ones((), np.float32).astype(scale_dtype or np.float32)
    return ScaledArray(as_scaled(x).to_array(dtype), unit)


# -- storage ---------------------------------------------------------------------------------


def storage_blocks(shape: tuple[int, ...], block_size: int | None) -> tuple[int, ...] | None:
    """The block shape a state leaf of ``shape`` is stored with: about ``block_size``
    elements a scale. Along the last axis, ``block_size`` elements where they divide it, the
    whole axis otherwise; a last axis shorter than ``block_size`` is extended over the axes
    before it (by their largest divisors that fit), so that small leaves do not pay a scale
    every few elements. None (one scale) for scalars, one-element leaves and
    ``block_size=None``.

    Example:
        >>> storage_blocks((64, 512), 32), storage_blocks((16, 8), 32), storage_blocks((), 32)
        ((1, 32), (4, 8), None)
        >>> storage_blocks((3, 3, 1, 16), 32), storage_blocks((50257,), 32)
        ((1, 1, 1, 16), (50257,))
    """
    if block_size is None or math.prod(shape) <= 1:
        return None
    blocks = [1] * len(shape)
    remaining = block_size
    for axis in reversed(range(len(shape))):
        n = shape[axis]
        if n % remaining == 0 or axis == len(shape) - 1 and n > remaining:
            blocks[axis] = remaining if n % remaining == 0 else n
            break
        blocks[axis] = max(d for d in range(1, min(n, remaining) + 1) if n % d == 0)
        if blocks[axis] < n:
            break
        remaining //= n
    return tuple(blocks)


def stores_in_blocks(dtype: DTypeLike) -> bool:
    """False for a dtype that :func:`stored` keeps at unit scale (float32 and wider: a scale
    would add arithmetic, not range), True for the narrow ones it quantizes.

    Example:
        >>> stores_in_blocks(jnp.float16), stores_in_blocks(jnp.float32)
        (True, False)
    """
    return not (jnp.finfo(dtype).bits >= 32 and computes_plain(dtype))


def stored(
    x: jax.Array,
    dtype: DTypeLike,
    rescale: str | None,
    block_size: int | None = None,
    scale_dtype: DTypeLike | None = None,
    exact_subnormals: bool = True,
) -> jax.Array:
    """A floating leaf as it is stored between steps (traced under scalify).

    With ``block_size``, quantized to ``dtype`` with one power-of-two scale per block
    (:func:`storage_blocks`; ``"rceil"`` scale rounding: each block's largest value at the top of
    the format, never saturated), so each block keeps the format's whole range below its own
    largest element. Otherwise one scale: re-centred (:func:`centred`, which also gives a plain
    value a scale) while its data is still wide, clipped to the finite range of ``dtype``
    (no ``inf``/``NaN`` from an overflowing cast), cast to ``dtype``. Scalars keep at least
    float32 data: they are hyperparameters (schedule-free's ``b1``, injected learning rates)
    or moments of scalar parameters, precision-sensitive and small.
    ``exact_subnormals=False``: ``x`` comes from an update's float32 arithmetic, which leaves
    no subnormal where the platform flushes them (``js.quantize``'s argument).
    """
    if jnp.ndim(x) == 0:  # a hyperparameter or a scalar's moment: costs nothing in float32
        dtype = wider_dtype(dtype, jnp.float32)
    if not stores_in_blocks(dtype):
        return unit_scaled(x, dtype, scale_dtype)
    blocks = storage_blocks(jnp.shape(x), block_size)
    if blocks is not None:
        return quantize_read_elsewhere(  # the update reads a new moment too
            x,
            dtype,
            block_shape=blocks,
            scale_rounding="rceil",
            scale_dtype=scale_dtype,
            exact_subnormals=exact_subnormals,
        )
    return saturate(centred(x, rescale, scale_dtype), dtype).astype(dtype)


def stored_tree(
    tree: Any,
    dtype: DTypeLike,
    rescale: str | None,
    block_size: int | None = None,
    scale_dtype: DTypeLike | None = None,
    exact_subnormals: bool = True,
) -> Any:
    """:func:`stored` applied to every floating leaf of ``tree``; other leaves unchanged."""

    def store(x: Any) -> Any:
        if not is_float(x):
            return x
        return stored(x, dtype, rescale, block_size, scale_dtype, exact_subnormals)

    return tree_map(store, tree)


def loaded(x: Any, compute_dtype: DTypeLike | None) -> Any:
    """A stored floating leaf as an update computes on it (traced under scalify): widened to
    float32 and merged to one scale (exact: float32 holds every block's range), then cast to
    ``compute_dtype`` (None: back to the stored dtype, as plain optax on a cast state
    computes, the data re-centred on its RMS first). A per-tensor leaf is only widened (the
    merge is an identity)."""
    if not is_float(x):
        return x
    target = x.dtype if compute_dtype is None else wider_dtype(x.dtype, compute_dtype)
    merged = merge_blocks(x.astype(wider_dtype(x.dtype, jnp.float32)))
    if jnp.finfo(target).maxexp < jnp.finfo(jnp.float32).maxexp:  # stored at the top of it
        merged = rescaled(merged, "l2")
    return merged.astype(target)


E8M0_ZERO_SCALE = 2.0**-100


@functools.partial(jax.jit, static_argnames=("dtype", "rescale", "block_size", "scale_dtype"))
def _store_scaled(
    tree: Any, dtype: jnp.dtype, rescale: str | None, block_size: int | None, scale_dtype: Any
) -> Any:
    tree = tree_map(_lift_e8m0_zero_scale, tree)
    return scalify(stored_tree)(tree, dtype, rescale, block_size, scale_dtype)


def _lift_e8m0_zero_scale(x: Any) -> Any:
    """An all-zero ScaledArray with an E8M0 scale gets :data:`E8M0_ZERO_SCALE`, not ``2^-126``.

    Rules multiply scales (Adam's ``b2 * nu``): a product below ``2^-126`` is a float32
    subnormal, flushed to 0 on CPU, which an E8M0 scale cannot hold (it becomes NaN). Float32
    scales keep ``2^-126``: a zero there is harmless, and any higher scale would dominate the
    estimates of values below it.
    """
    if not isinstance(x, ScaledArray) or x.scale.dtype != jnp.float8_e8m0fnu:
        return x
    zero_scale = jnp.asarray(E8M0_ZERO_SCALE, x.scale.dtype)
    return ScaledArray._trusted(x.data, jnp.where(jnp.any(x.data != 0), x.scale, zero_scale))


def to_storage(
    tree: Any,
    dtype: DTypeLike,
    rescale: str | None,
    scale_dtype: DTypeLike | None,
    block_size: int | None = None,
) -> Any:
    """Every floating leaf of a concrete ``tree`` as a ScaledArray with ``dtype`` data.

    Plain arrays are first split at their RMS (:func:`~jax_scaled.as_scaled_array`; all-zero
    leaves get scale ``2^-126``), then stored (:func:`stored`) in one compiled call.
    """
    tree = as_scaled_array(tree, scale_dtype=scale_dtype)
    scale_dtype = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return _store_scaled(tree, float_dtype(dtype), check_rescale(rescale), block_size, scale_dtype)


def like_reference(reference: Any, tree: Any) -> Any:
    """``tree`` with a plain array wherever ``reference`` has one (ScaledArray values of
    ``tree`` there become ``data * scale``, in the wider of the two dtypes).

    ``tree``'s structure must match ``reference`` up to its leaves; ``None`` leaves pass.
    """

    def convert(ref: Any, x: Any) -> Any:
        if isinstance(x, ScaledArray) and not isinstance(ref, ScaledArray) and ref is not None:
            return x.to_array(jnp.promote_types(x.dtype, ref.dtype))
        return x

    return jax.tree.map(
        convert, reference, tree, is_leaf=lambda x: x is None or isinstance(x, ScaledArray)
    )
