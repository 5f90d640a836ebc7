"""A chart of scale records: where values and their data sit against the formats' ranges.

matplotlib is imported when :func:`plot` is called, not with ``jax_scaled``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jax_scaled.engine.recording import ScaleRecord

METRICS = ("rms", "max_abs")
DEFAULT_FORMATS = ("float16", "float8_e4m3fn", "float8_e5m2")
_FORMAT_COLORS = ("tab:gray", "tab:green", "tab:purple", "tab:brown", "tab:olive")
_PASS_MARKERS = {"forward": (">", "tab:blue"), "backward": ("<", "tab:orange")}


def plot(
    records: Sequence[ScaleRecord],
    *,
    path: str | None = None,
    metric: str = "rms",
    formats: Sequence[str] = DEFAULT_FORMATS,
    title: str | None = None,
) -> Any:
    """Chart every record: one row per (user source line, primitive), two log2 axes.

    The left panel places each record's *value* (``data * scale``), the right panel its
    *data*, i.e. where the numbers sit inside their format. Forward records are drawn as
    ``>``, backward ones as ``<``; several records of one row (a primitive used several
    times on one line, a loop) are several markers. Records whose data has infinities or
    NaNs get a red ``x`` on top. The ranges of ``formats`` are shaded from the smallest
    subnormal to the largest finite number, with a dotted line at the smallest normal: data
    should sit well inside them; values outside show where an unscaled program would under-
    or overflow.

    Rows are labelled ``file_name:line primitive`` and ordered as they first occur in
    ``records`` (top to bottom). Records whose metric is 0 or not finite have no marker.
    The marker artists are ``Line2D`` objects with ``gid`` ``"value-forward"``,
    ``"value-backward"``, ``"data-forward"`` and ``"data-backward"``: their points are the
    records of that pass in order, at ``y`` = row number.

    Args:
        records: from :func:`~jax_scaled.diagnostics.record_scales`.
        path: where to write a PNG of the chart; None writes nothing.
        metric: ``"rms"`` (root mean square of the finite elements, as
            :attr:`ScaleRecord.rms`) or ``"max_abs"`` (largest finite magnitude, for
            overflow headroom).
        formats: names of floating dtypes whose ranges are drawn.
        title: the figure's title (default: names the metric).

    Returns:
        The ``matplotlib.figure.Figure`` (rendered with the Agg backend, never on a screen).

    Raises:
        ImportError: when matplotlib is not installed.

    Example:
        >>> import os, tempfile
        >>> x = js.as_scaled_array(jnp.ones((4, 8), jnp.float16))
        >>> with js.diagnostics.record_scales() as records:
        ...     _ = js.scalify(jax.grad(lambda x: jnp.sum(jnp.tanh(x @ x.T))))(x)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     figure = js.diagnostics.plot(records, path=os.path.join(tmp, "scales.png"))
        ...     os.path.getsize(os.path.join(tmp, "scales.png")) > 0
        True
        >>> [axes.get_title() for axes in figure.axes]
        ['value (data × scale)', 'data, inside its format']
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    agg_canvas, figure_class = _matplotlib()
    labels, rows = _rows(records)
    figure = figure_class(figsize=(12, 1.6 + 0.24 * max(len(labels), 1)), layout="constrained")
    agg_canvas(figure)
    value_axes, data_axes = figure.subplots(1, 2, sharey=True)
    for axes, side in ((value_axes, "value"), (data_axes, "data")):
        _draw_formats(axes, formats)
        for pass_name in _PASS_MARKERS:
            _draw_pass(axes, records, rows, side, pass_name, metric)
        _decorate(axes, side, metric)
    value_axes.set_yticks(range(len(labels)), labels, fontsize=7)
    value_axes.set_ylim(max(len(labels), 1) - 0.5, -0.5)
    figure.suptitle(title or f"{metric} of every scaled value (log2 axes)")
    figure.legend(*data_axes.get_legend_handles_labels(), loc="outside lower center", ncol=4)
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure


def _matplotlib() -> tuple[type, type]:
    """matplotlib's Agg canvas and Figure (a figure of its own, no pyplot state, no screen)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "jax_scaled.diagnostics.plot needs matplotlib; install the 'analysis' extra: "
            "pip install 'jax_scaled[analysis]'"
        ) from error
    return FigureCanvasAgg, Figure


def _rows(records: Sequence[ScaleRecord]) -> tuple[list[str], list[int]]:
    """The row labels, one per (file, line, primitive) in order of first occurrence, and the
    row number of every record."""
    numbers: dict[tuple, int] = {}
    labels: list[str] = []
    rows: list[int] = []
    for r in records:
        where = r.location
        key = (where.file, where.line, r.primitive)
        if key not in numbers:
            numbers[key] = len(labels)
            labels.append(f"{where.short} {r.primitive}")
        rows.append(numbers[key])
    return labels, rows


def _metric(r: ScaleRecord, side: str, metric: str) -> float:
    data = r.rms if metric == "rms" else r.max_abs
    return data * r.scale if side == "value" else data


def _draw_pass(
    axes: Any,
    records: Sequence[ScaleRecord],
    rows: list[int],
    side: str,
    pass_name: str,
    metric: str,
) -> None:
    """The records of one pass, in order, as one ``Line2D`` of markers (gid ``side-pass``)."""
    points = [
        (_metric(r, side, metric), y, r.nonfinite > 0)
        for r, y in zip(records, rows)
        if r.backward == (pass_name == "backward")
    ]
    points = [p for p in points if p[0] > 0 and math.isfinite(p[0])]
    marker, color = _PASS_MARKERS[pass_name]
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    axes.plot(xs, ys, linestyle="none", marker=marker, color=color, label=pass_name,
              gid=f"{side}-{pass_name}", alpha=0.8)  # fmt: skip
    bad = [p for p in points if p[2]]
    if bad:
        axes.plot([p[0] for p in bad], [p[1] for p in bad], linestyle="none", marker="x",
                  color="red", label="has inf/NaN", gid=f"{side}-nonfinite")  # fmt: skip


def _draw_formats(axes: Any, formats: Sequence[str]) -> None:
    for name, color in zip(formats, _FORMAT_COLORS):
        info = jnp.finfo(name)
        low, normal, high = map(float, (info.smallest_subnormal, info.smallest_normal, info.max))
        label = f"{name}: 2^{math.log2(low):.0f} .. {high:g}"
        axes.axvspan(low, high, color=color, alpha=0.08, label=label)
        axes.axvline(normal, color=color, linestyle=":", linewidth=1)
        axes.axvline(high, color=color, linestyle="-", linewidth=1, alpha=0.5)


def _decorate(axes: Any, side: str, metric: str) -> None:
    axes.set_xscale("log", base=2)
    axes.set_title("value (data × scale)" if side == "value" else "data, inside its format")
    axes.set_xlabel(f"{metric} of the {side}")
    axes.grid(axis="both", alpha=0.25)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.tick_params(axis="x", labelsize=7)
