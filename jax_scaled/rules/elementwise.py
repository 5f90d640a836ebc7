"""Scale rules for elementwise primitives: arithmetic, selections, rounding, predicates, casts.
Powers and roots are in :mod:`jax_scaled.rules.powers`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled._jax_internals import lax_primitives
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine import estimates
from jax_scaled.engine.facts import converted_fact
from jax_scaled.engine.registry import Property, register_scale_rule
from jax_scaled.engine.together import register_together
from jax_scaled.pow2.static import is_static
from jax_scaled.pow2.xla import float_division
from jax_scaled.rules.toolkit import align_selection, has_static_scale
from jax_scaled.scales import (
    align,
    as_scaled,
    cast_guarded,
    centred,
    from_compute,
    guard_band,
    guard_factors_together,
    guarded,
    make_scale,
    max_scale,
    min_scale,
    products_guarded,
    rounded_l2_scale,
    scale_f32,
    scale_mul,
    sums_guarded,
    to_compute,
    top_of_format,
    wide_data,
    widened,
)


def _add_or_sub(x, y, op, guard: bool) -> ScaledArray:
    """Unit-scaling estimate for a sum of independent terms: sqrt(sx^2 + sy^2).

    With ``guard``, the sum is formed in float32 and range-guarded
    (:func:`~jax_scaled.scales.guard.guarded`).
    """
    scale = rounded_l2_scale(scale_f32(x), scale_f32(y))
    wide = op(wide_data(x, scale, pow2_target=True), wide_data(y, scale, pow2_target=True))
    if guard:
        return guarded(wide, scale, x.dtype, x, y)
    return ScaledArray(wide.astype(x.dtype), make_scale(scale, x, y))


# Property sets of this module's records (jax_scaled.engine.registry.Property).
_SUM = Property.FOLDS_SCALARS | Property.ANY_SCALE_PRESERVING | Property.ADDING
_PRODUCT = Property.FOLDS_SCALARS | Property.ABSORBING | Property.MULTIPLICATIVE
_SELECTION = Property.ANY_SCALE_PRESERVING | Property.SELECTING


@register_scale_rule(lax.add_p, properties=_SUM, estimate=estimates.sum_of_squares, fold=np.add)
def add_rule(x, y, **params):
    return _add_or_sub(x, y, lax.add, sums_guarded(x.dtype))


@register_scale_rule(
    lax.sub_p,
    properties=_SUM,
    estimate=estimates.sum_of_squares,
    fold=np.subtract,
)
def sub_rule(x, y, **params):
    return _add_or_sub(x, y, lax.sub, sums_guarded(x.dtype))


@register_scale_rule(
    lax.mul_p,
    properties=_PRODUCT | Property.ANY_SCALE_PRESERVING,
    estimate=estimates.product,
    fold=np.multiply,
)
def mul_rule(x, y, **params):
    """sx * sy, data dx * dy. 8-bit data may sit at the top of its format
    (:func:`~jax_scaled.scales.guard.top_of_format`): a constant factor is applied with its
    mantissa in [0.5, 1) (:func:`_shrinking_constant`), other products are formed in
    float32 and their largest datum put at the guard's target (:func:`centred`)."""
    static = has_static_scale(x) != has_static_scale(y)
    x, y = as_scaled(x), as_scaled(y)
    scale = scale_mul(scale_f32(x), scale_f32(y))
    if top_of_format(x.dtype) and static and jnp.finfo(x.dtype).minexp < 0:
        x, y = _shrinking_constant(x), _shrinking_constant(y)
        scale = scale_mul(scale_f32(x), scale_f32(y))
    elif products_guarded(x.dtype):
        return centred(lax.mul(widened(x.data), widened(y.data)), scale, x.dtype, x, y)
    return ScaledArray(lax.mul_p.bind(x.data, y.data, **params), make_scale(scale, x, y))


def _shrinking_constant(x: ScaledArray) -> ScaledArray:
    """A promoted constant (mantissa in [1, 2), static scale) as mantissa / 2 at twice its
    scale, so that multiplying by it never grows data (exact: the half is a normal number of
    the format); other values as they are."""
    if not has_static_scale(x):
        return x
    half = lax.mul(x.data, np.asarray(0.5, x.dtype))
    return ScaledArray(half, make_scale(scale_mul(scale_f32(x), np.float32(2.0)), x))


