"""Scale rules for control flow: scan, while, cond/switch and remat (``jax.checkpoint``).

Each sub-jaxpr is interpreted by scalify's interpreter inside a function re-bound through the
public JAX API (``lax.scan``, ``lax.while_loop``, ``lax.switch``, ``jax.checkpoint``): the
program keeps its structure, only the representation of its values changes.

* **Loop carries** (scan, while): a ScaledArray carry travels as its ``(data, scale)``
  pytree, so its scale may change every iteration. Which carries are scaled, and their scale
  dtype, must agree between the body's input and output: when the body would turn a plain
  carry into a ScaledArray, the initial value is promoted and the body interpreted again (a
  fixed point, usually reached at once). A scaled carry that the body returns plain is
  promoted inside the body. Constants keep their static facts in the body; carries do not.
  A carry with float32 data leaves each iteration with its largest datum within ``2^+-8``
  of 1 (:func:`~jax_scaled.scales.guard.recentred_carry`): no rule guards float32 data,
  and an estimate that is off compounds over the iterations.
* **Stacked outputs** (``ys`` of scan): a loop-invariant scale (that of a constant or of
  ``xs``, kept by the body) is returned as is. Otherwise each iteration's scale is stacked and
  the result is brought to the largest scale of its rows that are not all zero (one rescale
  of the stacked data). The rows stay in the output's slot at their own scales
  (:attr:`~jax_scaled.engine.facts.Slot.finer`): a later scan that reads it as ``xs`` uses
  them directly (residuals of ``grad`` of a scan), and so do ``stop_scaling``, ``is_finite``
  and casts (a scanned model's gradients, read by the optimizer and a finite check), exactly.
  Under ``jit`` the rescale is then dead code.
  8-bit float data is stacked as its bytes, which XLA writes in place.
* **Branches** (cond, switch): interpreted separately; where they disagree on an output, the
  plain ones are promoted to ScaledArray (and scale dtypes joined).
* **remat**: re-bound with its policy, ``prevent_cse`` and ``differentiated`` flag.

A plain value promoted to a ScaledArray keeps its static facts (a known constant is split,
an estimate becomes its scale); zeros take the smallest scale ``2^-126`` (they are the same
at any scale and then never dominate an estimate); a value with no facts gets scale 1.

Example:
    >>> product = scalify(lambda xs: jax.lax.scan(lambda c, x: (c * x, None), jnp.ones(2), xs)[0])
    >>> out = product(scaled_array(jnp.full((3, 2), 1.5, jnp.float16), 2.0**-20))
    >>> out.data.tolist(), float(out.scale) == 2.0**-60  # 3.375 * 2^-60: below float16's range
    ([3.375, 3.375], True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, Value
from jax_scaled.config import current_config
from jax_scaled.engine.facts import Slot, plain_slot, rebound
from jax_scaled.engine.interpreter import interpret_closed, interpret_jaxpr
from jax_scaled.engine.promotion import promote
from jax_scaled.engine.registry import Property, register_higher_order_rule
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT, is_static
from jax_scaled.pow2.traced import pow2_ratio
from jax_scaled.pow2.xla import computed_once, computed_once_per_block
from jax_scaled.scales import recentred_carry, rescale

Signature = Any  # the scale dtype of a ScaledArray, or None for a plain value

_E8M0 = jnp.dtype(jnp.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------
# Representation signatures: which values are scaled, with which scale dtype
# ---------------------------------------------------------------------------------------


def _signature(value: Value) -> Signature:
    return jnp.dtype(value.scale.dtype) if isinstance(value, ScaledArray) else None


def _join(a: Signature, b: Signature) -> Signature:
    """The representation that can hold both: scaled wins; E8M0 wins, as in the rules."""
    if a is None or a == b:
        return b
    if b is None:
        return a
    return current_config().scale_dtype or _E8M0


def _conform(slot: Slot, signature: Signature) -> Value:
    """The slot's value in the representation ``signature`` (at least as wide as its own)."""
    value = slot.value
    if signature is None:
        return value
    if not isinstance(value, ScaledArray):
        value = _promote_plain(slot)
    if value.scale.dtype != signature:
        value = ScaledArray._trusted(value.data, value.scale.astype(signature))
    return value


