"""The training zoo: every model x optimizer x mode of experiments/zoo.py against float32.

    python benchmarks/training_zoo.py                              # the whole grid, 200 steps
    python benchmarks/training_zoo.py --models mlp,cnn --optimizers adam,lion --steps 300
    python benchmarks/training_zoo.py --modes readme,fp8 --out ''  # print only, write nothing
    python benchmarks/training_zoo.py --models transformer --ensemble 5  # means of 5 jitters

For each model and optimizer the ``fp32`` cell runs first (it is the reference, added when
``--modes`` leaves it out), then every other mode from the same initialisation on the same
batches. A cell passes when every step's loss is finite and its final test accuracy is at
most 1 percentage point below fp32's, or its test loss within 1% of fp32's
(:func:`experiments.zoo.verdict`). With ``--ensemble K`` every cell runs K times, from the
initialisation and from K-1 jitters of it the size of one float16 rounding
(:func:`experiments.zoo.init_params`), and the verdict compares the means: for a model whose
float32 accuracy moves by more than the tolerance under such a jitter alone, one run cannot
tell numerics from chance. The table is printed as cells finish and written, with
the command, to ``OUT/NAME.md`` and ``OUT/NAME.json`` (``--name``, default
``training_zoo``) after every cell (an interrupted run leaves what it ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments import zoo  # noqa: E402

LEARNING_RATES = (
    "adam 1e-3, adamw 1e-3, lion 1e-4, sgd 0.05 (momentum 0.9), adafactor 1e-2, "
    "rmsprop 1e-3, adabelief 1e-3, lamb 1e-3; every other hyperparameter optax's default"
)


TOLERANCE_PP = 1.0


@dataclasses.dataclass(frozen=True)
class Row:
    """A cell's runs (one, or one per jitter with --ensemble) and its fp32 reference's."""

    runs: tuple[zoo.CellResult, ...]
    reference_runs: tuple[zoo.CellResult, ...]

    @property
    def result(self) -> zoo.CellResult:
        return ensemble_mean(self.runs)

    @property
    def reference(self) -> zoo.CellResult:
        return ensemble_mean(self.reference_runs)

    @property
    def accuracies(self) -> tuple[float, ...]:
        return tuple(r.test_accuracy for r in self.runs)

    @property
    def verdict(self) -> zoo.Verdict | None:
        """None for the fp32 cell itself; a non-inferiority test for ensembles."""
        if self.runs[0].mode == "fp32":
            return None
        if len(self.runs) > 1 and len(self.reference_runs) > 1:
            return zoo.ensemble_verdict(self.runs, self.reference_runs, TOLERANCE_PP)
        return zoo.verdict(self.result, self.reference, TOLERANCE_PP)


HEADER = ("model", "optimizer", "mode", "test acc", "fp32 acc", "delta pp", "final loss",
          "finite", "pass", "wall s")  # fmt: skip


def cells(row: Row) -> tuple[str, ...]:
    """One table row's cells."""
    r, v = row.result, row.verdict
    nan = r.first_nonfinite_step
    finite = "yes" if nan is None else f"no (step {nan})"
    spread = ""
    if len(row.accuracies) > 1:
        spread = f" ({100 * min(row.accuracies):.2f}-{100 * max(row.accuracies):.2f})"
    return (r.model, r.optimizer, r.mode, f"{100 * r.test_accuracy:.2f}%{spread}",
            f"{100 * row.reference.test_accuracy:.2f}%",
            _delta(v), f"{r.losses[-1]:.4f}",
            finite, _mark(v), f"{r.wall_s:.0f}")  # fmt: skip


def _delta(v: zoo.Verdict | None) -> str:
    if v is None:
        return "-"
    allowance = f" (noise {v.allowance_pp:.2f})" if v.allowance_pp else ""
    return f"{v.accuracy_delta_pp:+.2f}{allowance}"


def ensemble_mean(results: Sequence[zoo.CellResult]) -> zoo.CellResult:
    """One result for runs of the same cell: mean accuracy, test loss and per-step loss (a
    non-finite step of any run stays non-finite), total wall time."""
    if len(results) == 1:
        return results[0]
    losses = np.mean([r.losses for r in results], axis=0).tolist()
    return dataclasses.replace(
        results[0],
        losses=losses,
        test_accuracy=float(np.mean([r.test_accuracy for r in results])),
        test_loss=float(np.mean([r.test_loss for r in results])),
        wall_s=sum(r.wall_s for r in results),
    )


def _mark(v: zoo.Verdict | None) -> str:
    return "ref" if v is None else "PASS" if v.passed else "FAIL"


