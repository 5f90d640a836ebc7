"""Promotion: plain values that meet a ScaledArray become ScaledArrays, exactly.

The interpreter knows some plain values statically (see :class:`~jax_scaled.engine.facts.Slot`):
a trace-time constant, a broadcast of a 0-d value, a magnitude estimate, or a value that is
the same at any scale (zeros, infinities, NaNs). When such a value is an operand of a scale
rule, it is split into data and a power-of-two scale without rounding: a constant by its
mantissa and exponent, a traced scalar by its float32 bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled.array import ScaledArray, Value
from jax_scaled.config import current_config
from jax_scaled.dtypes import compute_dtype, is_narrow_float
from jax_scaled.engine import constants
from jax_scaled.engine.facts import Slot
from jax_scaled.memo import memoized
from jax_scaled.pow2.static import static_pow2_split
from jax_scaled.pow2.traced import as_float32, pow2_smallest_normal_over, split_bits
from jax_scaled.pow2.xla import computed_together

_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def promote_inputs(in_slots: list[Slot], multiplicative: bool = False) -> list[Value]:
    """The operands of a scale rule: the slots' values, with every plain float value whose
    static facts allow it promoted to a ScaledArray (see :func:`promote`).

    For a ``multiplicative`` primitive (its output scale a product of its input scales:
    ``mul``, ``dot_general``, ...) a scale-independent operand (zeros, infinities) is promoted
    at the scale that puts the product at the smallest normal float32 scale: a zero product
    (``0 * x``, a learning rate warming up from 0) then never dominates a later sum's scale,
    which would otherwise take it as the sum's unit and push the other addend's data towards
    underflow. Elsewhere it takes the other operands' scale.

    Example:
        >>> from jax_scaled.engine.facts import Slot
        >>> x = scaled_array([1.0, 2.0], 4.0)
        >>> _, two = promote_inputs([Slot(x), Slot(np.float32(6.0), constant=6.0)], True)
        >>> float(two.data), float(two.scale)
        (1.5, 4.0)
    """
    scale = next((s.value.scale for s in in_slots if s.is_scaled), None)
    if scale is None:
        return [s.value for s in in_slots]
    if all(s.is_scaled or _stays_plain(s) for s in in_slots):
        return [s.value for s in in_slots]  # nothing to promote: no scale to work out
    if np.ndim(scale) > 0:  # block scales: a scale-free operand takes the largest
        largest = lax.reduce_max(as_float32(scale), tuple(range(np.ndim(scale))))
        scale = lax.convert_element_type(largest, scale.dtype)
    if multiplicative:  # computed only if a zero operand asks for it
        reference = functools.cache(lambda: zero_factor_scale(scale))
    else:
        reference = lambda: scale  # noqa: E731
    scale_dtype = current_config().scale_dtype or scale.dtype
    factor_of = scale if multiplicative else None
    return [promote(s, reference, scale_dtype, factor_of) for s in in_slots]


def _stays_plain(slot: Slot) -> bool:
    """True for a plain operand :func:`promote` returns as it is (no static facts, or not a
    float)."""
    no_facts = slot.base is None and slot.constant is None and slot.estimate is None
    return no_facts and not slot.any_scale or not jnp.issubdtype(slot.value.dtype, jnp.floating)


def zero_factor_scale(other_scale: jax.Array) -> jax.Array:
    """The scale of a scale-free factor whose product with ``other_scale`` is ``2^-126``
    (within ``[2^-126, 1]``, so that it is a normal number in every scale dtype).

    Example:
        >>> float(zero_factor_scale(jnp.float32(2.0**-100))) == 2.0**-26
        True
    """
    if isinstance(other_scale, np.ndarray):  # a static scale stays static
        with np.errstate(divide="ignore"):
            scale = _SMALLEST_NORMAL / other_scale.astype(np.float32)
        return np.clip(scale, _SMALLEST_NORMAL, 1.0).astype(other_scale.dtype)
    return pow2_smallest_normal_over(other_scale).astype(other_scale.dtype)


def split_scalar(base: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(mantissa, scale, any_scale, factor_floor)`` of a 0-d float value: for a normal
    float32 number, its exact split into a mantissa in ``[1, 2)`` (signed) and a power of
    two, with bit operations; for anything else (zero, subnormal, infinity, NaN), the value
    at scale 1. ``any_scale`` is true for zeros, infinities and NaNs, the same at any scale.
    ``factor_floor`` is the lowest scale the value takes as a factor of a product: ``2^-126``
    where ``any_scale`` holds, its own scale otherwise (see :func:`promote`).

    All four are computed by one kernel of their own
    (:func:`~jax_scaled.pow2.xla.computed_together`): the value is typically a learning
    rate or a bias correction read by every parameter's update, and XLA would otherwise
    copy its whole chain (the schedule, then the split) into each of their kernels.

    Example:
        >>> [x.item() for x in split_scalar(jnp.float32(-6.0))]
        [-1.5, 4.0, False, 4.0]
        >>> [x.item() == 2.0**-126 for x in split_scalar(jnp.float32(0.0))]
        [False, False, False, True]
    """
    parts = split_bits(lax.convert_element_type(base, np.float32))
    # As bits: a subnormal value, its own mantissa, must not meet a flushing float max.
    mantissa, scale, any_scale, floor = computed_together(list(parts))
    as_float = functools.partial(lax.bitcast_convert_type, new_dtype=np.float32)
    return as_float(mantissa), as_float(scale), lax.ne(any_scale, np.int32(0)), as_float(floor)