def _promote_plain(slot: Slot) -> ScaledArray:
    """A plain float value as a ScaledArray, from its static facts (exact: pow2 scales)."""
    smallest = jnp.asarray(2.0**MIN_SCALE_EXPONENT, jnp.float32)  # the scale of zeros
    promoted = promote(slot, lambda: smallest, current_config().scale_dtype or jnp.float32)
    if isinstance(promoted, ScaledArray):
        return promoted
    return ScaledArray._trusted(promoted, np.ones((), np.float32))


def _out_slot(value: Value) -> Slot:
    return Slot(value) if isinstance(value, ScaledArray) else plain_slot(value)


class _Mismatch(Exception):
    """Raised inside a traced body whose outputs need a wider representation than guessed."""

    def __init__(self, token: object, signatures: list[Signature]):
        super().__init__("scalify: control-flow representation mismatch (internal)")
        self.token = token
        self.signatures = signatures


# ---------------------------------------------------------------------------------------
# Loop carries: fixed point on their representation
# ---------------------------------------------------------------------------------------

LoopRun = Callable[[list, object], list[Slot]]


def _to_fixed_point(run: LoopRun, init: Sequence[Slot], guess: list[Signature]) -> list[Slot]:
    """``run(init_values, token)`` with init values widened until the body keeps them.

    ``run`` traces the loop; its body raises :class:`_Mismatch` with ``token`` when its carry
    outputs need a wider representation. Widening is monotone (plain -> scaled -> E8M0), so
    this ends within two passes per carry; with a good ``guess`` the first pass succeeds.
    """
    signatures = [_join(_signature(s.value), g) for s, g in zip(init, guess, strict=True)]
    for _ in range(2 * len(init) + 1):
        token = object()
        values = [_conform(s, sig) for s, sig in zip(init, signatures, strict=True)]
        try:
            return run(values, token)
        except _Mismatch as mismatch:
            if mismatch.token is not token:
                raise
            signatures = [_join(a, b) for a, b in zip(signatures, mismatch.signatures, strict=True)]
    raise RuntimeError("scalify: loop carry representations did not converge (a bug).")


def _guess_carries(
    body: jxi.ClosedJaxpr, inputs: Sequence[Slot], first_carry: int, num_carry: int
) -> list[Signature]:
    """A static guess of the carries' representation, to interpret the body only once.

    A float value is guessed scaled when a float input of its equation is (every rule keeps
    scaled inputs scaled, but for explicit unscaling), iterating through the carries until
    stable. A wrong guess costs nothing: a plain output of a guessed carry is promoted in
    the body, and a missed one re-interprets it.
    """
    jaxpr = body.jaxpr
    scaled = [s.is_scaled for s in inputs]
    carries = slice(first_carry, first_carry + num_carry)
    for _ in range(num_carry + 1):
        found = _float_dependents(jaxpr, {v for v, s in zip(jaxpr.invars, scaled) if s})
        outs = [isinstance(v, jxi.Var) and v in found for v in jaxpr.outvars[:num_carry]]
        updated = [was or now for was, now in zip(scaled[carries], outs, strict=True)]
        if updated == scaled[carries]:
            break
        scaled[carries] = updated
    dtype = current_config().scale_dtype or _inputs_scale_dtype(inputs)
    return [dtype if s and not i.is_scaled else None for s, i in zip(scaled, inputs)][carries]


def _float_dependents(jaxpr: jxi.Jaxpr, sources: set) -> set:
    """The float variables of ``jaxpr`` computed from a float variable in ``sources``."""
    found = set(sources)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jxi.Var) and v in found and _is_float(v) for v in eqn.invars):
            found.update(v for v in eqn.outvars if _is_float(v))
    return found


