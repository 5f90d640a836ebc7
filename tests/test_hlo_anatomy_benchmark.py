"""Smoke test of ``benchmarks/hlo_anatomy.py`` on a tiny GPT: its kinds add up to the module's
instruction count (as ``model_scale`` counts them), and a scalified step has scale
arithmetic where the plain one has almost none."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from helpers import load_benchmark

pytest.importorskip("flax")

ms = load_benchmark("model_scale")
hlo_anatomy = load_benchmark("hlo_anatomy")
TINY = dataclasses.replace(ms.SIZE, width=16, heads=2, context=8, batch_size=2, layers=1)


@functools.cache
def _compiled_part(name: str, part: str = "step", layers: int = 1) -> str:
    """One compilation per configuration, part and depth for all tests (each takes seconds)."""
    size = dataclasses.replace(TINY, layers=layers)
    params = ms.init_params(size.model_config(ms.VOCAB), "unrolled", 0)
    batch = ms.batch_of(size)
    return hlo_anatomy.compiled_part_text(name, size, "unrolled", params, batch, part)


def test_kinds_add_up_and_lines_are_attributed():
    texts = [_compiled_part(name) for name in ("fp32", "fp16_scalify")]
    plain, scaled = (hlo_anatomy.anatomy(text) for text in texts)
    for text, found in zip(texts, (plain, scaled), strict=True):
        assert found.total == ms.hlo_instructions(text) == sum(found.lines.values())
        assert set(found.kinds) <= set(hlo_anatomy.KINDS) and found.kinds["entry"] > 0
    scalar = ("scalar ops in tensor kernels", "scalar-only computations")
    assert sum(scaled.kinds[k] for k in scalar) > 2 * sum(plain.kinds[k] for k in scalar)
    assert any(where.startswith("gpt.py:") for where in scaled.lines)
    assert "(scalify's own)" in scaled.lines and "(scalify's own)" not in plain.lines
    table = hlo_anatomy.report("fp16_scalify", 1, "unrolled", scaled, lines=3)
    assert table[0].startswith("### fp16_scalify, 1 layer(s), unrolled:")
    assert table[-5] == "| --- | --- |" and table[-1] == ""
    assert all(line.startswith("| ") for line in table[-4:-1])  # the 3 source lines


def test_unknown_config_is_an_error():
    with pytest.raises(SystemExit):
        hlo_anatomy.parse_args(["--configs", "fp64"])


def test_the_step_s_parts_compile_less_than_the_step():
    # grads: forward and backward only; plain-optimizer: those grads and optax in float32
    parts = hlo_anatomy.PARTS
    counts = {part: ms.hlo_instructions(_compiled_part("fp16_scalify", part)) for part in parts}
    assert counts["grads"] < counts["plain-optimizer"] < counts["step"], counts
    assert hlo_anatomy.parse_args(["--part", "grads"]).part == "grads"


def test_one_layer_more_is_the_difference_of_the_two_modules():
    one, two = (hlo_anatomy.anatomy(_compiled_part("fp16_scalify", "grads", n)) for n in (1, 2))
    added = two.minus(one)
    assert added.total == two.total - one.total > 0
    assert sum(added.lines.values()) == added.total
    for where, n in added.lines.items():  # each line's opcodes add up to its instructions
        assert sum(added.line_opcodes[where].values()) == n, where
    table = hlo_anatomy.report("fp16_scalify", "2 minus 1", "unrolled", added, lines=4, opcodes=3)
    assert table[-6] == "| --- | --- | --- |" and table[-1] == ""
    rows = [row.split(" | ") for row in table[-5:-1]]
    assert all(len(row) == 3 and ":" in row[2] and " 0," not in row[2] for row in rows)
    assert hlo_anatomy.parse_args(["--per-layer"]).per_layer
