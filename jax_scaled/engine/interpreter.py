"""The scalify transform: trace a function to a jaxpr and re-run it on ScaledArrays.

Each value of the jaxpr travels in a :class:`~jax_scaled.engine.facts.Slot`: the value itself (a
plain array or a ScaledArray) and what is statically known about it. An equation whose
inputs are all plain is bound untouched (its outputs' facts follow :mod:`jax_scaled.engine.facts`);
a higher-order equation (``jit``, ``scan``, ...) goes to its higher-order rule, which
interprets its sub-jaxprs with :func:`interpret_closed`; any other equation with a scaled
input goes to its scale rule, after plain operands known statically are promoted to
ScaledArrays (:mod:`jax_scaled.engine.promotion`). Both kinds of rule live in the primitive's record
(:mod:`jax_scaled.engine.registry`). A scaled ``dot_general`` whose only use is a transpose of its
result is bound as one swapped contraction (:mod:`jax_scaled.engine.peephole`), and a sum of
two tensors read twice or more is range-guarded (:mod:`jax_scaled.engine.fusion`).

The public API for higher-order rules: :func:`interpret_closed`, :func:`interpret_jaxpr`,
:func:`rule_output_slots` and :func:`source_line`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax.numpy as jnp
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.any_scale import AnyScaleValue
from jax_scaled.array import ScaledArray, Value, is_array_like
from jax_scaled.config import ScalifyConfig, current_config
from jax_scaled.dtypes import is_narrow_float
from jax_scaled.engine import block_dispatch, constants, recording
from jax_scaled.engine.facts import Slot, constant_slot, forwarded
from jax_scaled.engine.fusion import (
    bundle_scales,
    computed_once_where_shared,
    guards_shared_sum,
    marked_computed,
    operands_computed_together,
    scalar_chains_bounded,
)
from jax_scaled.engine.peephole import transposed_contractions, use_counts
from jax_scaled.engine.promotion import (
    constant_output,
    normalized_scalar,
    normalizes,
    promote_inputs,
)
from jax_scaled.engine.registry import Property, record
from jax_scaled.engine.together import SharedWork
from jax_scaled.engine.tracing import Traced, bind_eqn, call_traced, evaluate_jaxpr
from jax_scaled.scales.geometry import is_blocked
from jax_scaled.scales.wide import record_chain


def scalify(fn: Callable, *, config: ScalifyConfig | None = None) -> Callable:
    """Transform ``fn`` to propagate scales through every operation it performs.

    The returned function has ``fn``'s signature. It accepts pytrees of arrays and
    ScaledArrays in positional and keyword arguments; operations that see a ScaledArray
    apply their scale rule, the rest run untouched. Leaves that are not arrays (Python
    numbers, strings, callables) are treated as static values, baked into the trace; under
    ``jax.jit`` mark them static there too (``static_argnums``) or bind them with
    ``functools.partial``.

    Under ``jax.vmap``, a ScaledArray's scale is mapped like any leaf: to share one scale
    across the batch, pass ``in_axes``/``out_axes`` built as
    ``jax.tree.unflatten(jax.tree.structure(x), [0, None])`` (data mapped, scale not).

    Args:
        fn: the function to transform.
        config: a ScalifyConfig to trace under (default: the active one, see ScalifyConfig).

    Example:
        >>> f = scalify(lambda x, y: x * y + x)
        >>> out = f(scaled_array([1.0, 2.0], 2.0**-20), scaled_array([3.0, 4.0], 1.0))
        >>> isinstance(out, ScaledArray), float(out.to_array()[1] * 2**20)
        (True, 10.0)
    """

    if not callable(fn):
        raise TypeError(f"scalify expects a function, got {type(fn).__name__}: {fn!r}.")

    check = functools.partial(_check_outputs, fn)

    @functools.wraps(fn)
    def scalified(*args, **kwargs):
        # The call's one context: traces (js.quantize binds its primitive), then runs rules.
        with context.scalify_call(config):
            return call_traced(fn, args, kwargs, _interpret, scaled_leaves=True, check=check)

    return scalified


def _interpret(traced: Traced) -> list:
    """The traced function's outputs, its jaxpr run with scale rules."""
    context.start_rules(_true_constants(traced))
    in_slots = [Slot(normalized_scalar(x) if normalizes(x) else x) for x in traced.arrays]
    marked_computed([s.value for s in in_slots])
    out_slots = interpret_closed(traced.closed, in_slots)
    kept = constant_output if any(s.is_scaled for s in in_slots) else (lambda s: s.value)
    return bundle_scales([kept(s) for s in out_slots], traced.arrays)


