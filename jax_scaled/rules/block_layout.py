"""Block rules for layout ops and reductions: the data moves or reduces, the scales follow.

Layout ops keep the blocks exactly: the scale array is permuted, sliced, repeated or
reshaped alongside the data (transpose, broadcast_in_dim, reshape that keeps blocks whole,
squeeze, slice and pad at block boundaries, concatenate, rev, dynamic_slice and gather along
unblocked axes). Reductions keep the blocks along the axes they do not reduce: the reduced axes are
first widened to one block (the largest block scale, the data shifted to it), then the
per-tensor rule runs on every remaining block. An operand these rules cannot keep in blocks
(:class:`~jax_scaled.engine.block_dispatch.Unsupported`) falls back to one scale per tensor.

Example:
    >>> x = ScaledArray(jnp.ones((2, 64)), jnp.array([[1.0, 2.0], [4.0, 8.0]], jnp.float32))
    >>> y = scalify(lambda x: x.T)(x)
    >>> y.scale.shape, y.block_shape
    ((2, 2), (32, 1))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine.block_dispatch import Unsupported, coarsened, map_blocks
from jax_scaled.engine.registry import record, register_block_rule
from jax_scaled.scales import as_scaled, geometry


def _scale(x: Value) -> Any:
    """``x``'s scale with the data's rank (a 0-d scale as one block along every axis)."""
    x = as_scaled(x)
    return x.scale if np.ndim(x.scale) else lax.reshape(x.scale, (1,) * x.ndim)


@register_block_rule(lax.transpose_p)
def transpose_block_rule(x: ScaledArray, *, permutation: Sequence[int]) -> ScaledArray:
    """Data and block scales transposed alike."""
    return ScaledArray(lax.transpose(x.data, permutation), lax.transpose(x.scale, permutation))


@register_block_rule(lax.rev_p)
def rev_block_rule(x: ScaledArray, *, dimensions: Sequence[int]) -> ScaledArray:
    """Data and block scales reversed alike."""
    return ScaledArray(lax.rev(x.data, dimensions), lax.rev(x.scale, dimensions))


@register_block_rule(lax.squeeze_p)
def squeeze_block_rule(x: ScaledArray, *, dimensions: Sequence[int]) -> ScaledArray:
    """Size-1 axes removed from data and scales."""
    return ScaledArray(lax.squeeze(x.data, dimensions), lax.squeeze(x.scale, dimensions))


@register_block_rule(lax.broadcast_in_dim_p)
def broadcast_in_dim_block_rule(
    x: ScaledArray, *dyn: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int], **params
) -> ScaledArray:
    """New axes and broadcast size-1 axes are one block each; the others keep theirs."""
    if dyn:
        raise Unsupported
    data = lax.broadcast_in_dim(x.data, shape, broadcast_dimensions)
    scale_shape = [1] * len(shape)
    for axis, out_axis in enumerate(broadcast_dimensions):
        scale_shape[out_axis] = x.scale.shape[axis]  # 1 for a broadcast size-1 axis
    return ScaledArray(data, lax.broadcast_in_dim(x.scale, scale_shape, broadcast_dimensions))


@register_block_rule(lax.slice_p)
def slice_block_rule(x: ScaledArray, *, start_indices, limit_indices, strides=None) -> ScaledArray:
    """A slice at block boundaries: the scales of the blocks it keeps."""
    blocks = x.block_shape
    if strides is not None and any(s != 1 for s in strides):
        raise Unsupported
    if any(s % b or (e % b and e != n) for s, e, b, n in _axes(start_indices, limit_indices, x)):
        raise Unsupported
    data = lax.slice(x.data, start_indices, limit_indices)
    starts = [s // b for s, b in zip(start_indices, blocks, strict=True)]
    limits = [-(-e // b) for e, b in zip(limit_indices, blocks, strict=True)]
    return ScaledArray(data, lax.slice(x.scale, starts, limits))


def _axes(starts: Sequence[int], limits: Sequence[int], x: ScaledArray):
    blocks = x.block_shape
    return zip(starts, limits, blocks, x.shape, strict=True)


@register_block_rule(lax.dynamic_slice_p)
def dynamic_slice_block_rule(x: ScaledArray, *indices: Any, slice_sizes) -> ScaledArray:
    """A dynamic slice along axes of blocks of one element (the scales sliced alike), whole
    axes and axes that are one block (the scales kept)."""
    scale_starts, scale_sizes = [], []
    for index, size, n, b in zip(indices, slice_sizes, x.shape, x.block_shape, strict=True):
        if b == 1:
            scale_starts.append(index)
            scale_sizes.append(size)
        elif size == n or b == n:
            scale_starts.append(np.zeros((), np.asarray(index).dtype))
            scale_sizes.append(n // b)
        else:
            raise Unsupported  # a traced start cannot be checked against block boundaries
    data = lax.dynamic_slice(x.data, indices, slice_sizes)
    return ScaledArray(data, lax.dynamic_slice(x.scale, scale_starts, scale_sizes))


@register_block_rule(lax.gather_p)
def gather_block_rule(
    x: ScaledArray, indices: Any, *, dimension_numbers, slice_sizes, fill_value=None, **params
) -> ScaledArray:
    """A gather along axes of blocks of one element (embedding rows, batched lookups) or
    axes that are one block: the scales gathered with the same indices (a one-block axis at
    index 0). Slices along the other axes must start at 0 and end at a block boundary. A
    finite non-zero fill value (out-of-bounds slices) is not a block value: falls back."""
    if fill_value is not None and fill_value != 0 and math.isfinite(fill_value):
        raise Unsupported
    index_map = dimension_numbers.start_index_map
    scale_sizes = []
    for axis, (size, n, b) in enumerate(zip(slice_sizes, x.shape, x.block_shape, strict=True)):
        indexed = axis in index_map or axis in dimension_numbers.operand_batching_dims
        if b == 1 or (b == n and axis not in dimension_numbers.operand_batching_dims):
            scale_sizes.append(size if b == 1 else 1)
        elif not indexed and size % b == 0:  # starts at 0: whole blocks
            scale_sizes.append(size // b)
        else:
            raise Unsupported  # a traced start cannot be checked against block boundaries
    data = lax.gather_p.bind(
        x.data, indices, dimension_numbers=dimension_numbers, slice_sizes=slice_sizes,
        fill_value=fill_value, **params,
    )  # fmt: skip
    keep_index = [x.block_shape[axis] == 1 for axis in index_map]  # index vector order
    scale_indices = indices if all(keep_index) else indices * np.asarray(keep_index, indices.dtype)
    scale = lax.gather_p.bind(
        x.scale, scale_indices, dimension_numbers=dimension_numbers,
        slice_sizes=tuple(scale_sizes), fill_value=1, **params,
    )  # fmt: skip
    return ScaledArray(data, scale)


@register_block_rule(lax.pad_p)
def pad_block_rule(x: ScaledArray, padding_value: Value, *, padding_config) -> ScaledArray:
    """Padding by whole blocks: the new blocks hold the padding value at its own scale. An
    axis that is one block is padded only with a known zero (its block then grows)."""
    value = as_scaled(padding_value)
    zero = _is_static_zero(value)
    scale_config = []
    for (low, high, interior), b, n in zip(padding_config, x.block_shape, x.shape, strict=True):
        whole_axis = b == n and b > 1
        if interior or (whole_axis and (low or high) and not zero):
            raise Unsupported
        if not whole_axis and (low % b or high % b):
            raise Unsupported
        scale_config.append((0, 0, 0) if whole_axis else (low // b, high // b, 0))
    data = lax.pad(x.data, lax.convert_element_type(value.data, x.dtype), padding_config)
    fill = lax.convert_element_type(value.scale, x.scale.dtype)
    return ScaledArray(data, lax.pad(x.scale, fill, scale_config))


def _is_static_zero(x: ScaledArray) -> bool:
    try:
        return float(np.asarray(x.data)) == 0.0
    except Exception:  # a traced padding value: not known to be zero
        return False


@register_block_rule(lax.concatenate_p)
def concatenate_block_rule(*xs: Value, dimension: int) -> ScaledArray:
    """Operands on a common grid (the concatenated axis included), scales concatenated;
    the operands keep their values (blocks repeated onto the finer grid, exactly)."""
    blocks = geometry.common_blocks(xs)
    scaled = [as_scaled(x) for x in xs]
    if any(not isinstance(x, ScaledArray) for x in xs):
        raise Unsupported  # a plain operand has no scale to join with
    data = lax.concatenate([x.data for x in scaled], dimension)
    scales = [geometry.scale_on_grid(x, blocks) for x in scaled]
    return ScaledArray(data, lax.concatenate(scales, dimension))


@register_block_rule(lax.reshape_p)
def reshape_block_rule(x: ScaledArray, *dyn: Any, new_sizes, dimensions, **params) -> ScaledArray:
    """A reshape that keeps every block whole: the scales reshaped alongside."""
    if dyn or dimensions is not None:
        raise Unsupported
    scale_sizes = _reshaped_grid(x.shape, x.block_shape, tuple(new_sizes))
    data = lax.reshape(x.data, new_sizes)
    return ScaledArray(data, lax.reshape(x.scale, scale_sizes))


def _reshaped_grid(shape: tuple, blocks: tuple, new_shape: tuple) -> tuple[int, ...]:
    """The scale shape of ``new_shape`` if the reshape keeps every block whole, else
    :class:`Unsupported`.

    The data, in row-major order, is the sequence of factors ``(grid_0, block_0, grid_1,
    block_1, ...)``. Each new axis takes the next factors in order (splitting one where it
    must); it keeps the blocks whole when its grid factors all come before its block factors.

    Example:
        >>> _reshaped_grid((4, 64), (1, 32), (4, 2, 32))
        (4, 2, 1)
    """
    atoms = [
        [size, kind]
        for n, b in zip(shape, blocks, strict=True)
        for size, kind in ((n // b, "grid"), (b, "block"))
        if size > 1
    ]
    grid = []
    for n in new_shape:
        count, need, seen_block = 1, n, False
        while need > 1:
            if not atoms:
                raise Unsupported
            size, kind = atoms[0]
            take = math.gcd(size, need)
            if take == 1 or (size > need and size % need) or (size < need and need % size):
                raise Unsupported
            if kind == "grid":
                if seen_block:
                    raise Unsupported  # a block of this axis is not contiguous
                count *= take
            seen_block |= kind == "block"
            need //= take
            atoms[0][0] //= take
            if atoms[0][0] == 1:
                atoms.pop(0)
        grid.append(count)
    return tuple(grid)


# ---------------------------------------------------------------------------------------
# Reductions: the reduced axes widened to one block, the per-tensor rule on every block
# ---------------------------------------------------------------------------------------


def _register_reduction(primitive) -> None:
    def rule(x: ScaledArray, *, axes: Sequence[int], **params) -> Any:
        """Blocks kept along the axes not reduced (the reduced ones widened to one block)."""
        per_tensor_rule = record(primitive).rule
        widened = coarsened(x, axes)
        reduce = lambda v, **p: per_tensor_rule(v, axes=axes, **p)  # noqa: E731
        return map_blocks(reduce, [widened], params, False, reduced=axes)

    rule.__name__ = rule.__qualname__ = f"{primitive.name}_block_rule"
    register_block_rule(primitive)(rule)


for _reduction in (lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p):
    _register_reduction(_reduction)
