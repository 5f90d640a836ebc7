"""Equal work of independent equations done together: one small kernel instead of one each.

A range guard's factors and a dynamic rescale's new scale are a few scalar operations on a
reduction of the data, which XLA compiles as a small kernel of their own, with a division,
for every equation. A train step applies such equations to every parameter alike: the casts
of float32 parameters to float16, the rescales of the gradients and of the new float16
master weights. Their operands are all computed before the first of them runs, so the
scalar work of all of them can be done on a vector, by one kernel.

A rule says how (:func:`register_together`): which of its primitive's equations may share
(a key from their parameters) and a function that does the shared part for a group of
operands and leaves each equation's part in the per-call memo (:mod:`jax_scaled.memo`),
where the rule then finds it. :func:`together_plan` finds the groups of a jaxpr: equations
of one key whose operands are all defined before the first of them; :class:`SharedWork`
runs a group's shared part when the interpreter reaches its first equation.

Example:
    >>> jaxpr = jax.make_jaxpr(lambda a, b: (a.astype(jnp.float16), b.astype(jnp.float16)))
    >>> [group.members for group in together_plan(jaxpr(1.0, 2.0).jaxpr.eqns).values()]
    [[0, 1]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jax_scaled import _jax_internals as jxi
from jax_scaled.engine.facts import Slot

Operands = list[list[Any]]  # each equation's operand values


@dataclasses.dataclass(frozen=True)
class Together:
    """How equations of one primitive share work: ``key(params)`` is hashable for those that
    may (equations with equal keys do the same work), None for the others;
    ``prepare(key, operands)`` does a group's shared part, given each equation's operands."""

    key: Callable[[dict], Hashable | None]
    prepare: Callable[[Hashable, Operands], None]


_TOGETHER: dict[jxi.Primitive, Together] = {}


def register_together(
    primitive: jxi.Primitive,
    key: Callable[[dict], Hashable | None],
    prepare: Callable[[Hashable, Operands], None],
) -> None:
    """Let ``primitive``'s equations share work (see the module notes). ``prepare`` must
    leave values unchanged: the rule reads what it memoized instead of computing the same
    thing alone.

    Example:
        >>> from jax_scaled import _jax_internals as jxi
        >>> twice_p = jxi.define_primitive("twice_example", lambda x: 2 * x)
        >>> register_together(twice_p, lambda params: "all", lambda key, operands: None)
        >>> jaxpr = jax.make_jaxpr(lambda a, b: (twice_p.bind(a), twice_p.bind(b)))(1.0, 2.0)
        >>> [group.members for group in together_plan(jaxpr.jaxpr.eqns).values()]
        [[0, 1]]
    """
    _TOGETHER[primitive] = Together(key, prepare)


@dataclasses.dataclass
class Group:
    """Equations (indices into a jaxpr's equations, in order) that share work."""

    together: Together
    key: Hashable
    members: list[int]


def together_plan(eqns: Sequence[jxi.JaxprEqn]) -> dict[int, Group]:
    """The groups of ``eqns`` that share work, of two equations or more, by the index of their
    first equation: equations of one primitive and key (:func:`register_together`) whose
    operands are all defined before the first equation of their group.

    Example:
        >>> def casts(a):
        ...     doubled = a * 2.0  # equation 0
        ...     first = doubled.astype(jnp.float16)  # 1
        ...     second = a.astype(jnp.float16)  # 2: its operand is there at 1, together
        ...     third = (doubled * 2.0).astype(jnp.float16)  # 3 and 4: alone
        ...     return first, second, third
        >>> plan = together_plan(jax.make_jaxpr(casts)(1.0).jaxpr.eqns)
        >>> [(str(group.key), group.members) for group in plan.values()]
        [('float16', [1, 2])]
    """
    defined: dict[jxi.Var, int] = {}
    latest: dict[tuple, Group] = {}
    groups: list[Group] = []
    for i, eqn in enumerate(eqns):
        together = _TOGETHER.get(eqn.primitive)
        key = None if together is None else together.key(eqn.params)
        if key is not None:
            ready = max((defined.get(v, -1) for v in _vars(eqn.invars)), default=-1)
            group = latest.get((eqn.primitive, key))
            if group is not None and ready < group.members[0]:
                group.members.append(i)
            else:
                latest[(eqn.primitive, key)] = group = Group(together, key, [i])
                groups.append(group)
        defined.update((v, i) for v in eqn.outvars)
    return {g.members[0]: g for g in groups if len(g.members) > 1}


def _vars(atoms: Sequence[Any]) -> list[jxi.Var]:
    return [a for a in atoms if isinstance(a, jxi.Var)]


class SharedWork:
    """Runs the shared part of a jaxpr's groups (:func:`together_plan`) as the interpreter
    reaches each group's first equation, from the slots the walk has bound so far.

    Example:
        >>> jaxpr = jax.make_jaxpr(lambda a: a + 1.0)(1.0).jaxpr
        >>> work = SharedWork(jaxpr, [], [Slot(jnp.float32(1.0))], lambda atom: None)
        >>> work.plan
        {}
    """

    def __init__(
        self,
        jaxpr: jxi.Jaxpr,
        const_slots: Sequence[Slot],
        in_slots: Sequence[Slot],
        literal: Callable[[jxi.Literal], Slot],
    ):
        self.plan = together_plan(jaxpr.eqns)
        self._leaders = {id(jaxpr.eqns[i]): group for i, group in self.plan.items()}
        self._eqns = jaxpr.eqns
        self._literal = literal
        self._needed = {
            v for g in self.plan.values() for j in g.members for v in _vars(jaxpr.eqns[j].invars)
        }
        self._bound: dict[jxi.Var, Slot] = {}
        self.bind(jaxpr.constvars, const_slots)
        self.bind(jaxpr.invars, in_slots)

    def bind(self, variables: Sequence[Any], slots: Sequence[Slot]) -> None:
        """Record the slots of ``variables`` that a group will read."""
        if self._needed:
            self._bound.update((v, s) for v, s in zip(variables, slots) if v in self._needed)

    def before(self, eqn: jxi.JaxprEqn) -> None:
        """Do the shared part of the group that ``eqn`` opens, if any."""
        group = self._leaders.get(id(eqn))
        if group is None:
            return
        atoms = [self._eqns[j].invars for j in group.members]
        if all(a in self._bound for a in _vars([a for each in atoms for a in each])):
            operands = [[self._read(a).value for a in each] for each in atoms]
            group.together.prepare(group.key, operands)

    def _read(self, atom: Any) -> Slot:
        return self._literal(atom) if isinstance(atom, jxi.Literal) else self._bound[atom]