def _check_outputs(fn: Callable, leaves: list) -> None:
    """Name the user's function, not scalify's wrapper, when it returns a non-array."""
    for leaf in leaves:
        if not (is_array_like(leaf) or isinstance(leaf, (bool, int, float, complex))):
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"scalified function {name} returned a {type(leaf).__name__} ({leaf!r:.60}): "
                "it must return arrays, ScaledArrays, Python numbers or pytrees of them."
            )


def _true_constants(traced: Traced) -> constants.TrueConstants:
    """Constants such as optax's ``eps=1e-8`` that a narrow trace rounded to 0 or inf."""
    if not any(is_narrow_float(x.dtype) for x in traced.arrays):
        return constants.TrueConstants()
    return constants.recover_constants(traced.closed, lambda: traced.retraced(widen=True))


def interpret_jaxpr(
    jaxpr: jxi.Jaxpr, consts: Sequence[Any], in_slots: Sequence[Slot]
) -> list[Slot]:
    """Run ``jaxpr`` on slots, applying scale rules; returns the output slots."""
    eqns, pairs = jaxpr.eqns, transposed_contractions(jaxpr).items()
    swaps = {id(eqns[i]): (eqns[j], swapped) for i, (j, swapped) in pairs}
    passed_on: set[int] = set()  # transposes whose value their swapped dot computed
    uses = use_counts(jaxpr)
    broadcasts = {e.outvars[0] for e in eqns if e.primitive is lax.broadcast_in_dim_p}

    def step(eqn: jxi.JaxprEqn, eqn_slots: list[Slot]) -> list[Slot]:
        outvars = eqn.outvars
        if id(eqn) in passed_on:
            shared.bind(outvars, eqn_slots)
            return eqn_slots
        shared.before(eqn)
        swap = swaps.get(id(eqn))
        if swap is not None and any(s.is_scaled for s in eqn_slots):
            # A scaled weight gradient: the swapped dot computes the transpose's value.
            transpose, eqn = swap
            passed_on.add(id(transpose))
            eqn_slots = eqn_slots[::-1]
        with _sum_guard(eqn, uses, broadcasts):
            outs = interpret_eqn(eqn, eqn_slots)
        outs = computed_once_where_shared(eqn.outvars, outs, uses)
        shared.bind(outvars, outs)
        return outs

    def literal(atom: jxi.Literal) -> Slot:
        return constant_slot(atom.val, constants.true_value(atom))

    const_slots = [constant_slot(c) for c in consts]
    shared = SharedWork(jaxpr, const_slots, in_slots, literal)
    with recording.batched_observations():
        return evaluate_jaxpr(jaxpr, const_slots, in_slots, step, literal)


def _sum_guard(eqn: jxi.JaxprEqn, uses: dict, broadcasts: set) -> Any:
    """Where ``eqn`` is a shared sum (:func:`~jax_scaled.engine.fusion.guards_shared_sum`),
    a block that guards it; otherwise a block that changes nothing."""
    if not guards_shared_sum(eqn, uses, broadcasts):
        return contextlib.nullcontext()
    return context.entered(config=replace(current_config(), guard_sums=True))


def interpret_closed(closed: jxi.ClosedJaxpr, in_slots: Sequence[Slot]) -> list[Slot]:
    """Run a closed jaxpr (a higher-order equation's sub-jaxpr) on slots.

    Example:
        >>> closed = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(2))
        >>> out = interpret_closed(closed, [Slot(scaled_array([1.0, 2.0], 4.0))])
        >>> out[0].value.data.tolist(), float(out[0].value.scale)
        ([1.0, 2.0], 8.0)
    """
    return interpret_jaxpr(closed.jaxpr, closed.consts, in_slots)