@register_scale_rule(lax.div_p, properties=_PRODUCT, estimate=estimates.quotient, fold=np.divide)
def div_rule(x, y, **params):
    """sx / sy, data dx / dy. A quotient by anything but a constant (whose mantissa >= 1
    only shrinks data) is formed in float32 and range-guarded: one of two in-band float16
    data reaches 2^15, where one more product overflows (a layer norm's gradient multiplies
    ``rsqrt(v) / v`` by a cotangent). 8-bit data (top of its format) is centred
    (:func:`~jax_scaled.scales.guard.centred`)."""
    divisor_constant = has_static_scale(y) and not has_static_scale(x)
    if isinstance(x, ScaledArray) and _is_one(y, x.shape):  # x / 1 is x (XLA folds it too)
        return x
    x, y = as_scaled(x), as_scaled(y)
    scale = float_division(scale_f32(x), scale_f32(y))  # cuts scale chains: see scales.xla
    if divisor_constant or guard_band(x.dtype) is None:
        return ScaledArray(lax.div_p.bind(x.data, y.data, **params), make_scale(scale, x, y))
    quotient = lax.div(widened(x.data), widened(y.data))
    if products_guarded(x.dtype):
        return centred(quotient, scale, x.dtype, x, y)
    return guarded(quotient, scale, x.dtype, x, y)


def _is_one(y: Value, shape: tuple[int, ...]) -> bool:
    """True for a trace-time constant (numpy, or a ScaledArray of numpy data and scale) equal
    to 1 everywhere, of ``shape`` or a scalar."""
    data, scale = (y.data, y.scale) if isinstance(y, ScaledArray) else (y, np.float32(1))
    if not isinstance(data, (np.ndarray, np.generic)) or not is_static(scale):
        return False
    if np.ndim(data) and np.shape(data) != shape:
        return False
    return bool(np.all(np.asarray(data, np.float64) * np.asarray(scale, np.float64) == 1.0))


@register_scale_rule(
    lax.neg_p,
    properties=Property.FOLDS_SCALARS | _SELECTION,
    estimate=estimates.first,
    fold=np.negative,
)
def neg_rule(x, **params):
    return ScaledArray(-x.data, x.scale)


# ---------------------------------------------------------------------------------------
# Sign, magnitude and data-only primitives: the scale is kept
# ---------------------------------------------------------------------------------------


def _on_data(x: ScaledArray, primitive, **params) -> ScaledArray:
    return ScaledArray(primitive.bind(x.data, **params), make_scale(scale_f32(x), x))


@register_scale_rule(
    lax.abs_p,
    properties=Property.FOLDS_SCALARS | _SELECTION,
    estimate=estimates.first,
    fold=np.abs,
)
def abs_rule(x: ScaledArray, **params) -> ScaledArray:
    """Input scale: |d| * s."""
    return _on_data(x, lax.abs_p, **params)


@register_scale_rule(lax.sign_p, properties=Property.FOLDS_SCALARS, fold=np.sign)
def sign_rule(x: ScaledArray, **params) -> ScaledArray:
    """Scale 1: sign(d * s) == sign(d) for a positive scale."""
    return ScaledArray(lax.sign(x.data), make_scale(np.ones((), np.float32), x))


@register_scale_rule(
    lax.reduce_precision_p, properties=Property.POINTWISE, estimate=estimates.first
)
def reduce_precision_rule(x: ScaledArray, **params) -> ScaledArray:
    """Input scale; applied to the data (the emulated format's exponent range is the data's)."""
    return _on_data(x, lax.reduce_precision_p, **params)


@register_scale_rule(
    lax.copy_p,
    properties=Property.SHAPE_ONLY | _SELECTION | Property.POINTWISE,
    estimate=estimates.first,
)
def copy_rule(x: ScaledArray, **params) -> ScaledArray:
    """Input scale; data and scale copied."""
    return ScaledArray(lax.copy_p.bind(x.data, **params), lax.copy_p.bind(x.scale, **params))


@register_scale_rule(
    lax_primitives.stop_gradient_p, properties=Property.POINTWISE, estimate=estimates.first
)
def stop_gradient_rule(x: ScaledArray, **params) -> ScaledArray:
    """Input scale; no gradient flows through the data nor the scale."""
    stop = lax_primitives.stop_gradient_p
    return ScaledArray(stop.bind(x.data, **params), stop.bind(x.scale, **params))


