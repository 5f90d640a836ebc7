"""Block rules for ``dot_general`` and ``conv_general_dilated``: free and batch blocks factor
out, contracting blocks are consumed.

``sum_k x[i, k] y[k, j]`` with block scales: blocks along the batch and free axes factor out of
the sum exactly (the output scale has the grid of those axes: per row of ``x``, per column of
``y``, ...). Blocks along a contracting axis cannot: the rule forms the partial product of
every contracting block in float32 (a ``dot_general`` with the block index as a batch axis),
weighs each by its blocks' scales relative to the output scale (exact powers of two) and sums
them in float32. The output scale of an output block is the product of each operand's largest
block scale along the contracting axes (per row of ``x``, per column of ``y``) times
``sqrt(K)`` (the unit-scaling estimate; an upper bound of the largest product of paired block
scales, so the weights are computed per operand and no grid of products is formed), and the
range guard applies as in the per-tensor rule. The output keeps the free-axis blocks of an
operand with one block along its contracting axes (per-row activations, per-column weights: the
output scale is their outer product); an operand with several (MX) gets one scale across its
free axes, since every output element sums over all its blocks (and a scale per output element
would cost as much memory as the output): MX times MX is per tensor. An output with a single
block gets a 0-d scale: the per-tensor path.

A convolution keeps the blocks of the input's batch axis and of the kernel's output-feature
axis (per example x per output channel); its contracted axes (input features and the window,
which slides across blocks) are consumed by widening each operand to float32 at its largest
block scale along them: exact (power-of-two ratios), at the cost of a float32 convolution
(XLA's convolutions do not expose per-block partial sums).

Example:
    >>> rows = ScaledArray(jnp.ones((2, 64)), jnp.array([[1.0], [4.0]], jnp.float32))
    >>> mx = ScaledArray(jnp.ones((2, 64)), jnp.array([[1.0, 4.0], [2.0, 8.0]], jnp.float32))
    >>> w = ScaledArray(jnp.ones((64, 3)), jnp.float32(1.0))
    >>> y, z = scalify(lambda x, w: x @ w)(rows, w), scalify(lambda x, w: x @ w)(mx, w)
    >>> js.asarray(y)[:, 0].tolist(), y.scale.shape, js.asarray(z)[:, 0].tolist(), z.scale.shape
    ([64.0, 256.0], (2, 1), [160.0, 320.0], ())
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray, Value, expand_scale
from jax_scaled.engine.registry import register_block_rule
from jax_scaled.rules.toolkit import bind_contraction
from jax_scaled.scales import (
    as_scaled,
    geometry,
    guard_factors,
    make_scale,
    per_tensor_scale,
    scale_f32,
    sqrt_pow2,
    times_scalar,
)


@register_block_rule(lax.dot_general_p, behaviour="consumes")
def dot_general_block_rule(
    x: Value, y: Value, *, dimension_numbers, preferred_element_type=None, **params
) -> ScaledArray:
    """Batch and free blocks kept, contracting blocks consumed (see the module docstring)."""
    x, y = as_scaled(x), as_scaled(y)
    (cx, cy), (bx, by) = dimension_numbers
    x_blocks, y_blocks = _paired_blocks(x, y, cx, cy, bx, by)
    out_dtype = preferred_element_type or jnp.result_type(x.dtype, y.dtype)
    free_x = [a for a in range(x.ndim) if a not in cx and a not in bx]
    free_y = [a for a in range(y.ndim) if a not in cy and a not in by]
    nb, nc = len(bx), len(cx)
    # Block scales as (batch, contracting, free) grids, split into a scale per output row
    # (column) and exact power-of-two ratios of every block to it.
    row_x, ratio_x = _split_scale(
        lax.transpose(_full_rank_scale(x, x_blocks), (*bx, *cx, *free_x)), nb, nc,
        _blocked_along(x, x_blocks, cx),
    )  # fmt: skip
    row_y, ratio_y = _split_scale(
        lax.transpose(_full_rank_scale(y, y_blocks), (*by, *cy, *free_y)), nb, nc,
        _blocked_along(y, y_blocks, cy),
    )  # fmt: skip
    k = math.prod(x.shape[a] for a in cx)
    out_scale = lax.mul(_outer(row_x, row_y, nb), np.float32(sqrt_pow2(k)))  # powers of two
    partials = _block_partials(x, y, x_blocks, dimension_numbers, params)
    value = _weighted_sum(partials, ratio_x, ratio_y, nb, nc, len(free_x))
    value = lax.mul(value, np.float32(1.0 / sqrt_pow2(k)))  # a power of two: exact
    return _output(value, out_scale, out_dtype, x, y)


def _blocked_along(x: ScaledArray, blocks: Sequence[int], axes: Sequence[int]) -> bool:
    """True if ``x`` has several blocks along ``axes`` (its contracting axes: MX)."""
    return any(blocks[a] < x.shape[a] for a in axes)


def _split_scale(scale: jax.Array, nb: int, nc: int, coarsen: bool) -> tuple[jax.Array, jax.Array]:
    """``(row scale, ratios)`` of a ``(batch, contracting, free)`` grid of block scales.

    The row scale, of shape ``(batch, free)``, is the largest over the contracting blocks,
    per batch and free block, or per batch block only (free axes of size 1) when ``coarsen``
    (an operand with several contracting blocks: every output element sums over all of them,
    and a scale per output element would cost as much memory as the output). The ratios of
    every block to it are exact powers of two."""
    free = tuple(range(nb + nc, scale.ndim))
    axes = tuple(range(nb, nb + nc)) + (free if coarsen else ())
    largest, ratios = geometry.split_at_largest(scale, axes)
    row_dims = [*range(nb), *free]
    row_shape = [1 if d in axes else scale.shape[d] for d in row_dims]
    row_kept = [i for i, d in enumerate(row_dims) if d not in axes]
    return lax.broadcast_in_dim(largest, row_shape, row_kept), ratios


def _paired_blocks(x: ScaledArray, y: ScaledArray, cx, cy, bx, by) -> tuple[list[int], list[int]]:
    """Block shapes of ``x`` and ``y`` with paired (contracting, batch) axes on a common grid."""
    x_blocks, y_blocks = list(x.block_shape), list(y.block_shape)
    for a, b in zip((*cx, *bx), (*cy, *by), strict=True):
        x_blocks[a] = y_blocks[b] = math.gcd(x_blocks[a], y_blocks[b])
    return x_blocks, y_blocks


def _full_rank_scale(x: ScaledArray, blocks: Sequence[int]) -> jax.Array:
    """``x``'s float32 scale on the grid of ``blocks`` (a 0-d scale repeated)."""
    as_float = ScaledArray._trusted(x.data, scale_f32(x))
    return geometry.scale_on_grid(as_float, tuple(blocks))


