"""Text views of scale records: a table of records, or the user's source annotated with bits."""

from __future__ import annotations

import linecache
import math
from collections.abc import Sequence

from jax_scaled.engine.recording import ScaleRecord, first_nonfinite

_FIRST = "FIRST NON-FINITE"

_GROUPINGS = (None, "record", "source")


def format_records(records: Sequence[ScaleRecord], group_by: str | None = None) -> str:
    """A plain-text view of ``records``, for printing.

    ``group_by=None`` (or ``"record"``) gives a table, one line per record. ``"source"`` gives
    an annotated listing: every user source line that produced a record, read from its file,
    followed by one line per primitive with the data's rms in bits (``log2``, 0 = unit scale)
    on the forward (``->``) and backward (``<-``) pass, like unit-scaling's
    ``analyse_module``. Several records of one primitive on one line show as a range
    ``lo..hi`` with their count. A file that cannot be read shows its locations only.
    Both views mark the first record with an ``inf`` or ``NaN`` in program order (see
    :func:`~jax_scaled.diagnostics.first_nonfinite`) with ``FIRST NON-FINITE``.

    Args:
        records: from :func:`~jax_scaled.diagnostics.record_scales`.
        group_by: None or ``"record"`` (a table) or ``"source"`` (an annotated listing).

    Returns:
        The text, lines separated by newlines.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:1", "", (4,), "float16", 1.0, 2.0, 1.5, 0, 0, 0)
        >>> print(format_records([r]).splitlines()[1].split()[:4])
        ['fwd', 'mul', 'float16[4]', 'scale=2^0']
        >>> print(format_records([r], group_by="source"))
        f.py
              1  <source not available>
                 mul                  -> +0.6
    """
    if group_by not in _GROUPINGS:
        raise ValueError(f"group_by must be one of {_GROUPINGS}, got {group_by!r}")
    if group_by == "source":
        return _annotated_listing(records)
    return _record_table(records)


def _record_table(records: Sequence[ScaleRecord]) -> str:
    lines = ["pass primitive  value  scale  rms(bits)  max  headroom(bits)  zeros  source"]
    first = first_nonfinite(records)
    for r in records:
        shape = ",".join(map(str, r.shape))
        exponent = f"2^{math.log2(r.scale):.0f}" if r.scale > 0 else "0"
        lines.append(
            f"{'bwd' if r.backward else 'fwd'} {r.primitive} {r.dtype}[{shape}] "
            f"scale={exponent} rms={r.rms_bits:+.1f} max={r.max_abs:.3g} "
            f"headroom={r.headroom_bits:.1f} zeros={r.zeros / max(r.size, 1):.0%}"
            f"{' nonfinite=' + str(r.nonfinite) if r.nonfinite else ''}"
            f"{' NaN=' + str(r.nans) if r.nans else ''} {r.source}"
            f"{'  <- ' + _FIRST if r is first else ''}"
        )
    return "\n".join(lines)


def _annotated_listing(records: Sequence[ScaleRecord]) -> str:
    by_file: dict[str, dict[int, list[ScaleRecord]]] = {}
    for r in records:
        where = r.location
        by_file.setdefault(where.file, {}).setdefault(where.line, []).append(r)
    lines: list[str] = []
    first = first_nonfinite(records)
    for file, by_line in by_file.items():
        lines.append(file)
        for line in sorted(by_line):
            if line:  # 0: a location without a line (``<unknown location>``)
                lines.append(f"{line:7d}  {_source_text(file, line)}")
            lines.extend(_primitive_annotations(by_line[line], first))
    return "\n".join(lines)


def _source_text(file: str, line: int) -> str:
    """The stripped text of ``file``'s ``line``, or a placeholder when it cannot be read."""
    return linecache.getline(file, line).strip() or "<source not available>"


def _primitive_annotations(records: list[ScaleRecord], first: ScaleRecord | None) -> list[str]:
    """One line per primitive: ``name  -> forward bits  <- backward bits  [warnings]``."""
    by_primitive: dict[str, list[ScaleRecord]] = {}
    for r in records:
        by_primitive.setdefault(r.primitive, []).append(r)
    lines = []
    for primitive, group in by_primitive.items():
        forward = [r for r in group if not r.backward]
        backward = [r for r in group if r.backward]
        passes = [f"-> {_bits(forward)}"] if forward else []
        passes += [f"<- {_bits(backward)}"] if backward else []
        annotation = "  ".join(passes)
        lines.append(f"{'':9}{primitive:20} {annotation}{_warnings(group, first)}".rstrip())
    return lines


def _bits(records: list[ScaleRecord]) -> str:
    """The data rms in bits, as ``+x.x`` or a range ``lo..hi (count)``."""
    bits = [r.rms_bits for r in records]
    low, high = min(bits), max(bits)
    if len(bits) == 1 or low == high:
        return f"{low:+.1f}" + (f" ({len(bits)})" if len(bits) > 1 else "")
    return f"{low:+.1f}..{high:+.1f} ({len(bits)})"


def _warnings(records: list[ScaleRecord], first: ScaleRecord | None) -> str:
    nonfinite = sum(r.nonfinite for r in records)
    zeros = sum(r.zeros for r in records) / max(sum(r.size for r in records), 1)
    notes = [_FIRST] if any(r is first for r in records) else []
    notes += [f"nonfinite={nonfinite}"] if nonfinite else []
    notes += [f"zeros={zeros:.0%}"] if zeros >= 0.5 else []
    return "  [" + ", ".join(notes) + "]" if notes else ""
