"""Trace a function on pytree arguments, evaluate its jaxpr equation by equation.

The scaffolding that :func:`~jax_scaled.engine.interpreter.scalify` and
:func:`~jax_scaled.dot_policy.dot_formats` share: :func:`call_traced` flattens the
arguments, traces the function on their array leaves to a closed jaxpr, hands it to the
caller's evaluation and gives the outputs back in the function's structure;
:func:`evaluate_jaxpr` runs a jaxpr with a callback per equation (scalify's rules,
``dot_formats``' casts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, is_array_like
from jax_scaled.dtypes import compute_dtype


@dataclasses.dataclass(frozen=True)
class Traced:
    """A function traced on the array leaves of its arguments, by :func:`call_traced`.

    Attributes:
        closed: the closed jaxpr: one input per array leaf, one output per output leaf.
        arrays: the array leaves of the arguments, in order (whole ScaledArrays with
            ``scaled_leaves``).
        flat_fn: the traced function of the array leaves (the other leaves baked in).

    Example:
        >>> traced = []
        >>> x = jnp.ones(2, jnp.float16)
        >>> call_traced(lambda x: x + 1, (x,), {}, lambda t: traced.append(t) or [0])
        0
        >>> [str(t.jaxpr.invars[0].aval) for t in (traced[0].closed, traced[0].retraced(True))]
        ['float16[2]', 'float32[2]']
    """

    closed: jxi.ClosedJaxpr
    arrays: list
    flat_fn: Callable

    def retraced(self, widen: bool = False) -> jxi.ClosedJaxpr:
        """The function traced again; with ``widen``, on inputs of their compute dtypes
        (float32 for float16 and float8)."""
        return jax.make_jaxpr(self.flat_fn)(*[_abstract(x, widen) for x in self.arrays])


def call_traced(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    run: Callable[[Traced], Sequence[Any]],
    *,
    scaled_leaves: bool = False,
    check: Callable[[list], None] | None = None,
) -> Any:
    """``fn(*args, **kwargs)``, traced on the array leaves of its arguments, evaluated by ``run``.

    ``run(traced)`` (a :class:`Traced`) returns the output leaves, which come back in the
    structure of ``fn``'s output. Leaves that are not arrays (Python numbers, strings) are
    static: baked into the trace.

    Args:
        fn: the function to trace.
        args: its positional arguments (pytrees).
        kwargs: its keyword arguments (pytrees).
        run: evaluates the traced jaxpr on ``traced.arrays``.
        scaled_leaves: a ScaledArray is one leaf (traced as an array of its dtype), not two.
        check: called on the output leaves of ``fn`` while it is traced.

    Returns:
        ``run``'s outputs, in the structure of ``fn``'s output.

    Example:
        >>> def run(traced):  # evaluate the jaxpr as it is
        ...     closed = traced.closed
        ...     return evaluate_jaxpr(closed.jaxpr, closed.consts, traced.arrays, bind_eqn)
        >>> call_traced(lambda x, n: {"y": x * n}, (jnp.ones(2), 3.0), {}, run)
        {'y': Array([3., 3.], dtype=float32)}
    """
    is_leaf = (lambda x: isinstance(x, ScaledArray)) if scaled_leaves else None
    leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=is_leaf)
    is_dynamic = [isinstance(x, ScaledArray) or is_array_like(x) for x in leaves]
    arrays = [x for x, d in zip(leaves, is_dynamic, strict=True) if d]
    out_trees: list = []

    def flat_fn(*values):
        values = iter(values)
        merged = [next(values) if d else x for x, d in zip(leaves, is_dynamic, strict=True)]
        call_args, call_kwargs = jax.tree.unflatten(in_tree, merged)
        out_leaves, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        if check is not None:
            check(out_leaves)
        out_trees.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*[_abstract(x) for x in arrays])
    outs = run(Traced(closed, arrays, flat_fn))
    return jax.tree.unflatten(out_trees[0], outs)


def _abstract(x: Any, widen: bool = False) -> jax.ShapeDtypeStruct:
    weak_type = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    if isinstance(x, ScaledArray):
        weak_type = False
    # Inside shard_map, keep the mesh axes the value varies over (check_vma typing).
    manual = jxi.manual_axis_kwargs(x.data if isinstance(x, ScaledArray) else x)
    dtype = compute_dtype(x.dtype) if widen else x.dtype
    return jax.ShapeDtypeStruct(x.shape, dtype, weak_type=weak_type, **manual)


def evaluate_jaxpr(
    jaxpr: jxi.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    eval_eqn: Callable[[jxi.JaxprEqn, list], Sequence[Any]],
    literal: Callable[[jxi.Literal], Any] = lambda atom: atom.val,
) -> list:
    """Run ``jaxpr``: each equation's outputs are ``eval_eqn(eqn, its input values)``.

    Args:
        jaxpr: the jaxpr to run.
        consts: the values of its constvars.
        args: the values of its invars.
        eval_eqn: the outputs of one equation (a list, even for one output).
        literal: the value of a literal input (default: the literal's own value).

    Returns:
        The values of the jaxpr's outputs.

    Example:
        >>> closed = jax.make_jaxpr(lambda x: x * 2.0 + 1.0)(1.0)
        >>> names = []
        >>> def eval_eqn(eqn, invals):
        ...     names.append(eqn.primitive.name)
        ...     return bind_eqn(eqn, invals)
        >>> evaluate_jaxpr(closed.jaxpr, closed.consts, [3.0], eval_eqn), names
        ([Array(7., dtype=float32, weak_type=True)], ['mul', 'add'])
    """
    env: dict[jxi.Var, Any] = {}

    def read(atom: Any) -> Any:
        return literal(atom) if isinstance(atom, jxi.Literal) else env[atom]

    # Not strict: a higher-order rule may run an open sub-jaxpr without its consts.
    env.update(zip(jaxpr.constvars, consts, strict=False))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = eval_eqn(eqn, [read(v) for v in eqn.invars])
        for var, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jxi.DropVar):
                env[var] = out
    return [read(v) for v in jaxpr.outvars]


def bind_eqn(eqn: jxi.JaxprEqn, invals: Sequence[Any]) -> list:
    """The outputs of ``eqn``'s primitive bound on ``invals`` with its parameters.

    Example:
        >>> eqn = jax.make_jaxpr(lambda x: x + 1.0)(1.0).jaxpr.eqns[0]
        >>> bind_eqn(eqn, [2.0, 1.0])
        [Array(3., dtype=float32, weak_type=True)]
    """
    subfuns, params = jxi.eqn_bind_params(eqn)
    outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]
