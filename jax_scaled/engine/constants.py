"""The program's constants as the user wrote them, when a narrow trace rounded them away.

JAX gives a Python number the dtype of the array it meets, while it traces. In a float16
program, optax's ``eps=1e-8`` becomes a float16 literal ``0.0`` (float16's smallest
subnormal is ``2^-24``, about ``6e-8``), and ``1e5`` becomes ``inf``: the program scalify
receives is already another program, whatever the scales. A ScaledArray holds ``1e-8``
without trouble (a float16 mantissa times ``2^-27``), so scalify recovers such constants:

1. it looks for narrow-float literals (float16, bfloat16, float8) that are zero, subnormal or
   infinite in their dtype, in the jaxpr and its sub-jaxprs; most programs have some (the
   ``0.0`` of a ReLU). The zeros that differentiation writes (a slice's transpose pads with
   them) are true zeros and do not count (:func:`differentiation_zero`);
2. it traces the same function once more on float32 inputs (tracing only, nothing compiled);
3. it aligns the equations of the two traces (the float32 one lacks the casts that are no-ops
   there) and, where a suspicious literal's float32 counterpart is another number that rounds
   to the same narrow value, records that number as the literal's true value.

The interpreter then gives such a literal its true value as a static fact: where it meets a
ScaledArray it is promoted exactly (see :mod:`jax_scaled.engine.promotion`), and folded constants
and casts keep it (see :mod:`jax_scaled.engine.interpreter`), and an output that is such a
constant comes back as a ScaledArray of it (the gradient of ``jnp.sum(x * 1e-8)``). A
suspicious literal that cannot be matched triggers one :class:`ConstantPrecisionWarning`
naming it and its source line.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.dtypes import is_narrow_float


class ConstantPrecisionWarning(UserWarning):
    """A constant of a float16/float8 program may have been rounded away by JAX's trace,
    and scalify could not recover the value written in the source.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():  # make it an error, to be told at once
        ...     warnings.simplefilter("error", ConstantPrecisionWarning)
        ...     out = scalify(lambda x: x + 1e-8)(scaled_array(jnp.ones(2, jnp.float16), 1.0))
        >>> out.dtype  # 1e-8 recovered here (the float32 trace aligns): no warning
        dtype('float16')
    """


class TrueConstants:
    """The true values of the literals a narrow trace rounded, keyed by literal identity.

    Example:
        >>> TrueConstants().get(object()) is None
        True
    """

    def __init__(self) -> None:
        self._values: dict[int, tuple[Any, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def add(self, literal: Any, value: float) -> None:
        self._values[id(literal)] = (literal, value)  # the literal is kept: its id stays its own

    def get(self, literal: Any) -> float | None:
        entry = self._values.get(id(literal))
        return None if entry is None or entry[0] is not literal else entry[1]


@contextlib.contextmanager
def true_constants(found: TrueConstants) -> Iterator[None]:
    """A block in which :func:`true_value` answers from ``found`` (a scalify call's context
    holds those of the call).

    Example:
        >>> with true_constants(TrueConstants()):
        ...     true_value(object()) is None
        True
    """
    with context.entered(constants=found):
        yield


def true_value(literal: Any) -> float | None:
    """The value the source wrote for a literal the trace rounded away; None for the others."""
    found = context.current().constants
    return found.get(literal) if found else None


def is_rounded_away(value: Any) -> bool:
    """True for a narrow-float scalar that a rounding may have produced from another number:
    zero, subnormal or infinite in its dtype, or NaN (what the float8 ``fn`` formats, which
    have no infinity, give on overflow).

    Example:
        >>> is_rounded_away(np.float16(0.0)), is_rounded_away(np.float16(1e-6))
        (True, True)
        >>> is_rounded_away(np.float16(0.5)), is_rounded_away(np.float32(0.0))
        (False, False)
    """
    value = np.asarray(value)
    if value.ndim != 0 or not is_narrow_float(value.dtype):
        return False
    magnitude = abs(float(value))
    smallest_normal = float(ml_dtypes.finfo(value.dtype).smallest_normal)
    return not magnitude >= smallest_normal or magnitude == np.inf


def holds(dtype: Any, value: float) -> bool:
    """True if ``dtype`` holds ``value`` within its range (rounding its mantissa is fine).

    Example:
        >>> holds(jnp.float16, 1e-3), holds(jnp.float16, 1e-8), holds(jnp.float16, 0.0)
        (True, False, True)
    """
    if not np.isfinite(value):
        return True
    with np.errstate(over="ignore"):
        cast = np.asarray(value).astype(dtype)
    return not is_rounded_away(cast) or float(cast) == value


def rounded_to_precision(value: float, dtype: Any) -> float:
    """``value`` cast to a float ``dtype`` with the range of a scaled value: its mantissa is
    rounded to ``dtype``'s precision, its power of two kept (as a cast of scaled data does).

    Example:
        >>> rounded_to_precision(1e-8, jnp.float16) == float(np.float16(1e-8 * 2**27)) / 2**27
        True
        >>> rounded_to_precision(0.1, jnp.float32) == float(np.float32(0.1))
        True
    """
    if holds(dtype, value):
        with np.errstate(over="ignore"):
            return float(np.asarray(value, np.float64).astype(dtype))
    mantissa, exponent = np.frexp(value)
    return float(np.ldexp(float(np.asarray(mantissa, dtype)), int(exponent)))


def suspicious_literals(jaxpr: jxi.Jaxpr) -> Iterator[tuple[jxi.JaxprEqn, jxi.Literal]]:
    """Every literal operand of ``jaxpr`` (sub-jaxprs included) that is rounded away.

    Example:
        >>> f = lambda x: x + 1e-8
        >>> closed = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((2,), jnp.float16))
        >>> [float(lit.val) for _, lit in suspicious_literals(closed.jaxpr)]
        [0.0]
    """
    for eqn in jaxpr.eqns:
        for atom in eqn.invars:
            if isinstance(atom, jxi.Literal) and is_rounded_away(atom.val):
                if not differentiation_zero(eqn, atom):
                    yield eqn, atom
        for sub in _sub_jaxprs(eqn.params):
            yield from suspicious_literals(sub)


# The zeros that JAX's differentiation writes: the padding of a slice's transpose, the
# zeros a gather's or a dynamic slice's transpose scatters into, the missing pieces of a
# split's. Their equations keep the source of the forward operation, by which they are
# told apart from a user's own pad or fill, whose traceback names jax.lax.pad, full,
# broadcast_in_dim... (a traceback that names neither keeps its literal suspicious).
_DIFFERENTIATION_ZEROS = {
    (lax.pad_p, "slice"), (lax.pad_p, "_slice_jvp_rule"), (lax.broadcast_in_dim_p, "gather"),
    (lax.broadcast_in_dim_p, "_dynamic_slice_jvp"), (lax.broadcast_in_dim_p, "split"),
}  # fmt: skip


def differentiation_zero(eqn: jxi.JaxprEqn, literal: jxi.Literal) -> bool:
    """True for a zero literal that JAX's differentiation wrote (a transpose's padding or
    fill): a true zero, which needs no float32 trace to recover it. A GPT's backward pass
    has such zeros and often no other rounded literal, so its float32 trace is saved.

    Example:
        >>> f = jax.grad(lambda x: jnp.sum(x[1:] * 2.0))  # the slice's transpose pads with 0
        >>> closed = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((4,), jnp.float16))
        >>> pad = closed.jaxpr.eqns[-1]
        >>> pad.primitive.name, differentiation_zero(pad, pad.invars[1])
        ('pad', True)
    """
    zero = float(literal.val) == 0.0
    return zero and (eqn.primitive, jxi.eqn_lax_origin(eqn)) in _DIFFERENTIATION_ZEROS


def recover_constants(
    narrow: jxi.ClosedJaxpr, trace_wide: Callable[[], jxi.ClosedJaxpr]
) -> TrueConstants:
    """The true values of ``narrow``'s rounded-away literals, read off ``trace_wide()``.

    ``trace_wide`` traces the same function on float32 inputs; it is called only when
    ``narrow`` has a literal that is zero, subnormal or infinite in a narrow float dtype.
    Literals that cannot be matched are reported by a :class:`ConstantPrecisionWarning`.

    Example:
        >>> f = lambda x: jnp.sqrt(x) + 1e-8
        >>> trace = lambda dtype: jax.make_jaxpr(f)(jax.ShapeDtypeStruct((2,), dtype))
        >>> found = recover_constants(trace(jnp.float16), lambda: trace(jnp.float32))
        >>> len(found)
        1
    """
    found = TrueConstants()
    pending = list(suspicious_literals(narrow.jaxpr))
    if not pending:
        return found
    try:
        wide = trace_wide()
    except Exception as error:  # a program that only traces in its own dtypes
        _warn_unmatched(pending, f"tracing it on float32 inputs failed ({error!r})")
        return found
    matched: set[int] = set()
    _match_jaxprs(narrow.jaxpr, wide.jaxpr, found, matched)
    unmatched = [(eqn, lit) for eqn, lit in pending if id(lit) not in matched]
    _warn_unmatched(unmatched, "its equation has no counterpart in the float32 trace")
    return found


def _match_jaxprs(narrow: jxi.Jaxpr, wide: jxi.Jaxpr, found: TrueConstants, matched: set) -> None:
    """Align the equations of two traces and read each rounded literal's wide counterpart."""
    # Casts exist in a narrow trace and are no-ops (absent) in the float32 one, or the reverse.
    narrow_eqns = [e for e in narrow.eqns if e.primitive is not lax.convert_element_type_p]
    wide_eqns = [e for e in wide.eqns if e.primitive is not lax.convert_element_type_p]
    matcher = difflib.SequenceMatcher(
        None, [_signature(e) for e in narrow_eqns], [_signature(e) for e in wide_eqns],
        autojunk=False,
    )  # fmt: skip
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            _match_eqns(narrow_eqns[block.a + offset], wide_eqns[block.b + offset], found, matched)