def markdown(rows: Sequence[Row]) -> str:
    lines = [HEADER, ("---",) * len(HEADER), *(cells(r) for r in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def summary(rows: Sequence[Row]) -> list[str]:
    """Pass counts per mode and one line per failing cell."""
    lines = []
    for mode in dict.fromkeys(r.result.mode for r in rows if r.verdict is not None):
        verdicts = [r.verdict for r in rows if r.result.mode == mode]
        lines.append(f"{mode}: {sum(v.passed for v in verdicts)}/{len(verdicts)} pass")
    for r in rows:
        if r.verdict is not None and not r.verdict.passed:
            c = cells(r)
            lines.append(f"FAIL {c[2]} {c[0]} {c[1]}: acc {c[3]} vs fp32 {c[4]} ({c[5]} pp), "
                         f"finite {c[7]}")  # fmt: skip
    return lines


def write(out: pathlib.Path, rows: Sequence[Row], meta: dict, name: str = "training_zoo") -> None:
    """``name``.md and ``name``.json in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "cells": [_cell_json(r) for r in rows]}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = ["# Training zoo: low precision against float32, optax default hyperparameters", "",
            "Produced by `benchmarks/training_zoo.py` (models, modes: `experiments/zoo.py`) with:",
            "", f"    {meta['command']}", "", _settings(meta), "", markdown(rows), "",
            *[f"- {line}" for line in summary(rows)], "", READING, ""]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(text))


def _settings(meta: dict) -> str:
    state = "complete" if meta["complete"] else "PARTIAL (interrupted or still running)"
    runs = meta.get("ensemble", 1)
    ensemble = f"; each cell the mean of {runs} runs (jitters 0-{runs - 1})" if runs > 1 else ""
    return (f"{meta['steps']} steps of batch {meta['batch_size']}, seed {meta['seed']}{ensemble}; "
            f"learning rates: {LEARNING_RATES}. jax {meta['jax']} on {meta['device']}; "
            f"{len(meta['ran'])} cells, {meta['wall_s']:.0f} s; run {state}.")  # fmt: skip


def _cell_json(row: Row) -> dict:
    r, v = row.result, row.verdict
    data = dataclasses.asdict(r)
    data["losses"] = [_finite_or_none(x) for x in r.losses]
    data["test_loss"] = _finite_or_none(r.test_loss)
    data["finite"] = r.finite
    data["verdict"] = None if v is None else dataclasses.asdict(v)
    if len(row.runs) > 1:
        data["runs"] = [{"test_accuracy": x.test_accuracy, "test_loss": _finite_or_none(
            x.test_loss), "finite": x.finite} for x in row.runs]  # fmt: skip
    return data


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def rows_from_json(payload: dict) -> list[Row]:
    """The rows of a written report (``NAME.json``), to judge again with today's criterion.
    An ensemble's runs come back with their accuracy, test loss and finiteness, and the
    cell's mean per-step losses."""
    rows, reference = [], ()
    for cell in payload["cells"]:
        losses = [math.nan if x is None else x for x in cell["losses"]]
        test_loss = math.nan if cell["test_loss"] is None else cell["test_loss"]
        mean = zoo.CellResult(cell["model"], cell["optimizer"], cell["mode"], cell["steps"],
                              losses, cell["test_accuracy"], test_loss, cell["wall_s"])  # fmt: skip
        records = _runs_json(cell)
        runs = tuple(_run_from_json(mean, run, len(records)) for run in records) or (mean,)
        if cell["mode"] == "fp32":
            reference = runs
        rows.append(Row(runs, reference))
    return rows


def _runs_json(cell: dict) -> list[dict]:
    """Per-run records; reports written before they were kept hold only the accuracies (the
    runs then share the cell's mean test loss and finiteness)."""
    if "runs" in cell:
        return cell["runs"]
    return [{"test_accuracy": a, "test_loss": cell["test_loss"], "finite": cell["finite"]}
            for a in cell.get("accuracies", [])]  # fmt: skip


def _run_from_json(mean: zoo.CellResult, run: dict, count: int) -> zoo.CellResult:
    loss = math.nan if run["test_loss"] is None else run["test_loss"]
    losses = mean.losses if run["finite"] else [*mean.losses[:-1], math.nan]
    return dataclasses.replace(mean, losses=losses, test_accuracy=run["test_accuracy"],
                               test_loss=loss, wall_s=mean.wall_s / count)  # fmt: skip


READING = """\
Data: scikit-learn's digits (1347 train / 450 test images, standardised), reshaped per
model. *test acc*: accuracy on the 450 test images after the last step, from logits computed
in the mode's own numerics; *delta pp*: minus fp32's, in percentage points; *final loss*:
the last training batch's loss; *finite*: every step's loss finite (else the first
non-finite step); *pass*: finite, and delta >= -1 pp or a test loss within 1% of fp32's.
With `--ensemble K`: *test acc* is the mean of K runs from jitters of the initialisation
(the size of one float16 rounding), the range of the runs in parentheses, and *pass* a
non-inferiority test: it fails when the runs show, at 95% (one-sided Welch t), that the
cell is more than 1 pp below fp32 (*noise*: that test's allowance beyond the 1 pp).
Modes: `readme` the README's quickstart: ScaledArray parameters of float32 data (master
weights), `js.optim.scaled_state(opt)` state (float16, a scale per 32 elements), float16
ScaledArray inputs, `jax.jit(js.scalify(step))`; `fp16_params` the same with float16
parameters; `raw_fp16_state` `fp16_params` with plain optax on
`js.tree.astype(js.as_scaled_array(opt.init(params)), jnp.float16)` (known to fail where a
per-tensor float16 second moment flushes); `fp8` `readme` with `js.dot_formats(loss)`, E4M3
forward and E5M2 backward on every contraction but the classifier head (kept 16-bit, as FP8
recipes and Table 3's `fp8_policy_scalify` do), float32 master weights as FP8 recipes keep
them; `mxfp8` the same with `block=js.nn.MXFP8`
(dense contractions whose sizes blocks of 32 tile; convolutions, attention and the GRU's
per-step matmuls that blocks do not tile keep per-tensor FP8)."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/training_zoo.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, known in (("models", zoo.MODELS), ("optimizers", zoo.OPTIMIZERS),
                        ("modes", zoo.MODES)):  # fmt: skip
        parser.add_argument(f"--{name}", default=",".join(known),
                            help=f"comma-separated, from: {', '.join(known)}")  # fmt: skip
    parser.add_argument("--steps", type=int, default=200, help="train steps per cell")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ensemble",
        type=int,
        default=1,
        help="runs per cell (jitters of the initialisation); verdict on means",
    )
    parser.add_argument("--out", default="docs/results", help="directory of the report ('': none)")
    parser.add_argument("--name", default="training_zoo", help="file name of the report")
    parser.add_argument("--rejudge", metavar="JSON", default=None,
                        help="judge a written report again with today's criterion and rewrite "
                        "it (no training)")  # fmt: skip
    args = parser.parse_args(argv)
    for name, known in (("models", zoo.MODELS), ("optimizers", zoo.OPTIMIZERS),
                        ("modes", zoo.MODES)):  # fmt: skip
        chosen = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        unknown = sorted(set(chosen) - known.keys())
        if unknown:
            parser.error(f"unknown {name} {unknown}; known: {list(known)}")
        setattr(args, name, chosen)
    args.modes = ["fp32", *(m for m in args.modes if m != "fp32")]
    return args


def rejudge(path: pathlib.Path) -> int:
    """Rewrite the report ``path`` (``NAME.json``) and its ``NAME.md`` with today's verdicts."""
    payload = json.loads(path.read_text())
    rows = rows_from_json(payload)
    write(path.parent, rows, payload["meta"], path.stem)
    print("\n".join(summary(rows)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected grid; exit status 1 if a cell other than raw_fp16_state fails."""
    args = parse_args(argv)
    if args.rejudge:
        return rejudge(pathlib.Path(args.rejudge))
    command = "python benchmarks/training_zoo.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    meta = {"command": command.strip(), "steps": args.steps, "batch_size": args.batch_size,
            "seed": args.seed, "ensemble": args.ensemble, "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "ran": [], "complete": False,
            "wall_s": 0.0}  # fmt: skip
    start, rows = time.perf_counter(), []
    print(" | ".join(HEADER), flush=True)
    for optimizer in args.optimizers:  # optimizer-major: a partial run covers every model
        for model in args.models:
            reference = None
            for mode in args.modes:
                runs = [zoo.run_cell(model, optimizer, mode, args.steps, jitter=j,
                                     batch_size=args.batch_size, seed=args.seed)
                        for j in range(args.ensemble)]  # fmt: skip
                reference = reference or tuple(runs)
                rows.append(Row(tuple(runs), reference))
                print(" | ".join(cells(rows[-1])), flush=True)
                meta["ran"].append(f"{model}/{optimizer}/{mode}")
                meta["wall_s"] = time.perf_counter() - start
                if args.out:
                    write(pathlib.Path(args.out), rows, meta, args.name)
    meta["complete"] = True
    if args.out:
        write(pathlib.Path(args.out), rows, meta, args.name)
    print("\n" + "\n".join(summary(rows)))
    known = "raw_fp16_state"  # its per-tensor float16 second moment flushes: a known failure
    return int(any(r.verdict and not r.verdict.passed and r.result.mode != known for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