# ---------------------------------------------------------------------------------------
# Selections: max, min, select_n, clamp, nextafter
# ---------------------------------------------------------------------------------------


@register_scale_rule(
    lax.max_p,
    properties=Property.FOLDS_SCALARS | _SELECTION,
    estimate=estimates.largest,
    fold=np.maximum,
)
def max_rule(x: Value, y: Value, **params) -> ScaledArray:
    """max(sx, sy): both aligned to it (rounding is monotone, so max commutes with it); a
    whole operand where it wins everywhere (:func:`_extremum`)."""
    return _extremum(lax.max_p, x, y, **params)


@register_scale_rule(
    lax.min_p,
    properties=Property.FOLDS_SCALARS | _SELECTION,
    estimate=estimates.largest,
    fold=np.minimum,
)
def min_rule(x: Value, y: Value, **params) -> ScaledArray:
    """max(sx, sy): both aligned to it (rounding is monotone, so min commutes with it); a
    whole operand where it wins everywhere (:func:`_extremum`)."""
    return _extremum(lax.min_p, x, y, **params)


def _extremum(primitive, x: Value, y: Value, **params) -> ScaledArray:
    """``max`` or ``min`` of ``x`` and ``y``, aligned, or the operand it picks everywhere.

    Aligned to one scale, the operand of the smaller scale loses the bits below the other's
    range: ``min(1.0 / norm, 1.0)`` of a norm of 2^28 kept 2^-28 as float16 subnormal data
    at the scale the constant needs, and a tensor far below a clip bound
    (``jnp.clip(g, -1, 1)``, ``jax.nn.relu6``) lost its small elements. Where one operand is
    picked everywhere, at run time, it is the output with its own data and scale, exactly:
    always for one element (one comparison), and for a tensor with a trace-time constant
    operand, at the cost of one reduction (two traced tensors keep the alignment alone).
    """
    (dx, dy), scale = align_selection(x, y)
    out = ScaledArray(primitive.bind(dx, dy, **params), make_scale(scale, x, y))
    if out.size > 1 and has_static_scale(x) == has_static_scale(y):
        return out
    # x where the output is x's aligned data; x's NaNs propagate, as in lax's max and min
    picks_x = (out.data == dx) | jnp.isnan(dx)
    return _picked_whole(out, picks_x.astype(np.int32), (y, x))


def _picked_whole(out: ScaledArray, picks: jax.Array, cases: tuple[Value, ...]) -> ScaledArray:
    """``out``, or the case of ``cases`` that ``picks`` (its index, per element) names
    everywhere at run time, whole: its data broadcast to ``out``'s shape, its own scale.
    Per-tensor scales only (a block-scaled selection keeps ``out``)."""
    scaled = [as_scaled(c) for c in cases]
    if out.size == 0 or any(np.ndim(c.scale) for c in (out, *scaled)):
        return out
    first = picks.reshape(-1)[0]
    scaled = [ScaledArray(jnp.broadcast_to(c.data, out.shape), c.scale) for c in scaled]
    whole = _whole_case(first, tuple(scaled))
    if out.size == 1:
        return whole
    uniform = jnp.all(picks == first)
    return ScaledArray(
        lax.select(uniform, whole.data, out.data), lax.select(uniform, whole.scale, out.scale)
    )


def _whole_case(which: jax.Array, cases: tuple[Value, ...]) -> ScaledArray:
    """The case a 0-d ``which`` picks, data and scale together: exact, nothing aligned."""
    scaled = [as_scaled(c) for c in cases]
    scale = lax.select_n(which, *[scale_f32(c) for c in scaled])
    data = lax.select_n(which, *[c.data for c in scaled])
    return ScaledArray(data, make_scale(scale, *cases))


@register_scale_rule(
    lax.select_n_p, properties=_SELECTION | Property.POINTWISE, estimate=estimates.largest_case
)
def select_n_rule(which: jax.Array, *cases: Value, **params) -> ScaledArray:
    """Largest case scale (constants: see :func:`align_selection`); cases aligned, selected.

    A ``which`` that is 0-d, or uniform at run time when a constant case is mixed with traced
    ones (``jnp.where(norm <= eps, 1.0, x)``), picks a whole case, data and scale: a value
    of 2^-30 chosen over a fill of 1 is not flushed to the fill's scale.
    """
    if np.ndim(which) == 0:
        return _whole_case(which, cases)
    datas, scale = align_selection(*cases)
    out = ScaledArray(lax.select_n_p.bind(which, *datas, **params), make_scale(scale, *cases))
    mixed = any(has_static_scale(c) for c in cases) and not all(map(has_static_scale, cases))
    return _picked_whole(out, which, cases) if mixed else out


