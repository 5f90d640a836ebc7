"""Tabular export of scale records: plain dicts, or a pandas DataFrame (the ``analysis`` extra)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jax_scaled.engine.recording import ScaleRecord


def to_rows(records: Sequence[ScaleRecord]) -> list[dict[str, Any]]:
    """One plain dict per record, for a DataFrame, a CSV file or a JSON log.

    Columns: ``index``, ``pass`` (``"forward"``/``"backward"``), ``primitive``, ``source``
    (as recorded) and its parts ``file``, ``line``, ``function``; ``where`` (name stack),
    ``shape``, ``size``, ``dtype``; ``scale`` and ``scale_bits`` (its log2); the data's
    ``data_rms``, ``data_rms_bits``, ``data_max_abs``, ``headroom_bits``; the represented
    value's ``value_rms`` (``data_rms * scale``), ``value_rms_bits``, ``value_max_abs``; and
    the counts ``zeros``, ``subnormals``, ``nonfinite``, ``nans``. Bits are ``log2`` of the
    quantity (``-inf`` for 0).

    Args:
        records: from :func:`~jax_scaled.diagnostics.record_scales`.

    Returns:
        A list of dicts with the keys above, in the order of ``records``.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:3:4 (f)", "", (4,), "float16", 0.25, 2.0, 1.0, 0, 0, 0)
        >>> row = js.diagnostics.to_rows([r])[0]
        >>> row["pass"], row["line"], row["value_rms"], row["value_rms_bits"], row["data_rms_bits"]
        ('forward', 3, 0.25, -2.0, 0.0)
    """
    return [_row(r) for r in records]


def _row(r: ScaleRecord) -> dict[str, Any]:
    where = r.location
    return {
        "index": r.index,
        "pass": "backward" if r.backward else "forward",
        "primitive": r.primitive,
        "source": r.source,
        "file": where.file,
        "line": where.line,
        "function": where.function,
        "where": r.where,
        "shape": r.shape,
        "size": r.size,
        "dtype": r.dtype,
        "scale": r.scale,
        "scale_bits": math.log2(r.scale) if r.scale > 0 else -math.inf,
        "data_rms": r.rms,
        "data_rms_bits": r.rms_bits,
        "data_max_abs": r.max_abs,
        "headroom_bits": r.headroom_bits,
        "value_rms": r.value_rms,
        "value_rms_bits": r.value_rms_bits,
        "value_max_abs": r.value_max_abs,
        "zeros": r.zeros,
        "subnormals": r.subnormals,
        "nonfinite": r.nonfinite,
        "nans": r.nans,
    }


def to_dataframe(records: Sequence[ScaleRecord]) -> Any:
    """The records as a ``pandas.DataFrame``, one row per record (columns of :func:`to_rows`).

    Needs pandas: ``pip install 'jax_scaled[analysis]'``.

    Args:
        records: from :func:`~jax_scaled.diagnostics.record_scales`.

    Returns:
        A ``pandas.DataFrame``.

    Raises:
        ImportError: when pandas is not installed.

    Example:
        >>> r = ScaleRecord(0, "mul", "f.py:3:4 (f)", "", (4,), "float16", 0.25, 2.0, 1.0, 0, 0, 0)
        >>> frame = js.diagnostics.to_dataframe([r])
        >>> frame[["pass", "primitive", "value_rms"]].values.tolist()
        [['forward', 'mul', 0.25]]
    """
    try:
        import pandas
    except ImportError as error:
        raise ImportError(
            "jax_scaled.diagnostics.to_dataframe needs pandas; install the 'analysis' extra: "
            "pip install 'jax_scaled[analysis]'"
        ) from error
    columns = list(_row(ScaleRecord(0, "", "", "", (), "float32", 1.0, 0.0, 0.0, 0, 0, 0)))
    return pandas.DataFrame(to_rows(records), columns=columns)  # the columns even when empty