def _outer(sx: jax.Array, sy: jax.Array, shared: int) -> jax.Array:
    """``sx[s, i] * sy[s, j]`` over the ``shared`` leading axes: ``(s, i, j)``."""
    shape = (*sx.shape, *sy.shape[shared:])
    left = lax.broadcast_in_dim(sx, shape, tuple(range(sx.ndim)))
    right_dims = (*range(shared), *range(sx.ndim, len(shape)))
    right = lax.broadcast_in_dim(sy, shape, right_dims)
    return lax.mul(left, right)


def _block_partials(
    x: ScaledArray, y: ScaledArray, x_blocks, dimension_numbers, params: dict
) -> jax.Array:
    """The float32 product of every contracting block: ``(batch, contracting blocks,
    free x, free y)`` at full resolution along batch and free axes."""
    (cx, cy), (bx, by) = dimension_numbers
    x_split, x_axes = _split_contracting(x.data, cx, [x_blocks[a] for a in cx])
    y_split, y_axes = _split_contracting(y.data, cy, [x_blocks[a] for a in cx])
    batch_x = (*[x_axes[a][0] for a in bx], *[x_axes[a][0] for a in cx])
    batch_y = (*[y_axes[a][0] for a in by], *[y_axes[a][0] for a in cy])
    inner_x = tuple(x_axes[a][1] for a in cx)
    inner_y = tuple(y_axes[a][1] for a in cy)
    numbers = ((inner_x, inner_y), (batch_x, batch_y))
    return bind_contraction(
        lax.dot_general_p, x_split, y_split,
        dimension_numbers=numbers, preferred_element_type=jnp.float32, **params,
    )  # fmt: skip


