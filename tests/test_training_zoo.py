"""experiments/zoo.py: low-precision training against float32, optax default hyperparameters.

A covering subset of the zoo (every model, optimizer and mode at least once, not their
product), tens of steps each; the whole grid, hundreds of steps, is
``python benchmarks/training_zoo.py`` (docs/results/training_zoo.md). A cell passes when
every step's loss is finite and its test accuracy at most 1 percentage point below the fp32
cell's, same initialisation, same batches.
"""

from __future__ import annotations

import functools
import json
import pathlib

import pytest
from helpers import load_benchmark

from experiments import zoo

STEPS = 50
KNOWN = "raw_fp16_state: per-tensor float16 Adam second moment flushes, loss goes nan"

CELLS = [
    ("transformer", "adam", "readme"),
    ("gru", "lion", "readme"),
    ("cnn", "rmsprop", "fp16_params"),
    ("mlp", "adamw", "fp8"),
    ("cnn", "sgd", "fp8"),
    ("gru", "adabelief", "fp8"),
    ("cnn", "adafactor", "mxfp8"),
    ("mlp", "lamb", "mxfp8"),
    pytest.param(
        "mlp", "adam", "raw_fp16_state", marks=pytest.mark.xfail(strict=True, reason=KNOWN)
    ),
]


@functools.cache
def fp32_cell(model: str, optimizer: str) -> zoo.CellResult:
    return zoo.run_cell(model, optimizer, "fp32", STEPS)


def test_cells_cover_every_model_optimizer_and_mode():
    cells = [c.values if hasattr(c, "values") else c for c in CELLS]
    for index, names in enumerate((zoo.MODELS, zoo.OPTIMIZERS, zoo.MODES)):
        assert {c[index] for c in cells} | {"fp32"} >= set(names)


@pytest.mark.parametrize(("model", "optimizer", "mode"), CELLS)
def test_cell_trains_like_fp32(model: str, optimizer: str, mode: str):
    reference = fp32_cell(model, optimizer)
    result = zoo.run_cell(model, optimizer, mode, STEPS)
    verdict = zoo.verdict(result, reference)
    assert reference.finite and reference.test_accuracy > 0.5  # the reference itself learns
    assert verdict.finite, f"first non-finite loss at step {result.first_nonfinite_step}"
    assert verdict.passed, (
        f"test accuracy {100 * result.test_accuracy:.2f}% vs fp32 "
        f"{100 * reference.test_accuracy:.2f}% ({verdict.accuracy_delta_pp:+.2f} pp)"
    )


def test_cli_writes_the_table_and_json(tmp_path: pathlib.Path, capsys):
    cli = load_benchmark("training_zoo")
    argv = ["--models", "cnn", "--optimizers", "sgd", "--modes", "fp32", "--steps", "3",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "training_zoo.json").read_text())
    assert data["meta"]["complete"] and data["meta"]["ran"] == ["cnn/sgd/fp32"]
    assert len(data["cells"][0]["losses"]) == 3
    text = (tmp_path / "training_zoo.md").read_text()
    assert "--models cnn --optimizers sgd" in text and "| cnn | sgd | fp32 |" in text
    assert "cnn | sgd | fp32" in capsys.readouterr().out


def test_verdict_fails_a_nonfinite_or_distant_cell():
    ref = zoo.CellResult("mlp", "adam", "fp32", 2, [2.3, 1.0], 0.9, 0.3, 0.0)
    nan = zoo.CellResult("mlp", "adam", "readme", 2, [2.3, float("nan")], 0.9, 0.3, 0.0)
    far = zoo.CellResult("mlp", "adam", "readme", 2, [2.3, 1.0], 0.885, 0.35, 0.0)
    better = zoo.CellResult("mlp", "adam", "readme", 2, [2.3, 1.0], 0.95, 0.35, 0.0)
    close_loss = zoo.CellResult("mlp", "adam", "readme", 2, [2.3, 1.0], 0.885, 0.302, 0.0)
    assert zoo.verdict(better, ref).passed and zoo.verdict(close_loss, ref).passed
    assert not zoo.verdict(nan, ref).passed and nan.first_nonfinite_step == 1
    assert not zoo.verdict(far, ref).passed and zoo.verdict(far, ref).finite


def test_ensemble_verdict_fails_a_clear_loss_or_a_non_finite_run():
    def runs(mode, accuracies, finite=True, test_loss=0.3):
        losses = [2.3, 1.0 if finite else float("nan")]
        return [zoo.CellResult("mlp", "adam", mode, 2, losses, a, test_loss, 0.0)
                for a in accuracies]  # fmt: skip

    reference = runs("fp32", [0.90, 0.91, 0.92, 0.91])
    assert zoo.ensemble_verdict(runs("readme", [0.905, 0.90, 0.915, 0.91]), reference).passed
    far = zoo.ensemble_verdict(runs("readme", [0.85, 0.86, 0.87, 0.86], test_loss=0.4), reference)
    assert not far.passed and far.accuracy_delta_pp == pytest.approx(-5.0)
    assert 0 < far.allowance_pp < 4  # the noise of four runs each: about 1.1 pp
    assert not zoo.ensemble_verdict(runs("readme", [0.91] * 4, finite=False), reference).passed
