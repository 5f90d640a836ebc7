"""Recording: a :class:`ScaleRecord` of the data statistics of every scaled value scalify computes.

The interpreter asks :func:`is_recording` after each scale rule it applies and, inside
:func:`record_scales`, hands the rule's outputs to :func:`observe`. Each output's statistics
are one variadic reduction on the device, and the statistics of a whole jaxpr walk leave in
one ``jax.debug.callback`` (:func:`batched_observations`): a callback per value made a
recorded CNN step compile about 9x slower than the plain one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled import context
from jax_scaled.array import ScaledArray


@dataclasses.dataclass(frozen=True)
class ScaleRecord:
    """The statistics of one scaled output of one equation, computed on its data.

    ``max_abs`` and ``rms`` are of the data (not the value), so for a well-calibrated tensor
    both are near 1. ``finite_max`` is the largest finite number of the data's dtype;
    ``nonfinite`` counts infinities and NaNs; ``zeros`` and ``subnormals`` count data
    elements that are exactly zero or below the dtype's smallest normal number; ``nans``
    counts the NaNs among the non-finite ones. ``where`` is
    the JAX name stack: ``transpose(jvp(...))`` marks the backward pass. For block scales,
    ``scale`` is the largest block scale. ``block_fallback`` marks an equation without a
    block-scale rule whose block-scaled operands fell back to one scale
    (:mod:`jax_scaled.engine.block_dispatch`).

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:3:4 (f)", "", (4,), "float16", 0.25, 2.0, 1.0, 0, 0, 0)
        >>> r.rms_bits, r.value_rms, r.backward, r.location.short
        (0.0, 0.25, False, 'f.py:3')
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
    block_fallback: bool = False

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

    @property
    def value_rms(self) -> float:
        """The rms of the represented value: data rms times scale."""
        return self.rms * self.scale

    @property
    def value_max_abs(self) -> float:
        """The largest finite magnitude of the represented value: data max times scale."""
        return self.max_abs * self.scale

    @property
    def value_rms_bits(self) -> float:
        """log2 of the value's rms (``rms_bits + log2(scale)``), -inf when zero."""
        return math.log2(self.value_rms) if self.value_rms > 0 else -math.inf

    @property
    def finite(self) -> bool:
        """True when every data element and the scale are finite (no ``inf``, no ``NaN``)."""
        return self.nonfinite == 0 and math.isfinite(self.scale)

    @property
    def location(self) -> SourceLocation:
        """``source`` parsed into file, line and function."""
        return SourceLocation.parse(self.source)


_SOURCE_PATTERN = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?::\d+)?(?: \((?P<function>.*)\))?$")


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """A user's source line, as recorded in :attr:`ScaleRecord.source`.

    ``line`` is 0 and ``file`` the whole text when the source has no ``file:line`` form
    (e.g. ``<unknown location>``).

    Example:
        >>> from jax_scaled.engine.recording import SourceLocation
        >>> SourceLocation.parse("/src/model.py:12:8 (mlp)")
        SourceLocation(file='/src/model.py', line=12, function='mlp')
    """

    file: str
    line: int
    function: str

    @classmethod
    def parse(cls, source: str) -> SourceLocation:
        match = _SOURCE_PATTERN.match(source)
        if match is None:
            return cls(source, 0, "")
        return cls(match["file"], int(match["line"]), match["function"] or "")

    @property
    def short(self) -> str:
        """``file_name:line``, without the directories (the whole text when there is no line)."""
        if not self.line:
            return self.file
        return f"{os.path.basename(self.file)}:{self.line}"


class _Recorder:
    def __init__(self) -> None:
        self.records: list[ScaleRecord] = []
        self.count = 0
        self.batch: _Batch | None = None

    def next_index(self) -> int:
        self.count += 1
        return self.count - 1