@register_scale_rule(
    lax.clamp_p, properties=_SELECTION | Property.POINTWISE, estimate=estimates.largest
)
def clamp_rule(lo: Value, x: Value, hi: Value, **params) -> ScaledArray:
    """Scale of x: the bounds are brought to it in float32, clamped, rounded once; a bound
    picked everywhere is the output whole (at x's scale, one far below it flushed to zero:
    ``lax.clamp(0.001, x, 0.002)`` of float16 data at 2^20)."""
    scale = scale_f32(x)
    wide_lo, wide_x, wide_hi = (wide_data(v, scale) for v in (lo, x, hi))
    bounded = lax.clamp_p.bind(wide_lo, wide_x, wide_hi, **params)
    if products_guarded(x.dtype):  # a bound far above x's scale leaves an 8-bit format
        out = guarded(bounded, scale, x.dtype, x, lo, hi)
    else:
        out = ScaledArray(bounded.astype(x.dtype), make_scale(scale, x, lo, hi))
    # 0: lo, 1: x (NaNs too), 2: hi, as lax's clamp picks them
    picks = jnp.where(wide_x < wide_lo, 0, jnp.where(wide_x > wide_hi, 2, 1))
    return _picked_whole(out, picks.astype(np.int32), (lo, x, hi))


@register_scale_rule(lax.nextafter_p, properties=Property.POINTWISE)
def nextafter_rule(x: Value, y: Value, **params) -> ScaledArray:
    """Scale of x: the next value of the data format *at x's scale*, towards y (aligned to it).

    When y rounds to x at that scale, x is returned unchanged.
    """
    (dx, dy), scale = align(x, y, scale=scale_f32(x))
    return ScaledArray(lax.nextafter_p.bind(dx, dy, **params), make_scale(scale, x, y))


@register_scale_rule(
    lax_primitives.add_jaxvals_p,
    properties=Property.ADDING | Property.POINTWISE,
    estimate=estimates.sum_of_squares,
)
def add_any_rule(x: Value, y: Value, **params) -> ScaledArray:
    """Like add: sqrt(sx^2 + sy^2), pow2-rounded; range-guarded in float16/float8.

    Gradient accumulation adds cotangents from different paths, whose scales can be far
    apart: ``silu``'s gradient at inputs around 2^20 adds ``sigmoid(x)`` (scale 1) to
    ``x * sigmoid'(x)``, exactly zero but at scale 2^20, and without the guard the first
    term would underflow in float16.
    """
    return _add_or_sub(x, y, lax.add, guard_band(x.dtype) is not None)


# ---------------------------------------------------------------------------------------
# Rounding to integers and remainders: computed on the value in float32
# ---------------------------------------------------------------------------------------


def _integral(x: ScaledArray, primitive, **params) -> ScaledArray:
    """Scale max(s, 1): integers need no finer scale than 1."""
    value = primitive.bind(to_compute(x), **params)
    return from_compute(value, jnp.maximum(scale_f32(x), 1), x.dtype, x)


@register_scale_rule(lax.floor_p, properties=Property.POINTWISE)
def floor_rule(x: ScaledArray, **params) -> ScaledArray:
    """max(s, 1); floor of the value in float32 (exact)."""
    return _integral(x, lax.floor_p, **params)


@register_scale_rule(lax.ceil_p, properties=Property.POINTWISE)
def ceil_rule(x: ScaledArray, **params) -> ScaledArray:
    """max(s, 1); ceil of the value in float32 (exact)."""
    return _integral(x, lax.ceil_p, **params)


@register_scale_rule(lax.round_p, properties=Property.POINTWISE)
def round_rule(x: ScaledArray, **params) -> ScaledArray:
    """max(s, 1); round of the value in float32 (exact)."""
    return _integral(x, lax.round_p, **params)


@register_scale_rule(lax.rem_p, properties=Property.POINTWISE)
def rem_rule(x: Value, y: Value, **params) -> ScaledArray:
    """The smaller of the two scales (``|rem(x, y)| <= min(|x|, |y|)``: ``x`` itself when
    ``|x| < |y|``); fmod of the values in float32 (exact), rounded once."""
    value = lax.rem_p.bind(to_compute(x), to_compute(y), **params)
    return from_compute(value, min_scale(scale_f32(x), scale_f32(y)), x.dtype, x, y)


