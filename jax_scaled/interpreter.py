"""The scalify transform: trace a function to a jaxpr and re-run it on ScaledArrays.

Each value of the jaxpr travels in a :class:`Slot`: the value itself (a plain array or a
ScaledArray) and what is statically known about it (is it a broadcast scalar, and of which
constant). An equation whose inputs are all plain is bound untouched; a higher-order equation
(``jit``, ``custom_jvp_call``, ...) has its sub-jaxpr interpreted; any other equation with a
scaled input goes to its registered scale rule, after plain operands known statically are
promoted to ScaledArrays (:mod:`jax_scaled.promotion`). A scaled ``dot_general`` whose only
use is a transpose of its result is bound as one swapped contraction
(:mod:`jax_scaled.peephole`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled import _jax_internals as jxi
from jax_scaled import constants, diagnostics, estimates
from jax_scaled.any_scale import AnyScaleValue
from jax_scaled.array import ScaledArray, _is_array_like
from jax_scaled.config import ScalifyConfig
from jax_scaled.dtypes import compute_dtype, is_narrow_float
from jax_scaled.fusion import bundle_scales
from jax_scaled.memo import scale_memo
from jax_scaled.peephole import transposed_contractions
from jax_scaled.promotion import normalized_scalar, normalizes, promote_inputs
from jax_scaled.registry import applies_to_unscaled, find_scale_rule

Value = Any  # jax.Array | ScaledArray


@dataclasses.dataclass(frozen=True)
class Slot:
    """A jaxpr value during interpretation, with its static facts.

    ``constant`` is the Python value of a broadcast scalar known at trace time (a literal,
    a folded constant). ``base`` is the 0-d array the value is a broadcast of, when known.
    ``estimate`` is a static power-of-two estimate of a plain value's magnitude (see
    :mod:`jax_scaled.estimates`), used to scale it if it meets a ScaledArray.
    ``any_scale`` says the value does not depend on its scale (:data:`ANY_SCALE`: zeros,
    infinities, NaNs and selections among them), so it takes the scale of what it meets.
    """

    value: Value
    constant: float | None = None
    base: jax.Array | None = None
    estimate: float | None = None
    any_scale: bool = False

    @property
    def is_scaled(self) -> bool:
        return isinstance(self.value, ScaledArray)

    @property
    def is_any_scale(self) -> bool:
        """True for scale-independent values: marked ones, and constants 0, ±inf, NaN."""
        if self.any_scale or self.constant is None:
            return self.any_scale
        return self.constant == 0 or not math.isfinite(self.constant)


# Plain shape-only primitives through which "broadcast of a scalar" facts survive.
_FACT_PRESERVING = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p"}


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

    @functools.wraps(fn)
    def scalified(*args, **kwargs):
        with config if config is not None else contextlib.nullcontext():
            return _scalify_call(fn, args, kwargs)

    return scalified


def _is_dynamic_leaf(x: Any) -> bool:
    return isinstance(x, ScaledArray) or _is_array_like(x)


def _abstract(x: Any, widen: bool = False) -> jax.ShapeDtypeStruct:
    weak_type = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    if isinstance(x, ScaledArray):
        _check_scalar_scale(x)
        weak_type = False
    # Inside shard_map, keep the mesh axes the value varies over (check_vma typing).
    manual = jxi.manual_axis_kwargs(x.data if isinstance(x, ScaledArray) else x)
    dtype = compute_dtype(x.dtype) if widen else x.dtype
    return jax.ShapeDtypeStruct(x.shape, dtype, weak_type=weak_type, **manual)


def _check_scalar_scale(x: ScaledArray) -> None:
    if np.ndim(x.scale) != 0:
        raise NotImplementedError(
            f"scalify supports scalar (per-tensor) scales only; got a ScaledArray of shape "
            f"{x.shape} with scale of shape {tuple(np.shape(x.scale))}."
        )


def _scalify_call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=lambda x: isinstance(x, ScaledArray))
    is_dynamic = [_is_dynamic_leaf(x) for x in leaves]
    dynamic = [x for x, d in zip(leaves, is_dynamic, strict=False) if d]
    out_tree_box: list = []

    def flat_fn(*dynamic_values):
        values = iter(dynamic_values)
        merged = [next(values) if d else x for x, d in zip(leaves, is_dynamic, strict=False)]
        call_args, call_kwargs = jax.tree.unflatten(in_tree, merged)
        out_leaves, out_tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_tree_box.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*[_abstract(x) for x in dynamic])
    found = _true_constants(flat_fn, closed, dynamic)
    with scale_memo(), constants.true_constants(found):
        in_slots = [Slot(normalized_scalar(x) if normalizes(x) else x) for x in dynamic]
        out_slots = interpret_jaxpr(closed.jaxpr, closed.consts, in_slots)
    outputs = bundle_scales([s.value for s in out_slots], dynamic)
    return jax.tree.unflatten(out_tree_box[0], outputs)


def _true_constants(
    flat_fn: Callable, closed: jxi.ClosedJaxpr, dynamic: list
) -> constants.TrueConstants:
    """Constants such as optax's ``eps=1e-8`` that a narrow trace rounded to 0 or inf."""
    if not any(is_narrow_float(x.dtype) for x in dynamic):
        return constants.TrueConstants()
    widened = [_abstract(x, widen=True) for x in dynamic]
    return constants.recover_constants(closed, lambda: jax.make_jaxpr(flat_fn)(*widened))


