"""Smoke test of ``benchmarks/optimizer_cost.py`` on small parameters: per-parameter counts of
the plain and a scalified optimizer, the counterfactual guards, the table and the command
line."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from helpers import load_benchmark

pytest.importorskip("flax")  # experiments/table3.py's model

oc = load_benchmark("optimizer_cost")
SHAPE = (8, 16)


def test_a_scalified_optimizer_costs_more_per_parameter_than_the_plain_one():
    plain, scaled = oc.measure("fp32", SHAPE), oc.measure("fp16_scalify", SHAPE)
    assert 0 < plain.instructions < scaled.instructions
    assert plain.kernels > 0 and scaled.kernels > 0
    lines = oc.table([plain, scaled], plain)
    assert lines[2] == f"| `fp32` | {plain.instructions:,.1f} | {plain.kernels:.1f} | 1.00x |"
    assert lines[3].startswith("| `fp16_scalify` |") and len(lines) == 4


def test_a_counterfactual_guard_replaces_the_reduction_only_inside_its_block():
    wide = jnp.array([[3.0, -7.0]])
    with oc.counterfactual(oc.COUNTERFACTUALS["guards read one datum"]):
        assert float(oc.guard.largest_magnitude(wide)) == 3.0
    assert float(oc.guard.largest_magnitude(wide)) == 7.0


def test_the_command_line_checks_configs_and_shape():
    args = oc.parse_args(["--configs", "fp32,fp8_policy_scalify", "--shape", "4,8"])
    assert args.configs == ["fp32", "fp8_policy_scalify"] and args.shape == (4, 8)
    for bad in (["--configs", "fp64"], ["--shape", "4"], ["--shape", "0,8"]):
        with pytest.raises(SystemExit):
            oc.parse_args(bad)