def _signature(eqn: jxi.JaxprEqn) -> tuple:
    return eqn.primitive.name, len(eqn.invars), len(eqn.outvars)


def _match_eqns(
    narrow: jxi.JaxprEqn, wide: jxi.JaxprEqn, found: TrueConstants, matched: set
) -> None:
    for atom, twin in zip(narrow.invars, wide.invars, strict=True):
        if isinstance(atom, jxi.Literal) and is_rounded_away(atom.val):
            value = _true_value(atom, twin)
            if value is not None:
                matched.add(id(atom))
                if not math.isnan(value) and value != float(atom.val):
                    found.add(atom, value)
    narrow_subs, wide_subs = list(_sub_jaxprs(narrow.params)), list(_sub_jaxprs(wide.params))
    if len(narrow_subs) == len(wide_subs):
        for narrow_sub, wide_sub in zip(narrow_subs, wide_subs, strict=True):
            _match_jaxprs(narrow_sub, wide_sub, found, matched)


def _true_value(literal: jxi.Literal, twin: Any) -> float | None:
    """The wide literal's value if it rounds to the narrow one (the same constant), else None."""
    if not isinstance(twin, jxi.Literal) or np.ndim(twin.val) != 0:
        return None
    if not jnp.issubdtype(np.asarray(twin.val).dtype, jnp.floating):
        return None
    value = float(twin.val)
    narrow = float(literal.val)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = float(np.asarray(value).astype(np.asarray(literal.val).dtype))
    same = rounded == narrow or (np.isnan(rounded) and np.isnan(narrow))
    return value if same else None


