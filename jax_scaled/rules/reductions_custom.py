"""Scale rules for reductions with a user computation: ``reduce``, ``reduce_window`` and
``select_and_scatter`` (the variadic forms JAX binds when ``lax.reduce`` or
``lax.reduce_window`` get a computation other than a plain sum, max or min).

The rule reads the computation's jaxpr. One that only selects and compares (max, min,
select_n, comparisons; float constants only 0, inf or NaN) runs on the data, bit exact, and
each group of lanes it mixes keeps its own scale. One that also adds runs on the data at
scale ``s * sqrt(N)``, as ``reduce_window_sum`` does. Anything else runs on the represented
values (float32 or wider) and comes back through the range guard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import compute_dtype
from jax_scaled.engine.registry import Property, record, register_scale_rule
from jax_scaled.scales import (
    align,
    as_scaled,
    guarded,
    make_scale,
    scale_f32,
    sqrt_pow2,
    to_compute,
)

# Float primitives commute with multiplying their float operands by one positive power of
# two when their records say SELECTING (selections and comparisons: exactly) or ADDING (with
# the same rounding, but their results may outgrow their operands).
_COMMUTING = Property.SELECTING | Property.ADDING


@dataclasses.dataclass(frozen=True)
class _Computation:
    """A reduction computation that commutes with a power-of-two scale of its float lanes.

    Lane ``i`` is the ``i``-th operand, init value and result. ``groups[i]`` names the lanes
    that the computation mixes with lane ``i`` (they must share a scale); ``adds`` says it
    adds float values (else every float result is one of its float inputs).
    """

    adds: bool
    groups: tuple[int, ...]


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _is_float_atom(atom: Any) -> bool:
    return jnp.issubdtype(atom.aval.dtype, jnp.floating)


def _scale_free(value: Any) -> bool:
    """True for constants that are the same at any scale: zeros, infinities, NaNs."""
    value = np.asarray(value)
    return not jnp.issubdtype(value.dtype, jnp.floating) or bool(
        np.all((value == 0) | ~np.isfinite(value))
    )


def _scale_commuting(jaxpr: jxi.Jaxpr, consts: Sequence, lanes: int) -> _Computation | None:
    """The :class:`_Computation` of a reduction ``jaxpr`` over ``lanes`` lanes (inputs
    ``(acc_0..acc_{lanes-1}, x_0..)``, one result per lane), or None if it does not commute
    with a scale: other float primitives, or float constants other than 0, inf and NaN."""
    parent = list(range(lanes))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    def join(members: set[int]) -> None:
        roots = sorted({root(i) for i in members})
        for r in roots[1:]:
            parent[r] = roots[0]

    origins = {v: {i % lanes} for i, v in enumerate(jaxpr.invars) if _is_float_atom(v)}
    adds = _trace_lanes(jaxpr, consts, origins, join)
    if adds is None:
        return None
    for lane, out in enumerate(jaxpr.outvars):
        if isinstance(out, jxi.Literal) and not _scale_free(out.val):
            return None
        join({lane} | _origin(origins)(out))
    return _Computation(adds, tuple(root(i) for i in range(lanes)))


def _trace_lanes(
    jaxpr: jxi.Jaxpr, consts: Sequence, origins: dict, join: Callable[[set[int]], None]
) -> bool | None:
    """Record in ``origins`` which lanes each float variable of ``jaxpr`` comes from, joining
    the lanes that an equation mixes; returns whether it adds, None if it does not commute."""
    if any(_is_float_atom(v) and not _scale_free(c) for v, c in zip(jaxpr.constvars, consts)):
        return None
    adds = False
    for eqn in jaxpr.eqns:
        float_in = [v for v in eqn.invars if _is_float_atom(v)]
        if not float_in and not any(_is_float_atom(v) for v in eqn.outvars):
            continue  # integer and boolean work (indices, flags) needs no scale
        if any(isinstance(v, jxi.Literal) and not _scale_free(v.val) for v in float_in):
            return None
        inner = _inlined(eqn)
        if inner is not None:  # e.g. jnp.where, jax.nn.relu: look inside
            origins.update(zip(inner.jaxpr.invars, map(_origin(origins), eqn.invars)))
            inner_adds = _trace_lanes(inner.jaxpr, inner.consts, origins, join)
            if inner_adds is None:
                return None
            origins.update(zip(eqn.outvars, map(_origin(origins), inner.jaxpr.outvars)))
            adds |= inner_adds
        elif record(eqn.primitive).properties & _COMMUTING:
            lanes = set().union(*map(_origin(origins), float_in))
            join(lanes)
            origins.update((v, lanes) for v in eqn.outvars if _is_float_atom(v))
            adds |= record(eqn.primitive).has(Property.ADDING)
        else:
            return None
    return adds


def _origin(origins: dict) -> Callable[[Any], set[int]]:
    """The lanes an atom comes from (none for literals and integer values)."""
    return lambda atom: origins.get(atom, set()) if isinstance(atom, jxi.Var) else set()


def _inlined(eqn: jxi.JaxprEqn) -> jxi.ClosedJaxpr | None:
    """The body of a call that can be evaluated inline (``jit``, ``custom_jvp_call``)."""
    if eqn.primitive is jxi.jit_p:
        return eqn.params["jaxpr"]
    if eqn.primitive is jxi.custom_jvp_call_p:
        return eqn.params["call_jaxpr"]
    return None


def _init_scale(init: Value) -> jax.Array:
    """The scale an init value asks for: its own, or 0 for 0, inf and NaN (any scale fits)."""
    init = as_scaled(init)
    meaningful = jnp.isfinite(init.data) & (init.data != 0)
    return jnp.where(meaningful, scale_f32(init), np.float32(0))


def _on_data(primitive, args: Sequence[Value], comp: _Computation, count: int, **params) -> list:
    """Bind ``primitive`` (operands then init values) on the data, each group of float lanes
    at one scale: the largest of its operands and init values, times ``sqrt(count)`` if the
    computation adds (``count`` values meet in one result)."""
    lanes = len(args) // 2
    headroom = np.float32(sqrt_pow2(count) if comp.adds else 1.0)
    group_scale: dict[int, jax.Array] = {}
    for lane in filter(lambda i: _is_float(args[i]), range(lanes)):
        scale = lax.max(scale_f32(args[lane]), _init_scale(args[lanes + lane]))
        group = comp.groups[lane]
        group_scale[group] = lax.max(group_scale.get(group, scale), scale)
    scales = [
        group_scale[comp.groups[i % lanes]] * headroom if _is_float(x) else None
        for i, x in enumerate(args)
    ]
    datas = [x if s is None else align(x, scale=s)[0][0] for x, s in zip(args, scales)]
    outs = primitive.bind(*datas, **params)
    return [
        out if s is None else ScaledArray(out, make_scale(s, *args))
        for out, s in zip(outs, scales[:lanes], strict=True)
    ]


def _on_values(primitive, args: Sequence[Value], widened: Callable, **params) -> list:
    """Bind ``primitive`` on the represented values in the compute dtype; ``widened(values)``
    re-binds it with its computation widened where that dtype differs. Float results are
    range-guarded at scale 1."""
    values = [to_compute(x) if _is_float(x) else x for x in args]
    if all(v.dtype == x.dtype for v, x in zip(values, args, strict=True)):
        outs = primitive.bind(*values, **params)
    else:
        outs = widened(values)
    outs = outs if primitive.multiple_results else [outs]
    return [
        guarded(out, np.float32(1.0), x.dtype, *args) if _is_float(x) else out
        for out, x in zip(outs, args, strict=False)
    ]


def _wide_dtype(dtype) -> jnp.dtype:
    """The compute dtype of a float dtype (float32 for narrow formats); others unchanged."""
    return compute_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(dtype)


def _widen(value: Any) -> Any:
    """A constant in its :func:`_wide_dtype`."""
    return value.astype(_wide_dtype(value.dtype)) if hasattr(value, "astype") else value


def _widened(jaxpr: jxi.Jaxpr, consts: Sequence) -> Callable:
    """``jaxpr`` as a function of compute-dtype values: its narrow float constants, literals
    and casts are widened, so that it computes in float32 and its results round only once."""

    def run(*args):
        env = dict(zip(jaxpr.constvars, map(_widen, consts), strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(atom):
            return _widen(atom.val) if isinstance(atom, jxi.Literal) else env[atom]

        for eqn in jaxpr.eqns:
            env.update(zip(eqn.outvars, _widened_eqn(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]

    return run


def _widened_eqn(eqn: jxi.JaxprEqn, args: list) -> list:
    """The outputs of ``eqn`` on compute-dtype ``args``: calls inlined, casts widened."""
    inner = _inlined(eqn)
    if inner is not None:
        return _widened(inner.jaxpr, inner.consts)(*args)
    params = dict(eqn.params)
    if eqn.primitive is lax.convert_element_type_p:
        params["new_dtype"] = _wide_dtype(params["new_dtype"])
    out = eqn.primitive.bind(*args, **params)
    return out if eqn.primitive.multiple_results else [out]


def _widened_jaxpr(jaxpr: jxi.Jaxpr, consts: Sequence) -> jxi.ClosedJaxpr:
    """The closed jaxpr of :func:`_widened` (for primitives bound with jaxpr parameters)."""
    avals = [jax.ShapeDtypeStruct((), _wide_dtype(v.aval.dtype)) for v in jaxpr.invars]
    return jax.make_jaxpr(_widened(jaxpr, consts))(*avals)


def _widened_computation(jaxpr: jxi.Jaxpr, consts: Sequence) -> Callable:
    """A ``computation(xs, ys)`` for ``lax.reduce``/``lax.reduce_window`` from a jaxpr."""
    run = _widened(jaxpr, consts)
    return lambda xs, ys: run(*xs, *ys)


@register_scale_rule(lax.reduce_p)
def reduce_rule(*args: Value, computation, jaxpr: jxi.ClosedJaxpr, dimensions) -> list:
    """``lax.reduce`` with any computation (operands, then init values).

    A computation that only selects among float values and compares them (max, argmax with
    a payload, ...) runs on the data, each output keeping its lane's scale: bit exact. One that
    also adds runs on the data at the scale times ``sqrt(N)`` for ``N`` reduced elements (the
    rounding of the program in the data dtype). Any other runs on the represented values in
    float32 (or wider), its float results range-guarded at scale 1.
    """
    params = dict(computation=computation, jaxpr=jaxpr, dimensions=dimensions)
    lanes = len(args) // 2
    comp = _scale_commuting(jaxpr.jaxpr, jaxpr.consts, lanes)
    if comp is not None:
        count = math.prod(args[0].shape[d] for d in dimensions)
        return _on_data(lax.reduce_p, args, comp, count, **params)
    fn = _widened_computation(jaxpr.jaxpr, jaxpr.consts)
    widened = lambda v: lax.reduce(v[:lanes], v[lanes:], fn, dimensions)  # noqa: E731
    return _on_values(lax.reduce_p, args, widened, **params)


@register_scale_rule(lax.reduce_window_p)
def reduce_window_rule(*args: Value, jaxpr: jxi.Jaxpr, consts, **window) -> list:
    """``lax.reduce_window`` with any computation: as :func:`reduce_rule`, ``N`` the window
    size (padding takes the init values, at their lane's scale)."""
    lanes = len(args) // 2
    comp = _scale_commuting(jaxpr, consts, lanes)
    if comp is not None:
        count = math.prod(window["window_dimensions"])
        return _on_data(
            lax.reduce_window_p, args, comp, count, jaxpr=jaxpr, consts=consts, **window
        )
    fn = _widened_computation(jaxpr, consts)
    widened = lambda v: lax.reduce_window(v[:lanes], v[lanes:], fn, **window)  # noqa: E731
    return _on_values(lax.reduce_window_p, args, widened, jaxpr=jaxpr, consts=consts, **window)


@register_scale_rule(lax.select_and_scatter_p)
def select_and_scatter_rule(
    operand: Value,
    source: Value,
    init_value: Value,
    *,
    select_jaxpr: jxi.Jaxpr,
    select_consts,
    scatter_jaxpr: jxi.Jaxpr,
    scatter_consts,
    **window,
) -> ScaledArray:
    """Select in each window of ``operand``, scatter ``source`` there (combined from
    ``init_value``).

    A select that commutes with a scale (comparisons) runs on the operand's data, and a
    scatter that does (add, max, ...) on the source and init value at the larger of their
    scales, which the result keeps, as ``select_and_scatter_add`` does. Otherwise all three
    are computed on their represented values in float32 (or wider), the result range-guarded
    at scale 1.
    """
    jaxprs = dict(select_jaxpr=select_jaxpr, select_consts=select_consts)
    jaxprs.update(scatter_jaxpr=scatter_jaxpr, scatter_consts=scatter_consts)
    select = _scale_commuting(select_jaxpr, select_consts, 1)
    scatter = _scale_commuting(scatter_jaxpr, scatter_consts, 1)
    if select is not None and scatter is not None:
        scale = lax.max(scale_f32(source), _init_scale(init_value))
        (data, init), scale = align(source, init_value, scale=scale)
        out = lax.select_and_scatter_p.bind(as_scaled(operand).data, data, init, **jaxprs, **window)
        return ScaledArray(out, make_scale(scale, source, init_value))

    def widened(values: list) -> jax.Array:
        select_w = _widened_jaxpr(select_jaxpr, select_consts)
        scatter_w = _widened_jaxpr(scatter_jaxpr, scatter_consts)
        return lax.select_and_scatter_p.bind(
            *values,
            select_jaxpr=select_w.jaxpr,
            select_consts=tuple(select_w.consts),
            scatter_jaxpr=scatter_w.jaxpr,
            scatter_consts=tuple(scatter_w.consts),
            **window,
        )

    args = [operand, source, init_value]
    return _on_values(lax.select_and_scatter_p, args, widened, **jaxprs, **window)[0]
