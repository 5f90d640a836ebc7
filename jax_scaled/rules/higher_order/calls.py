"""Higher-order rules for calls: nested ``jit``, custom derivatives, ``closed_call`` and
``custom_linear_solve``.

A nested ``jit`` is re-bound through ``jax.jit`` (its name, donation and shardings kept) with
its body interpreted inside; the other calls are interpreted in place. The forward computation
of custom derivative rules is interpreted in place because scalify's input jaxpr already holds
the user's derivative rules wherever ``jax.grad`` was traced inside it.

Example:
    >>> f = scalify(jax.jit(lambda x: x * 3.0))
    >>> out = f(scaled_array([1.0, 2.0], 2.0**-20))
    >>> out.data.tolist(), float(out.scale) == 2.0**-19
    ([1.5, 3.0], True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.engine.facts import Slot, constant_slot, with_static_facts
from jax_scaled.engine.interpreter import interpret_closed
from jax_scaled.engine.registry import HigherOrderRule, Property, register_higher_order_rule


def _inline_call(param_name: str) -> HigherOrderRule:
    def rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
        return interpret_closed(eqn.params[param_name], in_slots)

    return rule


for _primitive in (jxi.custom_jvp_call_p, jxi.custom_vjp_call_p, jxi.closed_call_p):
    register_higher_order_rule(_primitive, properties=Property.BLOCKS_INSIDE)(
        _inline_call("call_jaxpr")
    )


@register_higher_order_rule(jxi.linear_solve_p, properties=Property.BLOCKS_INSIDE)
def linear_solve_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """``lax.custom_linear_solve``: the user's ``solve`` is interpreted in place on ``b``.

    Operands are the constants of ``matvec``, ``vecmat``, ``solve`` and ``transpose_solve``
    (``const_lengths`` of each), then ``b``. As for custom derivatives, the implicit
    differentiation rules only matter where ``jax.grad`` is traced inside scalify, and the
    input jaxpr already holds their result there (solves with the transposed system).
    """
    lengths = eqn.params["const_lengths"]
    starts = np.cumsum([0, *lengths])
    solve_index = lengths._fields.index("solve")
    solve_consts = in_slots[starts[solve_index] : starts[solve_index + 1]]
    b = in_slots[starts[-1] :]
    return interpret_closed(eqn.params["jaxprs"].solve, [*solve_consts, *b])


@register_higher_order_rule(jxi.jit_p, properties=Property.FACTS_INSIDE | Property.BLOCKS_INSIDE)
def jit_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """Re-bind a nested ``jit`` through ``jax.jit``, keeping its name, donation and shardings;
    the trace-time facts of its operands reach its body, and its outputs' facts come back."""
    params = eqn.params
    static_facts = [s.static_facts() for s in in_slots]
    out_facts: list[list[dict]] = []

    def body(*values):
        slots = [_slot_in_body(v, f) for v, f in zip(values, static_facts, strict=True)]
        out_slots = interpret_closed(params["jaxpr"], slots)
        out_facts.append([s.static_facts() for s in out_slots])
        return [s.value for s in out_slots]

    body.__name__ = body.__qualname__ = params["name"]
    values = [s.value for s in in_slots]
    jit_kwargs = dict(
        donate_argnums=tuple(i for i, d in enumerate(params["donated_invars"]) if d),
        keep_unused=params["keep_unused"],
        inline=params["inline"],
    )
    jit_kwargs.update(_jit_shardings(params, body, values))
    outs = jax.jit(body, **jit_kwargs)(*values)
    facts = out_facts[-1] if out_facts else [{} for _ in outs]  # none when jit's cache hit
    return [with_static_facts(v, f) for v, f in zip(outs, facts, strict=True)]


def _slot_in_body(value: Value, facts: dict) -> Slot:
    if facts == Slot(None).static_facts():
        return constant_slot(value)
    return Slot(value, **facts)


def _jit_shardings(params: dict, body: Callable, values: list[Value]) -> dict:
    in_shardings, out_shardings = params["in_shardings"], params["out_shardings"]
    found = {}
    if not all(jxi.is_unspecified_sharding(s) for s in in_shardings):
        found["in_shardings"] = tuple(
            _scaled_sharding(s, v) for s, v in zip(in_shardings, values, strict=True)
        )
    if not all(jxi.is_unspecified_sharding(s) for s in out_shardings):
        out_shapes = jax.eval_shape(body, *values)
        found["out_shardings"] = [
            _scaled_sharding(s, v) for s, v in zip(out_shardings, out_shapes, strict=True)
        ]
    return found


def _scaled_sharding(sharding: Any, value: Any) -> Any:
    """The sharding of a value's data; a ScaledArray's scale is replicated."""
    if not isinstance(value, ScaledArray) or jxi.is_unspecified_sharding(sharding):
        return None if jxi.is_unspecified_sharding(sharding) else sharding
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return ScaledArray.tree_unflatten(None, (sharding, replicated))
