"""The primitive registry: one record per primitive, everything scalify knows about it.

A :class:`PrimitiveRecord` holds a primitive's scale rule (or, for a primitive with
sub-jaxprs, its higher-order rule), whether the rule also runs on plain operands, the
properties the interpreter's plain-value facts and the promotion of plain operands rely on
(:class:`Property`), how a static magnitude estimate propagates through it
(:mod:`jax_scaled.engine.estimates`) and how a trace-time constant folds through it
(:mod:`jax_scaled.engine.facts`). Records are keyed by primitive object. A rule module registers
its primitives with :func:`register_scale_rule` or :func:`register_higher_order_rule`;
families share a table and a loop.

Example:
    >>> from jax import lax
    >>> record(lax.mul_p).has(Property.MULTIPLICATIVE), record(lax.mul_p).module
    (True, 'jax_scaled.rules.elementwise')
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from jax_scaled._jax_internals import Primitive

ScaleRule = Callable[..., object]  # rule(*values, **params) -> outputs
HigherOrderRule = Callable[..., list]  # rule(eqn, in_slots) -> out_slots
EstimateRule = Callable[..., float | None]  # rule(estimates, *, shapes, **params) -> estimate
FactRule = Callable[..., object]  # rule(eqn, in_slots, out) -> Slot (see jax_scaled.engine.facts)


class Property(enum.Flag):
    """What the interpreter may assume about a primitive, beyond its scale rule.

    * ``SHAPE_ONLY``: moves data without changing values (``reshape``); a broadcast of a
      scalar stays that broadcast.
    * ``FOLDS_SCALARS``: pointwise arithmetic whose value on broadcasts of scalars the
      interpreter computes at trace time (a broadcast scalar's fact goes through it).
      Implies ``POINTWISE``; the other pointwise primitives (comparisons, trigonometry,
      casts) are not folded, so their outputs carry no fact.
    * ``ANY_SCALE_PRESERVING``: on scale-free inputs only (zeros, infinities, NaNs), its
      output is scale-free too (a selection or reshuffle of such values).
    * ``ABSORBING``: one scale-free factor makes the output scale-free (``0 * x``, ``x / 0``).
    * ``MULTIPLICATIVE``: its output scale is a product of the input scales, so a
      scale-free zero operand is promoted at the scale that keeps the product smallest.
    * ``SELECTING``: every output element is one of the input elements (exact on data).
    * ``ADDING``: its outputs are sums of its inputs.
    * ``LAYOUT``: pure data layout (transposes, reshapes): what the transpose of a
      contraction may contain besides the contraction. Not ``SHAPE_ONLY``'s synonym: a
      ``copy`` keeps a fact but is no layout, a ``transpose`` is a layout whose facts the
      interpreter does not track.
    * ``FACTS_INSIDE``: a call (``jit``) that is interpreted even on plain operands when
      they carry facts, so that facts its body derives reach its outputs.
    * ``POINTWISE``: each output element is a function of the same element of the operands
      (arithmetic, selections, activations, casts): on block-scaled operands its per-tensor
      rule runs on every block (:mod:`jax_scaled.engine.block_dispatch`).
    * ``BLOCKS_INSIDE``: a higher-order primitive whose body receives block-scaled operands
      as they are (calls: ``jit``, custom derivatives, ``checkpoint``). Other higher-order
      primitives (loops, ``cond``, ``shard_map``) get them at one scale per tensor.
    * ``READS_FINER_SCALES``: a primitive with a block rule or ``POINTWISE``, exact on block
      scales, whose rule reads an operand's finer scales where the interpreter holds them
      (:attr:`~jax_scaled.engine.facts.Slot.finer`): a plain output (``stop_scaling``,
      ``is_finite``) comes from them alone, a scaled one (a cast) keeps both forms.
    """

    NONE = 0
    SHAPE_ONLY = enum.auto()
    FOLDS_SCALARS = enum.auto()
    ANY_SCALE_PRESERVING = enum.auto()
    ABSORBING = enum.auto()
    MULTIPLICATIVE = enum.auto()
    SELECTING = enum.auto()
    ADDING = enum.auto()
    LAYOUT = enum.auto()
    FACTS_INSIDE = enum.auto()
    POINTWISE = enum.auto()
    BLOCKS_INSIDE = enum.auto()
    READS_FINER_SCALES = enum.auto()


@dataclasses.dataclass
class PrimitiveRecord:
    """Everything scalify knows about one primitive (see the module docstring).

    ``fold`` computes the primitive on trace-time scalar constants, exactly as XLA would
    (numpy for the correctly rounded operations); ``facts`` replaces the generic fact
    propagation of a forwarded equation (``reduce_sum`` of a broadcast scalar, casts).
    ``block_rule`` handles block-scaled operands (:mod:`jax_scaled.engine.block_dispatch`), and
    ``block_behaviour`` says what it does with the blocks: ``"keeps"`` or ``"consumes"``.
    """

    primitive: Primitive
    rule: ScaleRule | None = None
    higher_order: HigherOrderRule | None = None
    applies_to_unscaled: bool = False
    properties: Property = Property.NONE
    estimate: EstimateRule | None = None
    fold: Callable | None = None
    facts: FactRule | None = None
    block_rule: ScaleRule | None = None
    block_behaviour: str | None = None

    def has(self, properties: Property) -> bool:
        """True if the primitive has all of ``properties``."""
        return properties in self.properties

    @property
    def module(self) -> str | None:
        """The module of the primitive's rule (None without one)."""
        handler = self.higher_order or self.rule
        return None if handler is None else handler.__module__


_RECORDS: dict[Primitive, PrimitiveRecord] = {}


def record(primitive: Primitive) -> PrimitiveRecord:
    """The record of ``primitive``: an empty one (no rule, no property) if none is registered.

    Example:
        >>> from jax import lax
        >>> record(lax.add_p).has(Property.FOLDS_SCALARS | Property.ADDING)
        True
    """
    found = _RECORDS.get(primitive)
    return found if found is not None else PrimitiveRecord(primitive)


def declare(
    primitive: Primitive,
    *,
    properties: Property = Property.NONE,
    estimate: EstimateRule | None = None,
    fold: Callable | None = None,
    facts: FactRule | None = None,
) -> PrimitiveRecord:
    """Add properties to ``primitive``'s record (created if needed); returns the record.

    Example:
        >>> from jax.extend.core import Primitive
        >>> halve_p = Primitive("halve")
        >>> declare(halve_p, properties=Property.FOLDS_SCALARS).has(Property.POINTWISE)
        True
    """
    found = _RECORDS.setdefault(primitive, PrimitiveRecord(primitive))
    if properties & Property.FOLDS_SCALARS:
        properties |= Property.POINTWISE
    found.properties |= properties
    found.estimate = estimate or found.estimate
    found.fold = fold or found.fold
    found.facts = facts or found.facts
    return found


def register_scale_rule(
    primitive: Primitive,
    *,
    applies_to_unscaled: bool = False,
    properties: Property = Property.NONE,
    estimate: EstimateRule | None = None,
    fold: Callable | None = None,
    facts: FactRule | None = None,
) -> Callable[[ScaleRule], ScaleRule]:
    """Register the decorated function as the scale rule of ``primitive``, with its record.

    A rule receives the equation's inputs (ScaledArrays and plain arrays) as positional
    arguments and the primitive's params as keyword arguments, and returns what the primitive
    returns (a list for multiple-result primitives), with ScaledArray where it keeps scale.
    Registering a primitive twice replaces the earlier rule. By default a rule only runs
    when some input is a ScaledArray (otherwise the primitive is bound as is); pass
    ``applies_to_unscaled=True`` for primitives that create scaled values from plain ones.
    The other keywords fill the primitive's record (see :func:`declare`).

    Example:
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double")  # a user's own primitive
        >>> @register_scale_rule(double_p, properties=Property.FOLDS_SCALARS)
        ... def double_rule(x, **params):
        ...     return ScaledArray(x.data, x.scale * 2)
    """

    def register(rule: ScaleRule) -> ScaleRule:
        found = declare(primitive, properties=properties, estimate=estimate, fold=fold, facts=facts)
        found.rule, found.applies_to_unscaled = rule, applies_to_unscaled
        return rule

    return register


def register_higher_order_rule(
    primitive: Primitive, *, properties: Property = Property.NONE
) -> Callable[[HigherOrderRule], HigherOrderRule]:
    """Register a rule ``(eqn, in_slots) -> out_slots`` for a primitive with sub-jaxprs
    (``jit``, ``scan``, ...), which interprets them with
    :func:`jax_scaled.engine.interpreter.interpret_closed`.

    Example:
        >>> from jax_scaled import _jax_internals as jxi
        >>> record(jxi.scan_p).higher_order is not None
        True
    """

    def register(rule: HigherOrderRule) -> HigherOrderRule:
        declare(primitive, properties=properties).higher_order = rule
        return rule

    return register


def register_block_rule(
    primitive: Primitive, *, behaviour: str = "keeps"
) -> Callable[[ScaleRule], ScaleRule]:
    """Register the decorated function as ``primitive``'s rule for block-scaled operands
    (same signature as a scale rule); ``behaviour`` is ``"keeps"`` (the output keeps block
    scales) or ``"consumes"`` (a contraction over blocked axes: per-row or per-tensor out).

    Example:
        >>> from jax import lax
        >>> record(lax.transpose_p).block_behaviour
        'keeps'
    """
    if behaviour not in ("keeps", "consumes"):
        raise ValueError(f"behaviour is 'keeps' or 'consumes', got {behaviour!r}")

    def register(rule: ScaleRule) -> ScaleRule:
        found = declare(primitive)
        found.block_rule, found.block_behaviour = rule, behaviour
        return rule

    return register


def registered_primitives() -> dict[str, str]:
    """Map of primitive name to the module holding its rule, for every registered rule.

    Example:
        >>> "dot_general" in registered_primitives()
        True
    """
    rules = [r for r in _RECORDS.values() if r.rule is not None]
    return {r.primitive.name: r.rule.__module__ for r in sorted(rules, key=_name)}


def higher_order_primitives() -> dict[str, str]:
    """Names of the primitives interpreted recursively, with the module handling each.

    Example:
        >>> higher_order_primitives()["scan"]
        'jax_scaled.rules.higher_order.control_flow'
    """
    rules = [r for r in _RECORDS.values() if r.higher_order is not None]
    return {r.primitive.name: r.higher_order.__module__ for r in sorted(rules, key=_name)}


def records() -> list[PrimitiveRecord]:
    """Every registered record, sorted by primitive name."""
    return sorted(_RECORDS.values(), key=_name)


def _name(found: PrimitiveRecord) -> str:
    return found.primitive.name