def _is_float(var: jxi.Var) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _inputs_scale_dtype(inputs: Sequence[Slot]) -> jnp.dtype:
    dtypes = {_signature(s.value) for s in inputs}
    return _E8M0 if _E8M0 in dtypes else jnp.dtype(jnp.float32)


def _carry_slots(carry: Sequence[Value]) -> list[Slot]:
    return [_out_slot(v) for v in carry]


def _conform_carries(carry_in: Sequence[Value], out: Sequence[Slot], token: object) -> list:
    """The body's carry outputs in the carries' input representation, or :class:`_Mismatch`."""
    current = [_signature(v) for v in carry_in]
    wanted = [_join(c, _signature(o.value)) for c, o in zip(current, out, strict=True)]
    if wanted != current:
        raise _Mismatch(token, wanted)
    conformed = [_conform(o, sig) for o, sig in zip(out, current, strict=True)]
    return [recentred_carry(v) if isinstance(v, ScaledArray) else v for v in conformed]


# ---------------------------------------------------------------------------------------
# scan
# ---------------------------------------------------------------------------------------


@register_higher_order_rule(jxi.scan_p)
def _scan_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """``lax.scan`` with scaled consts, carries and xs; see the module docstring."""
    num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts = in_slots[:num_consts]
    init = in_slots[num_consts : num_consts + num_carry]
    xs = in_slots[num_consts + num_carry :]
    run = functools.partial(_run_scan, eqn.params, consts, xs)
    guess = _guess_carries(eqn.params["jaxpr"], in_slots, num_consts, num_carry)
    return _to_fixed_point(run, init, guess)