def _sub_jaxprs(params: dict) -> Iterator[jxi.Jaxpr]:
    """The jaxprs among an equation's parameters (``jit``'s, ``scan``'s, ``cond``'s branches...)."""
    for name in sorted(params):
        yield from _jaxprs_in(params[name])


def _jaxprs_in(value: Any) -> Iterator[jxi.Jaxpr]:
    if isinstance(value, jxi.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jxi.Jaxpr):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _jaxprs_in(item)


def _warn_unmatched(pending: list, reason: str) -> None:
    """One warning naming the literals that could not be checked (zeros included: a zero may
    be ``1e-8`` rounded, as likely as a ReLU's own zero)."""
    if not pending:
        return
    shown = [
        f"{float(literal.val)} ({literal.aval.dtype}) at {jxi.eqn_source_line(eqn)}"
        for eqn, literal in pending[:_SHOWN]
    ]
    more = f" and {len(pending) - _SHOWN} more" if len(pending) > _SHOWN else ""
    warnings.warn(
        "scalify: these constants of a narrow-precision program may be smaller or larger "
        f"numbers that JAX rounded when it traced the program, and scalify could not recover "
        f"them ({reason}): {'; '.join(shown)}{more}. Write such a constant in a dtype that "
        "holds it, or scale it.",
        ConstantPrecisionWarning,
        stacklevel=4,
    )


_SHOWN = 5
