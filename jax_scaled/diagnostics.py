"""Where do scales drift? Record the data statistics of every scaled value scalify computes.

Static scale propagation keeps a tensor's *data* near unit magnitude only as long as the
unit-scaling estimates of the rules hold. When they do not (correlated sums, saturated
activations, weights far from their initial scale), the data drifts towards the edges of its
format: it overflows, or underflows into subnormals and zeros. :func:`record_scales` shows
where, equation by equation, forward and backward:

Example:
    >>> import jax, jax.numpy as jnp, jax_scaled as js
    >>> x = js.as_scaled_array(jnp.full((4, 64), 3.0, jnp.float16))
    >>> with js.diagnostics.record_scales() as records:
    ...     _ = js.scalify(lambda x: jnp.sum(x, axis=1) * x[:, 0])(x)
    >>> [(r.primitive, r.max_abs) for r in records if r.primitive in ("reduce_sum", "mul")]
    [('reduce_sum', 12.0), ('mul', 18.0)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled._threadlocal import ThreadStack
from jax_scaled.array import ScaledArray


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """The statistics of one scaled output of one equation, computed on its data.

    ``max_abs`` and ``rms`` are of the data (not the value), so for a well-calibrated tensor
    both are near 1. ``finite_max`` is the largest finite number of the data's dtype;
    ``nonfinite`` counts infinities and NaNs; ``zeros`` and ``subnormals`` count data
    elements that are exactly zero or below the dtype's smallest normal number; ``nans``
    counts the NaNs among the non-finite ones. ``where`` is
    the JAX name stack: ``transpose(jvp(...))`` marks the backward pass.
    """

    index: int
    primitive: str
    source: str
    where: str
    shape: tuple[int, ...]
    dtype: str
    scale: float
    max_abs: float
    rms: float
    nonfinite: int
    zeros: int
    subnormals: int
    nans: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def backward(self) -> bool:
        """True for values of the backward pass (their name stack has a ``transpose``)."""
        return "transpose(" in self.where

    @property
    def headroom_bits(self) -> float:
        """log2 of (largest finite data value / ``max_abs``): bits left before overflow."""
        finite_max = float(jnp.finfo(self.dtype).max)
        return math.log2(finite_max / self.max_abs) if self.max_abs > 0 else math.inf

    @property
    def rms_bits(self) -> float:
        """log2 of the data's rms: 0 when perfectly unit-scaled, -inf when all zero."""
        return math.log2(self.rms) if self.rms > 0 else -math.inf


class _Recorder:
    def __init__(self) -> None:
        self.records: list[ScaleRecord] = []
        self.count = 0

    def next_index(self) -> int:
        self.count += 1
        return self.count - 1


_recorders = ThreadStack()  # of _Recorder


@contextlib.contextmanager
def record_scales() -> Iterator[list[ScaleRecord]]:
    """Record a :class:`ScaleRecord` for every scaled floating output of every scale rule.

    Recording happens where scalify *traces*: call the scalified function (eagerly, or a
    ``jax.jit`` of it that has not been traced before) inside the ``with`` block. The
    statistics are computed on the device with the program and reported through
    ``jax.debug.callback``, so recording works inside ``jit``, ``grad``, loops and nested
    calls; the list fills as the program runs, and is complete once its outputs are ready
    (the block waits for pending callbacks on exit). Values inside ``scan``/``while`` bodies
    are recorded once per iteration. The recorded program is slower: record a step or two.

    Example:
        >>> x = js.as_scaled_array(jnp.ones((8,), jnp.float16))
        >>> with js.diagnostics.record_scales() as records:
        ...     _ = jax.jit(js.scalify(lambda x: x * 2.0))(x)
        >>> records[0].primitive, records[0].rms, records[0].scale
        ('mul', 1.0, 2.0)
    """
    recorder = _Recorder()
    _recorders.items.append(recorder)
    try:
        yield recorder.records
        jax.effects_barrier()
    finally:
        _recorders.items.remove(recorder)
    recorder.records.sort(key=lambda r: r.index)


def is_recording() -> bool:
    """True inside :func:`record_scales` (the interpreter then calls :func:`observe`)."""
    return bool(_recorders.items)


