"""Trace-time (static) power-of-two arithmetic: Python and numpy, nothing staged.

Scale rules compute a scale at trace time wherever they can (the ``sqrt(K)`` of a matmul,
the mantissa and power of two of a constant operand): a static scale costs nothing in the
compiled program and lets later rules fold it too. Every function here is exact: its result
is a power of two (or an exact mantissa of one) in float32's normal range
``[2^-126, 2^127]``, the range of every scale (see :mod:`jax_scaled.scales`).

Example:
    >>> static_pow2_split(-6.0), static_pow2_round(3.0, "up")
    ((-1.5, 4.0), 4.0)
"""

from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np

MIN_SCALE_EXPONENT = -126
MAX_SCALE_EXPONENT = 127

MANTISSA_BITS = 23
EXPONENT_BIAS = 127  # float32's
EXPONENT_FIELD = np.uint32(0xFF << MANTISSA_BITS)  # float32's exponent bits: inf's pattern
SQRT2_MANTISSA_BITS = 0x3504F3  # mantissa bits of sqrt(2) in float32


class Rounding(enum.StrEnum):
    """How a positive value is rounded to a power of two.

    ``DOWN`` (the default, as the scalify paper recommends), ``UP``, or ``NEAREST`` (in log2).

    Example:
        >>> [static_pow2_round(3.0, r) for r in (Rounding.DOWN, Rounding.UP, "nearest")]
        [2.0, 4.0, 4.0]
    """

    DOWN = "down"
    UP = "up"
    NEAREST = "nearest"


def is_static(x: Any) -> bool:
    """True for a trace-time constant (a numpy value or Python number), as rules produce
    for scales known without tracing (``scale 1`` of ``exp``, a constant operand's).

    Example:
        >>> is_static(np.float32(1.0)), is_static(jnp.float32(1.0))
        (True, False)
    """
    return isinstance(x, np.ndarray | np.generic | float | int)


def is_static_one(x: Any) -> bool:
    """True for a trace-time constant 0-d 1: a factor that rules leave out rather than stage a
    product by it (an equation to trace, lower and compile that changes nothing).

    Example:
        >>> is_static_one(np.float32(1.0)), is_static_one(np.ones(2)), is_static_one(jnp.float32(1))
        (True, False, False)
    """
    return is_static(x) and np.ndim(x) == 0 and bool(np.float32(x) == 1)


def is_pow2(x) -> np.ndarray:
    """True where ``x`` (a concrete array) is an exact positive power of two.

    Example:
        >>> bool(is_pow2(np.float32(0.125))), bool(is_pow2(np.float32(0.3)))
        (True, False)
    """
    x = np.asarray(x, dtype=np.float64)
    mantissa, _ = np.frexp(x)
    return (x > 0) & np.isfinite(x) & (mantissa == 0.5)


def static_pow2_round(value: float, rounding: Rounding | str = Rounding.DOWN) -> float:
    """Trace-time :func:`pow2_round` of a Python float (same rounding and clamping).

    Example:
        >>> static_pow2_round(3.0), static_pow2_round(3.0, "up")
        (2.0, 4.0)
    """
    rounding = Rounding(rounding)
    value = abs(float(value))
    if value == 0 or not np.isfinite(value):
        return 1.0
    mantissa, exponent = np.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent -= 1
    if rounding is Rounding.UP and mantissa != 0.5:
        exponent += 1
    elif rounding is Rounding.NEAREST and 2 * mantissa >= np.sqrt(2.0):
        exponent += 1
    return 2.0 ** int(np.clip(exponent, MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT))


def static_pow2_split(value: float) -> tuple[float, float]:
    """Trace-time :func:`pow2_split` (round down) of a Python float: ``(mantissa, scale)``.

    Example:
        >>> static_pow2_split(-6.0)
        (-1.5, 4.0)
    """
    scale = static_pow2_round(value)
    return float(value) / scale, scale


def static_pow2_exponent(value: float) -> int:
    """The integer ``e`` with ``value == 2^e``, for a static power of two.

    Example:
        >>> static_pow2_exponent(0.25), static_pow2_exponent(32.0)
        (-2, 5)
    """
    mantissa, exponent = math.frexp(value)
    if mantissa != 0.5:
        raise ValueError(f"{value} is not a power of two")
    return exponent - 1


def static_pow2_bits(exponent: int) -> np.uint32:
    """The float32 bit pattern of ``2^exponent`` (its exponent field) as a uint32 literal.
    An exponent past float32's range gives a pattern past inf's (into the sign bit, still a
    uint32), for arithmetic that subtracts back into range.

    Example:
        >>> hex(static_pow2_bits(0)), static_pow2_bits(128) == EXPONENT_FIELD
        ('0x3f800000', np.True_)
    """
    return np.uint32((exponent + EXPONENT_BIAS) << MANTISSA_BITS)


# Added to the float32 bits of a positive value before masking out the mantissa: rounding
# down adds nothing, up carries any non-zero mantissa into the exponent, nearest carries a
# mantissa at or above sqrt(2).
