"""Overhead of scalify on an MLP train step: steady-state step time and first-call time.

    python benchmarks/overhead.py                 # defaults: --reps 5 --steps 50
    python benchmarks/overhead.py --reps 10 --steps 100 --dtypes float32

Model: MLP 784-512-512-10, ReLU, log-softmax cross-entropy, SGD (lr 1e-2), batch 128, random
data with a fixed seed. Variants, measured interleaved in one process:

* ``plain``:    ``jax.jit(step)`` on plain arrays of the given dtype;
* ``scalified``: ``jax.jit(js.scalify(step))`` on ScaledArrays with data of that dtype;
* ``unguarded`` (with ``--unguarded``): the same without the range guard
  (``ScalifyConfig(guard=False)``), to show what the guard costs. Not the default: without
  the guard, float16 training can overflow (docs/index.md);
* ``mxfp8`` (with ``--block``): ``jax.jit(js.scalify(step))`` with the matmuls that blocks of
  32 tile (the 512 x 512 one; 784 and 10 are not multiples of 32) as
  ``js.nn.block_linear(x, w, js.nn.MXFP8)``: every matmul, forward and backward, on
  block-quantized E4M3/E5M2 operands through scalify's block ``dot_general`` rule. It does
  more work than the plain program (quantizing, per-block partial products), so its ratio
  is a cost, not an overhead.

Each repetition builds a fresh step function (so no jit cache is reused), times its first
call (trace + lower + compile + one run, blocked), then times ``--steps`` chained steps one by
one (each blocked). The table shows medians over repetitions and steps, and the ratio
scalified / plain. Goals: step time <= 1.05x, first call <= 1.5x.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled as js
from jax_scaled.nn.block_linear import untiled_axes

SIZES = (784, 512, 512, 10)
BATCH = 128
GOALS = {"step": 1.05, "first call": 1.5}
CONFIGS = {"scalified": None, "unguarded": js.ScalifyConfig(guard=False), "mxfp8": None}
BLOCK_RECIPES = {"mxfp8": js.nn.MXFP8}


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) * np.sqrt(2.0 / n_in),
            "b": jnp.zeros((n_out,)),
        }
        for k, n_in, n_out in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def make_step(
    block: js.nn.BlockRecipe | None = None,
) -> tuple[Callable, optax.GradientTransformation]:
    """A fresh train step (a new function object: jax.jit reuses no cache) and its optimizer;
    with ``block``, the hidden layers' matmuls are block-scaled by that recipe."""
    opt = optax.sgd(1e-2)

    def matmul(x, w):
        if block is None or untiled_axes(x.shape, w.shape, block):
            return x @ w
        return js.nn.block_linear(x, w, block)

    def loss_fn(params, batch):
        x = batch["x"]
        for layer in params[:-1]:
            x = jax.nn.relu(matmul(x, layer["w"]) + layer["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return -jnp.mean(jnp.sum(batch["y"] * jax.nn.log_softmax(logits), axis=-1))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt


def make_inputs(dtype, scaled: bool, seed: int = 0):
    key_p, key_x, key_y = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = init_params(key_p)
    batch = {
        "x": jax.random.normal(key_x, (BATCH, SIZES[0])),
        "y": jax.nn.one_hot(jax.random.randint(key_y, (BATCH,), 0, SIZES[-1]), SIZES[-1]),
    }
    _, opt = make_step()
    opt_state = opt.init(params)
    if scaled:
        cast = lambda tree: js.tree.astype(js.as_scaled_array(tree), dtype)  # noqa: E731
    else:
        cast = lambda tree: js.tree.astype(tree, dtype)  # noqa: E731
    return cast(params), cast(opt_state), cast(batch)


def measure(variant: str, dtype, steps: int) -> tuple[float, list[float], bool]:
    """First-call seconds, per-step seconds and whether the final loss is finite."""
    scaled = variant != "plain"
    step, _ = make_step(BLOCK_RECIPES.get(variant))
    fn = jax.jit(js.scalify(step, config=CONFIGS[variant])) if scaled else jax.jit(step)
    params, opt_state, batch = make_inputs(dtype, scaled)
    jax.block_until_ready((params, opt_state, batch))

    start = time.perf_counter()
    params, opt_state, loss = fn(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, loss))
    first = time.perf_counter() - start

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = fn(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - start)
    return first, times, bool(np.isfinite(float(js.asarray(loss, jnp.float32))))


def run(
    dtypes: Sequence[str], reps: int, steps: int, variants: Sequence[str] = ("plain", "scalified")
) -> dict:
    firsts = {(d, v): [] for d in dtypes for v in variants}
    step_times = {(d, v): [] for d in dtypes for v in variants}
    finite = {(d, v): True for d in dtypes for v in variants}
    measure(variants[0], dtypes[0], 2)  # warm JAX's own caches once, untimed
    for rep in range(reps):
        for dtype in dtypes:
            order = variants if rep % 2 == 0 else variants[::-1]
            for variant in order:
                first, times, ok = measure(variant, jnp.dtype(dtype), steps)
                finite[dtype, variant] &= ok
                firsts[dtype, variant].append(first)
                step_times[dtype, variant].extend(times)
    return {
        key: (statistics.median(firsts[key]), statistics.median(step_times[key]), finite[key])
        for key in firsts
    }


def format_table(results: dict, dtypes: Sequence[str], variant: str = "scalified") -> str:
    """Markdown table of ``variant`` against plain, one row per dtype."""
    header = (
        "dtype", "plain step ms", f"{variant} step ms", "step ratio",
        "plain first call s", f"{variant} first call s", "first call ratio", "final loss finite",
    )  # fmt: skip
    rows = [header]
    for dtype in dtypes:
        p_first, p_step, p_ok = results[dtype, "plain"]
        s_first, s_step, s_ok = results[dtype, variant]
        rows.append(
            (
                dtype,
                f"{1e3 * p_step:.2f}",
                f"{1e3 * s_step:.2f}",
                f"{s_step / p_step:.2f}x",
                f"{p_first:.2f}",
                f"{s_first:.2f}",
                f"{s_first / p_first:.2f}x",
                f"plain {'yes' if p_ok else 'NO'}, {variant} {'yes' if s_ok else 'NO'}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="fresh functions per variant")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per repetition")
    parser.add_argument("--dtypes", default="float32,float16", help="comma-separated dtypes")
    parser.add_argument(
        "--unguarded", action="store_true", help="also time scalify without the range guard"
    )
    parser.add_argument(
        "--block", action="store_true", help="also time a block-scaled (MXFP8) scalified step"
    )
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    device = jax.devices()[0]
    print(
        f"MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, SGD; {args.reps} reps x {args.steps} "
        f"steps; jax {jax.__version__}, {device.platform} ({device.device_kind}), "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
    )
    variants = ("plain", "scalified") + ("unguarded",) * args.unguarded + ("mxfp8",) * args.block
    results = run(dtypes, args.reps, args.steps, variants)
    print(format_table(results, dtypes))
    if args.unguarded:
        print("\nwithout the range guard (ScalifyConfig(guard=False), not the default):")
        print(format_table(results, dtypes, "unguarded"))
    if args.block:
        print("\nblock-scaled MXFP8 hidden matmuls (js.nn.block_linear) under scalify:")
        print(format_table(results, dtypes, "mxfp8"))
    print(
        f"goals: step ratio <= {GOALS['step']}x, first call ratio <= {GOALS['first call']}x "
        "(medians; ratio = scalified / plain)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