@dataclasses.dataclass
class _Batch:
    """Statistics staged under one trace, reported by one callback."""

    trace: Any
    statics: list[tuple] = dataclasses.field(default_factory=list)
    statistics: list[tuple] = dataclasses.field(default_factory=list)


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

    Returns:
        A context manager yielding the list of records, in program order once the block exits.

    Example:
        >>> x = js.as_scaled_array(jnp.ones((8,), jnp.float16))
        >>> with js.diagnostics.record_scales() as records:
        ...     _ = jax.jit(js.scalify(lambda x: x * 2.0))(x)
        >>> records[0].primitive, records[0].rms, records[0].scale
        ('mul', 1.0, 2.0)
    """
    recorder = _Recorder()  # outlives the block: the program's callbacks fill it as it runs
    with context.entered(recorder=recorder):
        yield recorder.records
        jax.effects_barrier()
    recorder.records.sort(key=lambda r: r.index)


def is_recording() -> bool:
    """True inside :func:`record_scales` (the interpreter then calls :func:`observe`).

    Returns:
        Whether a :func:`record_scales` block is active in this thread.

    Example:
        >>> js.diagnostics.is_recording()
        False
    """
    return context.current().recorder is not None


def observe(
    primitive: str,
    source: str,
    where: str,
    outputs: Sequence[Any],
    block_fallback: bool = False,
) -> None:
    """Stage the statistics of the scaled floating ``outputs`` of one equation.

    Called by the interpreter for each rule it applies while :func:`is_recording`.

    Args:
        primitive: the equation's primitive name.
        source: the user's source line (``file:line:column (function)``).
        where: the JAX name stack (``transpose(...)`` marks the backward pass).
        outputs: the rule's outputs; plain and non-floating ones are skipped.
        block_fallback: the equation's block-scaled operands fell back to one scale.

    Example:
        >>> x = js.as_scaled_array(jnp.ones(4, jnp.float16))
        >>> with js.diagnostics.record_scales() as records:
        ...     js.diagnostics.observe("mul", "f.py:1:0 (f)", "", [x])
        >>> records[0].primitive, records[0].rms
        ('mul', 1.0)
    """
    recorder = context.current().recorder
    for out in outputs:
        if not isinstance(out, ScaledArray) or not jnp.issubdtype(out.dtype, jnp.floating):
            continue
        static = (
            recorder.next_index(), primitive, source, where, out.shape, str(out.dtype),
            block_fallback,
        )  # fmt: skip
        batch = recorder.batch
        if batch is not None and batch.trace is jxi.current_trace():
            batch.statics.append(static)
            batch.statistics.append(_data_statistics(out))
        else:
            _report(recorder, [static], [_data_statistics(out)])


@contextlib.contextmanager
def batched_observations() -> Iterator[None]:
    """Within the block, :func:`observe` stages the statistics computed under the current
    trace; on a normal exit one ``jax.debug.callback`` reports them all. Statistics from
    another trace (a loop body's) are reported by that trace's own batch, or at once.

    Example:
        >>> x = js.as_scaled_array(jnp.ones(4, jnp.float16))
        >>> with js.diagnostics.record_scales() as records:
        ...     with batched_observations():
        ...         js.diagnostics.observe("mul", "f.py:1:0 (f)", "", [x])
        ...         js.diagnostics.observe("add", "f.py:2:0 (f)", "", [x])
        >>> [r.primitive for r in records]
        ['mul', 'add']
    """
    recorder = context.current().recorder
    if recorder is None:
        yield
        return
    batch, previous = _Batch(jxi.current_trace()), recorder.batch
    recorder.batch = batch
    try:
        yield
    finally:
        recorder.batch = previous
    if batch.statics:
        _report(recorder, batch.statics, batch.statistics)


def _report(recorder: _Recorder, statics: list[tuple], statistics: list[tuple]) -> None:
    """One callback that turns each value's statistics into a :class:`ScaleRecord`."""

    def receive(*arrays: np.ndarray) -> None:
        for i, static in enumerate(statics):
            recorder.records.append(_record(static, arrays[i * _FIELDS : (i + 1) * _FIELDS]))

    flat = [a for stats in statistics for a in stats]
    jax.debug.callback(receive, *flat, ordered=False)


_FIELDS = 7  # the statistics of one value: see _data_statistics


def _data_statistics(x: ScaledArray) -> tuple[jax.Array, ...]:
    """``(scale, max_abs, sum of squares, nonfinite, zeros, subnormals, nans)`` of ``x``'s
    data: one variadic reduction (one kernel) for the six data statistics; the host takes
    the root mean square (:func:`_record`)."""
    data = x.data.astype(jnp.float32)
    finite = jnp.isfinite(data)
    magnitude = jnp.where(finite, jnp.abs(data), np.float32(0))
    tiny = np.float32(jnp.finfo(x.dtype).smallest_normal)

    def count(flags: jax.Array) -> jax.Array:
        return flags.astype(jnp.int32)

    operands = (
        magnitude, lax.square(magnitude), count(~finite), count(data == 0),
        count((magnitude > 0) & (magnitude < tiny)), count(jnp.isnan(data)),
    )  # fmt: skip
    inits = (np.float32(0), np.float32(0), *[np.int32(0)] * 4)
    statistics = lax.reduce(operands, inits, _combine, tuple(range(data.ndim)))
    scale = x.scale.astype(jnp.float32)
    return (scale.max() if scale.ndim else scale, *statistics)


def _combine(a: tuple, b: tuple) -> tuple:
    return (lax.max(a[0], b[0]), *(lax.add(p, q) for p, q in zip(a[1:], b[1:], strict=True)))


def _record(static: tuple, stats: Sequence[np.ndarray]) -> ScaleRecord:
    index, primitive, source, where, shape, dtype, block_fallback = static
    scale, max_abs, sum_sq, nonfinite, zeros, subnormals, nans = stats
    size = math.prod(shape)
    rms = np.sqrt(np.asarray(sum_sq, np.float64) / size) if size else np.zeros(())
    # Under vmap the statistics arrive batched: keep the worst of the batch.
    return ScaleRecord(
        index, primitive, source, where, tuple(shape), dtype,
        scale=float(np.max(scale)), max_abs=float(np.max(max_abs)),
        rms=float(np.max(rms)), nonfinite=int(np.sum(nonfinite)),
        zeros=int(np.sum(zeros)), subnormals=int(np.sum(subnormals)),
        nans=int(np.sum(nans)), block_fallback=block_fallback,
    )  # fmt: skip


def worst(records: Sequence[ScaleRecord], limit: int = 20, min_size: int = 2) -> list[ScaleRecord]:
    """The ``limit`` records furthest from unit scale, non-finite data first.

    The first non-finite record in program order (:func:`first_nonfinite`, the producer of
    the ``inf`` or ``NaN`` the others propagate) leads, then those with a ``NaN``.

    Records of fewer than ``min_size`` elements (scalars) are skipped: their data is a
    mantissa in ``[1, 2)`` by construction and says nothing about drift.

    Args:
        records: from :func:`record_scales`.
        limit: how many to return.
        min_size: the smallest number of elements a record needs to be considered.

    Returns:
        The selected records, worst first.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:1", "", (4,), "float16", 1.0, 9e3, 5e3, 0, 0, 0)
        >>> [x.primitive for x in worst([r])]
        ['mul']
    """
    candidates = [r for r in records if r.size >= min_size]
    first = first_nonfinite(candidates)

    def badness(r: ScaleRecord) -> tuple:
        drift = abs(r.rms_bits) if r.rms > 0 else math.inf
        return (r is first, r.nans > 0, not r.finite, drift, r.zeros / r.size)

    return sorted(candidates, key=badness, reverse=True)[:limit]


def first_nonfinite(records: Sequence[ScaleRecord], nans_only: bool = False) -> ScaleRecord | None:
    """The first record, in program order, whose value holds an ``inf`` or a ``NaN``.

    This names the operation that produced the first non-finite value of a step (its
    ``primitive`` and the user's ``source`` line): later ones only propagate it. Records are
    in program order once :func:`record_scales` exits (forward pass, then backward, then the
    optimizer); the records of an equation in a loop body (one per iteration) share its
    position. A value that was not scaled (computed from plain arrays only) has no record.

    Args:
        records: from :func:`record_scales`.
        nans_only: look for ``NaN`` only, passing over infinities a program makes on purpose
            (``-inf`` attention masks).

    Returns:
        The record, or ``None`` when every recorded value is finite.

    Example:
        >>> x = js.as_scaled_array(jnp.array([1.0, -1.0, 2.0]))
        >>> with js.diagnostics.record_scales() as records:
        ...     _ = jax.jit(js.scalify(lambda x: jnp.exp(jnp.log(x) * 2)))(x)
        >>> first = js.diagnostics.first_nonfinite(records)
        >>> first.primitive, first.nans
        ('log', 1)
    """
    for r in sorted(records, key=lambda r: r.index):
        if (r.nans > 0 or math.isnan(r.scale)) if nans_only else not r.finite:
            return r
    return None
