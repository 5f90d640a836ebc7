"""The float32 value of a short elementwise chain, for the functions that read it.

A rule's output has one scale, and its narrow data holds the binades of one format below
the largest element. A chain of elementwise rules on one tensor can need more: gelu's
``x + 0.044715 * x**3`` of a normal tensor at 2^20 spans far more than float16's 2^40, so
its moderate elements are flushed to zero (as the cubes of the small ones are), and
``tanh`` of them is 0 where it is 1: the gelu of 2320 was 1160, the gradient 10^9 times
too large. A function that is not
homogeneous (``exp``, ``tanh``, ``erf``, ...) reads the absolute value of each element,
not its size relative to the largest, so it is the one reader that such a flush misleads.

So an elementwise rule's output also keeps how to compute its value again in float32 from
its operands (:func:`record_chain`: add, sub, mul, negation, powers, at most
:data:`MAX_CHAIN` deep), and the transcendental rules evaluate their function on that value
(:func:`wide_value`) rather than on ``data * scale``. Inside the kernel XLA fuses the chain
into, it is the same arithmetic in float32 registers; the narrow outputs are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.array import ScaledArray, Value
from jax_scaled.dtypes import is_narrow_float
from jax_scaled.scales.values import to_compute

CHAIN_PRIMITIVES = frozenset(
    [lax.add_p, lax.sub_p, lax.mul_p, lax.neg_p, lax.integer_pow_p, lax.square_p]
    + [jxi.lax_primitives.add_jaxvals_p]
)
MAX_CHAIN = 8  # equations: gelu's chain is 4; deeper ones are computed where they are stored
_KIND = "wide chain"


@dataclasses.dataclass
class _Chain:
    data: jax.Array  # the output's data, held so that its id is not reused
    scale: jax.Array
    depth: int
    primitive: Any
    params: dict
    operands: Sequence[Value]
    trace: Any  # the trace it was recorded under: its tracers serve no other
    value: jax.Array | None = None


def record_chain(primitive: Any, params: dict, operands: Sequence[Value], out: Any) -> None:
    """Remember how to compute ``out`` (the output of ``primitive``'s rule on ``operands``)
    again in float32, for :func:`wide_value`. Only per-tensor narrow outputs of the chain
    primitives, inside a scalified call, and at most :data:`MAX_CHAIN` deep.

    Example:
        >>> from jax_scaled.memo import scale_memo
        >>> x = ScaledArray(jnp.array([1.0, 2.0**-20], jnp.float16), jnp.float32(2.0**20))
        >>> with scale_memo():
        ...     cube = ScaledArray(jnp.array([1.0, 0.0], jnp.float16), jnp.float32(2.0**60))
        ...     record_chain(lax.integer_pow_p, {"y": 3}, [x], cube)
        ...     wide_value(cube).tolist()
        [1.152921504606847e+18, 1.0]
    """
    if primitive not in CHAIN_PRIMITIVES or not _narrow_per_tensor(out):
        return
    # The call's memo dict itself, not memo.memoized: that keeps only traced keys, and a
    # call evaluated eagerly must read the same values as a jitted one.
    memo = context.current().memo
    if memo is None:
        return
    if not all(_per_tensor_float32_compute(v) for v in operands):
        return
    if any(isinstance(v, ScaledArray) and v.data is out.data for v in operands):
        return  # the rule returned an operand (``x + 0``): its value is the operand's
    depth = 1 + max((_depth(memo, v) for v in operands), default=0)
    if depth <= MAX_CHAIN:
        trace = jxi.current_trace()
        chain = _Chain(out.data, out.scale, depth, primitive, params, operands, trace)
        memo[(_KIND, id(out.data))] = chain


def wide_value(x: Value) -> jax.Array:
    """The value of ``x`` in the compute dtype: computed again from the operands of the
    chain that produced it (:func:`record_chain`), else ``data * scale``."""
    chain = _chain_of(context.current().memo, x)
    if chain is None:
        return to_compute(x)
    if chain.value is None:
        wides = [wide_value(v) for v in chain.operands]  # a plain operand: to_compute
        chain.value = chain.primitive.bind(*wides, **chain.params)
    return chain.value


def _chain_of(memo: dict | None, x: Value) -> _Chain | None:
    if memo is None or not isinstance(x, ScaledArray):
        return None
    chain = memo.get((_KIND, id(x.data)))
    if chain is None or chain.data is not x.data or chain.scale is not x.scale:
        return None
    return chain if chain.trace is jxi.current_trace() else None


def _depth(memo: dict, x: Value) -> int:
    chain = _chain_of(memo, x)
    return 0 if chain is None else chain.depth


def _narrow_per_tensor(x: Any) -> bool:
    """A per-tensor ScaledArray of computed (not trace-time constant) narrow float data."""
    return (
        isinstance(x, ScaledArray)
        and not isinstance(x.data, np.ndarray)
        and x.scale.ndim == 0
        and is_narrow_float(x.dtype)
    )


def _per_tensor_float32_compute(x: Any) -> bool:
    """A per-tensor or plain float operand whose value float32 holds as it is."""
    if isinstance(x, ScaledArray) and x.scale.ndim:
        return False
    dtype = jnp.result_type(x.dtype if hasattr(x, "dtype") else x)
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits <= 32
