"""js.diagnostics analysis: plot, to_rows / to_dataframe, the annotated source listing."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js
from jax_scaled.diagnostics import ScaleRecord, SourceLocation


def mlp_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)  # the hidden layers' line
    return jnp.sum(x**2)  # the loss line


def _mlp(dtype, sizes=(32, 64, 64, 16), batch=8):
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [
        jax.random.normal(k, (a, b)) / math.sqrt(a)
        for k, a, b in zip(keys[:-1], sizes[:-1], sizes[1:], strict=True)
    ]
    x = jax.random.normal(keys[-1], (batch, sizes[0])) * 2.0**-12
    return params, x, js.tree.astype(js.as_scaled_array((params, x)), dtype)


@pytest.fixture(scope="module")
def records():
    _, _, (params, x) = _mlp(jnp.float16)
    with js.diagnostics.record_scales() as records:
        jax.block_until_ready(js.scalify(jax.grad(mlp_loss))(params, x))
    assert any(r.backward for r in records) and any(not r.backward for r in records)
    return records


def _row_labels(records):
    labels = []
    for r in records:
        label = f"{r.location.short} {r.primitive}"
        if label not in labels:
            labels.append(label)
    return labels


def _points(figure, gid):
    lines = [line for axes in figure.axes for line in axes.get_lines() if line.get_gid() == gid]
    assert len(lines) == 1, gid
    return np.asarray(lines[0].get_xdata(), float), np.asarray(lines[0].get_ydata(), float)


@pytest.mark.parametrize("metric", ["rms", "max_abs"])
def test_plot_rows_match_the_records_and_value_is_data_times_scale(records, metric):
    figure = js.diagnostics.plot(records, metric=metric)
    value_axes, data_axes = figure.axes
    labels = [t.get_text() for t in value_axes.get_yticklabels()]
    assert labels == _row_labels(records)
    for pass_name, backward in (("forward", False), ("backward", True)):
        shown = [r for r in records if r.backward == backward and getattr(r, metric) > 0]
        value_x, value_y = _points(figure, f"value-{pass_name}")
        data_x, data_y = _points(figure, f"data-{pass_name}")
        rows = [labels.index(f"{r.location.short} {r.primitive}") for r in shown]
        assert value_y.tolist() == data_y.tolist() == rows
        np.testing.assert_allclose(data_x, [getattr(r, metric) for r in shown], rtol=1e-12)
        scales = np.array([r.scale for r in shown])
        np.testing.assert_allclose(value_x, data_x * scales, rtol=1e-6)
    assert value_axes.get_xscale() == data_axes.get_xscale() == "log"


def test_plot_draws_the_formats_and_writes_a_png(records, tmp_path):
    path = tmp_path / "scales.png"
    figure = js.diagnostics.plot(records, path=str(path), title="MLP")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    for name, smallest in (("float16", -24), ("float8_e4m3fn", -9), ("float8_e5m2", -16)):
        assert any(text.startswith(f"{name}: 2^{smallest} ..") for text in legend), legend
    assert "forward" in legend and "backward" in legend
    assert figure.get_suptitle() == "MLP"
    with pytest.raises(ValueError, match="metric"):
        js.diagnostics.plot(records, metric="mean")


def test_plot_of_no_records_is_an_empty_chart():
    figure = js.diagnostics.plot([])
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == []


def test_importing_jax_scaled_does_not_import_matplotlib_or_pandas():
    code = "import sys, jax_scaled; print('matplotlib' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_rows_are_the_records_with_value_rms_in_bits(records):
    rows = js.diagnostics.to_rows(records)
    assert len(rows) == len(records)
    for row, r in zip(rows, records, strict=True):
        assert (row["index"], row["primitive"], row["source"]) == (r.index, r.primitive, r.source)
        assert row["pass"] == ("backward" if r.backward else "forward")
        assert (row["shape"], row["dtype"], row["scale"]) == (r.shape, r.dtype, r.scale)
        assert (row["zeros"], row["subnormals"], row["nonfinite"]) == (
            r.zeros,
            r.subnormals,
            r.nonfinite,
        )
        assert row["file"].endswith("test_diagnostics_analysis.py") and row["line"] > 0
        assert row["value_rms"] == pytest.approx(r.rms * r.scale, rel=1e-6)
        assert row["data_rms_bits"] == r.rms_bits
        if r.rms > 0:
            assert row["value_rms_bits"] == pytest.approx(r.rms_bits + math.log2(r.scale))


def test_dataframe_rows_equal_the_records(records):
    pandas = pytest.importorskip("pandas")
    frame = js.diagnostics.to_dataframe(records)
    assert isinstance(frame, pandas.DataFrame) and len(frame) == len(records)
    assert frame["index"].tolist() == [r.index for r in records]
    scales = np.array([r.scale for r in records])
    np.testing.assert_allclose(frame["value_rms"], frame["data_rms"] * scales, rtol=1e-6)
    assert list(js.diagnostics.to_dataframe([]).columns) == list(frame.columns)


def test_dataframe_without_pandas_names_the_analysis_extra(records, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)  # "import pandas" raises ImportError
    with pytest.raises(ImportError, match=r"jax_scaled\[analysis\]"):
        js.diagnostics.to_dataframe(records)


def test_value_rms_matches_the_float32_intermediates():
    params, x, (scaled_params, scaled_x) = _mlp(jnp.float32)
    with js.diagnostics.record_scales() as records:
        jax.block_until_ready(js.scalify(mlp_loss)(scaled_params, scaled_x))
    products = [r for r in records if r.primitive == "dot_general"]
    expected = []
    for w in params:
        expected.append(float(jnp.sqrt(jnp.mean(jnp.square(x @ w)))))
        x = jnp.tanh(x @ w)
    rows = js.diagnostics.to_rows(products)
    np.testing.assert_allclose([row["value_rms"] for row in rows], expected, rtol=1e-5)


def test_the_default_table_is_unchanged(records):
    table = js.diagnostics.format_records(records)
    assert table == js.diagnostics.format_records(records, group_by="record")
    assert table == js.diagnostics.format_records(records, group_by=None)
    lines = table.splitlines()
    assert lines[0] == "pass primitive  value  scale  rms(bits)  max  headroom(bits)  zeros  source"
    assert len(lines) == len(records) + 1
    with pytest.raises(ValueError, match="group_by"):
        js.diagnostics.format_records(records, group_by="line")


def test_the_source_listing_annotates_the_users_lines(records):
    listing = js.diagnostics.format_records(records, group_by="source")
    lines = listing.splitlines()
    assert lines[0].endswith("test_diagnostics_analysis.py")
    hidden = next(i for i, line in enumerate(lines) if "x = jnp.tanh(x @ w)" in line)
    loss = next(i for i, line in enumerate(lines) if "return jnp.sum(x**2)" in line)
    assert hidden < loss
    dot = next(line for line in lines[hidden + 1 : loss] if "dot_general" in line)
    assert "->" in dot and "<-" in dot and "(3)" in dot  # three layers on one line
    tanh = [r.rms_bits for r in records if r.primitive == "tanh" and not r.backward]
    assert f"-> {min(tanh):+.1f}..{max(tanh):+.1f} (3)" in listing


def test_the_source_listing_survives_unreadable_files():
    missing = ScaleRecord(
        0, "mul", "/nowhere/model.py:7:3 (f)", "", (4,), "float16", 1.0, 1, 1, 0, 0, 0
    )
    backward = ScaleRecord(
        1,
        "mul",
        "/nowhere/model.py:7:3 (f)",
        "transpose(jvp(f))",
        (4,),
        "float16",
        1.0,
        8,
        4,
        2,
        0,
        0,
    )
    unknown = ScaleRecord(2, "add", "<unknown location>", "", (4,), "float16", 1.0, 1, 1, 0, 0, 0)
    listing = js.diagnostics.format_records([missing, backward, unknown], group_by="source")
    assert listing.splitlines() == [
        "/nowhere/model.py",
        "      7  <source not available>",
        "         mul                  -> +0.0  <- +2.0  [FIRST NON-FINITE, nonfinite=2]",
        "<unknown location>",
        "         add                  -> +0.0",
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("/a/b.py:12:8 (mlp)", ("/a/b.py", 12, "mlp", "b.py:12")),
        ("b.py:3", ("b.py", 3, "", "b.py:3")),
        ("C:\\x\\b.py:5:1 (f.<locals>.g)", ("C:\\x\\b.py", 5, "f.<locals>.g", None)),
        ("<unknown location>", ("<unknown location>", 0, "", "<unknown location>")),
    ],
)
def test_source_locations_parse(source, expected):
    where = SourceLocation.parse(source)
    assert (where.file, where.line, where.function) == expected[:3]
    if expected[3] is not None:
        assert where.short == expected[3]
