"""Dynamic rescaling: re-centre a ScaledArray's data on unit scale from its statistics.

Scale rules estimate output scales statically (unit-scaling assumptions); a tensor whose
statistics drift away from them can be re-centred explicitly, where the user asks for it
(scalify paper §3.3, Algorithm 4). Three statistics of the *data* are offered:

* ``l1``: the mean absolute value;
* ``l2``: the root mean square (the unit-scaling statistic);
* ``max``: the largest absolute value (the shared exponent of an MX block: with the default
  rounding the data's largest magnitude lands in ``[1, 2)``).

The statistic is rounded to a power of two with the configured rounding (``ScalifyConfig``;
default down) and moved from the data into the scale: the value is unchanged (exactly, the
factor being a power of two, unless data leaves its format's normal range), the new scale is
a power of two, and the statistic of the new data lands in ``[1, 2)`` (rounding down),
``(1/2, 1]`` (up) or ``[1/√2, √2)`` (nearest). All-zero or non-finite data is left as is; a
scale that would leave ``[2^-126, 2^127]`` is clamped to it (the data keeps the remainder),
and so is a statistic above 2^126 (float32 data near its largest value), whose data then lands
above ``[1, 2)``.

Each operation is one primitive, ``dynamic_rescale[norm=...]``, whose implementation is the
identity: outside scalify (and on plain arrays inside it, which stay plain) it lowers to no
operation at all. Its derivative is the identity too. The ``*_grad`` variants are identities
on the forward pass and rescale the cotangent on the backward pass (a ``jax.custom_vjp``):
trace ``jax.grad`` inside ``scalify`` for them to see scaled cotangents.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.config import current_config
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine.registry import register_scale_rule
from jax_scaled.engine.together import register_together
from jax_scaled.memo import memoized, recorded
from jax_scaled.pow2.traced import pow2_round, pow2_round_positive
from jax_scaled.pow2.xla import (
    computed_apart,
    computed_once,
    computed_once_per_block,
    float_division,
    stacked_scalars,
)
from jax_scaled.scales import make_scale, rescale, scale_f32
from jax_scaled.scales.guard import record_largest_magnitude

NORMS = ("l1", "l2", "max")


def dynamic_rescale_l1(x: jax.Array) -> jax.Array:
    """Rebalance ``x`` so that the mean absolute value of its data is about 1.

    The value is unchanged. Outside scalify, and for a plain array, this is the identity.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_l1
        >>> y = scalify(dynamic_rescale_l1)(scaled_array([2.0**20, -3 * 2.0**20], 1.0))
        >>> y.data, float(y.scale) == 2.0**21  # mean |data| = 2^21 moves to the scale
        (Array([ 0.5, -1.5], dtype=float32), True)
    """
    return _rescale(x, "l1")


def dynamic_rescale_l2(x: jax.Array) -> jax.Array:
    """Rebalance ``x`` so that the root mean square of its data is about 1.

    The value is unchanged. Outside scalify, and for a plain array, this is the identity.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_l2
        >>> y = scalify(dynamic_rescale_l2)(scaled_array(jnp.full(4, 2.0**-20), 4.0))
        >>> y.data, float(y.scale) == 2.0**-18
        (Array([1., 1., 1., 1.], dtype=float32), True)
        >>> dynamic_rescale_l2(jnp.array([1.0, 2.0]))  # outside scalify: identity
        Array([1., 2.], dtype=float32)
    """
    return _rescale(x, "l2")


def dynamic_rescale_max(x: jax.Array) -> jax.Array:
    """Rebalance ``x`` so that the largest magnitude of its data is in ``[1, 2)``.

    (``(1/2, 1]`` with rounding up.) The value is unchanged. Outside scalify, and for a
    plain array, this is the identity.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_max
        >>> y = scalify(dynamic_rescale_max)(scaled_array([1000.0, -3.0], 1.0, jnp.float16))
        >>> y.data.tolist(), float(y.scale)  # 1000 = 1.953 * 2^9
        ([1.953125, -0.005859375], 512.0)
    """
    return _rescale(x, "max")


def dynamic_rescale_l1_grad(x: jax.Array) -> jax.Array:
    """Identity forward; :func:`dynamic_rescale_l1` on the cotangent in the backward pass.

    Gradient values are unchanged; only their scaled representation is rebalanced.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_l1_grad
        >>> loss = lambda x, w: jnp.sum(dynamic_rescale_l1_grad(x) * w)
        >>> w = scaled_array(jnp.full(3, 2.0**-12), 1.0)
        >>> g = scalify(jax.grad(loss))(jnp.ones(3), w)
        >>> g.data, float(g.scale) == 2.0**-12
        (Array([1., 1., 1.], dtype=float32), True)
    """
    return _rescale_cotangent(x, "l1")


def dynamic_rescale_l2_grad(x: jax.Array) -> jax.Array:
    """Identity forward; :func:`dynamic_rescale_l2` on the cotangent in the backward pass.

    Gradient values are unchanged; only their scaled representation is rebalanced.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_l2_grad
        >>> loss = lambda x, w: jnp.sum(dynamic_rescale_l2_grad(x) * w)
        >>> w = scaled_array(jnp.full(3, 2.0**12), 1.0, jnp.float16)
        >>> g = scalify(jax.grad(loss))(jnp.ones(3, jnp.float16), w)
        >>> g.data, float(g.scale) == 2.0**12
        (Array([1., 1., 1.], dtype=float16), True)
    """
    return _rescale_cotangent(x, "l2")


def dynamic_rescale_max_grad(x: jax.Array) -> jax.Array:
    """Identity forward; :func:`dynamic_rescale_max` on the cotangent in the backward pass.

    Gradient values are unchanged; only their scaled representation is rebalanced.

    Example:
        >>> from jax_scaled.ops import dynamic_rescale_max_grad
        >>> loss = lambda x, w: jnp.sum(dynamic_rescale_max_grad(x) * w)
        >>> w = scaled_array([0.5, 2.0**-10], 2.0**-4)
        >>> g = scalify(jax.grad(loss))(jnp.ones(2), w)
        >>> g.data.tolist(), float(g.scale) == 2.0**-5
        ([1.0, 0.001953125], True)
    """
    return _rescale_cotangent(x, "max")


def _rescale(x: jax.Array, norm: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"dynamic rescaling needs a floating-point array, got dtype {x.dtype}.")
    return dynamic_rescale_p.bind(x, norm=norm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rescale_cotangent(x: jax.Array, norm: str) -> jax.Array:
    return x


def _rescale_cotangent_fwd(x: jax.Array, norm: str):
    return x, None


def _rescale_cotangent_bwd(norm: str, _, cotangent: jax.Array):
    return (_rescale(cotangent, norm),)


_rescale_cotangent.defvjp(_rescale_cotangent_fwd, _rescale_cotangent_bwd)


# -- the primitive: identity outside scalify -------------------------------------------------


def _identity(x, *, norm):
    return x


dynamic_rescale_p = jxi.define_primitive("dynamic_rescale", _identity, straight_through=True)


# -- the scale rule --------------------------------------------------------------------------


@register_scale_rule(dynamic_rescale_p)
def dynamic_rescale_rule(x: ScaledArray, *, norm: str) -> ScaledArray:
    """Move the power of two nearest the data's ``norm`` statistic into the scale."""
    shared = recorded(_rescaled_kind(norm), x.data)
    if shared is not None and shared[0] is x.scale:  # worked out with others' (below)
        return _moved(x, *shared[1:])
    statistic, largest = _data_statistic(x.data, norm)
    return _rebalanced(x, _factor(statistic), largest)


