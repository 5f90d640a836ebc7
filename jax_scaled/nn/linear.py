"""The general (FP8-aware) linear layer of the scalify paper, Appendix A.

An FP8 matrix multiplication differs from a 16- or 32-bit one in two ways: its two inputs
may have different formats (E4M3 activations and weights, E5M2 gradients), and it
accumulates and returns a wider format than its inputs. :func:`linear` exposes exactly these
choices, independently of any scaling:

* ``x_dtype`` / ``w_dtype``: formats ``x`` and ``w`` are cast to on the forward pass
  (``cast_on_forward``; their gradients come back in their original dtypes);
* ``grad_dtype``: format the output cotangent is cast to on the backward pass, where it is
  an operand of both backward matmuls (the forward pass is untouched); ``grad_rounding``
  chooses round-to-nearest or unbiased stochastic rounding (with ``key``) for this cast;
* ``wgrad_dtype``: format of the weight gradient the backward matmul returns;
* ``preferred_element_type``: accumulation and output format of the forward matmul.

Without scalify the casts quantise the *values*: anything below the format's smallest
subnormal (2^-9 for E4M3, 2^-16 for E5M2) flushes to zero and anything above its largest
(448, 57344) overflows (NaN for E4M3). Under :func:`jax_scaled.scalify`, ``x`` and ``w``
are ScaledArrays and only their *data* is cast, which the scale rules keep near unit scale:
the same layer then stays accurate at any magnitude.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jax_scaled.formats import BlockFormat, BlockRecipe, as_recipe
from jax_scaled.nn.block_linear import block_linear
from jax_scaled.nn.cast_contraction import CastFormats, Contraction, cast_contraction
from jax_scaled.ops.casts import reduce_precision_on_backward
from jax_scaled.ops.stochastic import RoundingMode, check_rounding


def linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    x_dtype: DTypeLike | None = None,
    w_dtype: DTypeLike | None = None,
    grad_dtype: DTypeLike | None = None,
    wgrad_dtype: DTypeLike | None = None,
    preferred_element_type: DTypeLike | None = None,
    grad_rounding: RoundingMode = "nearest",
    key: jax.Array | None = None,
    block: BlockRecipe | BlockFormat | int | None = None,
) -> jax.Array:
    """``x @ w + b`` with the formats of an FP8 matmul chosen independently.

    The contraction runs over the last axis of ``x`` and the first axis of ``w``: ``x`` of
    shape ``(..., K)`` and ``w`` of shape ``(K, ...)`` give an output of shape
    ``x.shape[:-1] + w.shape[1:]``; ``b`` (optional) broadcasts against it.

    Forward: ``x`` is cast to ``x_dtype`` and ``w`` to ``w_dtype`` (if given), and the
    matmul takes these casts as operands directly: with FP8 dtypes it is an FP8 matmul
    (on NVIDIA Hopper, XLA compiles it to the cuBLASLt FP8 GEMM; XLA CPU upcasts the
    operands to float32 and is exact for them). The bias is added after the matmul, in
    the output dtype.

    Backward, as FP8 training recipes do it: the output cotangent is cast to ``grad_dtype``
    (if given) and multiplies the *cast* operands of the forward pass, so both backward
    matmuls are FP8 matmuls too. The input gradient is accumulated in float32 and returned
    in ``x``'s dtype; the weight gradient is returned in ``wgrad_dtype`` (default: ``w``'s
    dtype; an 8-bit format halves its memory at the cost of its precision). The casts are
    straight-through: no further rounding of the gradients. The bias gradient is reduced
    from the uncast cotangent. With ``grad_rounding="stochastic"`` the cotangent's cast
    rounds stochastically (unbiased, :mod:`jax_scaled.ops.stochastic`) with ``key``:
    small gradient components then survive E5M2 on average instead of rounding away.
    Split the key for every layer and step.

    Accumulation (``preferred_element_type``): the forward matmul accumulates in, and
    returns, this dtype. The default is the promoted dtype of ``x`` and ``w`` *before*
    their casts (float32 in, float32 out: a drop-in replacement for ``x @ w``), or float32
    when ``x`` or ``w`` is itself an 8-bit float, which is never a useful accumulator.
    With all five dtypes left as None, the layer is exactly ``x @ w + b``.

    Under :func:`jax_scaled.scalify`, with ScaledArray ``x`` and ``w``, each cast applies
    to the data only (the scale is kept, unless the range guard of
    :class:`~jax_scaled.ScalifyConfig` moves a power of two into it), so FP8 operands
    stay within the format's range whatever the magnitudes; the matmuls' output scales
    follow the dot_general rule.

    Args:
        x: input activations, shape ``(..., K)``.
        w: weights, shape ``(K, ...)``.
        b: optional bias, broadcastable to the output.
        x_dtype: forward-pass format of ``x`` (e.g. ``jnp.float8_e4m3fn``); None: no cast.
        w_dtype: forward-pass format of ``w``; None: no cast.
        grad_dtype: backward-pass format of the output cotangent (e.g.
            ``jnp.float8_e5m2``); None: no cast.
        wgrad_dtype: format of the weight gradient; None: ``w``'s dtype.
        preferred_element_type: accumulation and output dtype of the matmul (see above).
        grad_rounding: rounding of the cotangent's cast to ``grad_dtype``: ``"nearest"``
            (round to nearest even) or ``"stochastic"`` (unbiased; needs ``key`` and
            ``grad_dtype``).
        key: PRNG key of the stochastic gradient rounding (``jax.random.key``); unused by
            ``"nearest"``.
        block: block scales instead of casts (:mod:`jax_scaled.nn.block_linear`): a recipe
            (:class:`~jax_scaled.formats.BlockRecipe`: ``js.nn.MXFP8``,
            ``js.nn.MXFP8_E4M3_GRADS``, ``js.nn.MXFP4_WEIGHTS``, ``js.nn.FP8_BLOCK128``) or a
            format ``F`` meaning ``F`` everywhere (:class:`~jax_scaled.formats.BlockFormat`:
            ``js.formats.MXFP8_E4M3``); then leave the three dtypes unset. Or a block size
            (MX blocks of that many elements along every matmul's contracting axis, E8M0
            scales, "floor" scale rounding, formats ``x_dtype``, ``w_dtype``,
            ``grad_dtype``, all three needed). ``w`` must be 2-D; ``wgrad_dtype``,
            ``preferred_element_type`` and stochastic rounding do not apply.

    Returns:
        The output array, of dtype ``preferred_element_type`` (promoted with ``b``'s).

    Example:
        >>> from jax_scaled.nn.linear import linear
        >>> x, w = jnp.ones((2, 32)) * 2.0**-20, jnp.ones((32, 4))
        >>> fp8 = dict(x_dtype=jnp.float8_e4m3fn, w_dtype=jnp.float8_e4m3fn)
        >>> float(linear(x, w, **fp8)[0, 0])  # raw FP8: 2^-20 flushes to zero
        0.0
        >>> y = js.scalify(lambda x, w: linear(x, w, **fp8))(*js.as_scaled_array((x, w)))
        >>> float(js.asarray(y)[0, 0]) * 2**20  # scaled FP8 data: exact
        32.0
        >>> sr = dict(grad_dtype=jnp.float8_e5m2, grad_rounding="stochastic", key=jax.random.key(0))
        >>> loss = lambda x: jnp.sum(linear(x, jnp.ones((1, 1)), **sr) * 0.3)  # cotangent 0.3
        >>> jax.grad(loss)(jnp.ones((4, 1))).ravel()  # E5M2 neighbours 0.25, 0.3125; mean 0.3
        Array([0.25  , 0.25  , 0.3125, 0.3125], dtype=float32)
        >>> x, w = jnp.full((32, 32), 3.0), jnp.full((32, 32), 0.5)
        >>> float(linear(x, w, block=js.formats.MXFP8_E4M3)[0, 0])  # block-scaled E4M3
        48.0
    """
    if block is not None:
        recipe = _block_recipe(block, x_dtype, w_dtype, grad_dtype)
        if wgrad_dtype or preferred_element_type or grad_rounding != "nearest":
            raise ValueError(
                "linear(block=...): wgrad_dtype, preferred_element_type and stochastic "
                "rounding do not apply to block-scaled matmuls; leave them unset."
            )
        y = block_linear(x, w, recipe)
        return y if b is None else y + b
    stochastic = check_rounding(grad_rounding, key)
    formats = _Formats(
        x=jnp.dtype(x.dtype),
        w=jnp.dtype(w.dtype),
        x_cast=_dtype_or_none(x_dtype),
        w_cast=_dtype_or_none(w_dtype),
        grad=_dtype_or_none(grad_dtype),
        wgrad=_dtype_or_none(wgrad_dtype) or jnp.dtype(w.dtype),
        accumulation=_accumulation_dtype(x, w, preferred_element_type),
    )
    if stochastic and formats.grad is None:
        raise ValueError("grad_rounding='stochastic' rounds the cast to grad_dtype: set it.")
    if formats.x_cast is formats.w_cast is formats.grad is None and formats.wgrad == formats.w:
        y = lax.dot_general(x, w, _forward_dims(x, w), preferred_element_type=formats.accumulation)
    else:
        y = _cast_matmul(x, w, formats)
    if stochastic:  # the cotangent takes grad_dtype's values here; its cast is then exact
        y = reduce_precision_on_backward(y, formats.grad, rounding="stochastic", key=key)
    return y if b is None else y + b


def _block_recipe(block: BlockRecipe | BlockFormat | int, *dtypes: DTypeLike | None) -> BlockRecipe:
    """The recipe of ``linear(block=...)``: a recipe as given, a format everywhere, or MX
    blocks of ``block`` elements in the three formats."""
    given = [d is not None for d in dtypes]
    if isinstance(block, numbers.Integral) and not isinstance(block, bool):
        if not all(given):
            raise ValueError(f"linear(block={block!r}) needs x_dtype, w_dtype and grad_dtype.")
        x, w, grad = (BlockFormat(f"{jnp.dtype(d).name}/{block}", d, int(block)) for d in dtypes)
        return BlockRecipe(x, w, grad)
    recipe = as_recipe(
        block, "linear(block=...)", also=", or a block size with x_dtype, w_dtype and grad_dtype"
    )
    if any(given):
        raise ValueError("linear(block=recipe) takes its formats from the recipe: leave "
                         "x_dtype, w_dtype and grad_dtype unset.")  # fmt: skip
    return recipe


class _Formats(NamedTuple):
    """The static dtypes of one :func:`linear` call (hashable: a custom_vjp static arg)."""

    x: jnp.dtype
    w: jnp.dtype
    x_cast: jnp.dtype | None
    w_cast: jnp.dtype | None
    grad: jnp.dtype | None
    wgrad: jnp.dtype
    accumulation: jnp.dtype


def _dtype_or_none(dtype: DTypeLike | None) -> jnp.dtype | None:
    return None if dtype is None else jnp.dtype(dtype)


def _forward_dims(x: jax.Array, w: jax.Array) -> tuple:
    """``x[..., K] @ w[K, ...]``."""
    return (((x.ndim - 1,), (0,)), ((), ()))


def _cast_matmul(x: jax.Array, w: jax.Array, formats: _Formats) -> jax.Array:
    """The cast matmul (a custom VJP) of :mod:`jax_scaled.nn.cast_contraction`, over ``x``'s
    last axis and ``w``'s first."""
    cast_formats = CastFormats(
        lhs=formats.x_cast,
        rhs=formats.w_cast,
        grad=formats.grad,
        lhs_grad=formats.x,
        rhs_grad=formats.wgrad,
        accumulation=formats.accumulation,
        output=formats.accumulation,
    )
    return cast_contraction(x, w, Contraction.dot_general(_forward_dims(x, w)), cast_formats)


def _accumulation_dtype(x: jax.Array, w: jax.Array, preferred: DTypeLike | None) -> jnp.dtype:
    """The matmul's accumulation dtype: ``preferred``, else that of the uncast inputs."""
    if preferred is not None:
        return jnp.dtype(preferred)
    if _is_8bit_float(x.dtype) or _is_8bit_float(w.dtype):
        return jnp.dtype(jnp.float32)
    return jnp.result_type(x.dtype, w.dtype)


def _is_8bit_float(dtype: DTypeLike) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits <= 8
