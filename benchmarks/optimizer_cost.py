"""What one parameter costs a train step's optimizer, in compiled instructions and kernels.

    python benchmarks/optimizer_cost.py                          # 128 x 512 parameters
    python benchmarks/optimizer_cost.py --shape 512,128 --configs fp32,fp8_policy_scalify
    python benchmarks/optimizer_cost.py --counterfactual         # what the guards' parts cost

The optimizer of ``experiments/table3.py`` (``clip_by_global_norm``, then Adam on a
warmup-cosine schedule), in each configuration's storage of parameters and state (float32;
float16 master weights; float16 state in blocks with rescaled gradients), applied by the
configuration's step (``table3.make_step``) to the gradients of a linear loss
``sum((x @ w) * y)`` per parameter ``w`` of ``--shape`` (``x`` 16 rows, ``y`` the output's
width), so that each gradient is ``x.T @ y``, a float16 contraction range-guarded as the
GPT's are. Every step is compiled with one and with three parameters; half the difference is
what one parameter costs. The same difference for the loss's value and gradients alone is
subtracted: the rest is the optimizer's (and the step's finiteness check) per parameter.

Columns: HLO instructions and kernels (fusions, dots and custom calls of the entry
computation, as ``compile_breakdown.py`` counts them) per parameter, and the instructions over
``fp32``'s (plain optax on float32 gradients, the optimizer qwix's step runs).

``--counterfactual`` adds, for each scalify configuration, two programs that are not right
but tell where a range guard's cost lies: every guard's reduction replaced by a read of one
datum (the guard's chain kept, its pass over the data gone: what reading a record of the
largest magnitude saves), and by the constant 1 (the chain folded away by XLA).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
from collections.abc import Callable, Iterator, Sequence
from unittest import mock

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from compile_breakdown import kernel_counts  # noqa: E402

import jax_scaled as js  # noqa: E402
from experiments import table3  # noqa: E402
from jax_scaled.scales import guard  # noqa: E402

DEFAULT_CONFIGS = ("fp32", "fp16_scalify", "fp16_scalify_fp16_master", "fp8_policy_scalify")
ROWS = 16  # of x: a batch's tokens
COUNTERFACTUALS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "guards read one datum": lambda wide: jax.lax.abs(wide.reshape(-1)[0]),
    "guards read a constant": lambda wide: jnp.float32(1.0),
}


@dataclasses.dataclass
class Row:
    """Per-parameter counts of one configuration (or a counterfactual of it)."""

    config: str
    instructions: float = 0.0
    kernels: float = 0.0


def linear_loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    """``sum((x @ w) * y)`` over the parameters: each gradient is ``x.T @ y``."""
    return sum(jnp.sum((x @ w) * y) for w in params.values())


def _inputs(precision: table3.Precision, shape: tuple[int, int], count: int) -> tuple:
    keys = jax.random.split(jax.random.key(0), count + 2)
    params = {f"w{i}": jax.random.normal(keys[i], shape) * 0.05 for i in range(count)}
    x = jax.random.normal(keys[-2], (ROWS, shape[0])).astype(precision.compute_dtype)
    y = (jax.random.normal(keys[-1], (ROWS, shape[1])) * 0.01).astype(precision.compute_dtype)
    if precision.scalify:
        x, y = js.as_scaled_array((x, y))
    return params, x, y


def _compiled_counts(fn: Callable, args: tuple, scalify: bool) -> tuple[int, int]:
    text = jax.jit(js.scalify(fn) if scalify else fn).lower(*args).compile().as_text()
    instructions = sum(1 for line in text.splitlines() if " = " in line)
    return instructions, kernel_counts(text)[0]


def counts(name: str, shape: tuple[int, int], count: int) -> dict[str, tuple[int, int]]:
    """``(instructions, kernels)`` of configuration ``name``'s ``"step"`` and of its
    ``"gradients"`` alone, with ``count`` parameters of ``shape``."""
    precision = table3.PRECISIONS[name]
    size = table3.SIZES["full"]
    params, x, y = _inputs(precision, shape, count)

    def loss(params, x, y):
        return linear_loss(js.tree.astype(params, precision.compute_dtype), x, y)

    opt = table3.make_optimizer(size, precision)
    state = table3.initial_state(params, opt, precision, size)
    step = table3.make_step(loss, opt, precision)
    return {
        "step": _compiled_counts(step, (*state, x, y), precision.scalify),
        "gradients": _compiled_counts(
            jax.value_and_grad(loss), (state[0], x, y), precision.scalify
        ),
    }


def measure(name: str, shape: tuple[int, int]) -> Row:
    """``name``'s optimizer cost per parameter (step minus gradients, three vs one)."""
    one, three = counts(name, shape, 1), counts(name, shape, 3)
    per = [
        ((three["step"][i] - one["step"][i]) - (three["gradients"][i] - one["gradients"][i])) / 2
        for i in range(2)
    ]
    return Row(name, *per)


@contextlib.contextmanager
def counterfactual(largest: Callable[[jax.Array], jax.Array]) -> Iterator[None]:
    """Range guards that take ``largest(wide)`` for the largest magnitude of their data."""
    with mock.patch.object(guard, "largest_magnitude", largest):
        yield


def table(rows: Sequence[Row], reference: Row | None) -> list[str]:
    """The markdown table of ``rows``, instructions also over ``reference``'s."""
    lines = ["| config | HLO instructions / parameter | kernels / parameter | vs fp32 |",
             "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        ratio = f"{row.instructions / reference.instructions:.2f}x" if reference else "-"
        lines.append(f"| `{row.config}` | {row.instructions:,.1f} | {row.kernels:.1f} | {ratio} |")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; ``--configs`` checked against ``table3.PRECISIONS``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from: {', '.join(table3.PRECISIONS)}")  # fmt: skip
    parser.add_argument("--shape", default="128,512", help="a parameter's shape, rows,cols")
    parser.add_argument("--counterfactual", action="store_true",
                        help="add each scalify configuration's guard counterfactuals")  # fmt: skip
    args = parser.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := sorted(set(args.configs) - table3.PRECISIONS.keys()):
        parser.error(f"unknown configuration(s) {unknown}; known: {list(table3.PRECISIONS)}")
    args.shape = tuple(int(n) for n in args.shape.split(","))
    if len(args.shape) != 2 or min(args.shape) < 1:
        parser.error(f"--shape takes two positive sizes, got {args.shape}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/optimizer_cost.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(f"`{command.strip()}`\n\njax {jax.__version__} on {jax.devices()[0].device_kind}, "
          f"parameters {args.shape[0]} x {args.shape[1]}\n", flush=True)  # fmt: skip
    rows = []
    for name in args.configs:
        rows.append(measure(name, args.shape))
        if args.counterfactual and table3.PRECISIONS[name].scalify:
            for label, largest in COUNTERFACTUALS.items():
                with counterfactual(largest):
                    rows.append(
                        dataclasses.replace(measure(name, args.shape), config=f"{name}, {label}")
                    )
    reference = next((r for r in rows if r.config == "fp32"), None)
    print("\n".join(table(rows, reference)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