def _factor(statistic: jax.Array) -> jax.Array:
    """The power of two moved from the data into the scale: ``statistic`` rounded, at most
    2^126, so that the data's factor (old scale over new) stays a normal float32. At 2^127
    (float32 data of a largest magnitude in ``[2^127, 2^128)``) it was 2^-127, which XLA:CPU
    reads as zero: the rescaled data was all zeros."""
    return lax.min(pow2_round(statistic, current_config().rounding), np.float32(2.0**126))


def _rescaled_kind(norm: str) -> str:
    return f"dynamic_rescale/{norm}"


def _rescales_together(norm: str, operands: list[list[Any]]) -> None:
    """The new scales of several rescales (every new float16 master weight of a step) worked
    out on a vector, in one kernel and one division instead of one of each per tensor: the
    same arithmetic as :func:`_rebalanced`'s, elementwise. Each tensor's part leaves the
    vector apart (:func:`~jax_scaled.pow2.xla.computed_apart`; its ratio as bits, as it is
    below float32's normal range for data near 2^127 moved into a tiny scale) and waits in
    the per-call memo for :func:`dynamic_rescale_rule`."""
    xs = {id(x.data): x for (x,) in operands if _per_tensor_scaled(x)}
    xs = [x for x in xs.values() if isinstance(x.data, jxi.Tracer)]
    if len(xs) < 2:
        return
    magnitudes, largest = zip(*(_magnitudes(x.data, norm) for x in xs), strict=True)
    if any(m.dtype != jnp.float32 for m in magnitudes):  # float64 data: in its own precision
        parts = zip(magnitudes, largest, [x.dtype for x in xs], strict=True)
        statistics = jnp.stack([_own_statistic(*part, norm) for part in parts])
    else:
        statistics = _statistics_together(magnitudes, largest, norm, [x.dtype for x in xs])
    factors = _factor(statistics)
    scales = stacked_scalars([scale_f32(x) for x in xs])
    new_scales = computed_once_per_block(pow2_round_positive(scales * factors))
    ratios = scales / new_scales
    parts = zip(
        xs, computed_apart(new_scales), computed_apart(ratios, as_bits=True), largest, strict=True
    )
    for x, *part in parts:
        shared = (x.scale, *part)
        memoized(_rescaled_kind(norm), x.data, lambda shared=shared: shared)