# ---------------------------------------------------------------------------------------
# Predicates: exact comparisons of the values, plain boolean results
# ---------------------------------------------------------------------------------------


def _compare(primitive, x: Value, y: Value, **params) -> jax.Array:
    scale = max_scale([scale_f32(x), scale_f32(y)])
    return primitive.bind(wide_data(x, scale), wide_data(y, scale), **params)


def _register_comparison(primitive, properties: Property) -> None:
    def rule(x: Value, y: Value, **params) -> jax.Array:
        return _compare(primitive, x, y, **params)

    rule.__name__ = f"{primitive.name}_rule"
    rule.__doc__ = f"Plain bool: ``{primitive.name}`` of the values aligned in float32 (exact)."
    register_scale_rule(primitive, properties=properties)(rule)


for _comparison in (lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p):
    _register_comparison(_comparison, Property.SELECTING | Property.POINTWISE)
# The *_to primitives compare in IEEE total order (jnp.searchsorted, jnp.interp).
for _comparison in (lax_primitives.eq_to_p, lax_primitives.lt_to_p, lax_primitives.le_to_p):
    _register_comparison(_comparison, Property.NONE)


@register_scale_rule(
    lax.is_finite_p,
    properties=Property.SELECTING | Property.POINTWISE | Property.READS_FINER_SCALES,
)
def is_finite_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain bool: finite data and finite scale."""
    return lax.is_finite_p.bind(x.data, **params) & lax.is_finite(scale_f32(x))


# ---------------------------------------------------------------------------------------
# Type conversions
# ---------------------------------------------------------------------------------------


@register_scale_rule(
    lax.convert_element_type_p,
    properties=Property.ANY_SCALE_PRESERVING | Property.POINTWISE | Property.READS_FINER_SCALES,
    facts=converted_fact,
)
def convert_element_type_rule(x: ScaledArray, *, new_dtype, **params) -> Value:
    """Float to float: data cast, scale kept. Else the value (float32) converted, plain.

    A cast into float16 or float8 from a wider format is range-guarded
    (:class:`~jax_scaled.ScalifyConfig`): data that would overflow or underflow the new
    format moves a power of two into the scale instead.
    """
    bind = functools.partial(lax.convert_element_type_p.bind, new_dtype=new_dtype, **params)
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return bind(to_compute(x))
    if cast_guarded(x.dtype, new_dtype):
        return guarded(widened(x.data), scale_f32(x), new_dtype, x)
    if (
        new_dtype == compute_dtype(x.dtype)
        and not params.get("weak_type")
        and params.get("sharding") is None
    ):
        data = widened(x.data)  # shared, with what a guard recorded of the narrow data
    else:
        data = bind(x.data)
    return ScaledArray(data, make_scale(scale_f32(x), x))


def _cast_key(params: dict) -> Any:
    """Casts into one float format may have their range guards worked out together."""
    new_dtype = jnp.dtype(params["new_dtype"])
    return new_dtype if jnp.issubdtype(new_dtype, jnp.floating) else None


def _casts_guarded_together(new_dtype: Any, operands: list[list[Value]]) -> None:
    """The range guards of several casts into ``new_dtype`` (a step's float32 parameters cast
    to float16) in one small kernel (:func:`~jax_scaled.scales.guard_factors_together`),
    where the cast rule above reads them."""
    wides = [
        widened(x.data)
        for (x,) in operands
        if isinstance(x, ScaledArray)
        and not x.scale.ndim
        and jnp.issubdtype(x.dtype, jnp.floating)
        and cast_guarded(x.dtype, new_dtype)
    ]
    guard_factors_together(wides, new_dtype)


register_together(lax.convert_element_type_p, _cast_key, _casts_guarded_together)


@register_scale_rule(lax.bitcast_convert_type_p)
def bitcast_convert_type_rule(x: ScaledArray, **params) -> jax.Array:
    """Plain: the bits of the *value* ``x.to_array()`` in the data dtype (scale applied first).

    The value can overflow or underflow the data dtype; bitcasts are not scale-aware.
    """
    return lax.bitcast_convert_type_p.bind(x.to_array(), **params)