def _split_contracting(data: jax.Array, axes, blocks) -> tuple[jax.Array, dict]:
    """``data`` with each contracting axis split into (blocks, block size); the new index of
    every old axis (a pair for a split one)."""
    shape, where = [], {}
    for a, n in enumerate(data.shape):
        if a in axes:
            b = blocks[list(axes).index(a)]
            where[a] = (len(shape), len(shape) + 1)
            shape += [n // b, b]
        else:
            where[a] = (len(shape),)
            shape.append(n)
    return lax.reshape(data, shape), where


def _weighted_sum(
    partials: jax.Array, ratio_x: jax.Array, ratio_y: jax.Array, nb: int, nc: int, n_free_x: int
) -> jax.Array:
    """``sum_c partial_c * ratio_x_c * ratio_y_c`` in float32 over the contracting blocks
    ``c``, each operand's ratios repeated over its batch and free blocks: the output data at
    its scale (one fused loop: no grid of ratio products is formed)."""
    lead = nb + nc
    x_dims = tuple(range(lead + n_free_x))
    y_dims = (*range(lead), *range(lead + n_free_x, partials.ndim))
    weighted = partials
    for ratio, dims in ((ratio_x, x_dims), (ratio_y, y_dims)):
        full = expand_scale(ratio, [partials.shape[d] for d in dims])
        weighted = lax.mul(weighted, lax.broadcast_in_dim(full, partials.shape, dims))
    return lax.reduce_sum(weighted, tuple(range(nb, lead)))


def _output(
    value: jax.Array, scale: jax.Array, dtype, x: ScaledArray, y: ScaledArray
) -> ScaledArray:
    """The output data cast to ``dtype`` (range-guarded as a whole), with its block scales;
    a single block gets a 0-d scale."""
    factors = guard_factors(value, dtype)
    if factors is not None:
        down, up = factors
        value, scale = times_scalar(value, down), lax.mul(scale, up)
    data = lax.convert_element_type(value, dtype)
    if all(n == 1 for n in scale.shape):  # one block: the per-tensor path from here on
        return ScaledArray(data, per_tensor_scale(lax.reshape(scale, ())))
    return ScaledArray(data, make_scale(scale, x, y))


@register_block_rule(lax.conv_general_dilated_p, behaviour="consumes")
def conv_general_dilated_block_rule(
    lhs: Value, rhs: Value, *, dimension_numbers, preferred_element_type=None, **params
) -> ScaledArray:
    """Input-batch and output-feature blocks kept, contracted blocks consumed in float32
    (see the module docstring)."""
    lhs, rhs = as_scaled(lhs), as_scaled(rhs)
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    kept_batch = lhs_spec[0] if params["batch_group_count"] == 1 else None  # groups mix it
    lhs_data, rows = _widened_along(lhs, kept_batch)
    rhs_data, cols = _widened_along(rhs, rhs_spec[0])
    k = math.prod(rhs.shape[d] for d in rhs_spec[1:])
    out = bind_contraction(
        lax.conv_general_dilated_p, lhs_data, rhs_data, dimension_numbers=dimension_numbers,
        preferred_element_type=jnp.float32, **params,
    )  # fmt: skip
    grid = [1] * out.ndim
    grid[out_spec[0]], grid[out_spec[1]] = rows.size, cols.size
    rows = lax.broadcast_in_dim(rows, grid, (out_spec[0],))
    scale = lax.mul(lax.mul(rows, lax.broadcast_in_dim(cols, grid, (out_spec[1],))),
                    np.float32(sqrt_pow2(k)))  # fmt: skip
    value = lax.mul(out, np.float32(1.0 / sqrt_pow2(k)))  # a power of two: exact
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    return _output(value, scale, out_dtype, lhs, rhs)


def _widened_along(x: ScaledArray, kept: int | None) -> tuple[jax.Array, jax.Array]:
    """``x``'s data in float32 at the largest block scale of each block along axis ``kept``
    (every axis widened if None), exact (power-of-two ratios), and those scales (1-d)."""
    scale = _full_rank_scale(x, x.block_shape)
    kept_axes = () if kept is None else (kept,)
    others = tuple(a for a in range(x.ndim) if a not in kept_axes)
    largest, ratios = geometry.split_at_largest(scale, others)
    data = lax.mul(lax.convert_element_type(x.data, jnp.float32), expand_scale(ratios, x.shape))
    return data, lax.reshape(largest, (largest.size,))
