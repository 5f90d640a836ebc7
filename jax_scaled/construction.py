"""Building ScaledArrays from plain values (Python numbers, numpy and jax arrays, pytrees of
them) and turning them back into plain arrays.

The default split puts an array's data at the power of two below its RMS, the unit scale
every rule assumes; a scalar is split exactly into mantissa and power of two.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jax_scaled.array import ScaledArray, is_array_like
from jax_scaled.dtypes import compute_dtype, is_floating
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT
from jax_scaled.pow2.traced import pow2_round, pow2_split


def is_scaled_leaf(x: Any) -> bool:
    """True for the leaves of a scaled pytree: ScaledArrays, arrays and scalars.

    Pass it as ``is_leaf`` to ``jax.tree`` functions so they stop at ScaledArrays instead of
    descending into ``data`` and ``scale``.

    Example:
        >>> tree = {"w": scaled_array([1.0], 2.0)}
        >>> type(jax.tree.leaves(tree, is_leaf=is_scaled_leaf)[0]).__name__
        'ScaledArray'
    """
    return isinstance(x, ScaledArray) or np.isscalar(x) or is_array_like(x)


def scaled_array(data, scale, dtype: DTypeLike | None = None) -> ScaledArray:
    """Build a ScaledArray from array-likes (Python lists and scalars included).

    ``data`` is converted to ``dtype`` (default: its own floating dtype); ``scale`` to a
    float32 array unless it already has a floating dtype.

    Example:
        >>> scaled_array([1.0, 2.0], 0.5, dtype=jnp.float16).to_array()
        Array([0.5, 1. ], dtype=float16)
    """
    data = jnp.asarray(data, dtype=dtype)
    scale_dtype = jnp.result_type(scale)
    scale = jnp.asarray(scale, dtype=scale_dtype if is_floating(scale_dtype) else jnp.float32)
    return ScaledArray(data, scale)


def _as_scaled_leaf(x: Any, scale, scale_dtype) -> Any:
    if isinstance(x, ScaledArray):
        if scale_dtype is None:
            return x
        return ScaledArray._trusted(x.data, x.scale.astype(scale_dtype))
    if not (is_array_like(x) or isinstance(x, float)):
        return x
    if not is_floating(jnp.result_type(x)):
        return x
    scale_dtype = jnp.dtype(scale_dtype or jnp.float32)
    if scale is None:
        data, scale = _split_array(jnp.asarray(x), scale_dtype)
    else:
        data, scale = _divide_by_scale(jnp.asarray(x), jnp.asarray(scale, jnp.float32), scale_dtype)
    return ScaledArray(data, scale)


@functools.partial(jax.jit, static_argnums=1)
def _split_array(x: jax.Array, scale_dtype) -> tuple[jax.Array, jax.Array]:
    """Default ``(data, scale)`` of an array: a mantissa split for scalars (a zero at the
    smallest scale, as an all-zero array), RMS for arrays."""
    if x.ndim == 0:
        data, scale = pow2_split(x)
        scale = jnp.where(x == 0, jnp.float32(2.0**MIN_SCALE_EXPONENT), scale)
    else:
        scale = _default_array_scale(x)
        data = (x.astype(compute_dtype(x.dtype)) / scale).astype(x.dtype)
    return data, scale.astype(scale_dtype)


@functools.partial(jax.jit, static_argnums=2)
def _divide_by_scale(x: jax.Array, scale: jax.Array, scale_dtype) -> tuple[jax.Array, jax.Array]:
    data = (x.astype(compute_dtype(x.dtype)) / scale).astype(x.dtype)
    return data, scale.astype(scale_dtype)


def _default_array_scale(x: jax.Array) -> jax.Array:
    """The power of two at or below the RMS of ``x``: data near unit scale, as rules assume.

    All-zero arrays get the smallest scale (they carry no scale information); arrays with
    non-finite values get 1.
    """
    wide = x.astype(compute_dtype(x.dtype))
    # The RMS of ``wide / 2^k`` (2^k at or below its largest magnitude) times 2^k: the plain
    # RMS exactly, except that the squares no longer overflow float32 above 1e19 or flush
    # below 1e-19.
    unit = pow2_round(jnp.max(jnp.abs(wide)))
    rms = jnp.sqrt(jnp.mean(jnp.square(wide / unit))) * unit
    scale = pow2_round(rms)
    scale = jnp.where(rms == 0, jnp.float32(2.0**MIN_SCALE_EXPONENT), scale)
    return jnp.where(jnp.isfinite(rms), scale, jnp.float32(1))


def as_scaled_array(tree: Any, scale=None, scale_dtype: DTypeLike | None = None) -> Any:
    """Turn every floating leaf of ``tree`` into a ScaledArray (value unchanged).

    Arrays get ``scale`` if given; by default the power of two at or below their root mean
    square, so that ``data`` is near unit scale (the assumption behind every scale rule: a
    weight initialised with standard deviation ``1/sqrt(fan_in)`` gets that scale). An
    all-zero array, such as a fresh bias or optimizer moment, gets the smallest scale
    ``2^-126`` so that it never dominates an estimate. Floating scalars are split exactly into
    a mantissa and a power-of-two scale (a zero, such as optax's ``eps_root`` hyperparameter
    in an ``inject_hyperparams`` state, at the smallest scale too). The default costs one
    reduction per array.

    Integer and boolean leaves and non-array values are returned unchanged; ScaledArray leaves
    are kept (their scale cast to ``scale_dtype`` if given). ``scale_dtype`` defaults to
    float32; pass ``jnp.float8_e8m0fnu`` for E8M0 scales.

    Example:
        >>> x = as_scaled_array({"w": jnp.full(2, 0.1), "step": jnp.int32(0)})
        >>> type(x["w"]).__name__, type(x["step"]).__name__, float(x["w"].scale)
        ('ScaledArray', 'ArrayImpl', 0.0625)
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, ScaledArray))
    convert = [i for i, x in enumerate(leaves) if _needs_split(x) and scale is None]
    if convert:  # one compiled call for all arrays: as cheap as it gets per training step
        dtype = jnp.dtype(scale_dtype or jnp.float32)
        split = _split_arrays(tuple(jnp.asarray(leaves[i]) for i in convert), dtype)
        for i, (data, leaf_scale) in zip(convert, split, strict=True):
            leaves[i] = ScaledArray._trusted(data, leaf_scale)
    leaves = [_as_scaled_leaf(x, scale, scale_dtype) for x in leaves]
    return jax.tree.unflatten(treedef, leaves)


