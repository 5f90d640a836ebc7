"""The general (FP8-aware) linear layer of the scalify paper, Appendix A.

An FP8 matrix multiplication differs from a 16- or 32-bit one in two ways: its two inputs
may have different formats (E4M3 activations and weights, E5M2 gradients), and it
accumulates and returns a wider format than its inputs. :func:`linear` exposes exactly these
choices, independently of any scaling:

* ``x_dtype`` / ``w_dtype``: formats ``x`` and ``w`` are cast to on the forward pass
  (``cast_on_forward``; their gradients come back in their original dtypes);
* ``grad_dtype``: format the output cotangent is cast to on the backward pass
  (``cast_on_backward``; the forward pass is untouched);
* ``preferred_element_type``: accumulation and output format of the matmul.

Without scalify the casts quantise the *values*: anything below the format's smallest
subnormal (2^-9 for E4M3, 2^-16 for E5M2) flushes to zero and anything above its largest
(448, 57344) overflows (NaN for E4M3). Under :func:`jax_scaled.scalify`, ``x`` and ``w``
are ScaledArrays and only their *data* is cast, which the scale rules keep near unit scale:
the same layer then stays accurate at any magnitude.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.ops.casts import cast_on_backward, cast_on_forward

DTypeLike = Any


def linear(
    x: jax.Array,
    w: jax.Array,
    b: jax.Array | None = None,
    *,
    x_dtype: DTypeLike | None = None,
    w_dtype: DTypeLike | None = None,
    grad_dtype: DTypeLike | None = None,
    preferred_element_type: DTypeLike | None = None,
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

    Backward: the cotangent of the matmul output is cast to ``grad_dtype`` (if given)
    before it reaches the two backward matmuls; the bias gradient is reduced from the
    uncast cotangent. The gradients of ``x`` and ``w`` come back in their own dtypes; JAX
    rounds each one through ``x_dtype`` / ``w_dtype`` on the way (the dtype of the
    operand it is the gradient of), so keep these dtypes wide enough for the gradients'
    magnitudes, which scalify does by keeping data near unit scale.

    Accumulation (``preferred_element_type``): the matmul accumulates in, and returns,
    this dtype. The default is the promoted dtype of ``x`` and ``w`` *before* their casts
    (float32 in, float32 out: a drop-in replacement for ``x @ w``), or float32 when ``x``
    or ``w`` is itself an 8-bit float, which is never a useful accumulator.

    With all four dtypes left as None, the layer is exactly ``x @ w + b``.

    Under :func:`jax_scaled.scalify`, with ScaledArray ``x`` and ``w``, each cast applies
    to the data only (the scale is kept), so FP8 operands stay within the format's range
    whatever the magnitudes; the matmul's output scale follows the dot_general rule.

    Args:
        x: input activations, shape ``(..., K)``.
        w: weights, shape ``(K, ...)``.
        b: optional bias, broadcastable to the output.
        x_dtype: forward-pass format of ``x`` (e.g. ``jnp.float8_e4m3fn``); None: no cast.
        w_dtype: forward-pass format of ``w``; None: no cast.
        grad_dtype: backward-pass format of the output cotangent (e.g.
            ``jnp.float8_e5m2``); None: no cast.
        preferred_element_type: accumulation and output dtype of the matmul (see above).

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
    """
    accumulation = _accumulation_dtype(x, w, preferred_element_type)
    if x_dtype is not None:
        x = cast_on_forward(x, x_dtype)
    if w_dtype is not None:
        w = cast_on_forward(w, w_dtype)
    contraction = (((x.ndim - 1,), (0,)), ((), ()))
    y = lax.dot_general(x, w, contraction, preferred_element_type=accumulation)
    if grad_dtype is not None:
        y = cast_on_backward(y, grad_dtype)
    return y if b is None else y + b


def _accumulation_dtype(x: jax.Array, w: jax.Array, preferred: DTypeLike | None) -> jnp.dtype:
    """The matmul's accumulation dtype: ``preferred``, else that of the uncast inputs."""
    if preferred is not None:
        return jnp.dtype(preferred)
    if _is_8bit_float(x.dtype) or _is_8bit_float(w.dtype):
        return jnp.dtype(jnp.float32)
    return jnp.result_type(x.dtype, w.dtype)


def _is_8bit_float(dtype: DTypeLike) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits <= 8
