"""ScaledArray: a tensor held as ``data * scale``, per tensor or per block, and the checks that
keep every instance valid. Building one from plain values, and back:
:mod:`jax_scaled.construction`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.dtypes import BLOCK_SCALE_DTYPES, compute_dtype, is_floating
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT, is_static_one


def is_array_like(x: Any) -> bool:
    """True for jax and numpy arrays and tracers (not for Python numbers).

    Example:
        >>> is_array_like(np.ones(2)), is_array_like(2.0)
        (True, False)
    """
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "aval")
    )


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ScaledArray:
    """A tensor represented as ``data * scale``.

    ``data`` holds the values in a (usually narrow) floating format; ``scale`` holds exact
    powers of two (float32, or E8M0: ``float8_e8m0fnu``). Shape and dtype are those of
    ``data``: a ScaledArray stands in for an array of that shape and dtype.

    The scale is either 0-d (one scale for the tensor) or a grid of **block scales**: the
    data's rank, every data dimension a multiple of the scale's, so that each scale covers a
    block of ``block_shape = data.shape // scale.shape`` elements. A per-channel scale is a
    block spanning whole axes (a ``(M, N)`` weight with one scale per output column has
    ``scale.shape == (1, N)``); MX formats are blocks of 32 along one axis
    (:func:`~jax_scaled.quantize.quantize`). Block scales are float32 or E8M0.

    Construction is validated: ``data`` must be a floating array, ``scale`` a floating array
    of one of these two shapes. A concrete scale must hold powers of two (or 0): any other
    value raises. A scale computed inside ``jax.jit`` (a tracer, such as delayed scaling's
    ``amax / 448``) cannot be checked, so it is **normalised exactly**: its power of two stays
    the scale and its mantissa (in ``[0.5, 1)``, so the data never grows) is multiplied into
    the data, one rounding in the data's format; a power-of-two scale leaves the data
    bit-identical. All-zero data with a 0-d scale gets the smallest scale (``2^-126``), as
    :func:`~jax_scaled.as_scaled_array` gives a zero: a nominal scale on a zero (a
    zero-initialised bias put at a model's scale) would dominate every sum it joins. (Pytree
    unflattening and scalify's own rules skip this, so JAX transformations can carry
    placeholders and batched scales through it.)

    Under ``jax.vmap`` the pytree's two leaves, data and scale, are mapped like any leaves.
    A block scale has the data's rank, so mapping both along the same axis (the default
    ``in_axes=0``) gives each example the scales of its own blocks: the batch axis must be
    unblocked (block size 1 there; else vmap reports inconsistent sizes). A 0-d scale cannot
    be mapped: share it with ``in_axes`` built as
    ``jax.tree.unflatten(jax.tree.structure(x), [0, None])``. A function that returns
    per-tensor ScaledArrays under vmap stacks their 0-d scales into shape ``(B,)``, which is
    not a valid scale of the stacked data: give such outputs block scales of shape
    ``(1, ..., 1)`` instead (one block per example, stacked to ``(B, 1, ..., 1)``).

    Under sharding, a block scale is sharded like its data
    (:func:`~jax_scaled.rules.higher_order.collectives.scaled_shardings`), so a shard holds
    the scales of its own blocks; a sharding that would split a block is refused
    (:func:`check_block_sharding`).

    Example:
        >>> x = ScaledArray(jnp.array([1.0, 1.5], jnp.float16), jnp.float32(0.25))
        >>> x.to_array()
        Array([0.25 , 0.375], dtype=float16)
        >>> rows = ScaledArray(jnp.ones((2, 3)), jnp.array([[1.0], [4.0]]))  # one per row
        >>> rows.block_shape, rows.to_array().tolist()
        ((1, 3), [[1.0, 1.0, 1.0], [4.0, 4.0, 4.0]])
    """

    data: jax.Array
    scale: jax.Array

    def __post_init__(self):
        _check_data(self.data)
        _check_scale(self.scale, self.data)
        if context.current().engine_builds:  # a rule's output: a power of two scale already
            return
        if isinstance(self.scale, jxi.Tracer) or isinstance(self.data, jxi.Tracer):
            data, scale = _normalised_traced(self.data, self.scale)
        else:
            _check_pow2_scale(self.scale)
            data, scale = self.data, _zero_aware_scale(self.data, self.scale)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scale", scale)

    # pytree protocol
    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls._trusted(*children)

    @classmethod
    def _trusted(cls, data, scale) -> ScaledArray:
        """Build without validation: for values jax_scaled itself produced."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "data", data)
        object.__setattr__(obj, "scale", scale)
        return obj

    # array-like properties (of the represented tensor)
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def aval(self) -> jxi.ShapedArray:
        return jxi.ShapedArray(self.shape, self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The elements one scale covers: ``data.shape // scale.shape``; the whole shape for
        a 0-d scale (one block). Static.

        Example:
            >>> ScaledArray(jnp.ones((4, 64)), jnp.ones((4, 2), jnp.float32)).block_shape
            (1, 32)
        """
        return block_shape_of(self.shape, np.shape(self.scale))

    def __jax_array__(self) -> jax.Array:
        """JAX's array protocol: outside ``scalify`` a ScaledArray is no array; ``jnp.sum(x)``
        and other JAX functions then say what to do instead of only refusing the type."""
        raise TypeError(
            "jax_scaled: a ScaledArray reached a JAX function outside js.scalify. Wrap the "
            "function in js.scalify(...) (its operations then run on data and scale), or take "
            "the value with js.asarray(x)."
        )

    def to_array(self, dtype: DTypeLike | None = None) -> jax.Array:
        """The represented value ``data * scale``, in ``dtype`` (default: the data dtype).

        The product is formed in float32 (or the data dtype if wider), then cast, so a value
        representable in ``dtype`` is returned exactly. Block scales are repeated onto the
        data's grid (:func:`expand_scale`): a power-of-two multiply per element, exact.
        """
        dtype = jnp.dtype(dtype or self.dtype)
        compute = jnp.promote_types(compute_dtype(self.dtype), compute_dtype(dtype))
        if is_static_one(self.scale):  # no equation to trace for a product by 1
            return self.data.astype(compute).astype(dtype)
        scale = self.scale.astype(compute)
        if scale.ndim:  # block scales
            scale = expand_scale(scale, self.shape)
        value = self.data.astype(compute) * scale
        return value.astype(dtype)

    def astype(self, dtype: DTypeLike) -> ScaledArray:
        """The same scaled value with data cast to ``dtype``; the scale is kept (data beyond
        ``dtype``'s range overflows: :func:`~jax_scaled.construction.cast_fitting`, which
        ``js.tree.astype`` uses, re-centres it first)."""
        if not is_floating(dtype):
            raise TypeError(f"ScaledArray data must have a floating dtype, got {dtype}.")
        return ScaledArray._trusted(self.data.astype(dtype), self.scale)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_array(), dtype=dtype)

    def __repr__(self) -> str:
        return f"ScaledArray(data={self.data!r}, scale={self.scale!r})"


# An operand as scale rules see it: scaled, or plain (a scale of 1).
Value = jax.Array | ScaledArray


def _check_data(data: Any) -> None:
    if isinstance(data, ScaledArray):
        raise TypeError("ScaledArray data cannot itself be a ScaledArray.")
    if not is_array_like(data):
        raise TypeError(
            f"ScaledArray data must be an array (jax.Array or numpy.ndarray), "
            f"got {type(data).__name__}. Use scaled_array(...) to convert Python values."
        )
    if not is_floating(data.dtype):
        raise TypeError(f"ScaledArray data must have a floating dtype, got {data.dtype}.")


def _check_scale(scale: Any, data: Any) -> None:
    if not is_array_like(scale):
        raise TypeError(
            f"ScaledArray scale must be an array, got {type(scale).__name__}. "
            "Use scaled_array(...) to convert Python values."
        )
    if not is_floating(scale.dtype):
        raise TypeError(f"ScaledArray scale must have a floating dtype, got {scale.dtype}.")
    if np.ndim(scale) != 0:
        _check_block_scale(scale, data)


def _check_block_scale(scale: Any, data: Any) -> None:
    grid, shape = tuple(np.shape(scale)), tuple(np.shape(data))
    tiles = len(grid) == len(shape) and all(
        (g > 0 and n % g == 0) or n == g == 0 for n, g in zip(shape, grid)
    )
    if not tiles:
        raise ValueError(
            f"ScaledArray scale of shape {grid} does not tile data of shape {shape}: a scale "
            "is 0-d (one scale for the tensor) or has the data's rank with every data "
            "dimension a multiple of the scale's (block scales, block_shape = data.shape // "
            "scale.shape; a per-row scale of a (M, N) array has shape (M, 1))."
        )
    if jnp.dtype(scale.dtype) not in BLOCK_SCALE_DTYPES:
        raise TypeError(
            f"ScaledArray block scales are stored as float32 or float8_e8m0fnu, got {scale.dtype}."
        )


def block_shape_of(shape: Sequence[int], scale_shape: Sequence[int]) -> tuple[int, ...]:
    """The block shape of data of ``shape`` under a scale of ``scale_shape`` (0-d: ``shape``).

    Example:
        >>> block_shape_of((128, 256), (1, 8)), block_shape_of((4, 4), ())
        ((128, 32), (4, 4))
    """
    if len(scale_shape) == 0:
        return tuple(shape)
    return tuple(n // g if g else 1 for n, g in zip(shape, scale_shape, strict=True))


def expand_scale(scale: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Block scales repeated onto the data grid of ``shape``: every element gets its block's
    scale (exact: only copies). A 0-d scale is broadcast.

    Example:
        >>> expand_scale(jnp.array([[1.0, 2.0]]), (2, 4)).tolist()
        [[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0]]
    """
    shape = tuple(shape)
    if jnp.ndim(scale) == 0:
        return jnp.broadcast_to(scale, shape)
    blocks = block_shape_of(shape, scale.shape)
    interleaved = [n for grid_and_block in zip(scale.shape, blocks) for n in grid_and_block]
    dims = tuple(range(0, 2 * len(shape), 2))
    return lax.broadcast_in_dim(scale, interleaved, dims).reshape(shape)


def check_block_sharding(x: ScaledArray, sharding: Any) -> None:
    """Refuse a sharding of ``x``'s data that splits one of its scale blocks.

    ``sharding`` is a ``jax.sharding.Sharding`` (a ``NamedSharding``, ...) of the data. A
    block must lie within one shard, so that each device holds whole blocks and their scales
    (a block scale is sharded like its data): along every axis, the shard's length must be
    a multiple of the block's. A 0-d scale (replicated) and other placements (a device,
    ``None``, a ``PartitionSpec`` without a mesh) pass unchecked.

    Example:
        >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        >>> x = ScaledArray(jnp.ones((4, 64)), jnp.ones((1, 2), jnp.float32))  # (4, 32) blocks
        >>> check_block_sharding(x, NamedSharding(mesh, P(None, "x")))  # 32 columns a shard
        >>> try:  # 2 of a block's 4 rows on each device
        ...     check_block_sharding(x, NamedSharding(mesh, P("x", None)))
        ... except ValueError as error:
        ...     print("refused:", "splits the scale blocks" in str(error))
        refused: True
    """
    if np.ndim(x.scale) == 0 or not isinstance(sharding, jax.sharding.Sharding):
        return
    shard = sharding.shard_shape(x.shape)
    split = [d for d, (n, b) in enumerate(zip(shard, x.block_shape)) if n % b]
    if split:
        raise ValueError(
            f"sharding {sharding} splits the scale blocks of a ScaledArray of shape {x.shape} "
            f"(blocks {x.block_shape}, shards {tuple(shard)}) along axes {split}: a block must "
            "lie within one shard. Shard those axes over fewer devices, or use blocks that "
            "divide the shards."
        )


@contextlib.contextmanager
def engine_builds() -> Iterator[None]:
    """Within this context, ScaledArrays are built by scalify's rules, whose scales are powers
    of two by construction: the constructor skips the normalisation of user-built values.

    Example:
        >>> with engine_builds():
        ...     x = ScaledArray(jnp.zeros(2), jnp.float32(4.0))
        >>> float(x.scale)  # a rule's zero keeps the scale the rule gave it
        4.0
    """
    with context.entered(engine_builds=True):
        yield


def _zero_scale(scale_dtype) -> np.ndarray:
    """The scale of an all-zero value: the smallest, so that it never dominates an estimate."""
    return np.asarray(2.0**MIN_SCALE_EXPONENT, np.float32).astype(scale_dtype)


def _zero_aware_scale(data: Any, scale: Any) -> Any:
    """``scale``, or the smallest scale where concrete ``data`` is all zero (0-d scales)."""
    if np.ndim(scale) or np.size(data) == 0 or np.any(np.asarray(data) != 0):
        return scale
    return jnp.asarray(_zero_scale(scale.dtype))


def _normalised_traced(data: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(data, scale)`` of a traced scale made an exact power of two: a non-power-of-two
    scale's mantissa (in ``[0.5, 1)``) moves into the data; a power of two leaves the data
    bit-identical (factor 1). A 0-d scale of all-zero data becomes the smallest scale."""
    data, scale = jnp.asarray(data), jnp.asarray(scale)
    if scale.dtype != jnp.float8_e8m0fnu:  # E8M0 holds powers of two only
        mantissa, exponent = jnp.frexp(scale.astype(jnp.float32))
        is_pow2 = mantissa == 0.5
        factor = jnp.where(is_pow2, np.float32(1), mantissa)
        pow2 = jnp.ldexp(np.float32(1), jnp.where(is_pow2, exponent - 1, exponent))
        compute = jnp.promote_types(compute_dtype(data.dtype), jnp.float32)
        data = (data.astype(compute) * expand_scale(factor, data.shape)).astype(data.dtype)
        scale = pow2.astype(scale.dtype)
    if scale.ndim == 0 and data.size:
        scale = jnp.where(jnp.any(data != 0), scale, _zero_scale(scale.dtype))
    return data, scale


def _check_pow2_scale(scale: Any) -> None:
    """Concrete scales must be powers of two (or 0): rules rely on it for exact re-scaling."""
    values = np.asarray(scale).astype(np.float64)
    mantissa, _ = np.frexp(values)
    if not np.all((values == 0) | ((values > 0) & (mantissa == 0.5))):
        raise ValueError(
            f"ScaledArray scale must be a positive power of two (or 0), got {values.ravel()[:4]}."
            " Use as_scaled_array(x) (or pow2_split / pow2_round) to build one from any value."
        )


def data_dtype_value(x: Value) -> jax.Array:
    """The represented value of a scaled or plain operand, in its data dtype: what a scale
    rule binds a value-based primitive on (its output dtype must follow the data's, not
    :func:`~jax_scaled.asarray`'s float32).

    Example:
        >>> data_dtype_value(scaled_array([1.0, 3.0], 0.5, dtype=jnp.float16))
        Array([0.5, 1.5], dtype=float16)
    """
    return x.to_array() if isinstance(x, ScaledArray) else x
