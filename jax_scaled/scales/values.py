"""Scale arithmetic on values: ScaledArrays, their scales and their data, for scale rules.

Conventions every rule follows:

* Scale arithmetic is done in float32 on 0-d arrays, then rounded to a power of two with the
  configured rounding (:func:`round_scale`) and cast to the output scale dtype
  (:func:`make_scale`), so float32 and E8M0 scales give bit-identical results.
* A static scale (a numpy value, :func:`is_static`) stays static through the arithmetic, so
  that trace-time constants cost nothing in the compiled program.
* Re-scaling data by a power-of-two ratio (:func:`rescale`) is done in float32 for narrow
  dtypes and cast back once: exact unless the result leaves the data format's range.
* A rule returns data in the dtype and shape the program expects (the interpreter checks).

Example:
    >>> datas, scale = align(scaled_array([1.0], 2.0), scaled_array([1.0], 8.0))
    >>> [d.tolist() for d in datas], float(scale)
    ([[0.25], [1.0]], 8.0)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray, Value
from jax_scaled.config import current_config
from jax_scaled.dtypes import compute_dtype
from jax_scaled.memo import memoized
from jax_scaled.pow2.static import (
    MAX_SCALE_EXPONENT,
    MIN_SCALE_EXPONENT,
    Rounding,
    is_static,
    is_static_one,
    static_pow2_round,
)
from jax_scaled.pow2.traced import (
    as_float32,
    pow2_reciprocal,
    pow2_round_positive,
    pow2_round_sqrt,
)
from jax_scaled.pow2.xla import as_division

__all__ = ["Value", "compute_dtype"]  # and every public function below


def scale_f32(x: Value) -> jax.Array:
    """The scale of ``x`` as a float32 0-d array (1 for a plain array)."""
    if isinstance(x, ScaledArray):
        return x.scale if x.scale.dtype == jnp.float32 else x.scale.astype(jnp.float32)
    return np.ones((), np.float32)


def out_scale_dtype(*xs: Value) -> jnp.dtype:
    """Scale dtype of a rule's output: the configured one, else E8M0 if any input has it."""
    configured = current_config().scale_dtype
    if configured is not None:
        return configured
    dtypes = {jnp.dtype(x.scale.dtype) for x in xs if isinstance(x, ScaledArray)}
    e8m0 = jnp.dtype(jnp.float8_e8m0fnu)
    return e8m0 if e8m0 in dtypes else jnp.dtype(jnp.float32)


def per_tensor_scale(scale: jax.Array) -> jax.Array:
    """A float32 power-of-two ``scale`` as the scale of a value that leaves its blocks (a
    block rule's per-tensor output, a fallback, ``merge_blocks``): the configured scale dtype,
    else float32, the per-tensor default. E8M0 is a storage format for block scales; a
    per-tensor E8M0 scale would make every following rule convert it (costly XLA:CPU code).

    Example:
        >>> per_tensor_scale(jnp.asarray(4.0, jnp.float8_e8m0fnu)).dtype
        dtype('float32')
    """
    return make_scale(as_float32(scale))


def round_scale(scale: jax.Array) -> jax.Array:
    """Round a positive float32 scale estimate to a power of two (configured rounding); a
    static estimate is rounded at trace time, to a numpy float32."""
    rounding = current_config().rounding
    if is_static(scale):  # the same clamping as pow2_round_positive
        value = float(scale)
        if not value > 0:
            return np.float32(2.0**MIN_SCALE_EXPONENT)
        return np.float32(
            2.0**MAX_SCALE_EXPONENT if math.isinf(value) else static_pow2_round(value, rounding)
        )
    return pow2_round_positive(scale, rounding)


def make_scale(scale: jax.Array, *like: Value) -> jax.Array:
    """Cast a float32 power-of-two ``scale`` to the scale dtype of the inputs ``like``.

    A static scale (numpy, see :func:`is_static`) stays a numpy value: no staged constant,
    and rules that read it can fold it at trace time.
    """
    dtype = out_scale_dtype(*like)
    if is_static(scale):  # a trace-time constant stays one (no staged constant)
        if dtype == jnp.float8_e8m0fnu:
            scale = max(float(scale), 2.0**-127)  # E8M0 has no zero (see below)
        return np.asarray(scale, np.float32).astype(dtype)
    return _cast_scale(as_float32(scale), dtype)