def observe(primitive: str, source: str, where: str, outputs: Sequence[Any]) -> None:
    """Stage the statistics of the scaled floating ``outputs`` of one equation.

    Called by the interpreter for each rule it applies while :func:`is_recording`.
    """
    recorder = _recorders.items[-1]
    for out in outputs:
        if not isinstance(out, ScaledArray) or not jnp.issubdtype(out.dtype, jnp.floating):
            continue
        static = (recorder.next_index(), primitive, source, where, out.shape, str(out.dtype))
        jax.debug.callback(_receiver(recorder, static), *_data_statistics(out), ordered=False)


def _data_statistics(x: ScaledArray) -> tuple[jax.Array, ...]:
    data = x.data.astype(jnp.float32)
    magnitude = jnp.abs(jnp.where(jnp.isfinite(data), data, 0))
    tiny = float(jnp.finfo(x.dtype).smallest_normal)
    return (
        jnp.asarray(x.scale, jnp.float32).max(),
        magnitude.max(initial=0.0),
        jnp.sqrt(jnp.mean(jnp.square(magnitude))) if x.size else jnp.float32(0),
        jnp.sum(~jnp.isfinite(data)),
        jnp.sum(data == 0),
        jnp.sum((magnitude > 0) & (magnitude < tiny)),
        jnp.sum(jnp.isnan(data)),
    )


def _receiver(recorder: _Recorder, static: tuple) -> Any:
    index, primitive, source, where, shape, dtype = static

    def receive(scale, max_abs, rms, nonfinite, zeros, subnormals, nans) -> None:
        # Under vmap the statistics arrive batched: keep the worst of the batch.
        recorder.records.append(
            ScaleRecord(
                index, primitive, source, where, tuple(shape), dtype,
                scale=float(np.max(scale)), max_abs=float(np.max(max_abs)),
                rms=float(np.max(rms)), nonfinite=int(np.sum(nonfinite)),
                zeros=int(np.sum(zeros)), subnormals=int(np.sum(subnormals)),
                nans=int(np.sum(nans)),
            )
        )  # fmt: skip

    return receive


def worst(records: Sequence[ScaleRecord], limit: int = 20, min_size: int = 2) -> list[ScaleRecord]:
    """The ``limit`` records furthest from unit scale, non-finite data first.

    Records of fewer than ``min_size`` elements (scalars) are skipped: their data is a
    mantissa in ``[1, 2)`` by construction and says nothing about drift.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:1", "", (4,), "float16", 1.0, 9e3, 5e3, 0, 0, 0)
        >>> [x.primitive for x in worst([r])]
        ['mul']
    """
    candidates = [r for r in records if r.size >= min_size]

    def badness(r: ScaleRecord) -> tuple:
        drift = abs(r.rms_bits) if r.rms > 0 else math.inf
        return (r.nans > 0, r.nonfinite > 0, drift, r.zeros / r.size)

    return sorted(candidates, key=badness, reverse=True)[:limit]


def format_records(records: Sequence[ScaleRecord]) -> str:
    """A plain-text table of ``records`` (one line each), for printing.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:1", "", (4,), "float16", 1.0, 2.0, 1.5, 0, 0, 0)
        >>> print(format_records([r]).splitlines()[1].split()[:4])
        ['fwd', 'mul', 'float16[4]', 'scale=2^0']
    """
    lines = ["pass primitive  value  scale  rms(bits)  max  headroom(bits)  zeros  source"]
    for r in records:
        shape = ",".join(map(str, r.shape))
        exponent = f"2^{math.log2(r.scale):.0f}" if r.scale > 0 else "0"
        lines.append(
            f"{'bwd' if r.backward else 'fwd'} {r.primitive} {r.dtype}[{shape}] "
            f"scale={exponent} rms={r.rms_bits:+.1f} max={r.max_abs:.3g} "
            f"headroom={r.headroom_bits:.1f} zeros={r.zeros / max(r.size, 1):.0%}"
            f"{' nonfinite=' + str(r.nonfinite) if r.nonfinite else ''}"
            f"{' NaN=' + str(r.nans) if r.nans else ''} {r.source}"
        )
    return "\n".join(lines)
