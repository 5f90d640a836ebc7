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
from jax_scaled.pow2.static import static_pow2_round

Estimate = float | None
EstimateRule = Callable[..., Estimate]  # rule(estimates, *, shapes, **params) -> estimate


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


# Estimate rules, named in the primitive records (jax_scaled.engine.registry): each takes
# the inputs' estimates, their shapes and the primitive's params, and returns the output's estimate.


def first(estimates, **params) -> Estimate:
    """The first input's estimate (layout ops, selections of one operand, ``neg``)."""
    return estimates[0]


def largest(estimates, **params) -> Estimate:
    """The largest input estimate (``max``, ``concatenate``)."""
    if all(e is None for e in estimates):
        return None
    return max(_known(estimates))


def largest_case(estimates, **params) -> Estimate:
    """``select_n``: the largest case; the predicate carries no magnitude."""
    return largest(estimates[1:])


def product(estimates, **params) -> Estimate:
    """The product of the estimates (``mul``)."""
    if all(e is None for e in estimates):
        return None
    return round_estimate(math.prod(_known(estimates)))


def quotient(estimates, **params) -> Estimate:
    """The quotient of the two estimates (``div``)."""
    if all(e is None for e in estimates):
        return None
    numerator, denominator = _known(estimates)
    return round_estimate(numerator / denominator)


def sum_of_squares(estimates, **params) -> Estimate:
    """``sqrt`` of the sum of squared estimates: a sum of independent terms (``add``)."""
    if all(e is None for e in estimates):
        return None
    return round_estimate(math.sqrt(sum(e * e for e in _known(estimates))))


def reduced_sum(estimates, *, shapes, axes, **params) -> Estimate:
    """``reduce_sum`` over N elements: the estimate times ``sqrt(N)``."""
    count = math.prod(shapes[0][a] for a in axes)
    return round_estimate(_known(estimates)[0] * math.sqrt(count))


def contraction(estimates, *, shapes, dimension_numbers, **params) -> Estimate:
    """``dot_general`` over K terms: the product of the estimates times ``sqrt(K)``."""
    (contracting, _), _ = dimension_numbers
    count = math.prod(shapes[0][d] for d in contracting)
    return round_estimate(math.prod(_known(estimates)) * math.sqrt(count))


def unit(estimates, **params) -> Estimate:
    """O(1) values whatever the input (``exp``, ``logistic``, ``cos``)."""
    return 1.0


def propagate(
    rule: EstimateRule | None,
    estimates: Sequence[Estimate],
    shapes: Sequence[tuple],
    params: dict,
) -> Estimate:
    """The estimate of a forwarded primitive's (first) output from its inputs' estimates, by
    the primitive's estimate ``rule`` (None: no estimate).

    Example:
        >>> propagate(product, [2.0**-6, None], [(3,), (3,)], {})
        0.015625
    """
    if rule is None:
        return None
    return rule(list(estimates), shapes=list(shapes), **params)


def cast_estimate(estimate: Estimate, from_float: bool) -> Estimate:
    """Casts keep a float value's estimate; a bool/int cast to float gives O(1) values."""
    return estimate if from_float else 1.0
