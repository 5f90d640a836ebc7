"""``custom_scale``: give a function its own scale rule, in the spirit of ``jax.custom_jvp``.

Outside scalify a ``custom_scale`` function is its body. Under scalify, when one of its
inputs is a ScaledArray, the user's rule runs instead of automatic propagation through the
body (scalify paper §3.2.1): an activation can keep its input's scale, a normalisation can
normalise the data alone.

Differentiation: the function is differentiable like its body. When ``jax.grad`` is traced
inside scalify, the forward pass runs the rule and the backward pass (the body's derivative)
is propagated automatically. To choose the backward's scales too, write the function with
``jax.custom_vjp`` and let its ``bwd`` call another ``custom_scale`` function: its rule then
runs on the cotangents.

Under ``jax.vmap`` the body is batched and the rule is dropped (automatic propagation, same
values), since a rule written for one example may not know about the batch axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.engine.facts import Slot
from jax_scaled.engine.interpreter import rule_output_slots
from jax_scaled.engine.promotion import promote_inputs
from jax_scaled.engine.registry import register_higher_order_rule


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """How to call the user's rule: hashable by identity, as primitive params must be."""

    rule: Callable
    in_tree: Any
    static_args: tuple
    static_argnums: tuple[int, ...]

    def arguments(self, dynamic: Sequence[Any]) -> list:
        """The user's positional arguments, static ones put back in their places."""
        args = list(jax.tree.unflatten(self.in_tree, list(dynamic)))
        for i, value in sorted(zip(self.static_argnums, self.static_args, strict=True)):
            args.insert(i, value)
        return args


class custom_scale:  # noqa: N801  (named like jax.custom_jvp, which it mirrors)
    """Decorator: a function whose scale propagation under scalify is given by a rule.

    Define the rule with ``@f.defscale``. It receives the same arguments as ``f``
    (ScaledArray where the input is scaled; static arguments as given) and returns what ``f``
    returns, with ScaledArray where it keeps a scale. Outside scalify only ``f``'s body runs.
    ``static_argnums`` marks hashable non-array arguments (like ``jax.custom_jvp``'s
    ``nondiff_argnums``). ``f`` must not close over traced values: pass them as arguments.

    Example:
        >>> @js.custom_scale
        ... def double(x):
        ...     return 2 * x
        >>> @double.defscale
        ... def double_rule(x):
        ...     return js.ScaledArray(x.data, x.scale * 2)  # exact: only the scale changes
        >>> out = js.scalify(double)(js.scaled_array([1.0, 1.5], 2.0**-20))
        >>> float(out.scale), out.data.tolist()
        (1.9073486328125e-06, [1.0, 1.5])
        >>> double(jnp.ones(2)).tolist()  # outside scalify: the body
        [2.0, 2.0]
    """

    def __init__(self, fun: Callable, static_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.static_argnums = tuple(sorted(static_argnums))
        self.rule: Callable | None = None

    def defscale(self, rule: Callable) -> Callable:
        """Register ``rule`` as this function's scale rule; returns ``rule``.

        Example:
            >>> @js.custom_scale
            ... def identity(x):
            ...     return x
            >>> _ = identity.defscale(lambda x: x)
        """
        self.rule = rule
        return rule

    def __call__(self, *args: Any) -> Any:
        if self.rule is None:
            raise TypeError(
                f"custom_scale function '{self.__name__}' has no scale rule: define one with "
                f"@{self.__name__}.defscale"
            )
        static = tuple(args[i] for i in self.static_argnums)
        dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]
        flat, in_tree = jax.tree.flatten(dynamic)
        call = _Call(self.rule, in_tree, static, self.static_argnums)
        out_trees = []

        def body(*flat):
            leaves, out_tree = jax.tree.flatten(self.fun(*call.arguments(flat)))
            out_trees.append(out_tree)
            return leaves

        closed = jax.make_jaxpr(body)(*flat)
        outs = _differentiable_call(closed, call)(*flat)
        return jax.tree.unflatten(out_trees[0], outs)


def _differentiable_call(closed: jxi.ClosedJaxpr, call: _Call) -> Callable:
    """Bind the primitive inside a custom_jvp whose tangents are the body's own."""

    @jax.custom_jvp
    def bound(*flat):
        return custom_scale_call_p.bind(*flat, jaxpr=closed, call=call)

    @bound.defjvp
    def bound_jvp(primals, tangents):
        outs = custom_scale_call_p.bind(*primals, jaxpr=closed, call=call)
        _, tangents_out = jax.jvp(jxi.jaxpr_as_fun(closed), primals, tangents)
        return outs, tangents_out

    return bound


def _evaluate(*args: Any, jaxpr: jxi.ClosedJaxpr, call: _Call) -> list:
    return jxi.jaxpr_as_fun(jaxpr)(*args)


def _batch(args: Sequence[Any], dims: Sequence[Any], *, jaxpr, call) -> tuple[list, list]:
    """Under vmap: the body, batched; the rule does not apply to batched values."""
    in_axes = [None if d is jxi.NOT_MAPPED else d for d in dims]
    outs = jax.vmap(jxi.jaxpr_as_fun(jaxpr), in_axes=in_axes)(*args)
    return list(outs), [0] * len(outs)


# Differentiated through the custom_jvp of _differentiable_call, never directly.
custom_scale_call_p = jxi.define_primitive(
    "custom_scale_call",
    _evaluate,
    multiple_results=True,
    abstract_eval=lambda *avals, jaxpr, call: jaxpr.out_avals,
    batcher=_batch,
)


@register_higher_order_rule(custom_scale_call_p)
def _custom_scale_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    call: _Call = eqn.params["call"]
    out = call.rule(*call.arguments(promote_inputs(in_slots)))
    leaves = jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, ScaledArray))
    return rule_output_slots(eqn, leaves)