def interpret_jaxpr(
    jaxpr: jxi.Jaxpr, consts: Sequence[Any], in_slots: Sequence[Slot]
) -> list[Slot]:
    """Run ``jaxpr`` on slots, applying scale rules; returns the output slots."""
    env: dict[jxi.Var, Slot] = {}

    def read(atom) -> Slot:
        if isinstance(atom, jxi.Literal):
            return _constant_slot(atom.val, constants.true_value(atom))
        return env[atom]

    for var, const in zip(jaxpr.constvars, consts, strict=False):
        env[var] = _constant_slot(const)
    for var, slot in zip(jaxpr.invars, in_slots, strict=True):
        env[var] = slot
    swaps = transposed_contractions(jaxpr)
    skipped: set[int] = set()
    for index, eqn in enumerate(jaxpr.eqns):
        if index in skipped:
            continue
        in_slots = [read(v) for v in eqn.invars]
        swap = swaps.get(index)
        if swap is not None and any(s.is_scaled for s in in_slots):
            # A scaled weight gradient: the swapped dot writes the transposed result itself.
            transpose_index, eqn = swap
            skipped.add(transpose_index)
            in_slots.reverse()
        out_slots = interpret_eqn(eqn, in_slots)
        for var, slot in zip(eqn.outvars, out_slots, strict=True):
            if not isinstance(var, jxi.DropVar):
                env[var] = slot
    return [read(v) for v in jaxpr.outvars]


def _constant_slot(value: Any, true_value: float | None = None) -> Slot:
    """The slot of a trace-time constant; ``true_value`` is the number the source wrote when
    the narrow trace rounded it away (see :mod:`jax_scaled.constants`)."""
    if isinstance(value, ScaledArray) or isinstance(value, jxi.Tracer):
        return Slot(value)
    if np.ndim(value) == 0 and jnp.issubdtype(jnp.result_type(value), jnp.floating):
        constant = float(value) if true_value is None else true_value
        return Slot(value, constant=constant, base=value, estimate=estimates.of_constant(constant))
    return Slot(value)


_enclosing_source_lines: list[str] = []


def _source_line(eqn: jxi.JaxprEqn) -> str:
    """The user's line for ``eqn``, or that of the enclosing call (library code has none)."""
    line = jxi.eqn_source_line(eqn)
    if line and not line.startswith(":"):
        return line
    return next((s for s in reversed(_enclosing_source_lines) if s), "<unknown location>")


