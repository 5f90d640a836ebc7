"""Cast-related primitives and their scale rules.

``saturate`` clips an array to the finite range of a float format (``±finfo(dtype).max``)
before a cast to that format, so that values beyond it become the format's largest value
instead of ``inf`` or ``NaN``. Under scalify the clip applies to the *data* of a ScaledArray
(the scale is kept): the data is what a cast stores in the narrow format.

The casts themselves need no new rule: ``convert_element_type`` (float to float: data cast,
scale kept) and ``reduce_precision`` (applied to the data) are handled in
:mod:`jax_scaled.rules.elementwise`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.dtypes import float_dtype
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.scales.guard import record_largest_magnitude, recorded_largest_magnitude


def saturate(x: jax.Array, dtype: DTypeLike) -> jax.Array:
    """Clip ``x`` to ``[-max, max]`` with ``max`` the largest finite value of ``dtype``.

    ``±inf`` become ``±max``; NaN stays NaN; the dtype of ``x`` is kept (a no-op when every
    finite value of ``x``'s dtype fits in ``dtype``: then no cast can overflow). Under scalify the
    data of a ScaledArray is clipped (its scale is kept). The derivative is the identity
    (straight-through): saturation is a quantisation detail, not part of the model.

    Example:
        >>> from jax_scaled.rules.casts import saturate
        >>> saturate(jnp.array([1e6, -jnp.inf, 3.0]), jnp.float8_e4m3fn)
        Array([ 448., -448.,    3.], dtype=float32)
    """
    return saturate_p.bind(x, dtype=float_dtype(dtype))


def _finite_max(dtype: jnp.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def _saturate_impl(x: jax.Array, *, dtype: jnp.dtype) -> jax.Array:
    bound = _finite_max(dtype)
    if bound >= _finite_max(x.dtype):
        return x  # every finite value of x fits; only infinities would change
    low, high = jnp.asarray(-bound, x.dtype), jnp.asarray(bound, x.dtype)
    return lax.clamp(low, x, high)


# Straight-through: the clip is not differentiated (a cast's rounding is not either).
saturate_p = jxi.define_primitive("saturate", _saturate_impl, straight_through=True)


@register_scale_rule(saturate_p, properties=Property.POINTWISE)
def saturate_rule(x: ScaledArray, *, dtype: jnp.dtype) -> ScaledArray:
    """Input scale; the data is clipped to the format's range (what a cast of it stores).
    A largest magnitude recorded for the data is clipped with it, for the cast's guard."""
    data = _saturate_impl(x.data, dtype=dtype)
    largest = recorded_largest_magnitude(x.data)
    if data is not x.data and largest is not None and largest.dtype == jnp.float32:
        record_largest_magnitude(data, lax.min(largest, np.float32(_finite_max(dtype))))
    return ScaledArray(data, x.scale)