def _needs_split(x: Any) -> bool:
    is_float = (is_array_like(x) or isinstance(x, float)) and is_floating(jnp.result_type(x))
    return is_float and not isinstance(x, ScaledArray)


@functools.partial(jax.jit, static_argnums=1)
def _split_arrays(xs: tuple[jax.Array, ...], scale_dtype) -> list[tuple[jax.Array, jax.Array]]:
    return [_split_array(x, scale_dtype) for x in xs]


def cast_fitting(x: ScaledArray, dtype: DTypeLike) -> ScaledArray:
    """``x`` with its data cast to ``dtype``, re-centred first where it would not fit.

    Data whose largest magnitude is above ``dtype``'s largest value, or so small that it
    would lose precision to subnormals (below ``tiny * 2^(mantissa bits + 1)``), is moved to
    the power of two at or below its RMS (as :func:`as_scaled_array` places it) before the
    cast: the value is kept, no ``inf`` or flushed zero appears. Data that fits is cast as
    is, bit-identical to ``x.astype(dtype)``. Block-scaled values are cast as is.

    Example:
        >>> x = ScaledArray(jnp.full(2, 1e20), jnp.float32(1.0))
        >>> y = cast_fitting(x, jnp.float16)
        >>> y.dtype, round(float(y.to_array(jnp.float32)[0]) / 1e20, 3)
        (dtype('float16'), 1.0)
    """
    dtype = jnp.dtype(dtype)
    if not is_floating(dtype):
        raise TypeError(f"ScaledArray data must have a floating dtype, got {dtype}.")
    if np.ndim(x.scale) or x.size == 0:
        return x.astype(dtype)
    return _cast_fitting(x, dtype)


@functools.partial(jax.jit, static_argnums=1)
def _cast_fitting(x: ScaledArray, dtype: jnp.dtype) -> ScaledArray:
    wide = x.data.astype(compute_dtype(x.dtype))
    largest = jnp.max(jnp.abs(wide))
    info = jnp.finfo(dtype)
    low = float(info.smallest_normal) * 2.0 ** (info.nmant + 1)
    fits = ~jnp.isfinite(largest) | (largest == 0) | ((largest <= info.max) & (largest >= low))
    shift = jnp.where(fits, np.float32(1), _default_array_scale(wide))
    data = (wide / shift.astype(wide.dtype)).astype(dtype)
    return ScaledArray._trusted(data, (x.scale.astype(jnp.float32) * shift).astype(x.scale.dtype))


def asarray(tree: Any, dtype: DTypeLike | None = None) -> Any:
    """Turn every ScaledArray of ``tree`` back into a plain array ``data * scale``.

    By default a ScaledArray with data narrower than float32 (float16, bfloat16, FP8, FP4)
    comes back in **float32**: its value ``data * scale`` may lie far outside the data
    format's range (that is what the scale is for), and float32 holds it exactly where the
    data dtype would flush it to zero or overflow it. Block-scaled FP8 data thus gives a
    float32 array that mixes with other float32 arrays. float32 and float64 data keep their
    dtype; plain leaves are unchanged. An explicit ``dtype`` casts every floating leaf
    (scaled or not) to it; other leaves are unchanged. :meth:`ScaledArray.to_array` keeps
    the data dtype.

    Example:
        >>> asarray(scaled_array([1.0, 3.0], 0.5))
        Array([0.5, 1.5], dtype=float32)
        >>> x = scaled_array([1.0, 3.0], 2.0**-30, dtype=jnp.float16)
        >>> y = asarray(x)
        >>> y.dtype, (y * 2**30).tolist()  # float32: exact
        (dtype('float32'), [1.0, 3.0])
        >>> asarray(x, jnp.float16).tolist()  # below float16's subnormals: flushed
        [0.0, 0.0]
    """

    def convert(x):
        if isinstance(x, ScaledArray):
            return x.to_array(compute_dtype(x.dtype) if dtype is None else dtype)
        if dtype is not None and is_array_like(x) and is_floating(x.dtype):
            return jnp.asarray(x, dtype=dtype)
        return x

    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, ScaledArray))
