"""A contraction with its operands cast on the forward pass and its cotangent on the backward.

This is the FP8 matmul of the scalify paper's Appendix A, for any ``dot_general`` (any
dimension numbers) and any ``conv_general_dilated``. :func:`jax_scaled.nn.linear` and
:func:`jax_scaled.dot_policy.dot_formats` are built on :func:`cast_contraction`.

* **Forward**: ``lhs`` and ``rhs`` are cast to their formats and the contraction takes the
  casts as operands directly (an FP8 GEMM on hardware that has one), accumulating in
  ``CastFormats.accumulation``; the result is returned in ``CastFormats.output``.
* **Backward**: the output cotangent is cast to ``CastFormats.grad`` and multiplies the cast
  forward operands (the residuals), so both backward contractions take narrow operands too.
  They are JAX's own transposes of the contraction (a dot_general for a dot_general; for a
  convolution, a convolution with swapped specs, a reversed kernel and new padding), traced
  once on the shapes in the accumulation dtype and replayed on the cast values. Gradients
  are returned in ``CastFormats.lhs_grad`` / ``rhs_grad``. The casts are straight-through.
  A convolution takes one operand dtype, so against an FP8 operand of another format its
  cotangent is cast to that operand's format instead (:func:`cotangent_format`): E4M3 x E4M3
  for the default recipe, an FP8 kernel where mixed formats would be widened to float32.

**Scaling.** With ``scaling="none"`` a cast quantises the values as they are: anything below
the format's smallest subnormal flushes to zero, anything above its largest overflows (this is
:func:`~jax_scaled.nn.linear`). With ``scaling="current"`` each operand (and the cotangent) is
first divided by a power of two derived from its absolute maximum (:func:`current_scale`), so
it fits the format, and the result is multiplied back by the scales: an FP8 simulation for
plain JAX programs (formats with float32's range, such as bfloat16, are cast unscaled). Under
:func:`jax_scaled.scalify` a ScaledArray operand is not rescaled (:func:`current_scale` is 1
for it: its scale already keeps its data in range) and every cast acts on its data, the scale
being kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine.registry import Property, record
from jax_scaled.engine.tracing import bind_eqn, evaluate_jaxpr
from jax_scaled.pow2.static import static_pow2_exponent, static_pow2_round
from jax_scaled.pow2.traced import pow2_exponent, pow2_from_exponent

F32 = jnp.dtype(jnp.float32)
SCALINGS = ("none", "current")


class Contraction(NamedTuple):
    """A ``dot_general`` or ``conv_general_dilated`` with its parameters, but for
    ``preferred_element_type`` (hashable: a static argument of :func:`cast_contraction`)."""

    primitive: jxi.Primitive
    params: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, primitive: jxi.Primitive, params: dict[str, Any]) -> Contraction:
        """The contraction ``primitive.bind(lhs, rhs, **params)`` (an equation's, say)."""
        kept = {k: v for k, v in params.items() if k != "preferred_element_type"}
        return cls(primitive, tuple(sorted(kept.items())))

    @classmethod
    def dot_general(cls, dimension_numbers: Any) -> Contraction:
        """``lax.dot_general(lhs, rhs, dimension_numbers)``."""
        dims = jax.tree.map(int, dimension_numbers)
        params = {"dimension_numbers": dims, "precision": None, "out_sharding": None}
        return cls.of(lax.dot_general_p, params)

    def __call__(self, lhs: jax.Array, rhs: jax.Array, accumulation: DTypeLike) -> jax.Array:
        """The contraction of ``lhs`` and ``rhs``, accumulated in and returning ``accumulation``."""
        lhs, rhs = _common_operands(self.primitive, lhs, rhs)
        params = dict(self.params, preferred_element_type=jnp.dtype(accumulation))
        return self.primitive.bind(lhs, rhs, **params)


class CastFormats(NamedTuple):
    """The static dtypes of one :func:`cast_contraction` (hashable).

    ``lhs``/``rhs``: forward formats of the operands, ``grad``: backward format of the output
    cotangent (None: no cast). ``lhs_grad``/``rhs_grad``: dtypes of the returned gradients.
    ``accumulation``: accumulation dtype of the forward contraction; ``output``: dtype of its
    result. ``scaling``: ``"none"`` or ``"current"`` (see the module notes).
    """

    lhs: jnp.dtype | None
    rhs: jnp.dtype | None
    grad: jnp.dtype | None
    lhs_grad: jnp.dtype
    rhs_grad: jnp.dtype
    accumulation: jnp.dtype
    output: jnp.dtype
    scaling: str = "none"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cast_contraction(
    lhs: jax.Array, rhs: jax.Array, contraction: Contraction, formats: CastFormats
) -> jax.Array:
    """``contraction(lhs, rhs)`` with narrow operands forward and a narrow cotangent backward.

    Args:
        lhs: the left operand.
        rhs: the right operand.
        contraction: which contraction (:class:`Contraction`).
        formats: the casts, accumulation and result dtypes (:class:`CastFormats`).

    Returns:
        The contraction of the cast operands, in ``formats.output``. Its gradients (reverse
        mode only) come from the cotangent cast to ``formats.grad`` and the cast operands.

    Example:
        >>> from jax_scaled.nn.cast_contraction import CastFormats, Contraction, cast_contraction
        >>> e4m3, f32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)
        >>> formats = CastFormats(e4m3, e4m3, None, f32, f32, f32, f32, "current")
        >>> x = jnp.full((2, 3), 2.0**-20)  # flushes to zero in raw FP8
        >>> y = cast_contraction(x, x.T, Contraction.dot_general((((1,), (0,)), ((), ()))), formats)
        >>> float(y[0, 0]) * 2**40
        3.0
    """
    return _forward(lhs, rhs, contraction, formats)[0]


def _forward(lhs, rhs, contraction: Contraction, formats: CastFormats) -> tuple:
    lhs_q, lhs_scale = _quantize(lhs, formats.lhs, formats.scaling)
    rhs_q, rhs_scale = _quantize(rhs, formats.rhs, formats.scaling)
    out = unscale(
        contraction(lhs_q, rhs_q, formats.accumulation), (lhs_scale, rhs_scale), formats.output
    )
    return out, (lhs_q, rhs_q, lhs_scale, rhs_scale)


def _backward(contraction: Contraction, formats: CastFormats, residuals, cotangent) -> tuple:
    def quantize(dtype: jnp.dtype | None) -> tuple:
        return _quantize(cotangent, dtype, formats.scaling)

    return backward_contractions(contraction, formats, residuals, quantize)


def backward_contractions(
    contraction: Contraction, formats: CastFormats, residuals: tuple, quantize: Callable
) -> tuple:
    """``(d_lhs, d_rhs)`` from the cast operands and scales ``residuals`` and the cotangent,
    ``quantize(dtype)`` giving it cast to ``dtype`` with its scale (None: not rescaled)."""
    lhs_q, rhs_q, lhs_scale, rhs_scale = residuals
    quantized = {}  # the cotangent per format: a convolution may need it in two

    def cotangent_against(other: jax.Array) -> tuple:
        dtype = cotangent_format(contraction.primitive, formats.grad, other.dtype)
        if dtype not in quantized:
            quantized[dtype] = quantize(dtype)
        return quantized[dtype]

    shapes = (tuple(lhs_q.shape), tuple(rhs_q.shape))
    lhs_accumulation = accumulation_dtype(formats.lhs_grad, formats.scaling)
    rhs_accumulation = accumulation_dtype(formats.rhs_grad, formats.scaling)
    g, g_scale = cotangent_against(rhs_q)
    d_lhs = _transpose(contraction, 0, shapes, lhs_accumulation, rhs_q, g)
    d_lhs = unscale(d_lhs, (g_scale, rhs_scale), formats.lhs_grad)
    g, g_scale = cotangent_against(lhs_q)
    d_rhs = _transpose(contraction, 1, shapes, rhs_accumulation, lhs_q, g)
    return d_lhs, unscale(d_rhs, (lhs_scale, g_scale), formats.rhs_grad)


cast_contraction.defvjp(_forward, _backward)


# ---------------------------------------------------------------------------------------
# Casts and current scaling
# ---------------------------------------------------------------------------------------


@functools.partial(custom_scale, static_argnums=(1,))
def current_scale(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The smallest power of two ``2^k`` with ``max|x| / 2^k`` within ``dtype``'s finite range.

    Exact (computed on the bits of ``max|x|``), as float32 in ``[2^-126, 2^127]``. Under
    scalify, for a ScaledArray ``x`` it is 1: the scale of ``x`` already keeps its data in
    range (and the range guard of narrowing casts moves any excess into the scale).

    Args:
        x: a floating-point array.
        dtype: the format ``x / 2^k`` must fit, e.g. ``jnp.float8_e4m3fn`` (largest: 448).

    Returns:
        ``2^k``, a float32 scalar.

    Example:
        >>> from jax_scaled.nn.cast_contraction import current_scale
        >>> e4m3 = jnp.dtype(jnp.float8_e4m3fn)
        >>> [float(current_scale(jnp.array([v]), e4m3)) for v in (448.0, 449.0, 2.0**20)]
        [1.0, 2.0, 4096.0]
    """
    return fitting_scale(lax.convert_element_type(jnp.max(jnp.abs(x)), F32), dtype)


def fitting_scale(amax: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The smallest power of two ``2^k`` with ``amax / 2^k`` within ``dtype``'s finite range
    (:func:`current_scale` of a value whose largest magnitude is the float32 ``amax``).

    Example:
        >>> from jax_scaled.nn.cast_contraction import fitting_scale
        >>> float(fitting_scale(jnp.float32(449.0), jnp.dtype(jnp.float8_e4m3fn)))
        2.0
    """
    largest = float(ml_dtypes.finfo(dtype).max)  # = m * 2^top, m in [1, 2)
    top = static_pow2_exponent(static_pow2_round(largest))
    exponent = pow2_exponent(amax) - np.int32(top)  # amax / 2^exponent in [2^top, 2^(top+1))
    too_large = amax > np.float32(largest) * pow2_from_exponent(exponent)
    return pow2_from_exponent(exponent + too_large.astype(jnp.int32))


@current_scale.defscale
def _scaled_data_needs_no_scale(x: Any, dtype: jnp.dtype) -> np.ndarray:
    return np.ones((), np.float32)


def _quantize(x: jax.Array, dtype: jnp.dtype | None, scaling: str) -> tuple:
    """``(x cast to dtype, its scale)``; the scale is None when ``x`` is not rescaled."""
    if dtype is None:
        return x, None
    if scaling == "none" or has_float32_range(dtype):
        return x.astype(dtype), None
    scale = current_scale(x, dtype)
    return (x.astype(compute_dtype(x.dtype)) / scale).astype(dtype), scale


def has_float32_range(dtype: jnp.dtype) -> bool:
    """True for bfloat16 (or wider): nothing to rescale, and a cast to the top of its range
    would overflow a float32 accumulator."""
    return ml_dtypes.finfo(dtype).maxexp >= ml_dtypes.finfo(F32).maxexp


def unscale(y: jax.Array, scales: tuple, dtype: jnp.dtype) -> jax.Array:
    """``y`` times each scale (one at a time: no underflow of their product), as ``dtype``."""
    for scale in scales:
        if scale is not None:
            y = y.astype(compute_dtype(y.dtype)) * scale
    return y.astype(dtype)


def cotangent_format(
    primitive: jxi.Primitive, grad: jnp.dtype | None, other: DTypeLike
) -> jnp.dtype | None:
    """The format a backward contraction takes the cotangent in, ``other`` being its other
    operand's dtype: ``grad``, but for a convolution against an 8-bit operand of another
    format. JAX's convolution takes one operand dtype, so there the cotangent is cast to
    ``other`` (E4M3 against an E4M3 kernel): the kernel stays FP8, where widening both to
    float32 would not (and casting the residual to ``grad`` would round it again).

    Example:
        >>> from jax_scaled.nn.cast_contraction import cotangent_format
        >>> e4m3, e5m2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
        >>> cotangent_format(lax.conv_general_dilated_p, e5m2, e4m3)
        dtype(float8_e4m3fn)
        >>> cotangent_format(lax.dot_general_p, e5m2, e4m3)  # dot_general mixes formats
        dtype(float8_e5m2)
    """
    other = jnp.dtype(other)
    narrow_other = jnp.issubdtype(other, jnp.floating) and other.itemsize == 1
    if primitive is lax.conv_general_dilated_p and grad is not None and narrow_other:
        return other
    return grad


def _common_operands(primitive: jxi.Primitive, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """Operands the primitive accepts: a convolution needs equal dtypes (dot_general does not),
    so different ones (an E5M2 cotangent, an E4M3 kernel) are both widened to float32, exactly."""
    if primitive is lax.conv_general_dilated_p and lhs.dtype != rhs.dtype:
        wide = jnp.promote_types(compute_dtype(lhs.dtype), compute_dtype(rhs.dtype))
        return lhs.astype(wide), rhs.astype(wide)
    return lhs, rhs


def _wide(dtype: DTypeLike) -> jnp.dtype:
    """``dtype``, or float32 for an 8-bit (or narrower) float: never a useful accumulator."""
    dtype = jnp.dtype(dtype)
    return F32 if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1 else dtype


def accumulation_dtype(result: DTypeLike, scaling: str) -> jnp.dtype:
    """The accumulation dtype of a contraction (forward, or a gradient's) returned as ``result``.

    ``result`` itself, float32 for an 8-bit format; at least float32 with current scaling,
    whose rescaled operands fill the narrow format's range (float16 could not hold products).

    Args:
        result: the dtype the contraction's result is returned in.
        scaling: ``"none"``, ``"current"`` or ``"delayed"``.

    Returns:
        The dtype to pass as the contraction's ``preferred_element_type``.

    Example:
        >>> from jax_scaled.nn.cast_contraction import accumulation_dtype
        >>> [str(accumulation_dtype(d, "none")) for d in (jnp.bfloat16, jnp.float8_e5m2)]
        ['bfloat16', 'float32']
        >>> str(accumulation_dtype(jnp.float16, "current"))
        'float32'
    """
    if scaling != "none":  # current or delayed: rescaled operands
        return compute_dtype(result)
    return _wide(result)


# ---------------------------------------------------------------------------------------
# Backward contractions: JAX's transposes, traced on shapes, replayed on the cast values
# ---------------------------------------------------------------------------------------

# What a traced transpose may contain besides the contraction: layout only (records with
# the LAYOUT property), no arithmetic and no dtype-specific constant, so that it replays
# unchanged on operands of any dtype.


def _transpose(
    contraction: Contraction, wrt: int, shapes: tuple, accumulation: jnp.dtype, other, g
) -> jax.Array:
    """The gradient of operand ``wrt`` (0: lhs, 1: rhs) for the cotangent ``g``, ``other``
    being the other (cast) operand; accumulated in and returned as ``accumulation``."""
    other, g = _common_operands(contraction.primitive, other, g)
    jaxpr = _transpose_jaxpr(contraction, wrt, shapes, accumulation)
    return _replay(jaxpr, other, g)


@functools.lru_cache(maxsize=512)
def _transpose_jaxpr(
    contraction: Contraction, wrt: int, shapes: tuple, accumulation: jnp.dtype
) -> jxi.ClosedJaxpr:
    """``(other, g) -> gradient of operand wrt``, as JAX transposes the contraction, traced
    with every value in ``accumulation``: the transposed contraction accumulates in it."""
    lhs, rhs = (jax.ShapeDtypeStruct(s, accumulation) for s in shapes)
    out = jax.eval_shape(lambda a, b: contraction(a, b, accumulation), lhs, rhs)

    def transposed(other: jax.Array, g: jax.Array) -> jax.Array:
        if wrt == 0:
            return jax.linear_transpose(lambda a: contraction(a, other, accumulation), lhs)(g)[0]
        return jax.linear_transpose(lambda b: contraction(other, b, accumulation), rhs)(g)[0]

    closed = jax.make_jaxpr(transposed)(rhs if wrt == 0 else lhs, out)
    unexpected = {
        e.primitive.name
        for e in closed.jaxpr.eqns
        if e.primitive is not contraction.primitive and not record(e.primitive).has(Property.LAYOUT)
    }
    if unexpected or closed.consts:
        raise NotImplementedError(
            f"the transpose of {contraction.primitive.name} contains {sorted(unexpected)}: it "
            "cannot be replayed on cast operands (jax_scaled supports this JAX's transposes)."
        )
    return closed


def _replay(closed: jxi.ClosedJaxpr, *args: jax.Array) -> jax.Array:
    """Evaluate a traced transpose on values of other dtypes (no type check of values)."""
    (result,) = evaluate_jaxpr(closed.jaxpr, closed.consts, args, bind_eqn)
    return result
