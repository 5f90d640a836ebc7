"""The range guard's floor: a plain float16 program with only the guard's work added.

    python benchmarks/model_scale.py --layers 1,4,8 --layouts unrolled --configs \
        fp16,fp16_guard_floor,fp16_scalify
    python benchmarks/hlo_anatomy.py --configs fp16,fp16_guard_floor,fp16_scalify --per-layer

The range guard stays on by default, so no scalified float16 step can compile faster than
the plain float16 step with the guard's work added and nothing else. :func:`guard_floor`
builds that program: it evaluates the plain step's jaxpr equation by equation and sends the
float16 outputs that ``fp16_scalify`` range-guards through :func:`jax_scaled.scales.guard.
guarded`, the guard scalify's rules call (the largest magnitude, the factor looked up by its
binade and computed once, the data divided by it):

* contractions (``dot_general``) with a float16 result, computed with a float32 result;
* sums of float16 data over more than one element into a vector (``reduce_sum``: the bias
  and layer-norm parameter gradients), summed in float32;
* accumulated cotangents (``add_any``), added in float32;
* sums and differences of two tensors of the result's shape, neither a broadcast, read twice
  or more: the residual stream's joins, which scalify guards so that XLA stores them once
  (``engine/fusion.py``, ``guards_shared_sum``);
* the casts of the step's float32 inputs (the parameters) to float16, their factors worked
  out together as scalify does (``guard_factors_together``).

Nothing else of scalify is there: no scale propagates, and each guard's scale is dropped
(the guarded data is divided by the guard's factor, so XLA keeps all of each guard's work).
Its numbers are therefore the plain program's only where no guard moves a power of two
(data in the guard's band): it is a measure of cost, not a training step. (Kept as the
factors of one product added to the loss times zero, the scales made a chain through the
whole step, which cost XLA's passes a second at 16 layers.) The configuration
``fp16_guard_floor`` of ``model_scale.py`` is the ``fp16`` step floored this way.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from jax_scaled.array import engine_builds
from jax_scaled.engine.fusion import guards_shared_sum
from jax_scaled.engine.peephole import use_counts
from jax_scaled.memo import scale_memo
from jax_scaled.scales.guard import guard_factors_together, guarded

F16 = jnp.dtype(jnp.float16)
# Equations evaluated as their one sub-jaxpr (the guards' operands can be inside them).
INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "remat2": "jaxpr"}  # fmt: skip
GUARDED = ("dot_general", "reduce_sum", "add_any", "sum", "cast")


def guard_floor(fn: Callable) -> Callable:
    """``fn`` (a float16 program) with the range guard's work added on the outputs
    ``fp16_scalify`` guards (module notes), their scales dropped.

    Example:
        >>> f = guard_floor(lambda x, w: (jnp.sum(x @ w), x @ w))
        >>> x, w = jnp.ones((4, 8), jnp.float16), jnp.ones((8, 2), jnp.float16)
        >>> total, y = f(x, w)  # 8 a product: in the float16 band, no power of two moved
        >>> float(total), y.dtype, float(y[0, 0])
        (64.0, dtype('float16'), 8.0)
        >>> guard_counts(jax.make_jaxpr(f)(x, w).jaxpr)["dot_general"]
        2
    """

    def floored(*args: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        inputs, leaves = set(closed.jaxpr.invars), jax.tree.leaves(args)
        with scale_memo(), engine_builds():
            guard_factors_together(_cast_inputs(closed.jaxpr, leaves), F16)  # as scalify does
            outs = _evaluate(closed, leaves, inputs)
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return floored


def guard_counts(jaxpr: Jaxpr) -> collections.Counter:
    """The guards of a floored program by kind (:data:`GUARDED`): the casts of their data to
    float16 (one a guard) under the names :func:`guard_floor` gives each guard's equations
    (``guard:<kind>``).

    Example:
        >>> guard_counts(jax.make_jaxpr(guard_floor(lambda x: (x + x).sum()))(jnp.ones(3)).jaxpr)
        Counter()
    """
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        for kind in GUARDED:
            named = f"guard:{kind}/" in f"{eqn.source_info.name_stack}/"
            cast = eqn.primitive.name == "convert_element_type"
            if named and cast and eqn.params["new_dtype"] == F16:
                found[kind] += 1
    return found


def _cast_inputs(jaxpr: Jaxpr, leaves: Sequence[Any]) -> list:
    """The inputs (of ``leaves``, for ``jaxpr``'s inputs) that ``jaxpr`` casts to float16."""
    values = dict(zip(jaxpr.invars, leaves, strict=True))
    return [values[e.invars[0]] for e in jaxpr.eqns if _casts_input(e, set(values))]


def _evaluate(closed: ClosedJaxpr | Jaxpr, args: Sequence[Any], inputs: set) -> list:
    if isinstance(closed, Jaxpr):  # a checkpoint's body
        closed = ClosedJaxpr(closed, [])
    jaxpr = closed.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    readers = use_counts(jaxpr)
    broadcasts = {
        v for e in jaxpr.eqns if e.primitive.name == "broadcast_in_dim" for v in e.outvars
    }

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        kind = _guard_kind(eqn, readers, inputs, broadcasts)
        if eqn.primitive.name in INLINED:
            outs = _evaluate(eqn.params[INLINED[eqn.primitive.name]], values, set())
        elif kind is not None:
            with jax.named_scope(f"guard:{kind}"):
                outs = [_guarded(eqn, values)]
        else:
            outs = eqn.primitive.bind(*values, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _guard_kind(eqn: JaxprEqn, readers: Mapping, inputs: set, broadcasts: set) -> str | None:
    """Which of :data:`GUARDED` ``eqn``'s output is, or None (module notes); ``readers``:
    each variable's uses, ``broadcasts``: the outputs of ``broadcast_in_dim``."""
    if not _narrow_tensor_out(eqn):
        return None
    name = eqn.primitive.name
    if name == "dot_general" or name == "add_any":
        return name
    if name == "reduce_sum" and eqn.invars[0].aval.size > eqn.outvars[0].aval.size:
        return name
    if guards_shared_sum(eqn, readers, broadcasts):  # scalify's own choice of joins
        return "sum"
    return "cast" if _casts_input(eqn, inputs) else None


def _narrow_tensor_out(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` has one output, a float16 array of rank 1 or more."""
    out = eqn.outvars[0].aval if len(eqn.outvars) == 1 else None
    return out is not None and getattr(out, "dtype", None) == F16 and out.ndim > 0


def _casts_input(eqn: JaxprEqn, inputs: set) -> bool:
    """Whether ``eqn`` casts one of ``inputs`` (the step's parameters) to a float16 array."""
    cast = eqn.primitive.name == "convert_element_type" and _narrow_tensor_out(eqn)
    return cast and eqn.invars[0] in inputs


def _guarded(eqn: JaxprEqn, values: list) -> jax.Array:
    """The guarded float16 data of ``eqn``'s output."""
    name = eqn.primitive.name
    if name == "dot_general":
        wide = eqn.primitive.bind(*values, **{**eqn.params, "preferred_element_type": jnp.float32})
    elif name == "reduce_sum":
        wide = eqn.primitive.bind(values[0].astype(jnp.float32), **eqn.params)
    elif name == "convert_element_type":
        wide = values[0]
    else:
        wide = eqn.primitive.bind(*(v.astype(jnp.float32) for v in values))
    return guarded(wide, np.float32(1.0), F16).data