def _statistics_together(
    magnitudes: tuple[jax.Array, ...],
    largest: tuple[jax.Array, ...],
    norm: str,
    dtypes: list[jnp.dtype],
) -> jax.Array:
    """The ``norm`` statistics (:func:`_statistic`) of several tensors' float32 magnitudes,
    as one vector: only the reductions are per tensor. The units (:func:`_unit`, 1 for data
    that needs none), their reciprocals, the mean's division, the square root and the
    product by the unit are worked out on vectors, elementwise, which gives the same floats
    (a product by a power of two's reciprocal is the division by it, both exact). Per
    tensor, each was a kernel of its own where XLA:CPU could not fuse it into the
    reduction's (a concatenate does not fuse its operands)."""
    if norm == "max":
        return jnp.stack(largest)
    with_unit = [_needs_unit(dtype, norm) for dtype in dtypes]
    units = None
    if any(with_unit):
        ones = np.ones((), np.float32)
        to_round = [m if needed else ones for m, needed in zip(largest, with_unit, strict=True)]
        units = computed_once_per_block(_unit(jnp.stack(to_round)))
        reciprocals = computed_apart(float_division(np.ones(units.shape, np.float32), units))
        magnitudes = tuple(map(lax.mul, magnitudes, reciprocals))
    sums = jnp.stack([_sum_statistic(m, norm) for m in magnitudes])
    means = _mean_statistic(sums / np.array([m.size for m in magnitudes], np.float32), norm)
    return means if units is None else means * units


def _per_tensor_scaled(x: Any) -> bool:
    """Whether the rule rescales ``x`` with one scale (not a plain array, not in blocks)."""
    return isinstance(x, ScaledArray) and x.scale.ndim == 0 and x.data.size > 0


register_together(dynamic_rescale_p, lambda params: params["norm"], _rescales_together)


def _data_statistic(data: jax.Array, norm: str) -> tuple[jax.Array, jax.Array]:
    """The ``norm`` statistic (``l1``, ``l2`` or ``max``) of ``data``, and its largest
    magnitude, as float32 scalars.

    Computed relative to the largest magnitude (itself rounded to a power of two), so that
    sums and squares neither overflow nor underflow whatever the data's magnitude. Data of a
    format with float16's range or less needs no such unit (:func:`_squares_fit_float32`):
    the statistic is then the same bit for bit, and its reduction no longer waits for the
    largest magnitude's (two passes over the data became one).
    """
    magnitude, largest = _magnitudes(data, norm)
    return _own_statistic(magnitude, largest, data.dtype, norm), largest


def _own_statistic(magnitude: jax.Array, largest: jax.Array, dtype, norm: str) -> jax.Array:
    """The ``norm`` statistic of ``dtype`` data of magnitudes ``magnitude``, relative to
    the unit of ``largest`` where ``dtype`` needs one."""
    unit = _unit(largest) if _needs_unit(dtype, norm) else None
    return _statistic(magnitude, largest, norm, unit)


