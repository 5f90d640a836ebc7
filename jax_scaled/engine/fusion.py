"""How a scalified program's scales meet XLA's fusion: computed once, returned by one kernel.

A scale is a chain of scalar arithmetic, and XLA copies such a chain into every kernel that
reads it. :func:`computed_once_where_shared` stops the copying where a value has several
readers: its scale is computed once (:func:`~jax_scaled.pow2.xla.computed_once`). Without it
the global norm that clips every parameter's update was compiled once per parameter, and
``benchmarks/model_scale.py``'s GPT compiled quadratically in depth.

Data meets the same copying. A float16 rule converts its output, and every reader converts
it back: each reader can fuse its producer, so XLA materialises nothing and recomputes the
producer in each reader. Through a transformer's residual stream (a sum of two tensors per
block, read by a layer norm, the next sum and the backward pass) every reader recomputed
the stream from the embeddings: 4,969 instructions in the weight-gradient transposes of a
4-layer GPT, quadratic in depth. :func:`guards_shared_sum` picks these sums for the range
guard, whose reduction is a reader XLA cannot fuse into: the sum is materialised once, as a
plain program's is.

XLA:CPU compiles every kernel of a program separately, at a fixed cost of several
milliseconds each, and it gives every program output that it cannot fuse into another
kernel a kernel of its own. A scalified training step returns one new scale per parameter,
each a short chain of scalar arithmetic: without help that is one kernel per parameter.
:func:`bundle_scales` routes them through a few multi-output operations instead, at most
16 scales each, because LLVM compiles one long kernel much more slowly than several short
ones (``benchmarks/compile_breakdown.py`` counts the kernels). For the same reason a chain
of 0-d rules, which XLA compiles as one kernel up to the last stored value (the global norm
adds every parameter's squared norm in sequence), is stored every 16 rules
(:func:`scalar_chains_bounded`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray
from jax_scaled.engine.facts import Slot
from jax_scaled.memo import memoized
from jax_scaled.pow2.xla import (
    computed_once,
    computed_once_as_bits,
    computed_together,
    computed_together_as_bits,
)

# A 0-d value's readers are spread over the whole program (a global norm, a scheduled
# learning rate, read by every parameter's update): copies of its chain grow with the model.
# A tensor's readers are a few kernels near it, where a kernel of its own can cost more than
# the copies. Measured (benchmarks/model_scale.py, 1-layer GPT, fp8_policy_scalify; and
# compile_breakdown.py's float32 MLP): 0-d values only, 53.8k HLO instructions; tensors read
# 3+ times too, 38.2k (MLP: 2 more kernels); read 2+ times, 37.3k (MLP: 8 more kernels).
_TENSOR_READERS = 3


def computed_once_where_shared(outvars: list, slots: list[Slot], uses: dict) -> list[Slot]:
    """``slots`` (an equation's outputs, for ``outvars``) with the traced scale of each
    shared output computed once: a 0-d value read twice or more, a tensor read
    :data:`_TENSOR_READERS` times or more (``uses``,
    :func:`~jax_scaled.engine.peephole.use_counts`). A plain 0-d float read twice or more is
    computed once itself (:func:`~jax_scaled.pow2.xla.computed_once_as_bits`). Values are
    unchanged; a scale already computed once stays as it is.

    Example:
        >>> def f(s):
        ...     slot = Slot(ScaledArray(jnp.float32(1.0), s * 2))
        ...     x = jax.make_jaxpr(lambda x: x)(1.0).jaxpr.invars[0]
        ...     return computed_once_where_shared([x], [slot], {x: 2})[0].value.scale
        >>> float(jax.jit(f)(jnp.float32(4.0)))
        8.0
        >>> "rem" in str(jax.make_jaxpr(f)(jnp.float32(4.0)))
        True
    """
    return [_once_if_shared(s, uses.get(v, 0)) for v, s in zip(outvars, slots, strict=True)]


def _once_if_shared(slot: Slot, readers: int) -> Slot:
    if _plain_traced_float_scalar(slot.value):
        return _value_once(slot) if readers >= 2 else slot
    return _with_scale_once(slot) if _shared(readers, slot) else slot


def _plain_traced_float_scalar(value: object) -> bool:
    if not (isinstance(value, jxi.Tracer) and value.ndim == 0):
        return False
    return jnp.issubdtype(value.dtype, jnp.floating)


def _value_once(slot: Slot) -> Slot:
    """A plain 0-d value read by several equations, computed once (an optax schedule's
    learning rate, read by every parameter's update); its facts kept."""
    value = slot.value
    once = memoized("value_once", value, lambda: computed_once_as_bits(value))
    memoized("value_once", once, lambda: once)
    base = once if slot.base is value else slot.base
    return dataclasses.replace(slot, value=once, base=base)


# XLA does not copy a square root into the kernels that read it, so a root's data gets a
# kernel of its own, and the kernel of its scale, which reads the operand's data (the zero
# check), compiled the operand's whole chain again. Measured on the 4-layer GPT's float16 step:
# the global norm of optax.clip_by_global_norm, a sum through every parameter, was compiled
# twice (42,341 HLO instructions; 41,374 with roots' operands computed together). Doing the
# same for the 0-d operands of div, exp, log, pow, tanh and logistic too gave 43,087.
_OPERANDS_COMPUTED_TOGETHER = (lax.sqrt_p,)


def operands_computed_together(primitive: jxi.Primitive, values: list) -> list:
    """``values`` (a rule's operands), with the data and traced scale of each 0-d ScaledArray
    computed by one kernel of their own where ``primitive`` is a square root (see above).
    Values are unchanged.

    Example:
        >>> norm = ScaledArray(jnp.float16(1.5), jnp.float32(4.0))
        >>> jaxpr = jax.make_jaxpr(lambda x: operands_computed_together(lax.sqrt_p, [x]))(norm)
        >>> [e.primitive.name for e in jaxpr.eqns].count("reduce")
        1
    """
    if primitive not in _OPERANDS_COMPUTED_TOGETHER:
        return values
    return [_data_and_scale_together(v) for v in values]


# XLA compiles a chain of 0-d operations between two stored values as one kernel, and LLVM
# compiles a long kernel slowly and into slow code. The global norm of
# optax.clip_by_global_norm adds the parameters' squared norms one after the other: in the
# 8-layer GPT's mxfp8_scalify step, one kernel of 5,016 instructions (compile 104 s, step
# 2.8 s, against 16 s and 0.43 s at 4 layers). Stored every 16 rules: 25 s and 0.86 s.
_LONGEST_SCALAR_CHAIN = 16


def scalar_chains_bounded(in_slots: list[Slot], out_slots: list[Slot]) -> list[Slot]:
    """``out_slots`` of a scale rule, each 0-d ScaledArray (traced data and scale) with the
    length of its chain: one more rule than its operands' longest. A chain that reaches
    the limit above has its last value's data and scale computed together, by a kernel of
    their own (:func:`~jax_scaled.pow2.xla.computed_together_as_bits`), and starts again.
    Values are unchanged.

    Example:
        >>> def chain(x, length):
        ...     return scalar_chains_bounded([Slot(x, scalar_chain=length)], [Slot(x)])[0]
        >>> lengths = []
        >>> def traced(x):
        ...     stored = chain(x, 15)
        ...     lengths.extend(chain(x, n).scalar_chain for n in (0, 14))
        ...     lengths.append(stored.scalar_chain)
        ...     return stored.value
        >>> jaxpr = jax.make_jaxpr(traced)(ScaledArray(jnp.float16(1.5), jnp.float32(4.0)))
        >>> lengths, [e.primitive.name for e in jaxpr.eqns].count("reduce")
        ([1, 15, 0], 1)
    """
    length = 1 + max((s.scalar_chain for s in in_slots), default=0)
    return [_chain_bounded(slot, length) for slot in out_slots]


def _chain_bounded(slot: Slot, length: int) -> Slot:
    value = slot.value
    if not _traced_scalar(value):
        return slot
    if length < _LONGEST_SCALAR_CHAIN:
        return dataclasses.replace(slot, scalar_chain=length)
    return dataclasses.replace(slot, value=_data_and_scale_together(value), scalar_chain=0)


def _traced_scalar(value: object) -> bool:
    """A 0-d ScaledArray whose data and scale are both traced."""
    if not (isinstance(value, ScaledArray) and value.ndim == 0):
        return False
    return isinstance(value.data, jxi.Tracer) and isinstance(value.scale, jxi.Tracer)


def _data_and_scale_together(value: object) -> object:
    if not _traced_scalar(value):
        return value
    data, scale = computed_together_as_bits([value.data, value.scale])
    return ScaledArray(data, scale)


def marked_computed(values: list) -> None:
    """Record the traced scales of ``values`` (a scalified call's inputs: XLA parameters,
    computed by the caller) as computed once, so that no kernel computes them again."""
    for x in values:
        if isinstance(x, ScaledArray) and isinstance(x.scale, jxi.Tracer):
            memoized("computed_once", x.scale, lambda x=x: x.scale)


def guards_shared_sum(eqn: jxi.JaxprEqn, uses: dict, broadcasts: set) -> bool:
    """True for a sum (``add``, ``sub``) of two tensors of its output's shape, neither
    broadcast (``broadcasts``: the outputs of ``broadcast_in_dim``), whose result is read
    twice or more (``uses``,
    :func:`~jax_scaled.engine.peephole.use_counts`). Under the range guard its rule guards
    it like a join (:class:`~jax_scaled.ScalifyConfig` ``guard_sums``); see the module notes.

    Example:
        >>> def block(x, y):
        ...     h = x + y
        ...     return h * h, x + 1.0
        >>> jaxpr = jax.make_jaxpr(block)(jnp.ones(3), jnp.ones(3)).jaxpr
        >>> uses = {v: 2 for v in jaxpr.eqns[0].outvars}
        >>> [guards_shared_sum(eqn, uses, set()) for eqn in jaxpr.eqns]
        [True, False, False]
    """
    if eqn.primitive not in (lax.add_p, lax.sub_p):
        return False
    out = eqn.outvars[0]
    if uses.get(out, 0) < 2 or not out.aval.ndim:
        return False
    return all(
        not isinstance(v, jxi.Literal) and v.aval.shape == out.aval.shape and v not in broadcasts
        for v in eqn.invars
    )


def _shared(readers: int, slot: Slot) -> bool:
    value = slot.value
    if not (isinstance(value, ScaledArray) and isinstance(value.scale, jxi.Tracer)):
        return False
    return readers >= (2 if value.ndim == 0 else _TENSOR_READERS)


def _with_scale_once(slot: Slot) -> Slot:
    value = slot.value
    scale = memoized("computed_once", value.scale, lambda: computed_once(value.scale))
    if scale is value.scale:
        return slot
    memoized("computed_once", scale, lambda: scale)  # not computed once more downstream
    return dataclasses.replace(slot, value=ScaledArray(value.data, scale))


def bundle_scales(values: list, inputs: list) -> list:
    """``values`` with the traced scalar scales of their ScaledArrays (except those passed in
    unchanged from ``inputs``) computed together, 16 to a kernel
    (:func:`~jax_scaled.pow2.xla.computed_together`). Values are unchanged, under every
    transform.

    Example:
        >>> def rescaled(x):
        ...     outs = [ScaledArray(x.data, x.scale * 2), ScaledArray(x.data, x.scale * 4)]
        ...     return bundle_scales(outs, [x])
        >>> out = jax.jit(rescaled)(ScaledArray(jnp.ones(2), jnp.float32(2.0)))
        >>> [float(y.scale) for y in out]
        [4.0, 8.0]
    """
    passed_in = {id(x.scale) for x in inputs if isinstance(x, ScaledArray)}
    picked: dict[int, jax.Array] = {}
    for x in values:
        if _bundles(x) and id(x.scale) not in passed_in:
            picked.setdefault(id(x.scale), x.scale)
    if len(picked) < 2:
        return values
    bundled = dict(zip(picked, computed_together(list(picked.values())), strict=True))
    return [
        ScaledArray(x.data, bundled[id(x.scale)]) if id(getattr(x, "scale", None)) in bundled else x
        for x in values
    ]


def _bundles(x: object) -> bool:
    return (
        isinstance(x, ScaledArray)
        and isinstance(x.scale, jxi.Tracer)
        and x.scale.ndim == 0
        and x.scale.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
    )
