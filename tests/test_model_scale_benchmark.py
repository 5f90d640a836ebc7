"""Smoke test of ``benchmarks/model_scale.py`` on a tiny GPT (a few seconds): the fp32 row's
counts and timings, FP8 dots in the lowered FP8 steps, the table's ratio columns."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import load_benchmark

pytest.importorskip("flax")


ms = load_benchmark("model_scale")
TINY = dataclasses.replace(ms.SIZE, width=16, heads=2, context=8, batch_size=2, layers=1)


def test_fp32_scan_row_counts_and_times():
    params = ms.init_params(TINY.model_config(ms.VOCAB), "scan", 0)
    row, step, args = ms.prepare("fp32", TINY, "scan", params, ms.batch_of(TINY))
    assert not row.error and step is not None
    assert row.eqns > 0 and row.hlo > row.kernels >= row.distinct > 0 and row.build > 0
    assert row.fp8_dots == 0 and row.temp_mib > 0
    ms.time_steps([(row, step, args)], reps=2)
    assert math.isfinite(row.step_s) and row.step_s > 0


def test_a_group_built_twice_keeps_the_median_times_and_times_the_last_builds():
    rows = ms.run_group(["fp32"], TINY, "scan", reps=1, builds=2)
    assert len(rows) == 1 and not rows[0].error
    assert rows[0].build > 0 and math.isfinite(rows[0].step_s)


@pytest.mark.parametrize("flag", ["--builds", "--reps"])
def test_fewer_than_one_build_or_rep_is_refused(flag):
    with pytest.raises(SystemExit):
        ms.parse_args([flag, "0"])


def _lowered_fp8_dots(name: str, layout: str, size=TINY) -> int:
    params = ms.init_params(size.model_config(ms.VOCAB), layout, 0)
    runner = ms.build(name, size, layout, params)
    return ms.fp8_dots(runner.step.lower(*runner.state, *ms.batch_of(size)).as_text())


def test_fp8_scalify_lowers_fp8_dots():
    assert _lowered_fp8_dots("fp8_scalify", "unrolled") > 0


def test_qwix_fp8_lowers_fp8_dots():
    pytest.importorskip("qwix")
    assert _lowered_fp8_dots(ms.QWIX, "scan") > 0


def test_qwix_fp8_all_dots_lowers_the_attention_products_in_fp8_as_the_policy_does():
    pytest.importorskip("qwix")
    # One layer: qkv, proj, fc, proj and the two attention products, forward and backward
    # (3 dots each); the output head stays bf16. qwix_fp8 leaves the attention products out.
    for layout in ("unrolled", "scan"):
        assert _lowered_fp8_dots(ms.QWIX_ALL, layout) == 18
        assert _lowered_fp8_dots("fp8_policy_scalify", layout) == 18
    assert _lowered_fp8_dots(ms.QWIX, "unrolled") == 12


def test_qwix_mxfp8_lowers_fp8_dots():
    pytest.importorskip("qwix")
    # Blocks of 32 along every contracting axis: the width, and the context (qwix tiles the
    # weight gradient's contraction over batch and context along the context). On CPU,
    # qwix emulates a contraction over several blocks in bfloat16 (the blocks' values
    # dequantized): those of one block, at width 32, stay FP8 dots.
    size = dataclasses.replace(TINY, width=32, context=32)
    assert _lowered_fp8_dots(ms.QWIX_MX, "scan", size) > 0


def test_table_ratios():
    rows = [ms.Row(1, "scan", name, 10, 20, 0.1, 0.1, 0.8, 1, 0.01, temp_mib=4.0) for name in
            ("fp32", ms.QWIX, "fp8_scalify")]  # fmt: skip
    rows[2].compile, rows[2].step_s, rows[2].temp_mib = 1.8, 0.02, 5.0
    lines = ms.table_lines(rows)
    assert len(lines) == 5
    assert lines[-1].endswith("| 2.00x, 2.00x | 1.00x, 2.00x, 2.00x, 1.25x | - |")
    assert lines[2].endswith("| - | - | - |")
    assert lines[2].split(" | ")[ms.HEADER.index("temp MiB")] == "4.0"
    rows[1].temp_mib = float("nan")  # a backend that does not tell its memory
    assert ms.table_lines(rows)[-1].endswith("| 1.00x, 2.00x, 2.00x, - | - |")


def test_scalified_rows_are_compared_with_the_plain_program_of_their_data_types():
    names = ("fp32", "fp16_raw", "fp16", ms.QWIX, "fp16_scalify", ms.POLICY_F32_STORAGE,
             "fp8_policy_scalify")  # fmt: skip
    rows = [ms.Row(1, "unrolled", name, 10, 100, 0.1, 0.1, 0.8, 0, 0.01, temp_mib=8.0)
            for name in names]  # fmt: skip
    rows[4].hlo, rows[4].compile, rows[4].step_s = 250, 1.8, 0.02  # fp16_scalify
    rows[4].temp_mib = 10.0
    rows[5].hlo = 180
    cells = [line.rstrip(" |").rsplit("| ", 1)[-1] for line in ms.table_lines(rows)[2:]]
    # fp16_raw stores in float16, as fp8_policy_scalify does, and fp16_scalify does not
    assert cells == ["-", "-", "-", "-", "2.50x, 2.00x, 2.00x, 1.25x", "1.80x, 1.00x, 1.00x, 1.00x",
                     "1.00x, 1.00x, 1.00x, 1.00x"]  # fmt: skip


@pytest.mark.parametrize(
    "peer, recipe", [(ms.QWIX_MX, "mxfp8_scalify"), (ms.QWIX_ALL, "fp8_policy_scalify")]
)
def test_a_recipe_is_compared_with_the_qwix_row_of_its_fp8_dots_when_it_ran(peer, recipe):
    # mxfp8_scalify: qwix's MXFP8; fp8_policy_scalify (every dot but the head's): qwix with
    # the attention products too. fp8_scalify keeps qwix_fp8; without the peer, so does each.
    names = ("fp32", ms.QWIX, peer, "fp8_scalify", recipe)
    rows = [ms.Row(1, "unrolled", name, 10, 100, 0.1, 0.1, 0.8, 1, 0.01, temp_mib=2.0)
            for name in names]  # fmt: skip
    rows[2].hlo = 200  # the recipe's peer
    qwix_cells = [line.split(" | ")[-2] for line in ms.table_lines(rows)[2:]]
    assert qwix_cells[3:] == ["1.00x, 1.00x, 1.00x, 1.00x", "0.50x, 1.00x, 1.00x, 1.00x"]
    without_peer = [line.split(" | ")[-2] for line in ms.table_lines(rows[:2] + rows[3:])[2:]]
    assert without_peer[-1] == "1.00x, 1.00x, 1.00x, 1.00x"


def test_unknown_config_is_an_error():
    with pytest.raises(SystemExit):
        ms.parse_args(["--configs", "fp64"])