def _cast_scale(scale: jax.Array, dtype) -> jax.Array:
    if scale.dtype == dtype:
        return scale
    if dtype == jnp.float8_e8m0fnu:
        # E8M0 has no zero: a scale flushed to 0 (a product below 2^-126) becomes the
        # smallest E8M0 power, 2^-127, instead of E8M0's NaN.
        smallest = jnp.asarray(2.0**-127, dtype)
        return jnp.where(scale > 0, lax.convert_element_type(scale, dtype), smallest)
    return lax.convert_element_type(scale, dtype)


def sqrt_pow2(n: int) -> float:
    """``sqrt(n)`` rounded to a power of two with the configured rounding (trace-time)."""
    return static_pow2_round(math.sqrt(max(n, 1)), current_config().rounding)


def as_scaled(x: Value) -> ScaledArray:
    """``x`` as a ScaledArray: a plain floating array gets scale 1."""
    if isinstance(x, ScaledArray):
        return x
    return ScaledArray(x, np.ones((), np.float32))


def scale_mul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` of two float32 0-d scales; a numpy product when both are static.

    Rules multiply scales with it rather than with ``*``: a ``jax.numpy`` operator costs
    a nested trace, and scale arithmetic runs for every equation of a scalified program.

    Example:
        >>> scale_mul(np.float32(2.0), np.float32(4.0))
        np.float32(8.0)
    """
    if is_static(a) and is_static(b):
        return np.float32(np.float32(a) * np.float32(b))
    if is_static_one(a) or is_static_one(b):  # exact: no equation
        return as_float32(b if is_static_one(a) else a)
    return lax.mul(as_float32(a), as_float32(b))


def times_scalar(data: jax.Array, factor: Any) -> jax.Array:
    """``data * factor`` in ``data``'s dtype, for a 0-d ``factor`` (static or traced); as a
    division where ``factor`` is an exact reciprocal (:func:`~jax_scaled.pow2.xla.as_division`).

    Example:
        >>> times_scalar(jnp.array([1.0, 2.0]), np.float32(0.5)).tolist()
        [0.5, 1.0]
    """
    if is_static(factor):
        if is_static_one(factor):
            return data
        return lax.mul(data, np.asarray(factor, data.dtype))
    divided = as_division(data, factor)
    if divided is not None:
        return divided
    return lax.mul(data, lax.convert_element_type(factor, data.dtype))


def rescale(data: jax.Array, ratio: jax.Array) -> jax.Array:
    """``data * ratio`` (ratio a float32 power of two), rounded once into ``data.dtype``."""
    wide = compute_dtype(data.dtype)
    if jnp.ndim(ratio) != 0:  # per-row ratios (stacked scan outputs): broadcasting multiply
        return (data.astype(wide) * ratio.astype(wide)).astype(data.dtype)
    return lax.convert_element_type(
        times_scalar(lax.convert_element_type(data, wide), ratio), data.dtype
    )


def safe_ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` for scales; 0/0 (two zero scales) gives 0, not NaN."""
    if numerator is denominator:
        return np.ones((), np.float32)
    # Scales are >= 2^-126 unless zero; a zero denominator means a zero numerator (the
    # denominator is the larger scale), whose data is multiplied by 0: the value stays 0.
    return numerator / lax.max(denominator, np.float32(2.0**-126))


def ratio_to_pow2(scale: jax.Array, target: jax.Array) -> jax.Array:
    """``scale / target`` for a power-of-two ``target`` (a rule's rounded output scale).

    A multiplication by an integer-built reciprocal: exact, and fusable by XLA into the
    data computation that uses it, where a float division would be compiled on its own.
    """
    if scale is target:
        return np.ones((), np.float32)
    return scale_mul(scale, scale_reciprocal(target))


def scale_reciprocal(scale: jax.Array) -> jax.Array:
    """``1 / scale`` of a power-of-two scale (:func:`~jax_scaled.pow2.traced.pow2_reciprocal`),
    computed once per traced scale within a scalified call (:mod:`jax_scaled.memo`).

    Example:
        >>> float(scale_reciprocal(np.float32(0.25)))
        4.0
    """
    return memoized("pow2_reciprocal", scale, lambda: pow2_reciprocal(scale))


def align(*xs: Value, scale: jax.Array | None = None) -> tuple[list[jax.Array], jax.Array]:
    """Express every input at one common scale: ``(datas, scale)``.

    The common scale defaults to the largest input scale, so nothing overflows.
    """
    scales = [scale_f32(x) for x in xs]
    pow2_target = scale is None  # the largest of power-of-two scales
    if scale is None:
        scale = max_scale(scales)
    ratio = ratio_to_pow2 if pow2_target else safe_ratio
    datas = [
        as_scaled(x).data if s is scale else rescale(as_scaled(x).data, ratio(s, scale))
        for x, s in zip(xs, scales, strict=True)
    ]
    return datas, scale


def max_scale(scales: list[jax.Array]) -> jax.Array:
    """Elementwise maximum of a list of 0-d scales (the same object when all are the same)."""
    out = scales[0]
    for s in scales[1:]:
        if s is not out:
            out = lax.max(out, s)
    return out


def min_scale(a: jax.Array, b: jax.Array) -> jax.Array:
    """The smaller of two 0-d scales; static when both are.

    Example:
        >>> min_scale(np.float32(0.5), np.float32(4.0))
        np.float32(0.5)
    """
    if a is b:
        return a
    if is_static(a) and is_static(b):
        return np.minimum(np.float32(a), np.float32(b))
    return lax.min(as_float32(a), as_float32(b))


def to_compute(x: Value) -> jax.Array:
    """The represented value ``data * scale`` in the compute dtype (float32 for narrow data)."""
    x = as_scaled(x)
    return times_scalar(lax.convert_element_type(x.data, compute_dtype(x.dtype)), x.scale)


def from_compute(value: jax.Array, scale: jax.Array, dtype, *like: Value) -> ScaledArray:
    """A ScaledArray of ``value`` (compute dtype) at the power-of-two ``scale`` (float32)."""
    if is_static(scale):
        data = value if float(scale) == 1 else value / np.asarray(scale, value.dtype)
    else:
        data = value / scale.astype(value.dtype)
    return ScaledArray(data.astype(dtype), make_scale(scale, *like))


def rounded_l2_scale(*scales: jax.Array) -> jax.Array:
    """``sqrt(sum(s**2))`` of power-of-two scales, rounded to a power of two.

    The unit-scaling estimate for a sum of independent terms, computed without sqrt or
    division.

    The largest scale is rounded first (a no-op for powers of two), the others are expressed
    relative to it by exact reciprocal multiplication, and the square root is rounded from
    the exponent of the sum of squares: every operation is cheap and fusable.
    """
    rounding = current_config().rounding
    if rounding is Rounding.DOWN and len(scales) <= 3:
        # Scales are powers of two (checked at ScaledArray construction; every rule keeps
        # it): their maximum needs no rounding.
        return max_scale(list(scales))
    largest = round_scale(max_scale(list(scales)))
    total = sum(lax.square(ratio_to_pow2(s, largest)) for s in scales)
    return round_scale(pow2_round_sqrt(total, rounding) * largest)


def wide_data(x: Value, scale: jax.Array, *, pow2_target: bool = False) -> jax.Array:
    """The data of ``x`` re-expressed at ``scale``, in the compute dtype (not rounded back).

    ``pow2_target=True`` promises ``scale`` is a power of two (a rounded estimate): the ratio
    is then a fusable reciprocal multiplication instead of a division.
    """
    x = as_scaled(x)
    data = lax.convert_element_type(x.data, compute_dtype(x.dtype))
    own_scale = scale_f32(x)
    if own_scale is scale:
        return data
    ratio = ratio_to_pow2 if pow2_target else safe_ratio
    return times_scalar(data, ratio(own_scale, scale))