def _magnitudes(data: jax.Array, norm: str) -> tuple[jax.Array, jax.Array]:
    """What ``norm`` sums, in ``data``'s compute dtype: ``|data|``, or ``data`` itself for
    ``l2``, whose squares are the same floats; and the largest magnitude as a float32 0-d.
    Squared without ``abs``, the data is read by two reductions and ``abs`` by one: XLA:CPU
    then fuses ``abs`` into the maximum, where shared by both it was a kernel of its own
    writing every magnitude (one per float32 master weight of a step)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}.")
    wide = data.astype(compute_dtype(data.dtype))
    magnitude = jnp.abs(wide)
    # Magnitudes are not negative: a maximum with 0 after the reduction only serves empty
    # data, and elsewhere it was a kernel of its own per tensor where rescales are stacked.
    largest = jnp.max(magnitude, initial=None if magnitude.size else 0)
    return (wide if norm == "l2" else magnitude), largest.astype(jnp.float32)


def _unit(largest: jax.Array) -> jax.Array:
    """The power of two that a statistic is taken relative to (elementwise): ``largest``
    rounded (1 for zero or non-finite), at most 2^126, so that its reciprocal is a normal
    float32. XLA:CPU divides data by a scalar as a product by its reciprocal, and reads a
    subnormal one as zero: relative to 2^127, data of a largest magnitude in
    ``[2^127, 2^128)`` had a zero statistic. Relative to 2^126 the statistic is the same
    float (every step scales exactly by the power of two)."""
    return lax.min(pow2_round(largest), np.float32(2.0**126))


def _needs_unit(dtype: jnp.dtype, norm: str) -> bool:
    """Whether the ``norm`` statistic of ``dtype`` data is taken relative to a unit."""
    return norm != "max" and not _squares_fit_float32(dtype)


def _statistic(
    magnitude: jax.Array, largest: jax.Array, norm: str, unit: jax.Array | None
) -> jax.Array:
    """The ``norm`` statistic of ``magnitude``, relative to ``unit`` (:func:`_unit` of the
    largest magnitude) unless it is None."""
    if norm == "max":
        return largest
    if unit is not None:
        magnitude = magnitude / unit.astype(magnitude.dtype)
    mean = _sum_statistic(magnitude, norm) / np.asarray(magnitude.size, magnitude.dtype)
    statistic = _mean_statistic(mean, norm).astype(jnp.float32)
    return statistic if unit is None else statistic * unit


def _sum_statistic(magnitude: jax.Array, norm: str) -> jax.Array:
    """The sum of ``magnitude`` (``l1``) or of its squares (``l2``)."""
    return jnp.sum(magnitude if norm == "l1" else jnp.square(magnitude))


def _mean_statistic(mean: jax.Array, norm: str) -> jax.Array:
    """The ``norm`` statistic from ``mean``: the mean magnitude (``l1``) or the mean square
    (``l2``, whose root it is)."""
    return mean if norm == "l1" else jnp.sqrt(mean)


def _squares_fit_float32(dtype: jnp.dtype) -> bool:
    """True when float32 squares of ``dtype`` data, and their sums, stay normal and finite:
    the largest below ``2^32`` (times up to ``2^90`` terms), the smallest nonzero above
    ``2^-126``. Every step of the statistic is then a correctly rounded float32 operation
    whose result scales exactly with the data's power of two, so the statistic computed
    relative to a power-of-two unit, times the unit, is the same float.

    Example:
        >>> _squares_fit_float32(jnp.float16), _squares_fit_float32(jnp.bfloat16)
        (True, False)
    """
    info = jnp.finfo(dtype)
    return info.maxexp <= 16 and float(info.smallest_subnormal) >= 2.0**-62


def _rebalanced(x: ScaledArray, factor: jax.Array, largest: jax.Array) -> ScaledArray:
    """``x`` with its scale multiplied by the power of two ``factor`` (clamped to the scale
    range) and its data divided by the same amount: the value is unchanged. ``largest``,
    the data's largest magnitude, is carried to the new data, multiplied as each datum is.

    The new scale is computed once (:func:`~jax_scaled.pow2.xla.computed_once`): derived
    from the data's statistic, it was worked out again in every kernel reading the rescaled
    data or its scale (3.5% of the 1-layer GPT's ``fp8_policy_scalify`` step, whose
    gradients and float16 master weights are rescaled every step). The largest magnitude
    spares a range guard of the new data (a cast of new float16 master weights) a reduction
    of its own: the product by a power of two is monotone, so the largest product is the
    largest datum's."""
    scale = scale_f32(x)
    new_scale = computed_once(pow2_round_positive(scale * factor))  # in [2^-126, 2^127]
    return _moved(x, new_scale, scale / new_scale, largest)


def _moved(
    x: ScaledArray, new_scale: jax.Array, ratio: jax.Array, largest: jax.Array
) -> ScaledArray:
    """``x`` at ``new_scale``, its data multiplied by ``ratio`` (the old scale over the new),
    its largest magnitude ``largest`` recorded for the new data."""
    data = rescale(x.data, ratio)
    if x.data.dtype == jnp.float32:
        record_largest_magnitude(data, rescale(largest, ratio))
    return ScaledArray(data, make_scale(new_scale, x))