def _run_scan(
    params: dict, consts: list[Slot], xs: list[Slot], init: list, token: object
) -> list[Slot]:
    closed, num_carry = params["jaxpr"], params["num_carry"]
    scanned, unscan = zip(*[_scanned_form(s) for s in xs], strict=True) if xs else ((), ())
    invariant = _invariant_scales(consts, xs)
    y_forms: list = []

    def body(carry, x):
        x_slots = [rebuild(v) for rebuild, v in zip(unscan, x, strict=True)]
        outs = interpret_closed(closed, [*consts, *_carry_slots(carry), *x_slots])
        new_carry = _conform_carries(carry, outs[:num_carry], token)
        packed = [_pack_y(o, invariant) for o in outs[num_carry:]]
        y_forms[:] = [unpack for _, unpack in packed]
        return new_carry, [y for y, _ in packed]

    carry, ys = lax.scan(
        body,
        init,
        list(scanned),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return _carry_slots(carry) + [unpack(y) for unpack, y in zip(y_forms, ys, strict=True)]


def _scanned_form(slot: Slot) -> tuple[Any, Callable[[Any], Slot]]:
    """What ``lax.scan`` slices for an ``xs`` input, and how to rebuild one iteration's slot."""
    value = slot.value
    if not isinstance(value, ScaledArray):  # facts of a broadcast hold for each slice
        return value, functools.partial(rebound, slot)
    rows = _rows_of(slot.finer)
    if rows is not None:  # an earlier scan's rows keep their scales: no rescale
        return rows, lambda row: Slot(ScaledArray._trusted(*row))
    return value.data, lambda data: Slot(ScaledArray._trusted(data, value.scale))


def _rows_of(finer: ScaledArray | None) -> tuple[jax.Array, jax.Array] | None:
    """``(data, one scale per row)`` of a value held at a scale per row, else None."""
    if finer is None or finer.scale.shape[1:] != (1,) * (finer.ndim - 1):
        return None
    return finer.data, finer.scale.reshape(finer.scale.shape[:1])


def _invariant_scales(consts: list[Slot], xs: list[Slot]) -> dict[int, jax.Array]:
    """The scales that are the same in every iteration (of consts and of xs), by identity.

    Together with trace-time (numpy) scales, these are the output scales that need no stacking.
    """
    scales = [s.value.scale for s in [*consts, *xs] if s.is_scaled and s.value.scale.ndim == 0]
    return {id(scale): scale for scale in scales}


def _pack_y(slot: Slot, invariant: dict[int, jax.Array]) -> tuple[Any, Callable]:
    """One iteration's output as scanned out, and how to rebuild the stacked slot."""
    value = slot.value
    if not isinstance(value, ScaledArray):
        stored, restore = _stacked_as_bytes(value)
        return stored, lambda ys: plain_slot(restore(ys))
    scale = value.scale
    data, restore = _stacked_as_bytes(value.data)
    if invariant.get(id(scale)) is scale or is_static(scale):
        return data, lambda ys: Slot(ScaledArray._trusted(restore(ys), scale))
    return (data, scale), lambda rows: _unify_rows((restore(rows[0]), rows[1]))


def _stacked_as_bytes(y: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """8-bit float data scanned out as its bytes (``uint8``), and how to read the stack back.

    XLA's CPU backend writes each row of an 8-bit float stack by widening the whole stack to
    float16 and back, in every iteration: the FP8 residuals of ``grad`` of a scan over
    layers cost a step twice the unrolled one. Bytes are written in place; both bitcasts
    are free.
    """
    dtype = jnp.dtype(y.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits != 8:
        return y, lambda ys: ys
    return lax.bitcast_convert_type(y, jnp.uint8), lambda ys: lax.bitcast_convert_type(ys, dtype)


def _unify_rows(rows: tuple[jax.Array, jax.Array]) -> Slot:
    """Stacked data with one scale per row, as a ScaledArray at the largest scale of a row that
    is not all zero (the largest of all when every row is); its slot keeps the rows at their
    own scales, as its finer form."""
    data, scales = rows
    scales32 = scales.astype(jnp.float32)
    # A row of zeros is the same at any scale: its scale (a saturated layer's gradient, say,
    # 2^20 above the others) must not push the other rows' data out of the format's bits.
    nonzero = jnp.any(data != 0, axis=tuple(range(1, data.ndim)))
    common = jnp.max(jnp.where(nonzero, scales32, 0.0), initial=0.0)
    # Both computed once: XLA copied their exponent arithmetic into each kernel that reads the
    # stacked data (a scanned GPT's gradients: 23 instructions a stacked leaf).
    common = computed_once(jnp.where(common > 0, common, jnp.max(scales32, initial=0.0)))
    ratio = computed_once_per_block(pow2_ratio(scales32, common))
    per_row = scales.shape + (1,) * (data.ndim - 1)  # broadcasts along each row
    unified = ScaledArray._trusted(
        rescale(data, ratio.reshape(per_row)), common.astype(scales.dtype)
    )
    return Slot(unified, finer=ScaledArray._trusted(data, scales.reshape(per_row)))


# ---------------------------------------------------------------------------------------
# while
# ---------------------------------------------------------------------------------------


@register_higher_order_rule(jxi.while_p)
def _while_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """``lax.while_loop``; the condition is interpreted too (it may read scaled carries)."""
    params = eqn.params
    num_cond, num_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = in_slots[:num_cond]
    body_consts = in_slots[num_cond : num_cond + num_body]
    init = in_slots[num_cond + num_body :]

    def run(init_values: list, token: object) -> list[Slot]:
        def cond_fun(carry):
            slots = [*cond_consts, *_carry_slots(carry)]
            return interpret_closed(params["cond_jaxpr"], slots)[0].value

        def body_fun(carry):
            outs = interpret_closed(params["body_jaxpr"], [*body_consts, *_carry_slots(carry)])
            return _conform_carries(carry, outs, token)

        return _carry_slots(lax.while_loop(cond_fun, body_fun, init_values))

    guess = _guess_carries(params["body_jaxpr"], in_slots[num_cond:], num_body, len(init))
    return _to_fixed_point(run, init, guess)


# ---------------------------------------------------------------------------------------
# cond / switch
# ---------------------------------------------------------------------------------------


@register_higher_order_rule(jxi.cond_p)
def _cond_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """``lax.switch`` (and ``lax.cond``): branches unified where their outputs disagree."""
    index, operands = in_slots[0], in_slots[1:]
    branches = eqn.params["branches"]
    targets = None  # first pass: keep each branch's own representation if they all agree
    for _ in range(2):
        token = object()
        try:
            return _run_switch(index.value, branches, operands, targets, token)
        except _Mismatch as mismatch:
            if mismatch.token is not token:
                raise
            targets = mismatch.signatures
    raise RuntimeError("scalify: cond branch representations did not converge (a bug).")


def _run_switch(
    index: jax.Array,
    branches: Sequence[jxi.ClosedJaxpr],
    operands: list[Slot],
    targets: list[Signature] | None,
    token: object,
) -> list[Slot]:
    found: dict[int, list[Signature]] = {}

    def branch_fn(number: int, branch: jxi.ClosedJaxpr) -> Callable:
        def run_branch(*values):
            slots = [rebound(s, v) for s, v in zip(operands, values, strict=True)]
            outs = interpret_closed(branch, slots)
            if targets is not None:
                return [_conform(o, t) for o, t in zip(outs, targets, strict=True)]
            found[number] = [_signature(o.value) for o in outs]
            if len(found) == len(branches):
                _check_branches_agree(list(found.values()), token)
            return [o.value for o in outs]

        return run_branch

    fns = [branch_fn(i, b) for i, b in enumerate(branches)]
    outs = lax.switch(index, fns, *[s.value for s in operands])
    return [_out_slot(v) for v in outs]


def _check_branches_agree(signatures: list[list[Signature]], token: object) -> None:
    joined = [functools.reduce(_join, column) for column in zip(*signatures, strict=True)]
    if any(sigs != joined for sigs in signatures):
        raise _Mismatch(token, joined)


# ---------------------------------------------------------------------------------------
# remat (jax.checkpoint)
# ---------------------------------------------------------------------------------------


@register_higher_order_rule(jxi.remat_p, properties=Property.BLOCKS_INSIDE)
def _remat_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """``jax.checkpoint`` with the same policy, ``prevent_cse`` and ``differentiated`` flag."""
    params = eqn.params

    def body(*values):
        slots = [rebound(s, v) for s, v in zip(in_slots, values, strict=True)]
        return [s.value for s in interpret_jaxpr(params["jaxpr"], [], slots)]

    values = [s.value for s in in_slots]
    if params["differentiated"]:
        outs = _bind_differentiated_remat(body, values, params)
    else:
        checkpointed = jax.checkpoint(
            body, prevent_cse=params["prevent_cse"], policy=params["policy"]
        )
        outs = checkpointed(*values)
    return [_out_slot(v) for v in outs]


def _bind_differentiated_remat(body: Callable, values: list[Value], params: dict) -> list:
    """Bind ``remat`` directly: the recomputation in a backward pass (``differentiated``).

    ``jax.checkpoint`` always binds ``differentiated=False``, which would drop the
    optimisation barrier that keeps XLA from merging the recomputation with the forward pass.
    """
    closed, out_shapes = jax.make_jaxpr(body, return_shape=True)(*values)
    prevent_cse = params["prevent_cse"]
    if not isinstance(prevent_cse, bool):  # one flag per input: one per leaf, consts unflagged
        per_leaf = [f for f, v in zip(prevent_cse, values, strict=True) for _ in jax.tree.leaves(v)]
        prevent_cse = (False,) * len(closed.consts) + tuple(per_leaf)
    outs = jxi.remat_p.bind(
        *closed.consts,
        *jax.tree.leaves(values),
        jaxpr=jxi.convert_constvars_jaxpr(closed.jaxpr),
        prevent_cse=prevent_cse,
        differentiated=True,
        policy=params["policy"],
    )
    return jax.tree.unflatten(jax.tree.structure(out_shapes), outs)