def interpret_eqn(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """Interpret one equation: forward it, recurse into it, or apply its scale rule."""
    if not any(s.is_scaled for s in in_slots) and not applies_to_unscaled(eqn.primitive):
        if not _needs_facts_inside(eqn, in_slots):
            return _forward(eqn, in_slots)
    higher_order = _HIGHER_ORDER_RULES.get(eqn.primitive)
    if higher_order is not None:
        _enclosing_source_lines.append(_source_line(eqn))
        try:
            with jxi.eqn_user_context(eqn):
                return higher_order(eqn, in_slots)
        finally:
            _enclosing_source_lines.pop()
    rule = find_scale_rule(eqn.primitive)
    if rule is None:
        raise NotImplementedError(
            f"scalify has no scale rule for primitive '{eqn.primitive.name}', used at "
            f"{_source_line(eqn)}. Register one with jax_scaled.register_scale_rule, "
            "or leave this value unscaled (jax_scaled.stop_scaling) before the operation."
        )
    invals = promote_inputs(in_slots, eqn.primitive.name)
    with jxi.eqn_user_context(eqn):
        outs = rule(*invals, **eqn.params)
    out_slots = _rule_output_slots(eqn, outs)
    if diagnostics.is_recording():
        values = [s.value for s in out_slots]
        diagnostics.observe(eqn.primitive.name, _source_line(eqn), jxi.eqn_name_stack(eqn), values)
    return out_slots


def _rule_output_slots(eqn: jxi.JaxprEqn, outs: Any) -> list[Slot]:
    """Slots of a rule's outputs; outputs wrapped with ``ANY_SCALE(x)`` become scale-free."""
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    any_scale = [isinstance(v, AnyScaleValue) for v in outs]
    outs = [v.value if isinstance(v, AnyScaleValue) else v for v in outs]
    _check_rule_outputs(eqn, outs)
    outs = [normalized_scalar(v) if normalizes(v) else v for v in outs]
    return [Slot(v, any_scale=a) for v, a in zip(outs, any_scale, strict=True)]


def _needs_facts_inside(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> bool:
    """A plain ``jit`` fed scale-free or constant values is interpreted, not forwarded, so
    that facts its body derives (e.g. a ``-inf`` mask from ``jnp.where``) reach its outputs."""
    if eqn.primitive is not jxi.jit_p:
        return False
    return any(s.is_any_scale or s.constant is not None for s in in_slots)


def _forward(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    subfuns, params = jxi.eqn_bind_params(eqn)
    with jxi.eqn_user_context(eqn):
        outs = eqn.primitive.bind(*subfuns, *[s.value for s in in_slots], **params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    out_slots = _forwarded_facts(eqn, in_slots, outs)
    if _keeps_any_scale(eqn, in_slots) and not out_slots[0].is_any_scale:
        out_slots[0] = dataclasses.replace(out_slots[0], any_scale=True)
    if len(out_slots) == 1 and jnp.issubdtype(out_slots[0].value.dtype, jnp.floating):
        constant = out_slots[0].constant
        if constant is not None:
            estimate = estimates.of_constant(constant)
        else:
            estimate = _forwarded_estimate(eqn, in_slots)
        out_slots[0] = dataclasses.replace(out_slots[0], estimate=estimate)
    return out_slots


def _forwarded_estimate(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> float | None:
    if eqn.primitive.name == "convert_element_type":
        from_float = jnp.issubdtype(in_slots[0].value.dtype, jnp.floating)
        return estimates.cast_estimate(in_slots[0].estimate, from_float)
    return estimates.propagate(
        eqn.primitive.name,
        [s.estimate for s in in_slots],
        [tuple(np.shape(s.value)) for s in in_slots],
        eqn.params,
    )


def _forwarded_facts(eqn: jxi.JaxprEqn, in_slots: list[Slot], outs: list) -> list[Slot]:
    """Broadcast-scalar facts of a forwarded equation's outputs."""
    source = in_slots[0] if in_slots else None
    if source is not None and (source.base is not None or source.constant is not None):
        name = eqn.primitive.name
        if name in _FACT_PRESERVING:
            return [Slot(outs[0], constant=source.constant, base=source.base)]
        if name == "convert_element_type":
            return [_converted_fact(source, outs[0])]
        if name == "reduce_sum":
            return [_summed_fact(source, outs[0], eqn.params["axes"])]
        if name in _ELEMENTWISE and all(_has_fact(s) for s in in_slots):
            return [_elementwise_fact(eqn, in_slots, outs[0])]
    return [_plain_slot(v) for v in outs]


# Float elementwise primitives: on broadcast scalars their result is a broadcast scalar.
_ELEMENTWISE = {
    "neg", "add", "sub", "mul", "div", "max", "min", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "sqrt", "rsqrt", "square", "integer_pow", "pow", "tanh", "logistic",
}  # fmt: skip


# Float primitives whose output is scale-independent when their float inputs all are (a
# selection, reshuffle or combination of zeros, infinities and NaNs is still one).
_ANY_SCALE_PRESERVING = _FACT_PRESERVING | {
    "neg", "add", "sub", "mul", "max", "min", "abs", "select_n", "concatenate", "transpose",
    "slice", "dynamic_slice", "gather", "rev", "pad", "convert_element_type", "reduce_max",
    "reduce_min", "squeeze", "broadcast_in_dim", "clamp",
}  # fmt: skip


# Products and quotients with one scale-independent factor are scale-independent: ``0 * x``
# and ``0 / x`` are zeros (or NaNs), ``x * inf`` and ``x / 0`` infinities (or NaNs). Such a
# zero (dpsgd's noise times noise_multiplier=0) then takes the scale of what it is added to.
_ABSORBING = {"mul", "div"}


def _keeps_any_scale(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> bool:
    name = eqn.primitive.name
    if (name not in _ANY_SCALE_PRESERVING and name not in _ABSORBING) or len(eqn.outvars) != 1:
        return False
    if not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return False
    floats = [s for s in in_slots if jnp.issubdtype(s.value.dtype, jnp.floating)]
    if name in _ABSORBING:
        return any(s.is_any_scale for s in floats)
    return bool(floats) and all(s.is_any_scale for s in floats)


def _has_fact(slot: Slot) -> bool:
    return slot.base is not None or slot.constant is not None


def _scalar_of(slot: Slot) -> Any:
    """The 0-d value a broadcast-scalar slot repeats."""
    if slot.base is not None:
        return slot.base
    return np.asarray(slot.constant, slot.value.dtype)


def _elementwise_fact(eqn: jxi.JaxprEqn, in_slots: list[Slot], out: Any) -> Slot:
    """An elementwise op of broadcast scalars: apply it to the scalars themselves."""
    if np.ndim(out) == 0:
        base = out  # the equation itself already computed the scalar
    else:
        base = eqn.primitive.bind(*[_scalar_of(s) for s in in_slots], **eqn.params)
    constant = None
    if all(s.constant is not None for s in in_slots):
        constant = _fold_constant(eqn, _fold_operands(in_slots))
    return Slot(out, constant=constant, base=base)


# Correctly rounded in every float dtype, so numpy folds them exactly as XLA computes them.
_NUMPY_EXACT = {
    "neg": np.negative, "add": np.add, "sub": np.subtract, "mul": np.multiply,
    "div": np.divide, "max": np.maximum, "min": np.minimum, "abs": np.abs, "sign": np.sign,
    "square": np.square,
}  # fmt: skip


def _fold_operands(in_slots: list[Slot]) -> list[np.ndarray]:
    """The constants of ``in_slots`` as scalars of their dtype, or of float32 where a narrow
    dtype cannot hold one of them (a constant the narrow trace rounded away, such as
    ``eps=1e-8`` in float16: the float32 program folds it in float32)."""
    dtypes = [s.value.dtype for s in in_slots]
    if not all(constants.holds(d, s.constant) for d, s in zip(dtypes, in_slots, strict=True)):
        dtypes = [compute_dtype(d) for d in dtypes]
    return [np.asarray(s.constant, d) for d, s in zip(dtypes, in_slots, strict=True)]


def _fold_constant(eqn: jxi.JaxprEqn, scalars: list[np.ndarray]) -> float:
    """The value of an elementwise equation on constant scalars, at trace time. Exact float
    arithmetic folds in numpy; the rest runs through XLA (compiled once per primitive and
    dtype in a process: tens of milliseconds)."""
    exact = _NUMPY_EXACT.get(eqn.primitive.name)
    if exact is not None and all(jnp.issubdtype(s.dtype, jnp.floating) for s in scalars):
        with np.errstate(all="ignore"):
            return float(np.asarray(exact(*scalars), scalars[0].dtype))
    with jax.ensure_compile_time_eval():
        return float(eqn.primitive.bind(*scalars, **eqn.params))


def _summed_fact(source: Slot, out: Any, axes: Sequence[int]) -> Slot:
    """reduce_sum of a broadcast scalar c over N elements is the broadcast scalar N * c."""
    count = math.prod(source.value.shape[a] for a in axes)
    constant = None if source.constant is None else source.constant * count
    base = _scalar_of(source) * np.asarray(count, source.value.dtype)
    return Slot(out, constant=constant, base=base)


def _converted_fact(source: Slot, out: Any) -> Slot:
    """Facts of a broadcast scalar after a cast (kept only for float-to-float casts). A
    constant keeps its range: a narrowing cast rounds its mantissa only, as a cast of scaled
    data does (the cast of ``1e-8`` to float16 is still ``1e-8``, to float16's precision)."""
    if not jnp.issubdtype(out.dtype, jnp.floating):
        return _plain_slot(out)
    constant = None
    if source.constant is not None:
        constant = constants.rounded_to_precision(source.constant, out.dtype)
    base = None if source.base is None else jnp.asarray(source.base).astype(out.dtype)
    return Slot(out, constant=constant, base=base)


def _plain_slot(value: Any) -> Slot:
    is_float_scalar = np.ndim(value) == 0 and jnp.issubdtype(value.dtype, jnp.floating)
    return Slot(value, base=value if is_float_scalar else None)


def _check_rule_outputs(eqn: jxi.JaxprEqn, outs: list[Value]) -> None:
    for var, out in zip(eqn.outvars, outs, strict=True):
        aval = var.aval
        if tuple(out.shape) != tuple(aval.shape) or out.dtype != aval.dtype:
            raise RuntimeError(
                f"the scale rule of '{eqn.primitive.name}' returned {out.dtype}{list(out.shape)}"
                f" where the program expects {aval.dtype}{list(aval.shape)} (at "
                f"{_source_line(eqn)}). This is a bug in the rule."
            )
        if isinstance(out, ScaledArray):
            _check_scalar_scale(out)


# ---------------------------------------------------------------------------------------
# Higher-order primitives
# ---------------------------------------------------------------------------------------

HigherOrderRule = Callable[[jxi.JaxprEqn, list], list]
_HIGHER_ORDER_RULES: dict[jxi.Primitive, HigherOrderRule] = {}


def register_higher_order_rule(
    primitive: jxi.Primitive,
) -> Callable[[HigherOrderRule], HigherOrderRule]:
    """Register a handler ``(eqn, in_slots) -> out_slots`` for a primitive with sub-jaxprs."""

    def register(rule: HigherOrderRule) -> HigherOrderRule:
        _HIGHER_ORDER_RULES[primitive] = rule
        return rule

    return register


def higher_order_primitives() -> dict[str, str]:
    """Names of the primitives interpreted recursively, with the module handling each."""
    return {p.name: rule.__module__ for p, rule in _HIGHER_ORDER_RULES.items()}


def _interpret_closed(closed: jxi.ClosedJaxpr, in_slots: list[Slot]) -> list[Slot]:
    return interpret_jaxpr(closed.jaxpr, closed.consts, in_slots)


def _inline_call(param_name: str) -> HigherOrderRule:
    def rule(eqn, in_slots):
        return _interpret_closed(eqn.params[param_name], in_slots)

    return rule


# The forward computation of custom derivative rules is interpreted in place: scalify's input
# jaxpr already contains the user's derivative rules wherever jax.grad was traced inside it.
register_higher_order_rule(jxi.custom_jvp_call_p)(_inline_call("call_jaxpr"))
register_higher_order_rule(jxi.custom_vjp_call_p)(_inline_call("call_jaxpr"))
register_higher_order_rule(jxi.closed_call_p)(_inline_call("call_jaxpr"))


@register_higher_order_rule(jxi.linear_solve_p)
def _linear_solve_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
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
    return _interpret_closed(eqn.params["jaxprs"].solve, [*solve_consts, *b])


@register_higher_order_rule(jxi.jit_p)
def _jit_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """Re-bind a nested ``jit`` through ``jax.jit``, keeping its name, donation and shardings."""
    params = eqn.params
    static_facts = [(s.constant, s.estimate, s.any_scale) for s in in_slots]

    out_facts: list[list[dict]] = []

    def body(*values):
        slots = [
            Slot(v, constant=c, estimate=e, any_scale=a) if (c, e, a) != (None, None, False)
            else _constant_slot(v)
            for v, (c, e, a) in zip(values, static_facts, strict=True)
        ]  # fmt: skip
        out_slots = _interpret_closed(params["jaxpr"], slots)
        out_facts.append([_static_facts(s) for s in out_slots])
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
    return [
        Slot(v, **f) if isinstance(v, ScaledArray) else dataclasses.replace(_plain_slot(v), **f)
        for v, f in zip(outs, facts, strict=True)
    ]


def _static_facts(slot: Slot) -> dict:
    """The trace-time (Python-level) facts of a slot, which may leave a nested trace."""
    return {"constant": slot.constant, "estimate": slot.estimate, "any_scale": slot.any_scale}


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
