"""Delayed scaling: the scale of a tensor from the amax history of its previous values.

The recipe of NVIDIA Transformer Engine's FP8 ``DelayedScaling``, expressed with
:func:`~jax_scaled.get_data_and_scale` and :func:`~jax_scaled.set_scaling`, so that it is
an identity on values (and on plain arrays outside scalify, apart from recording the amax):

1. ``amax``: the largest magnitude recorded over the last ``history_len`` calls
   (``amax_compute="max"``) or at the last call (``"most_recent"``);
2. the new scale is ``2^ceil(log2(amax * 2^margin / max(dtype)))``: the smallest power of
   two for which the data's largest magnitude, if it stays at ``amax``, is at most
   ``max(dtype) / 2^margin``. Rounding up keeps a data amax below the format's largest
   value, which rounding down (as Transformer Engine's non-power-of-two scale does not need)
   could exceed by up to a factor two. ``margin`` is extra headroom in powers of two.
3. the current largest magnitude ``|x|`` is pushed into the history (most recent first).

The value ``y`` returned equals ``x``; under scalify it is a ScaledArray whose scale is the
new scale, ready for a cast of its data (:func:`~jax_scaled.ops.cast_on_forward`). While the
history holds no positive finite amax (all-zero inputs so far), ``x`` keeps its scale.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes

from jax_scaled.array import ScaledArray
from jax_scaled.pow2.traced import pow2_round
from jax_scaled.primitives import get_data_and_scale, set_scaling

AMAX_COMPUTE = ("max", "most_recent")


class DelayedScalingState(NamedTuple):
    """State of :class:`DelayedScaling`: the amax of the last calls, most recent first.

    ``amax_history`` is a float32 array of shape ``(history_len,)``; never-filled entries
    are 0. A pytree (a NamedTuple): it can be jitted, stored and checkpointed.

    Example:
        >>> from jax_scaled.ops import DelayedScalingState
        >>> DelayedScalingState(jnp.zeros(2)).amax_history.shape
        (2,)
    """

    amax_history: jax.Array

    def pushed(self, amax: jax.Array) -> DelayedScalingState:
        """The history with ``amax`` recorded first and the oldest entry dropped.

        Example:
            >>> from jax_scaled.ops import DelayedScalingState
            >>> DelayedScalingState(jnp.array([2.0, 1.0])).pushed(jnp.float32(3)).amax_history
            Array([3., 2.], dtype=float32)
        """
        history = self.amax_history
        newest = amax.astype(history.dtype)[None]
        return DelayedScalingState(jnp.concatenate([newest, history[:-1]]))


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling of one tensor, optax-style: ``init`` a state, then ``update`` it.

    Args:
        history_len: how many past amax values are kept (>= 1).
        margin: extra headroom, in powers of two, below the format's largest value (>= 0).
        amax_compute: ``"max"`` (largest amax of the history) or ``"most_recent"``.
        dtype: the format the data is scaled for (its largest finite value is the target).

    Example:
        >>> from jax_scaled.ops import DelayedScaling
        >>> ds = DelayedScaling(history_len=4, margin=1)
        >>> x = jnp.array([3.0, -100.0])
        >>> state = ds.init(x)
        >>> y, state = jax.jit(scalify(ds.update))(x, state)
        >>> float(y.scale), y.data  # 100 * 2 / 448 rounded up to a power of two: 2^-1
        (0.5, Array([   6., -200.], dtype=float32))
        >>> state.amax_history
        Array([100., 100.,   0.,   0.], dtype=float32)
    """

    history_len: int
    margin: int = 0
    amax_compute: Literal["max", "most_recent"] = "max"
    dtype: jnp.dtype = jnp.dtype(jnp.float8_e4m3fn)

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len must be an int >= 1, got {self.history_len!r}.")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}.")
        if self.amax_compute not in AMAX_COMPUTE:
            raise ValueError(
                f"amax_compute must be one of {AMAX_COMPUTE}, got {self.amax_compute!r}."
            )
        dtype = jnp.dtype(self.dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype must be a floating-point format, got {dtype}.")
        object.__setattr__(self, "dtype", dtype)

    def init(self, x: jax.Array | ScaledArray) -> DelayedScalingState:
        """A state whose history holds the amax of ``x`` (a plain array or a ScaledArray).

        Example:
            >>> from jax_scaled.ops import DelayedScaling
            >>> DelayedScaling(3).init(scaled_array([1.0, -2.0], 4.0)).amax_history
            Array([8., 0., 0.], dtype=float32)
        """
        history = jnp.zeros((self.history_len,), jnp.float32)
        return DelayedScalingState(history.at[0].set(amax(x)))

    def update(
        self, x: jax.Array, state: DelayedScalingState
    ) -> tuple[jax.Array, DelayedScalingState]:
        """Rescale ``x`` from the history, record its amax: ``(y, new_state)`` with ``y == x``.

        Under scalify ``y`` is ``x`` with the delayed scale; outside, ``y`` is ``x``.

        Example:
            >>> from jax_scaled.ops import DelayedScaling
            >>> ds = DelayedScaling(2, amax_compute="most_recent")
            >>> y, state = scalify(ds.update)(jnp.array([1.0]), ds.init(jnp.array([900.0])))
            >>> float(y.scale), state.amax_history  # 900 / 448 rounded up: 4
            (4.0, Array([  1., 900.], dtype=float32))
        """
        data, current_scale = get_data_and_scale(x)
        y = set_scaling(x, self.scale(state, fallback=current_scale))
        return y, state.pushed(_amax(data, current_scale))

    def scale(self, state: DelayedScalingState, fallback: jax.Array | float = 1.0) -> jax.Array:
        """The power-of-two scale :meth:`update` applies next (``fallback`` if no amax yet).

        Example:
            >>> from jax_scaled.ops import DelayedScaling
            >>> ds = DelayedScaling(4, margin=2, dtype=jnp.float8_e5m2)
            >>> float(ds.scale(ds.init(jnp.array([57344.0]))))  # 2^2 headroom
            4.0
        """
        history = state.amax_history
        reference = history[0] if self.amax_compute == "most_recent" else jnp.max(history)
        target = float(ml_dtypes.finfo(self.dtype).max) / 2.0**self.margin
        valid = (reference > 0) & jnp.isfinite(reference)
        scale = pow2_round(reference / jnp.float32(target), "up")
        return jnp.where(valid, scale, jnp.asarray(fallback, jnp.float32))


def amax(x: jax.Array | ScaledArray) -> jax.Array:
    """The largest magnitude of the value of ``x``, as a float32 scalar (0 for empty ``x``).

    Works on a ScaledArray outside scalify and on any array inside it (through
    :func:`~jax_scaled.get_data_and_scale`, so only the data is reduced).

    Example:
        >>> from jax_scaled.ops import amax
        >>> amax(scaled_array([1.0, -3.0], 0.5)), scalify(amax)(scaled_array([2.0], 2.0**-30))
        (Array(1.5, dtype=float32), Array(1.8626451e-09, dtype=float32))
    """
    if isinstance(x, ScaledArray):
        return _amax(x.data, x.scale.astype(jnp.float32))
    return _amax(*get_data_and_scale(x))


def _amax(data: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(data), initial=0).astype(jnp.float32) * scale