def interpret_eqn(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """Interpret one equation: forward it, recurse into it, or apply its scale rule."""
    found = record(eqn.primitive)
    if not any(s.is_scaled for s in in_slots) and not found.applies_to_unscaled:
        if not _needs_facts_inside(found, in_slots):
            return _forward(eqn, in_slots)
    if found.higher_order is not None:
        if not found.has(Property.BLOCKS_INSIDE) and any(is_blocked(s.value) for s in in_slots):
            in_slots = block_dispatch.per_tensor_slots(eqn, in_slots, source_line(eqn))
        with context.entered(enclosing_line=source_line(eqn)), jxi.eqn_user_context(eqn):
            return found.higher_order(eqn, in_slots)
    if found.rule is None:
        raise NotImplementedError(
            f"scalify has no scale rule for primitive '{eqn.primitive.name}', used at "
            f"{source_line(eqn)}. Register one with jax_scaled.register_scale_rule, "
            "or leave this value unscaled (jax_scaled.stop_scaling) before the operation."
        )
    invals = promote_inputs(in_slots, found.has(Property.MULTIPLICATIVE))
    finer = _on_finer_scales(found, eqn, in_slots, invals)
    if finer is not None and not any(isinstance(v, ScaledArray) for v in finer):
        # Plain outputs: the one-scale operand is not read.
        return rule_output_slots(eqn, finer if eqn.primitive.multiple_results else finer[0])
    with jxi.eqn_user_context(eqn):
        fell_back = False
        if any(is_blocked(v) for v in invals):
            outs, fell_back = block_dispatch.apply_rule(found, eqn, invals, source_line(eqn))
        else:
            invals = operands_computed_together(eqn.primitive, invals)
            outs = found.rule(*invals, **eqn.params)
            record_chain(eqn.primitive, eqn.params, invals, outs)
    out_slots = scalar_chains_bounded(in_slots, rule_output_slots(eqn, outs, fell_back))
    if finer is None:
        return out_slots
    return [_with_finer(s, f) for s, f in zip(out_slots, finer, strict=True)]


def _on_finer_scales(
    found: Any, eqn: jxi.JaxprEqn, in_slots: list[Slot], invals: list[Value]
) -> list[Value] | None:
    """The outputs of ``eqn``'s rule on the finer scales of its operands that have them
    (:attr:`Slot.finer`), where the rule reads them; else None."""
    if not found.has(Property.READS_FINER_SCALES) or all(s.finer is None for s in in_slots):
        return None
    if found.block_rule is None and not found.has(Property.POINTWISE):
        raise RuntimeError(f"'{eqn.primitive.name}' reads finer scales without a block rule.")
    finer = [v if s.finer is None else s.finer for s, v in zip(in_slots, invals, strict=True)]
    with jxi.eqn_user_context(eqn):
        outs, _ = block_dispatch.apply_rule(found, eqn, finer, source_line(eqn))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _with_finer(slot: Slot, finer: Value) -> Slot:
    return replace(slot, finer=finer) if slot.is_scaled and is_blocked(finer) else slot


def rule_output_slots(eqn: jxi.JaxprEqn, outs: Any, block_fallback: bool = False) -> list[Slot]:
    """Slots of a rule's outputs (checked against the equation's avals); outputs wrapped
    with ``ANY_SCALE(x)`` become scale-free, and a one-element zero takes the smallest scale
    (:func:`~jax_scaled.engine.promotion.normalized_scalar`). Inside
    :func:`~jax_scaled.diagnostics.record_scales` the outputs are recorded (marked when
    block-scaled operands fell back to one scale)."""
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    any_scale = [isinstance(v, AnyScaleValue) for v in outs]
    outs = [v.value if isinstance(v, AnyScaleValue) else v for v in outs]
    _check_rule_outputs(eqn, outs)
    outs = [normalized_scalar(v) if normalizes(v) else v for v in outs]
    if recording.is_recording():
        where = jxi.eqn_name_stack(eqn)
        recording.observe(eqn.primitive.name, source_line(eqn), where, outs, block_fallback)
    return [Slot(v, any_scale=a) for v, a in zip(outs, any_scale, strict=True)]


def _needs_facts_inside(found: Any, in_slots: list[Slot]) -> bool:
    """A plain call (``jit``) fed scale-free or constant values is interpreted, not
    forwarded, so that facts its body derives (a ``-inf`` mask of ``jnp.where``) reach its
    outputs."""
    if not found.has(Property.FACTS_INSIDE):
        return False
    floats = (s for s in in_slots if jnp.issubdtype(jnp.result_type(s.value), jnp.floating))
    return any(s.is_any_scale or s.constant is not None for s in floats)


def _forward(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    with jxi.eqn_user_context(eqn):
        outs = bind_eqn(eqn, [s.value for s in in_slots])
    return forwarded(eqn, in_slots, outs)


def source_line(eqn: jxi.JaxprEqn) -> str:
    """The user's line for ``eqn``, or that of the enclosing call (library code has none).

    Example:
        >>> eqn = jax.make_jaxpr(lambda x: x + 1)(1.0).jaxpr.eqns[0]
        >>> "<doctest" in source_line(eqn)
        True
    """
    line = jxi.eqn_source_line(eqn)
    if line and not line.startswith(":"):
        return line
    return context.current().enclosing_line or "<unknown location>"


def _check_rule_outputs(eqn: jxi.JaxprEqn, outs: list[Value]) -> None:
    for var, out in zip(eqn.outvars, outs, strict=True):
        aval = var.aval
        if tuple(out.shape) != tuple(aval.shape) or out.dtype != aval.dtype:
            raise RuntimeError(
                f"the scale rule of '{eqn.primitive.name}' returned {out.dtype}{list(out.shape)}"
                f" where the program expects {aval.dtype}{list(aval.shape)} (at "
                f"{source_line(eqn)}). This is a bug in the rule."
            )
