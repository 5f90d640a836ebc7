"""Helpers that several rule modules share: the alignment of selections and the binding of
contractions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT, is_static
from jax_scaled.scales import (
    align,
    fitting_scale,
    max_scale,
    products_guarded,
    scale_f32,
    scale_reciprocal,
    times_scalar,
)

# ---------------------------------------------------------------------------------------
# Selections (select_n, max, min, clamp, concatenate)
# ---------------------------------------------------------------------------------------


def has_static_scale(x: Value) -> bool:
    """True for a trace-time constant promoted by the interpreter (its scale is numpy)."""
    return isinstance(x, ScaledArray) and is_static(x.scale)


def _headroom(dtype) -> float:
    """``2^H``, ``H`` half the binary exponent range above 1 of ``dtype`` (f32: 2^63, f16: 2^7)."""
    return 2.0 ** (int(math.log2(float(jnp.finfo(dtype).max))) // 2)


def _scale_free(x: Value, xs: tuple[Value, ...]) -> jax.Array | None:
    """Whether operand ``x`` of ``xs`` holds only zeros, infinities or NaNs (a bool traced at
    run time), or None where it need not be asked.

    Such a value is the same at any scale; the interpreter gives it the other operands'
    scale, or, where they have block scales, the largest block scale, which must not raise
    every block's (``relu``'s ``0.0``, a ``jnp.where`` fill). Asked of operands with a scale
    of their own: of one element (folded by XLA for a literal), or of any size for 8-bit
    data. A per-tensor program's fills share their scale object and cost nothing."""
    if not isinstance(x, ScaledArray) or has_static_scale(x) or x.size == 0:
        return None
    if any(y is not x and isinstance(y, ScaledArray) and y.scale is x.scale for y in xs):
        return None
    if x.size != 1 and not products_guarded(x.dtype):
        return None
    return jnp.all((x.data == 0) | ~lax.is_finite(x.data))


def align_selection(*xs: Value) -> tuple[list[jax.Array], jax.Array]:
    """Align the operands of a selection (select_n, max, min, concatenate): ``(datas, scale)``.

    The common scale is the largest scale of the traced operands. A trace-time constant (a
    mask fill such as ``finfo.min``, a clip bound) needs no unit-scale data, only to fit in
    the data format: it raises the scale to at most its own scale divided by the format's
    headroom (:func:`_headroom`), so a huge fill does not flush the other operands to zero.

    Example:
        >>> fill = ScaledArray(jnp.full(2, -1.5), np.float32(2.0**127))  # a promoted -2.6e38
        >>> x = ScaledArray(jnp.array([1.0, 2.0]), jnp.float32(1.0))
        >>> datas, scale = align_selection(fill, x)
        >>> float(scale), datas[1].tolist()
        (1.8446744073709552e+19, [5.421010862427522e-20, 1.0842021724855044e-19])

    Scale-free operands (:func:`_scale_free`) are left out of the common scale: a ``relu``
    of block-scaled data keeps every block's scale, exactly. 8-bit data sits at the top of
    its format: see :func:`_align_narrow`.
    """
    free = [_scale_free(x, xs) for x in xs]
    if all(f is None for f in free):
        return _align_with_constants(*xs)
    smallest = np.float32(2.0**MIN_SCALE_EXPONENT)
    kept = [
        x if f is None else ScaledArray(x.data, lax.select(f, smallest, scale_f32(x)))
        for x, f in zip(xs, free, strict=True)
    ]
    datas, scale = _align_with_constants(*kept)
    datas = [d if f is None else lax.select(f, x.data, d) for x, f, d in zip(xs, free, datas)]
    return datas, scale


def _align_with_constants(*xs: Value) -> tuple[list[jax.Array], jax.Array]:
    """:func:`align_selection` once scale-free operands are set aside."""
    if products_guarded(xs[0].dtype) and any(map(has_static_scale, xs)):
        return _align_narrow(*xs)
    if not any(has_static_scale(x) for x in xs) or all(has_static_scale(x) for x in xs):
        return align(*xs)
    traced = max_scale([scale_f32(x) for x in xs if not has_static_scale(x)])
    constants = [x for x in xs if has_static_scale(x)]
    floor = max(float(x.scale) / _headroom(x.dtype) for x in constants)
    floor = max(floor, 2.0**MIN_SCALE_EXPONENT)
    # Traced operands at scale 0 (zeros whose scale underflowed, such as a decayed moment
    # initialised at the smallest scale) hold no magnitude: the constants' own scale then.
    own = np.float32(max(float(x.scale) for x in constants))
    scale = lax.select(lax.gt(traced, np.float32(0)), lax.max(traced, np.float32(floor)), own)
    return align(*xs, scale=scale)


def _align_narrow(*xs: Value) -> tuple[list[jax.Array], jax.Array]:
    """:func:`align_selection` for 8-bit data mixed with constants: the largest traced scale,
    raised only as far as the constants need to fit below the top of the format
    (:func:`~jax_scaled.scales.guard.fitting_scale`); ``min(x, 6.0)`` of data far below 6
    keeps its scale. A format's few binades leave no room for the wider formats' headroom."""
    static = [has_static_scale(x) for x in xs]
    if all(static):
        return align(*xs)
    traced = max_scale([scale_f32(x) for x, s in zip(xs, static, strict=True) if not s])
    own = np.float32(max(float(x.scale) for x, s in zip(xs, static, strict=True) if s))
    scale = lax.select(lax.gt(traced, np.float32(0)), traced, own)  # see align_selection
    bound = times_scalar(np.float32(2 * own), scale_reciprocal(scale))  # |mantissa| < 2
    scale = fitting_scale(bound, scale, xs[0].dtype)
    return align(*xs, scale=scale)


# ---------------------------------------------------------------------------------------
# Contractions
# ---------------------------------------------------------------------------------------


def bind_contraction(primitive: jxi.Primitive, a: jax.Array, b: jax.Array, **params) -> jax.Array:
    """``primitive`` bound on ``a`` and ``b``; where ``precision`` names a dot algorithm
    (``lax.DotAlgorithmPreset``, such as the ``F16_F16_F32`` of ``jax.nn.dot_product_attention``
    and flax attention), XLA:CPU supports only a few: on CPU the operands are widened to
    float32 (exact for narrower floats) and contracted at default precision, which is at least
    as accurate, into the requested output dtype. Other platforms get the algorithm as asked.
    """
    if not isinstance(params.get("precision"), lax.DotAlgorithmPreset | lax.DotAlgorithm):
        return primitive.bind(a, b, **params)

    def widened(a: jax.Array, b: jax.Array) -> jax.Array:
        wide = {**params, "precision": None}
        if wide["preferred_element_type"] is None:
            wide["preferred_element_type"] = jnp.result_type(a.dtype, b.dtype)
        return primitive.bind(_widened(a), _widened(b), **wide)

    return lax.platform_dependent(
        a, b, cpu=widened, default=lambda a, b: primitive.bind(a, b, **params)
    )


def _widened(x: jax.Array) -> jax.Array:
    return lax.convert_element_type(x, compute_dtype(x.dtype))
