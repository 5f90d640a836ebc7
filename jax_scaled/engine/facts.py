"""Plain-value facts: what scalify knows statically about the values of a jaxpr.

Each value of an interpreted jaxpr travels in a :class:`Slot`: the value itself (a plain
array or a ScaledArray) and what is known about it at trace time: the constant it is a
broadcast of, the 0-d array it broadcasts, a power-of-two estimate of its magnitude
(:mod:`jax_scaled.engine.estimates`) and whether it is the same at any scale (:data:`ANY_SCALE`).
An equation with no scaled operand is bound as it is (:func:`forwarded`), and its outputs'
facts are derived from its operands' by the properties of its primitive's record
(:mod:`jax_scaled.engine.registry`). Where a plain value with facts meets a ScaledArray, the facts
make it one (:mod:`jax_scaled.engine.promotion`).

Example:
    >>> slot = constant_slot(np.float32(0.5))
    >>> slot.constant, slot.estimate, slot.is_any_scale
    (0.5, 0.5, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine import constants, estimates
from jax_scaled.engine.registry import Property, record


@dataclasses.dataclass(frozen=True)
class Slot:
    """A jaxpr value during interpretation, with its static facts.

    ``constant`` is the Python value of a broadcast scalar known at trace time (a literal,
    a folded constant). ``base`` is the 0-d array the value is a broadcast of, when known.
    ``estimate`` is a static power-of-two estimate of a plain value's magnitude (see
    :mod:`jax_scaled.engine.estimates`), used to scale it if it meets a ScaledArray.
    ``any_scale`` says the value does not depend on its scale (:data:`ANY_SCALE`: zeros,
    infinities, NaNs and selections among them), so it takes the scale of what it meets.
    ``scalar_chain`` counts the scale rules behind a 0-d ScaledArray since its data and scale
    were last stored (:func:`~jax_scaled.engine.fusion.scalar_chains_bounded`).
    ``finer`` holds the value at finer (block) scales where ``value`` is it brought to one
    scale (a scan's stacked rows, each at its own scale): rules with the property
    ``READS_FINER_SCALES`` read it instead, exactly.
    """

    value: Value
    constant: float | None = None
    base: jax.Array | None = None
    estimate: float | None = None
    any_scale: bool = False
    scalar_chain: int = 0
    finer: ScaledArray | None = None

    @property
    def is_scaled(self) -> bool:
        return isinstance(self.value, ScaledArray)

    @property
    def is_any_scale(self) -> bool:
        """True for scale-independent values: marked ones, and constants 0, ±inf, NaN."""
        if self.any_scale or self.constant is None:
            return self.any_scale
        return self.constant == 0 or not math.isfinite(self.constant)

    @property
    def has_fact(self) -> bool:
        """True for a known broadcast of a scalar (a constant, or a traced 0-d base)."""
        return self.base is not None or self.constant is not None

    def static_facts(self) -> dict:
        """The trace-time (Python-level) facts, which may leave a nested trace."""
        return {"constant": self.constant, "estimate": self.estimate, "any_scale": self.any_scale}


def constant_slot(value: Any, true_value: float | None = None) -> Slot:
    """The slot of a trace-time constant; ``true_value`` is the number the source wrote when
    the narrow trace rounded it away (see :mod:`jax_scaled.engine.constants`).

    Example:
        >>> constant_slot(np.float16(0.0), true_value=1e-8).constant
        1e-08
    """
    if isinstance(value, ScaledArray) or isinstance(value, jxi.Tracer):
        return Slot(value)
    if np.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.floating):
        constant = float(value) if true_value is None else true_value
        return Slot(value, constant=constant, base=value, estimate=estimates.of_constant(constant))
    if np.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.integer):
        # Its value only: a float cast of it is a constant (jnp.where(x < -1, -1, x) casts
        # the int -1 inside a jit), not a traced scalar that a selection aligns x to.
        return Slot(value, constant=float(value))
    if _is_scale_free_array(value):  # a closed-over mask of 0 and -inf: any scale fits it
        return Slot(value, any_scale=True)
    return Slot(value)


def _is_scale_free_array(value: Any) -> bool:
    """True for a concrete floating array of zeros, infinities and NaNs only."""
    if not (hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)):
        return False
    values = np.asarray(value, np.float32)
    return values.size > 0 and bool(np.all((values == 0) | ~np.isfinite(values)))


def plain_slot(value: Any) -> Slot:
    """The slot of a plain value with no known fact (a 0-d float is its own base).

    Example:
        >>> plain_slot(jnp.float32(2.0)).has_fact
        True
    """
    is_float_scalar = np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.floating)
    return Slot(value, base=value if is_float_scalar else None)


def rebound(slot: Slot, value: Value) -> Slot:
    """``slot``'s static facts for ``value``, the same value seen inside a traced function.

    Example:
        >>> rebound(constant_slot(np.float32(3.0)), jnp.ones(())).constant
        3.0
    """
    base = value if slot.base is slot.value else slot.base
    return dataclasses.replace(slot, value=value, base=base)


def with_static_facts(value: Value, facts: dict) -> Slot:
    """A slot of ``value`` with the trace-time facts of :meth:`Slot.static_facts`."""
    if isinstance(value, ScaledArray):
        return Slot(value, **facts)
    return dataclasses.replace(plain_slot(value), **facts)


# ---------------------------------------------------------------------------------------
# Facts of a forwarded equation (no scaled operand: bound as it is)
# ---------------------------------------------------------------------------------------


def forwarded(eqn: jxi.JaxprEqn, in_slots: list[Slot], outs: list) -> list[Slot]:
    """The slots of a forwarded equation's outputs ``outs``: broadcast-scalar facts, the
    scale-free fact and the magnitude estimate, by the primitive's record."""
    found = record(eqn.primitive)
    out_slots = _broadcast_facts(eqn, found, in_slots, outs)
    if _keeps_any_scale(eqn, found, in_slots) and not out_slots[0].is_any_scale:
        out_slots[0] = dataclasses.replace(out_slots[0], any_scale=True)
    if len(out_slots) == 1 and jnp.issubdtype(out_slots[0].value.dtype, jnp.floating):
        constant = out_slots[0].constant
        if constant is not None:
            estimate = estimates.of_constant(constant)
        else:
            estimate = _forwarded_estimate(eqn, found, in_slots)
        out_slots[0] = dataclasses.replace(out_slots[0], estimate=estimate)
    return out_slots


def _forwarded_estimate(eqn: jxi.JaxprEqn, found: Any, in_slots: list[Slot]) -> float | None:
    if eqn.primitive is jax.lax.convert_element_type_p:
        from_float = jnp.issubdtype(in_slots[0].value.dtype, jnp.floating)
        return estimates.cast_estimate(in_slots[0].estimate, from_float)
    return estimates.propagate(
        found.estimate,
        [s.estimate for s in in_slots],
        [tuple(np.shape(s.value)) for s in in_slots],
        eqn.params,
    )


def _broadcast_facts(eqn: jxi.JaxprEqn, found: Any, in_slots: list[Slot], outs: list) -> list:
    source = in_slots[0] if in_slots else None
    if source is not None and source.has_fact:
        if found.has(Property.SHAPE_ONLY):
            return [Slot(outs[0], constant=source.constant, base=source.base)]
        if found.facts is not None:
            return [found.facts(eqn, in_slots, outs[0])]
        if found.has(Property.FOLDS_SCALARS) and all(s.has_fact for s in in_slots):
            return [_elementwise_fact(eqn, in_slots, outs[0])]
    return [plain_slot(v) for v in outs]


def _keeps_any_scale(eqn: jxi.JaxprEqn, found: Any, in_slots: list[Slot]) -> bool:
    """Scale-free inputs give a scale-free output through ANY_SCALE_PRESERVING primitives
    (all float inputs scale-free) and ABSORBING ones (any of them: ``0 * x``, ``x / 0``)."""
    preserving, absorbing = found.has(Property.ANY_SCALE_PRESERVING), found.has(Property.ABSORBING)
    if not (preserving or absorbing) or len(eqn.outvars) != 1:
        return False
    if not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return False
    floats = [s for s in in_slots if jnp.issubdtype(s.value.dtype, jnp.floating)]
    if absorbing:
        return any(s.is_any_scale for s in floats)
    return bool(floats) and all(s.is_any_scale for s in floats)


def _scalar_of(slot: Slot) -> Any:
    """The 0-d value a broadcast-scalar slot repeats."""
    if slot.base is not None:
        return slot.base
    return np.asarray(slot.constant, slot.value.dtype)


def _elementwise_fact(eqn: jxi.JaxprEqn, in_slots: list[Slot], out: Any) -> Slot:
    """An elementwise op of broadcast scalars: apply it to the scalars themselves."""
    if np.ndim(out) == 0:
        base = out  # the equation itself already computed the scalar
    else:
        base = eqn.primitive.bind(*[_scalar_of(s) for s in in_slots], **eqn.params)
    constant = None
    if all(s.constant is not None for s in in_slots):
        constant = fold_constant(eqn, _fold_operands(in_slots))
    return Slot(out, constant=constant, base=base)


def _fold_operands(in_slots: list[Slot]) -> list[np.ndarray]:
    """The constants of ``in_slots`` as scalars of their dtype, or of float32 where a narrow
    dtype cannot hold one of them (a constant the narrow trace rounded away, such as
    ``eps=1e-8`` in float16: the float32 program folds it in float32)."""
    dtypes = [s.value.dtype for s in in_slots]
    if not all(constants.holds(d, s.constant) for d, s in zip(dtypes, in_slots, strict=True)):
        dtypes = [compute_dtype(d) for d in dtypes]
    return [np.asarray(s.constant, d) for d, s in zip(dtypes, in_slots, strict=True)]


def fold_constant(eqn: jxi.JaxprEqn, scalars: list[np.ndarray]) -> float:
    """The value of an elementwise equation on constant scalars, at trace time. Operations
    whose record has a ``fold`` (numpy, correctly rounded like XLA) fold in numpy; the rest
    runs through XLA (compiled once per primitive and dtype in a process: tens of ms)."""
    fold = record(eqn.primitive).fold
    if fold is not None and all(jnp.issubdtype(s.dtype, jnp.floating) for s in scalars):
        with np.errstate(all="ignore"):
            return float(np.asarray(fold(*scalars), scalars[0].dtype))
    with jax.ensure_compile_time_eval():
        return float(eqn.primitive.bind(*scalars, **eqn.params))


def summed_fact(eqn: jxi.JaxprEqn, in_slots: Sequence[Slot], out: Any) -> Slot:
    """``reduce_sum`` of a broadcast scalar c over N elements is the broadcast scalar N * c."""
    source = in_slots[0]
    count = math.prod(source.value.shape[a] for a in eqn.params["axes"])
    constant = None if source.constant is None else source.constant * count
    base = _scalar_of(source) * np.asarray(count, source.value.dtype)
    return Slot(out, constant=constant, base=base)


def converted_fact(eqn: jxi.JaxprEqn, in_slots: Sequence[Slot], out: Any) -> Slot:
    """Facts of a broadcast scalar after a cast (kept only for float-to-float casts). A
    constant keeps its range: a narrowing cast rounds its mantissa only, as a cast of scaled
    data does (the cast of ``1e-8`` to float16 is still ``1e-8``, to float16's precision)."""
    source = in_slots[0]
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return plain_slot(out)
    constant = None
    if source.constant is not None:
        constant = constants.rounded_to_precision(source.constant, out.dtype)
    base = None if source.base is None else jnp.asarray(source.base).astype(out.dtype)
    return Slot(out, constant=constant, base=base)