def promote(
    slot: Slot,
    reference: Callable[[], jax.Array],
    scale_dtype: Any,
    factor_of: jax.Array | None = None,
) -> Value:
    """``slot``'s value as a ScaledArray when its static facts allow; ``reference()`` gives the
    scale for values that are the same at any scale (zeros, infinities, NaNs).

    ``factor_of`` is the other operand's scale in a multiplicative rule: a traced scalar
    that is zero at run time then takes :func:`zero_factor_scale` of it, worked out from the
    split's ``factor_floor`` by one clamp (``pow2_smallest_normal_over``) rather than a
    selection between two scales. XLA copies it into every kernel that reads the product,
    each parameter's update for a learning rate: half as many operations there.

    Example:
        >>> from jax_scaled.engine.facts import Slot
        >>> from jax_scaled.array import engine_builds
        >>> zeros = Slot(jnp.zeros(2), any_scale=True)
        >>> with engine_builds():  # as scalify's rules run it
        ...     promoted = promote(zeros, lambda: np.float32(8.0), jnp.float32)
        >>> float(promoted.scale)
        8.0
    """
    value = slot.value
    if slot.is_scaled or _stays_plain(slot):
        return value
    if slot.is_any_scale:
        # Zeros, infinities and NaNs are the same at any scale: take the other operand's.
        return ScaledArray(jnp.asarray(value), reference())
    if slot.constant is not None:
        mantissa, scale = static_pow2_split(slot.constant)
        data = lax.full(np.shape(value), np.asarray(mantissa, value.dtype), value.dtype)
        # A numpy (static) scale tells rules this operand is a trace-time constant.
        return ScaledArray(data, np.asarray(scale, np.float32).astype(scale_dtype))
    if slot.base is not None:
        split = memoized("split", slot.base, lambda: split_scalar(slot.base))
        mantissa, scale, any_scale, factor_floor = split
        # A traced zero (or inf, nan) is the same at any scale: take the other operand's, or
        # in a product the scale that puts the product at 2^-126 (a clamp to [floor, scale]).
        if factor_of is not None:
            scale = pow2_smallest_normal_over(factor_of, factor_floor, scale)
        else:
            scale = lax.select(any_scale, as_float32(reference()), scale)
        mantissa = lax.convert_element_type(mantissa, value.dtype)
        data = lax.broadcast_in_dim(mantissa, value.shape, ())
        return ScaledArray(data, lax.convert_element_type(scale, scale_dtype))
    scale = jnp.asarray(slot.estimate, jnp.float32)
    wide = compute_dtype(value.dtype)
    data = (value.astype(wide) * (1 / scale).astype(wide)).astype(value.dtype)
    return ScaledArray(data, scale.astype(scale_dtype))


def constant_output(slot: Slot) -> Value:
    """An output of a call given a ScaledArray: a trace-time constant its narrow dtype cannot
    hold comes back as a ScaledArray of that constant, split exactly into data and scale (the
    gradient of ``jnp.sum(x * 1e-8)``, ``1e-8`` everywhere, would be 0 in float16); any other
    output as it is.

    Example:
        >>> from jax_scaled.engine.facts import Slot
        >>> from jax_scaled.array import engine_builds
        >>> tiny = Slot(jnp.zeros(2, jnp.float16), constant=1e-8)
        >>> with engine_builds():
        ...     out = constant_output(tiny)
        >>> f"{float(out.data[0]) * float(out.scale):.3g}"  # to float16 precision
        '1e-08'
    """
    value, constant = slot.value, slot.constant
    if slot.is_scaled or constant is None or not is_narrow_float(value.dtype):
        return value
    if constants.holds(value.dtype, constant):
        return value
    promoted = promote(slot, lambda: np.float32(1.0), current_config().scale_dtype or jnp.float32)
    return ScaledArray(promoted.data, jnp.asarray(promoted.scale))


def normalized_scalar(x: ScaledArray) -> ScaledArray:
    """A one-element ScaledArray that is zero at run time, at the smallest scale ``2^-126``
    (the value is unchanged; other values are returned as they are).

    Rules estimate scales statically, so a scalar that is exactly zero at run time (a
    ``vdot`` with a zero difference of parameters in prodigy's first step) keeps whatever
    scale its estimate gave, however large. A later ``max`` or sum with it takes that scale
    and pushes the other operand's data far below 1 (to float16's subnormals, or to a float32
    product that flushes). A zero takes the smallest scale instead, as a scale-free zero
    does when it is promoted (:func:`zero_factor_scale`). For a scalar the test costs one
    comparison, so the interpreter applies it to every one-element rule output (with the
    range guard on), except a static scale (a trace-time constant).

    Example:
        >>> float(normalized_scalar(scaled_array(0.0, 2.0**40)).scale) == 2.0**-126
        True
        >>> float(normalized_scalar(scaled_array([6.0], 2.0**10)).scale)
        1024.0
    """
    zero = lax.eq(lax.reshape(x.data, ()), np.zeros((), x.dtype))
    smallest = np.asarray(_SMALLEST_NORMAL, np.float32).astype(x.scale.dtype)
    return ScaledArray(x.data, lax.select(zero, smallest, x.scale))


def normalizes(x: Any) -> bool:
    """True for a rule output that :func:`normalized_scalar` applies to.

    Example:
        >>> normalizes(scaled_array([1.0], jnp.float32(2.0))), normalizes(jnp.ones(1))
        (True, False)
    """
    return (
        isinstance(x, ScaledArray)
        and x.size == 1
        and not isinstance(x.scale, np.ndarray | np.generic)
        and jnp.dtype(x.dtype).itemsize <= 4
        and current_config().guard
    )
