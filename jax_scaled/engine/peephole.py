"""Equation rewrites that keep a scalified program as lean as the plain one.

XLA folds ``transpose(dot_general(a, b))`` into ``dot_general(b, a)``, which writes the
result in the transposed order directly. ``jax.grad`` of ``x @ w`` emits exactly that pair for
the weight gradient. In a scalified program the dot's scale rule puts a multiplication (or a
cast) between the two, XLA no longer sees the pair, and every step copies the gradient
through a transpose. :func:`transposed_contractions` finds these pairs in a jaxpr so that
the interpreter can bind the swapped contraction instead.
"""

from __future__ import annotations

import collections

from jax import lax

from jax_scaled import _jax_internals as jxi


def transposed_contractions(jaxpr: jxi.Jaxpr) -> dict[int, tuple[int, jxi.JaxprEqn]]:
    """``{i: (j, swapped)}`` for each ``dot_general`` equation ``i`` whose only use is the
    ``transpose`` equation ``j`` that swaps its two groups of free dimensions. ``swapped`` is
    one equation computing the transpose's output: the contraction with operands exchanged.

    Example:
        >>> jaxpr = jax.make_jaxpr(lambda a, b: (a @ b).T)(jnp.ones((2, 3)), jnp.ones((3, 4)))
        >>> [(i, j, eqn.outvars[0].aval.shape) for i, (j, eqn) in
        ...  transposed_contractions(jaxpr.jaxpr).items()]
        [(0, 1, (4, 2))]
    """
    producer = {
        eqn.outvars[0]: i for i, eqn in enumerate(jaxpr.eqns) if eqn.primitive is lax.dot_general_p
    }
    if not producer:
        return {}
    uses = use_counts(jaxpr)
    found = {}
    for j, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive is not lax.transpose_p or isinstance(eqn.invars[0], jxi.Literal):
            continue
        i = producer.get(eqn.invars[0])
        if i is None or uses[eqn.invars[0]] != 1:
            continue
        swapped = _swapped(jaxpr.eqns[i], eqn)
        if swapped is not None:
            found[i] = (j, swapped)
    return found


def use_counts(jaxpr: jxi.Jaxpr) -> collections.Counter:
    """How many times each variable of ``jaxpr`` is read: by its equations and as an output.

    Example:
        >>> jaxpr = jax.make_jaxpr(lambda x: (x * x, x + 1.0))(1.0).jaxpr
        >>> use_counts(jaxpr)[jaxpr.invars[0]]
        3
    """
    uses: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        uses.update(v for v in eqn.invars if not isinstance(v, jxi.Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, jxi.Literal))
    return uses


def _swapped(dot: jxi.JaxprEqn, transpose: jxi.JaxprEqn) -> jxi.JaxprEqn | None:
    """``dot`` with its operands exchanged and ``transpose``'s output, if that is the same
    value; else None."""
    params = dict(dot.params)
    if params.get("out_sharding") is not None:
        return None
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    lhs, rhs = dot.invars
    n_batch = len(lhs_batch)
    n_lhs_free = lhs.aval.ndim - n_batch - len(lhs_contract)
    n_rhs_free = rhs.aval.ndim - n_batch - len(rhs_contract)
    # The swapped dot's output is (batch, rhs free, lhs free).
    order = (
        *range(n_batch),
        *range(n_batch + n_lhs_free, n_batch + n_lhs_free + n_rhs_free),
        *range(n_batch, n_batch + n_lhs_free),
    )
    if tuple(transpose.params["permutation"]) != order:
        return None
    params["dimension_numbers"] = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    if params.get("precision") is not None:
        params["precision"] = tuple(reversed(params["precision"]))
    return dot.replace(invars=[rhs, lhs], outvars=list(transpose.outvars), params=params)
