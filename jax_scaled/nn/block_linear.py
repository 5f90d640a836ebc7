"""Block-scaled matmul recipes: MXFP8, MXFP4 weights, 1x128 activations with 128x128 weights.

:func:`block_linear` is ``x @ w`` whose three matmuls (forward, input gradient, weight
gradient) each take operands quantized with one power-of-two scale per block **along that
matmul's contracting axis** (:func:`~jax_scaled.quantize.quantize`):

============================  =====================  ======================================
matmul                        contracting axis       operands quantized
============================  =====================  ======================================
forward ``y = x w``           ``K``                  ``x`` to format ``recipe.x`` in rows
                                                     of its block size along K, ``w`` to
                                                     ``recipe.w`` in ``w_block`` blocks
input grad ``dx = g w^T``     ``N``                  ``g`` to ``recipe.grad`` in rows along
                                                     N, ``w`` in transposed ``w_block``
weight grad ``dw = x^T g``    ``M`` (the batch)      ``x`` and ``g`` in columns along M
============================  =====================  ======================================

The transposed operands of the backward matmuls are quantized again **from the
high-precision values** saved by the forward pass (``x`` and ``w``), never re-blocked from
already quantized data (which would round twice). The products are accumulated in float32
and leave with one scale per tensor (:func:`~jax_scaled.ops.merge_blocks`).

**Where it runs.** Under :func:`~jax_scaled.scalify` the quantized operands are block-scaled
ScaledArrays of FP8/FP4 data and each matmul is scalify's block ``dot_general`` rule
(partial products per contracting block, scales applied exactly). Outside scalify the
quantized operands are dequantized to float32 before the product: the same values as an
FP8/FP4 GEMM with float32 accumulation (a simulation on hardware without one).

Recipes (:class:`~jax_scaled.formats.BlockRecipe`, built from
:class:`~jax_scaled.formats.BlockFormat` s; defined in :mod:`jax_scaled.formats`, the same
objects as ``js.formats.MXFP8``, ...). A format ``F`` where a recipe is expected means ``F``
everywhere (``js.formats.MXFP8_E4M3`` is :data:`MXFP8_E4M3_GRADS`).

* :data:`MXFP8`: E4M3 forward, E5M2 gradients, blocks of 32, E8M0 scales (OCP MX, "floor"
  scale rounding);
* :data:`MXFP8_E4M3_GRADS`: E4M3 everywhere;
* :data:`MXFP4_WEIGHTS`: E2M1 weights, E4M3 activations, E5M2 gradients (blocks of 32);
* :data:`FP8_BLOCK128`: E4M3 everywhere, 1x128 activation and gradient tiles and 128x128
  weight blocks, float32 scales that never saturate ("rceil"), as in FP8 LLM training recipes.

Example:
    >>> x = jax.random.normal(jax.random.key(0), (64, 128))
    >>> w = jax.random.normal(jax.random.key(1), (128, 32)) / 11
    >>> y = block_linear(x, w, MXFP8)
    >>> bool(jnp.abs(y - x @ w).max() < 0.1 * jnp.abs(x @ w).max())
    True
    >>> e4m3 = js.formats.MXFP8_E4M3  # a format: E4M3 everywhere
    >>> bool((block_linear(x, w, e4m3) == block_linear(x, w, MXFP8_E4M3_GRADS)).all())
    True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled.array import ScaledArray
from jax_scaled.formats import (
    FP8_BLOCK128,
    MXFP4_WEIGHTS,
    MXFP8,
    MXFP8_E4M3_GRADS,
    BlockFormat,
    BlockRecipe,
    as_recipe,
)
from jax_scaled.ops.blocks import merge_blocks
from jax_scaled.quantize import quantize

F32 = jnp.dtype(jnp.float32)


def block_linear(x: jax.Array, w: jax.Array, recipe: BlockRecipe | BlockFormat) -> jax.Array:
    """``x @ w`` with every matmul (forward and both gradients) on block-quantized operands.

    Args:
        x: activations of shape ``(..., K)``; the leading axes are flattened into ``M``
            (the weight gradient's contracting axis).
        w: a ``(K, N)`` weight.
        recipe: formats and blocks: a :class:`~jax_scaled.formats.BlockRecipe`
            (:data:`MXFP8`, :data:`FP8_BLOCK128`, ...) or a
            :class:`~jax_scaled.formats.BlockFormat` ``F`` (``F`` everywhere); anything else
            is refused with a ``TypeError`` naming the presets. ``K``, ``N`` and ``M`` must be
            multiples of the blocks along them.

    Returns:
        ``x @ w`` of shape ``(..., N)``, in ``x``'s dtype. Gradients (reverse mode) in ``x``'s
        and ``w``'s dtypes.

    Example:
        >>> x, w = jnp.ones((32, 64)), jnp.full((64, 32), 0.5)
        >>> float(block_linear(x, w, MXFP8)[0, 0]), jax.grad(
        ...     lambda w: block_linear(x, w, MXFP8).sum())(w)[0, 0].item()
        (32.0, 32.0)
    """
    recipe = as_recipe(recipe, "block_linear(x, w, recipe)")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"block_linear needs x (..., K) and w (K, N); got {x.shape}, {w.shape}")
    untiled = untiled_axes(x.shape, w.shape, recipe)
    if untiled:
        raise ValueError(f"block_linear: the blocks of the recipe do not tile {untiled}.")
    rows = x.reshape(-1, x.shape[-1])
    return _block_matmul(rows, w, recipe).reshape(*x.shape[:-1], w.shape[1])


def untiled_axes(x_shape: tuple, w_shape: tuple, recipe: BlockRecipe | BlockFormat) -> str:
    """The axes of ``x (..., K) @ w (K, N)`` that ``recipe``'s blocks do not tile, described
    (empty if they all are). ``recipe`` as in :func:`block_linear`.

    Example:
        >>> untiled_axes((4, 64, 96), (96, 128), FP8_BLOCK128)
        'K = 96 (a multiple of 128)'
        >>> untiled_axes((64, 96), (96, 64), MXFP8)
        ''
        >>> untiled_axes((64, 96), (96, 64), js.formats.MXFP8_E4M3)
        ''
    """
    recipe = as_recipe(recipe, "untiled_axes(x_shape, w_shape, recipe)")
    (wk, wn), xb, gb = recipe.w_block, recipe.x.block_size, recipe.grad.block_size
    m, (k, n) = int(np.prod(x_shape[:-1])), w_shape
    needs = {
        "K": (k, np.lcm(xb, wk)),
        "N": (n, np.lcm(gb, wn)),
        "M (the flattened batch)": (m, np.lcm(xb, gb)),
    }
    return ", ".join(
        f"{axis} = {size} (a multiple of {need})"
        for axis, (size, need) in needs.items()
        if size % need
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _block_matmul(x: jax.Array, w: jax.Array, recipe: BlockRecipe) -> jax.Array:
    return _forward(x, w, recipe)[0]


def _forward(x: jax.Array, w: jax.Array, recipe: BlockRecipe) -> tuple:
    xq = _quantize(x, recipe.x, (1, recipe.x.block_size))
    wq = _quantize(w, recipe.w, recipe.w_block)
    return _contract(xq, wq, ((1,), (0,)), x.dtype), (x, w)


def _backward(recipe: BlockRecipe, residuals: tuple, g: jax.Array) -> tuple:
    x, w = residuals
    g_rows = _quantize(g, recipe.grad, (1, recipe.grad.block_size))  # blocks along N
    w_t = _quantize(w, recipe.w, recipe.w_block[::-1])  # again, from w: along N
    dx = _contract(g_rows, w_t, ((1,), (1,)), x.dtype)
    x_cols = _quantize(x, recipe.x, (recipe.x.block_size, 1))  # from x: along M
    g_cols = _quantize(g, recipe.grad, (recipe.grad.block_size, 1))
    dw = _contract(x_cols, g_cols, ((0,), (0,)), w.dtype)
    return dx, dw


_block_matmul.defvjp(_forward, _backward)


def _quantize(value: jax.Array, fmt: BlockFormat, blocks: tuple[int, int]) -> Any:
    """``value`` in ``fmt``'s elements, scale dtype and rounding, in blocks of ``blocks``."""
    return quantize(
        value, fmt.element_dtype, block_shape=blocks, scale_rounding=fmt.scale_rounding,
        scale_dtype=fmt.scale_dtype,
    )  # fmt: skip


def _contract(a: Any, b: Any, contracting: tuple, dtype: DTypeLike) -> jax.Array:
    """The product of two quantized operands, accumulated in float32, returned as ``dtype``:
    on their narrow data under scalify (block-scaled ScaledArrays there), dequantized outside.
    The product leaves scalify with one scale per tensor (:func:`merge_blocks`): a per-row
    output (block-128 with one block along the contracting axis) would otherwise carry its
    row scales into every following operation."""
    if isinstance(a, ScaledArray):  # outside scalify: the exact values of the quantized data
        a, b = a.to_array(F32), b.to_array(F32)
    dims = (contracting, ((), ()))
    return merge_blocks(lax.dot_general(a, b, dims, preferred_element_type=F32)).astype(dtype)


__all__ = [
    "FP8_BLOCK128",
    "MXFP4_WEIGHTS",
    "MXFP8",
    "MXFP8_E4M3_GRADS",
    "BlockRecipe",
    "block_linear",
    "untiled_axes",
]
