"""The scale-rule registry: which primitive is handled by which rule."""

from __future__ import annotations

from collections.abc import Callable

from jax_scaled._jax_internals import Primitive

ScaleRule = Callable[..., object]

_RULES: dict[Primitive, ScaleRule] = {}
_ALWAYS_APPLIED: set[Primitive] = set()


def register_scale_rule(
    primitive: Primitive, *, applies_to_unscaled: bool = False
) -> Callable[[ScaleRule], ScaleRule]:
    """Register the decorated function as the scale rule of ``primitive``.

    A rule receives the equation's inputs (ScaledArrays and plain arrays) as positional
    arguments and the primitive's params as keyword arguments, and returns what the primitive
    returns (a list for multiple-result primitives), with ScaledArray where it keeps scale.
    Registering a primitive twice replaces the earlier rule. By default a rule only runs
    when some input is a ScaledArray (otherwise the primitive is bound as is); pass
    ``applies_to_unscaled=True`` for primitives that create scaled values from plain ones.

    Example:
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double")  # a user's own primitive
        >>> @register_scale_rule(double_p)
        ... def double_rule(x, **params):
        ...     return ScaledArray(x.data, x.scale * 2)
    """

    def register(rule: ScaleRule) -> ScaleRule:
        _RULES[primitive] = rule
        if applies_to_unscaled:
            _ALWAYS_APPLIED.add(primitive)
        else:
            _ALWAYS_APPLIED.discard(primitive)
        return rule

    return register


def find_scale_rule(primitive: Primitive) -> ScaleRule | None:
    """The rule registered for ``primitive``, or None."""
    return _RULES.get(primitive)


def applies_to_unscaled(primitive: Primitive) -> bool:
    """True if ``primitive``'s rule runs even when none of its inputs is scaled."""
    return primitive in _ALWAYS_APPLIED


def registered_primitives() -> dict[str, str]:
    """Map of primitive name to the module holding its rule, for every registered rule.

    Example:
        >>> "dot_general" in registered_primitives()
        True
    """
    return {p.name: rule.__module__ for p, rule in sorted(_RULES.items(), key=lambda i: i[0].name)}
