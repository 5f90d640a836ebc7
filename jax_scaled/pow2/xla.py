"""XLA-specific choices in scale arithmetic, and the measurements that justify them.

The rules' scale arithmetic is a few scalar operations per equation, but XLA compiles a
scalified program's scales along with its data, and some ways of writing the same math
compile to programs several times larger or slower on XLA:CPU. Each choice below was
measured with ``benchmarks/compile_breakdown.py`` and ``benchmarks/trace_speed.py``
(``docs/benchmarks.md`` has the figures); the rest of the library writes the math and calls
these helpers where the choice matters.

* **Integer operations on exponent fields instead of float division**
  (:func:`~jax_scaled.pow2.traced.pow2_ratio`, ``pow2_reciprocal``): XLA fuses integer
  and bit operations into the kernels that read them, while a float division of traced
  scalars is compiled as a kernel of its own, once for every promoted operand.
* **Except where a float division cuts a chain** (:func:`float_division`): XLA copies a
  scalar chain into every kernel that reads it; a division is not copied, so it cuts the
  chains of a deep unrolled network. Without it, the 3-layer unrolled transformer compiled
  to 189k HLO instructions instead of 22k.
* **Data divided by a power of two rather than multiplied by its reciprocal**
  (:func:`reciprocal_power`, :func:`as_division`): the range guard moves its data by a
  factor ``1 / up``, and that scalar division was a kernel of its own for every guarded
  output. Dividing the data by ``up`` in the kernel that writes it gives the same numbers
  (both are the correctly rounded value of one exact quotient) and needs no kernel for the
  factor. Where a static divisor ``2^d`` is folded into the factor (``2^-d / up``, a
  contraction's output), the guard's small kernel works out ``up * 2^d`` and ``up`` is
  derived from it by a static product (the data divided by ``up`` times a constant, XLA
  turned the division back into a product by a reciprocal in a kernel of its own).
* **No optimization barrier on output scales, and static ones where a rule's scale is 1.**
  Both cut the scalar chains of a deep unrolled network before the remainders below did
  (a traced 1 for ``exp`` and ``logistic`` kept a chain from running uncut through softmax).
  Since, a barrier per traced scale only stops the simplifier's folding, and a traced 1 is
  folded by XLA anyway: without them the 12-layer unrolled transformer of
  ``benchmarks/trace_speed.py`` compiles to 17% fewer instructions (float32) and the
  scalified steps stage 4% (the GPT of Table 3) to 15% fewer equations.
* **A remainder where a scale has several readers** (:func:`computed_once`): XLA copies a
  scalar chain into every kernel that reads it, so a scale read by every parameter (the
  global norm of ``optax.clip_by_global_norm``) was compiled once per parameter, its chain
  growing with depth too: compile time quadratic in the layer count. A remainder is an
  operation XLA does not copy and does not simplify away (a division by 1 it folds into the
  reader's own division); the scale is computed once, in a kernel of its own.
* **Block scales computed once** (:func:`computed_once_per_block`): the same remainder,
  elementwise. XLA copied the derivation of a quantization's block scales from the blocks'
  largest magnitudes into the kernel that writes the elements, about 25 block-shaped
  operations per quantized tensor (every optimizer state leaf stored in blocks, every MX
  operand): 3.5% of the 1-layer GPT's ``fp8_policy_scalify`` step.
* **A quantized value stored once** (:func:`stored_once`): the same remainder on data, by
  infinity (exact for every finite value, subnormals included; non-finite values are
  selected past it). A block quantization reads its value twice, in the blocks' maxima and
  in the kernel writing the elements, and XLA computed the value again in each: an
  optimizer state leaf stored in blocks had its new moment worked out three times (the
  third in the parameter's update, which reads the moment before it is stored), an MX
  operand its producer twice. 5.8% of the 4-layer GPT's ``fp8_policy_scalify`` step. Not
  for a value read outside the quantization too (an optimizer's new moment, since the
  update computes in plain float32): XLA stores a value of three readers itself, and the
  remainder's copy, read by the quantization only, left the update computing the moment
  again (6% of the same step).
* **A shared plain scalar computed once** (:func:`computed_once_as_bits`): a remainder
  on its bits, which is exact for every value (a float remainder turns infinities into
  NaN). Optax's learning-rate schedule, a float32 chain of about 30 operations that every
  parameter's update reads, was copied into each of those kernels, as in the plain
  program: 3.1% of the 4-layer GPT's float16 step (the readers keep the xor and the bitcast
  around the remainder, about 3 instructions each).
* **One kernel for several values** (:func:`computed_together`): an identity that is a
  variadic reduction, which XLA neither copies into its readers nor simplifies away (a
  reduction of one operand it folds). A traced scalar promoted into a rule's operand (a
  scheduled learning rate, a bias correction) was split into mantissa and power of two
  inside every kernel that read it, its schedule with it, and the range guard's two
  factors were worked out again in the kernel that writes the guarded data and in every
  kernel that reads its scale: together a quarter of the 4-layer GPT's float16 step. (The
  guard has since left it: one factor :func:`computed_once` and the other divided out of
  it (:func:`float_division`) need no reduction and no region.) At most
  16 values go through one reduction: LLVM's time on a reduction body grows faster than its
  operands, and the 8-layer GPT's 301 output scales in one kernel doubled its compile time.
  Values of different dtypes (a float16 datum and its float32 scale) go together as their
  bits (:func:`computed_together_as_bits`).
* **A function of a scalar's binade as a table lookup** (:func:`binade_lookup`): the range
  guard's factor depends only on the exponent field of the largest magnitude, and its
  branch-free arithmetic on that field (two range tests, a maximum, a selection) was 22
  instructions in a kernel of its own per guarded output, 25 of them in each layer of the
  GPT's float16 step. One dynamic slice of a 512-entry table (indexed by the sign and
  exponent bits) gives the same bits in 9: the 4-layer step from 24.4k instructions to
  23.0k.
* **The largest magnitude of guarded data** (:func:`largest_magnitude`): one reduction kernel
  instead of three, and ``abs`` fused into large reductions.
* **Scalars stacked by selects** (:func:`stacked_scalars`): XLA:CPU does not fuse a
  concatenate's operands, so each scalar that a few operations produce (a scale's maximum
  with 1, a rescaled largest magnitude) and a stack reads was a kernel of its own. A chain
  of selects by constant masks is one kernel with its operands' arithmetic: the 4-layer
  GPT's ``fp8_policy_scalify`` step from 2,541 kernels to 2,438 (48 instructions more).

Example:
    >>> float(float_division(np.float32(1.0), np.float32(4.0)))
    0.25
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.memo import memoized, recorded
from jax_scaled.pow2.static import MANTISSA_BITS, is_static
from jax_scaled.pow2.traced import as_float32


def float_division(numerator: Any, denominator: Any) -> Any:
    """``numerator / denominator`` of float32 scales, as a float division when traced (see
    the module notes); in numpy when both are static. Exact for powers of two in range.

    Example:
        >>> float(float_division(np.float32(2.0), np.float32(8.0)))
        0.25
    """
    if is_static(numerator) and is_static(denominator):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.float32(np.float32(numerator) / np.float32(denominator))
    return lax.div(as_float32(numerator), as_float32(denominator))


_RECIPROCAL = "reciprocal_power"


def reciprocal_power(scale: Any, exponent: int = 0) -> Any:
    """``2^-exponent / scale`` for a float32 power of two ``scale`` whose quotient is a normal
    float (exact). For ``exponent == 0`` the quotient is remembered as ``scale``'s reciprocal
    for this scalified call, so that :func:`as_division` applies it to data as a division
    by ``scale`` (see the module notes).

    Example:
        >>> float(reciprocal_power(np.float32(8.0), exponent=2))
        0.03125
    """
    factor = float_division(np.float32(2.0**-exponent), scale)
    if isinstance(factor, jxi.Tracer) and exponent == 0:
        record_reciprocal(factor, scale)
    return factor


def record_reciprocal(factor: jax.Array, scale: jax.Array) -> None:
    """Remember that the traced ``factor`` is ``1 / scale``, exactly, for a power of two
    ``scale`` with a normal reciprocal (:func:`reciprocal_power`); for a factor worked out
    some other way (one of several computed together)."""
    memoized(_RECIPROCAL, factor, lambda: scale)


def as_division(data: jax.Array, factor: Any) -> jax.Array | None:
    """``data * factor`` as ``data / scale`` where ``factor`` is ``1 / scale``
    (:func:`reciprocal_power`): the same numbers with no kernel for ``factor`` (see the
    module notes). None otherwise, and for data of a format narrower than float32's range,
    into which ``scale`` might not convert exactly.

    Example:
        >>> from jax_scaled.memo import scale_memo
        >>> def moved(x, scale):
        ...     with scale_memo():
        ...         return as_division(x, reciprocal_power(scale))
        >>> jax.jit(moved)(jnp.array([3.0, -2.0**-120]), jnp.float32(8.0)).tolist()
        [0.375, -9.4039548065783e-38]
    """
    scale = recorded(_RECIPROCAL, factor) if isinstance(factor, jxi.Tracer) else None
    if scale is None or not _holds_float32_range(data.dtype):
        return None
    return lax.div(data, lax.convert_element_type(scale, data.dtype))


def _holds_float32_range(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).maxexp >= 128


def binade_lookup(x: jax.Array, table: np.ndarray) -> jax.Array:
    """``table[i]`` elementwise, for ``i`` the sign and exponent fields of the float32 ``x``
    (its top 9 bits): a function of ``x``'s binade as one lookup rather than arithmetic on
    the exponent field (see the module notes). ``table`` has 512 entries.

    Example:
        >>> table = np.arange(512, dtype=np.uint32)
        >>> binade_lookup(jnp.array([1.5, -2.0, 0.0]), table).tolist()
        [127, 384, 0]
    """
    if table.shape != (512,):
        raise ValueError(f"a binade table has 512 entries (sign and exponent), not {table.shape}")
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    index = lax.shift_right_logical(bits, np.uint32(MANTISSA_BITS))
    return jnp.asarray(table).at[index].get(mode="promise_in_bounds")


# Larger than every scale (at most 2^127), so the remainder by it is the scale, exactly.
_ABOVE_EVERY_SCALE = np.float32(np.finfo(np.float32).max)


def computed_once(scale: Any) -> Any:
    """``scale`` (a float32 0-d power of two, or zero), computed once by XLA rather than
    copied into each kernel that reads it (see the module notes): ``fmod(scale, M)`` for the
    largest float32 ``M``, which is exact. Static and non-float32 scales pass unchanged.

    Example:
        >>> float(jax.jit(computed_once)(jnp.float32(2.0**127)))
        1.7014118346046923e+38
    """
    if not isinstance(scale, jxi.Tracer) or scale.dtype != jnp.float32 or scale.ndim:
        return scale
    return lax.rem(scale, _ABOVE_EVERY_SCALE)


def computed_once_per_block(scales: jax.Array) -> jax.Array:
    """Block scales (float32 powers of two in ``[2^-126, 2^127]``) computed once by XLA, in a
    kernel that the kernels reading them take as an input, rather than worked out again in
    each (see the module notes): ``fmod(scales, M)`` elementwise for the largest float32
    ``M``, which is exact.

    Example:
        >>> scales = jnp.array([2.0**-126, 1.0, 2.0**127], jnp.float32)
        >>> bool(jnp.all(jax.jit(computed_once_per_block)(scales) == scales))
        True
    """
    return lax.rem(scales, np.full(scales.shape, _ABOVE_EVERY_SCALE))


def computed_once_as_bits(value: jax.Array) -> jax.Array:
    """A 0-d float ``value``, bit for bit, computed once by XLA rather than copied into each
    kernel that reads it (see the module notes): its bits xor the largest integer of their
    width, their remainder by the most negative one, xor the largest again. That is the bits
    themselves for every pattern but the one the first xor takes to the most negative
    integer, ``-NaN`` with every payload bit set, which comes back as that NaN with its sign
    cleared.

    Example:
        >>> x = jnp.array([-0.0, 2.0**-140, -jnp.inf, 3.5], jnp.float32)
        >>> once = jax.jit(jax.vmap(computed_once_as_bits))(x)
        >>> bool(jnp.all(once.view(jnp.uint32) == x.view(jnp.uint32)))
        True
    """
    signed = jnp.dtype(f"int{8 * jnp.dtype(value.dtype).itemsize}")
    info = np.iinfo(signed)
    flip = np.array(info.max, signed)  # moves the one inexact pattern to a NaN's
    bits = lax.bitcast_convert_type(value, signed) ^ flip
    once = lax.rem(bits, np.array(info.min, signed)) ^ flip
    return lax.bitcast_convert_type(once, value.dtype)


def stored_once(value: jax.Array) -> jax.Array:
    """``value`` (a float array), bit for bit, computed once by XLA and stored for all the
    kernels that read it, rather than worked out again in each (see the module notes):
    ``fmod(value, inf)``, which is ``value`` for every finite value, with infinities and NaNs
    selected past it (``fmod`` turns them into NaN).

    Example:
        >>> x = jnp.array([-0.0, 2.0**-140, 3.5, -jnp.inf], jnp.float32)
        >>> bool(jnp.all(jax.jit(stored_once)(x).view(jnp.uint32) == x.view(jnp.uint32)))
        True
    """
    remainder = lax.rem(value, lax.full_like(value, np.inf))
    return lax.select(lax.is_finite(value), remainder, value)


def computed_together(values: Sequence[jax.Array]) -> list[jax.Array]:
    """``values`` (0-d arrays), unchanged, computed by kernels of their own rather than
    copied into each kernel that reads them (see the module notes): the largest of two copies
    of each, one variadic reduction per dtype and per group of at most 16 values (XLA rejects
    one over floats of different widths, and LLVM compiles a long one slowly; a dtype with a
    single value is folded by XLA, and so copied as before). Exact for
    integers and for floats other than subnormals, which XLA:CPU may flush to zero (pass
    their bits to keep them).

    Example:
        >>> [float(x) for x in computed_together([jnp.float32(1.5), jnp.float32(-jnp.inf)])]
        [1.5, -inf]
    """
    together = list(values)
    for dtype in dict.fromkeys(jnp.dtype(x.dtype) for x in values):
        same_dtype = [i for i, x in enumerate(values) if jnp.dtype(x.dtype) == dtype]
        for where in _balanced_groups(same_dtype, _MOST_PER_KERNEL):
            copies = [lax.broadcast(values[i], (2,)) for i in where]
            lowest = [_lowest(dtype)] * len(where)
            reduced = lax.reduce(copies, lowest, _elementwise_max, (0,))
            for i, x in zip(where, reduced, strict=True):
                together[i] = x
    return together


def computed_together_as_bits(values: Sequence[jax.Array]) -> list[jax.Array]:
    """:func:`computed_together` for 0-d values of different dtypes (8, 16 or 32 bits
    wide): their bits, widened to uint32, go through one reduction, so that a float16 datum
    and its float32 scale share a kernel (one reduction per dtype would leave each alone,
    and a reduction of a single value XLA folds away). Exact for every bit pattern.

    Example:
        >>> x = computed_together_as_bits([jnp.float16(-0.5), jnp.float32(2.0**-140)])
        >>> [(v.dtype.name, v.item()) for v in x]
        [('float16', -0.5), ('float32', 7.174648137343064e-43)]
    """
    bits = [lax.convert_element_type(_as_unsigned(x), jnp.uint32) for x in values]
    together = computed_together(bits)
    return [
        lax.bitcast_convert_type(lax.convert_element_type(b, _unsigned(x.dtype)), x.dtype)
        for b, x in zip(together, values, strict=True)
    ]


def computed_apart(vector: jax.Array, *, as_bits: bool = False) -> list[jax.Array]:
    """The elements of the 1-d ``vector`` as 0-d values computed together
    (:func:`computed_together`; :func:`computed_together_as_bits` for values that may be
    subnormal), so that each reader takes its own value rather than a slice of the vector:
    read as slices by every reader, the guard factors of a step's parameter casts made the
    4-layer GPT's float16 step compile a third slower.

    Example:
        >>> vector = jnp.array([0.5, 2.0**-140], jnp.float32)
        >>> [float(x) for x in computed_apart(vector, as_bits=True)]
        [0.5, 7.174648137343064e-43]
    """
    together = computed_together_as_bits if as_bits else computed_together
    return together([vector[i] for i in range(vector.shape[0])])


def stacked_scalars(values: Sequence[Any]) -> jax.Array:
    """0-d ``values`` of one dtype as a vector (``jnp.stack``'s result), built in one kernel
    with the scalar arithmetic that produced them: a chain of selects by constant masks.
    XLA:CPU does not fuse a concatenate's operands, so each traced value computed by a few
    scalar operations (a scale's maximum, a rescaled largest magnitude) that a stack reads
    was a kernel of its own.

    Example:
        >>> stacked_scalars([jnp.float32(1.5), np.float32(-2.0), jnp.float32(4.0)]).tolist()
        [1.5, -2.0, 4.0]
    """
    dtype = jnp.result_type(*values)
    vector = lax.broadcast(jnp.asarray(values[0], dtype), (len(values),))
    for i, value in enumerate(values[1:], start=1):
        mask = np.arange(len(values)) == i
        vector = lax.select(mask, lax.broadcast(jnp.asarray(value, dtype), mask.shape), vector)
    return vector


def _unsigned(dtype: Any) -> Any:
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def _as_unsigned(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, _unsigned(x.dtype))


# Measured on the 8-layer GPT's output scales (``docs/benchmarks.md``, "Output scales in
# groups"): 8, 16 and 32 per kernel compile alike, one kernel of 301 about twice as slowly.
_MOST_PER_KERNEL = 16


def _balanced_groups(items: list, most: int) -> list[list]:
    """``items`` in order, cut into the fewest groups of at most ``most``, sizes within one of
    each other (so no group is left with a single value while others are full)."""
    count = -(-len(items) // most)
    size, extra = divmod(len(items), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def _lowest(dtype: Any) -> np.ndarray:
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    return np.array(np.iinfo(dtype).min, dtype)


def _elementwise_max(a: tuple, b: tuple) -> tuple:
    return tuple(lax.max(p, q) for p, q in zip(a, b, strict=True))


# XLA:CPU hands a maximum over this many elements or more to its YNNPACK reduction, with
# ``abs`` fused in; below, it splits the reduction in two kernels and materialises ``abs``.
_LARGE_REDUCTION = 4096


def largest_magnitude(wide: jax.Array) -> jax.Array:
    """``max(|wide|)`` over all axes, written the way XLA compiles into the fewest kernels
    (the guard adds one per guarded output, and on CPU each kernel costs compile time):
    ``reduce_max(abs(x))`` for large arrays, one variadic reduction of the largest and
    smallest datum for small ones (one kernel instead of three; measured in
    ``benchmarks/compile_breakdown.py``).

    Example:
        >>> float(largest_magnitude(jnp.array([0.75, -3.0, 2.0])))
        3.0
    """
    axes = tuple(range(wide.ndim))
    if wide.size >= _LARGE_REDUCTION:
        return lax.reduce_max(lax.abs(wide), axes)
    lowest, highest = np.array(-np.inf, wide.dtype), np.array(np.inf, wide.dtype)
    largest, smallest = lax.reduce((wide, wide), (lowest, highest), _max_and_min, axes)
    return lax.max(largest, lax.neg(smallest))


def _max_and_min(a: tuple, b: tuple) -> tuple:
    return lax.max(a[0], b[0]), lax.min(a[1], b[1])
