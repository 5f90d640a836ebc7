"""Static scale estimates of plain (unscaled) values inside a scalified program.

Plain values run untouched through scalify, but many of them later meet a ScaledArray: the
cotangent seed of ``jax.grad`` (``1/batch`` times a one-hot mask), a mask times a constant,
a mean's ``1/N``. When that happens the interpreter must give the plain value a scale. Rather
than assume scale 1 (off by ``2^8`` for a cross-entropy cotangent) or measure the data (a
hidden statistic), it tracks, at trace time, a power-of-two estimate of each plain value's
magnitude, propagated with the same unit-scaling rules the scale rules use. The program's
graph is unchanged: estimates are Python floats, used only when a value is promoted.

A value with no estimate (a plain program input) counts as scale 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from jax_scaled.config import current_config
from jax_scaled.pow2 import static_pow2_round

Estimate = float | None
EstimateRule = Callable[..., Estimate]


def round_estimate(value: float) -> Estimate:
    """A positive estimate rounded to a power of two (configured rounding); None if unusable."""
    if not math.isfinite(value) or value <= 0:
        return None
    return static_pow2_round(value, current_config().rounding)


def of_constant(value: float) -> Estimate:
    """The estimate of a known scalar constant: its power of two (None for 0, inf, nan)."""
    return round_estimate(abs(value))


def _known(estimates: Sequence[Estimate]) -> list[float]:
    return [1.0 if e is None else e for e in estimates]


def _first(estimates, **params) -> Estimate:
    return estimates[0]


def _largest(estimates, **params) -> Estimate:
    if all(e is None for e in estimates):
        return None
    return max(_known(estimates))


def _largest_case(estimates, **params) -> Estimate:
    return _largest(estimates[1:])  # select_n: the predicate carries no magnitude


def _product(estimates, **params) -> Estimate:
    if all(e is None for e in estimates):
        return None
    return round_estimate(math.prod(_known(estimates)))


def _quotient(estimates, **params) -> Estimate:
    if all(e is None for e in estimates):
        return None
    numerator, denominator = _known(estimates)
    return round_estimate(numerator / denominator)


def _sum_of_squares(estimates, **params) -> Estimate:
    if all(e is None for e in estimates):
        return None
    return round_estimate(math.sqrt(sum(e * e for e in _known(estimates))))


def _reduced_sum(estimates, *, shapes, axes, **params) -> Estimate:
    count = math.prod(shapes[0][a] for a in axes)
    return round_estimate(_known(estimates)[0] * math.sqrt(count))


def _contraction(estimates, *, shapes, dimension_numbers, **params) -> Estimate:
    (contracting, _), _ = dimension_numbers
    count = math.prod(shapes[0][d] for d in contracting)
    return round_estimate(math.prod(_known(estimates)) * math.sqrt(count))


def _unit(estimates, **params) -> Estimate:
    return 1.0  # exp, logistic, casts from bool/int: O(1) values


_RULES: dict[str, EstimateRule] = {
    **dict.fromkeys(
        [
            "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
            "rev", "copy", "copy_p", "neg", "abs", "stop_gradient", "reduce_max", "reduce_min",
            "dynamic_slice", "gather", "cumsum", "pad", "reduce_precision", "sort", "tile",
        ],
        _first,
    ),
    **dict.fromkeys(["max", "min", "concatenate", "clamp"], _largest),
    "select_n": _largest_case,
    "mul": _product,
    "div": _quotient,
    **dict.fromkeys(["add", "sub", "add_any"], _sum_of_squares),
    "reduce_sum": _reduced_sum,
    "dot_general": _contraction,
    **dict.fromkeys(["exp", "exp2", "logistic", "cos", "erfc"], _unit),
}  # fmt: skip


def propagate(
    name: str, estimates: Sequence[Estimate], shapes: Sequence[tuple], params: dict
) -> Estimate:
    """The estimate of a forwarded primitive's (first) output from its inputs' estimates.

    Example:
        >>> propagate("mul", [2.0**-6, None], [(3,), (3,)], {})
        0.015625
    """
    rule = _RULES.get(name)
    if rule is None:
        return None
    return rule(list(estimates), shapes=list(shapes), **params)


def cast_estimate(estimate: Estimate, from_float: bool) -> Estimate:
    """Casts keep a float value's estimate; a bool/int cast to float gives O(1) values."""
    return estimate if from_float else 1.0
