"""Trace and compile time of scalify on a 12-layer transformer train step, scan vs unrolled.

    python benchmarks/trace_speed.py                          # --reps 5 --steps 20
    python benchmarks/trace_speed.py --variants scan --dtypes float32,float16
    python benchmarks/trace_speed.py --profile scan --layers 4   # where the time goes

``--profile`` prints a cProfile of one scalified trace, each program's trace / lower /
compile seconds, and its jaxpr equation and compiled HLO instruction counts, split into
array and scalar (0-d: the scale arithmetic) ones, with the most frequent scalar operations.
On a 2-core CPU the unrolled scalified program takes minutes to compile (see the report in
docs/benchmarks.md); ``--layers`` makes quicker runs.

Model: pre-LayerNorm decoder, 12 layers, width 64, 4 heads, causal softmax attention, GELU
MLP of width 256, token embedding and untied output projection (vocabulary 128), sequence 32,
batch 4; cross-entropy loss, gradients and an ``optax.adam(1e-3)`` update. Two variants:

* ``scan``:     the layers run in ``lax.scan`` over parameters stacked on a leading axis;
* ``unrolled``: the same layers in a Python loop over a list of per-layer parameters.

For each variant and dtype, two programs: ``plain`` (``jax.jit(step)`` on plain arrays) and
``scalified`` (``jax.jit(js.scalify(step))`` on ScaledArray params, optimizer state and
activations of that dtype; token ids stay integer). Each repetition clears JAX's caches,
builds a fresh step function and times ``jax.jit(fn).trace(...)``, ``.lower()`` and
``.compile()`` separately; then it times ``--steps`` chained steps of the compiled program.
The table gives medians and the ratios scalified / plain. Goal: trace + compile <= 1.5x.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import math
import os
import platform
import pstats
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jax_scaled as js

LAYERS, WIDTH, HEADS, SEQ, BATCH, VOCAB = 12, 64, 4, 32, 4, 128  # LAYERS: default
HIDDEN = 4 * WIDTH
GOAL = 1.5
PHASES = ("trace", "lower", "compile")


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def init_layer(key: jax.Array) -> dict[str, jax.Array]:
    """One decoder layer's parameters (float32)."""
    k_qkv, k_out, k_up, k_down = jax.random.split(key, 4)

    def dense(k, n_in, n_out):
        return jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in)

    return {
        "ln1": jnp.ones((WIDTH,)),
        "qkv": dense(k_qkv, WIDTH, 3 * WIDTH),
        "out": dense(k_out, WIDTH, WIDTH),
        "ln2": jnp.ones((WIDTH,)),
        "up": dense(k_up, WIDTH, HIDDEN),
        "up_b": jnp.zeros((HIDDEN,)),
        "down": dense(k_down, HIDDEN, WIDTH),
    }


def init_params(key: jax.Array, variant: str, layers: int = LAYERS) -> dict:
    """Parameters; layers stacked on a leading axis (``scan``) or as a list (``unrolled``)."""
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    per_layer = [init_layer(k) for k in jax.random.split(k_layers, layers)]
    if variant == "scan":
        per_layer = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
    return {
        "embed": jax.random.normal(k_embed, (VOCAB, WIDTH)),
        "layers": per_layer,
        "ln_f": jnp.ones((WIDTH,)),
        "head": jax.random.normal(k_head, (WIDTH, VOCAB)) / np.sqrt(WIDTH),
    }


def layer_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    variance = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * lax.rsqrt(variance + 1e-5) * gain


def attention(x: jax.Array, p: dict) -> jax.Array:
    batch, seq, _ = x.shape
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(batch, seq, HEADS, WIDTH // HEADS)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / math.sqrt(WIDTH // HEADS)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, heads(v)).reshape(batch, seq, WIDTH)
    return mixed @ p["out"]


def decoder_layer(x: jax.Array, p: dict) -> jax.Array:
    x = x + attention(layer_norm(x, p["ln1"]), p)
    hidden = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["up"] + p["up_b"])
    return x + hidden @ p["down"]


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy of the decoder on ``tokens`` (int32, batch x (SEQ + 1))."""
    x = params["embed"][tokens[:, :-1]]
    if isinstance(params["layers"], dict):  # stacked: scan over the leading axis
        x, _ = lax.scan(lambda h, p: (decoder_layer(h, p), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = decoder_layer(x, p)
    logits = layer_norm(x, params["ln_f"]) @ params["head"]
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB, dtype=logits.dtype)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


def make_step() -> tuple[Callable, optax.GradientTransformation]:
    """A fresh train step (a new function object, so no jit cache applies) and its optimizer."""
    opt = optax.adam(1e-3)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt


def make_inputs(variant: str, dtype, scaled: bool, layers: int = LAYERS, seed: int = 0) -> tuple:
    """``(params, opt_state, tokens)`` in ``dtype``; ScaledArray leaves when ``scaled``."""
    key_params, key_tokens = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(key_params, variant, layers)
    opt_state = make_step()[1].init(params)
    tokens = jax.random.randint(key_tokens, (BATCH, SEQ + 1), 0, VOCAB)
    if scaled:
        cast = lambda tree: js.tree.astype(js.as_scaled_array(tree), dtype)  # noqa: E731
    else:
        cast = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
        )
    return cast(params), cast(opt_state), tokens


# ---------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------


def step_function(scaled: bool) -> Callable:
    step, _ = make_step()
    return js.scalify(step) if scaled else step


def time_phases(scaled: bool, args: tuple, compile: bool = True) -> tuple[dict[str, float], Any]:
    """Seconds spent tracing, lowering and compiling a fresh step; and the compiled program."""
    jax.clear_caches()
    fn = step_function(scaled)
    times = {}
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    times["trace"] = time.perf_counter() - start
    start = time.perf_counter()
    lowered = traced.lower()
    times["lower"] = time.perf_counter() - start
    if not compile:
        return times, lowered
    start = time.perf_counter()
    compiled = lowered.compile()
    times["compile"] = time.perf_counter() - start
    return times, compiled


def time_steps(compiled, args: tuple, steps: int) -> tuple[list[float], bool]:
    """Seconds per chained step of ``compiled`` and whether the final loss is finite."""
    params, opt_state, tokens = args
    params, opt_state, loss = compiled(params, opt_state, tokens)  # warm-up, untimed
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens)
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - start)
    return times, bool(np.isfinite(float(js.asarray(loss, jnp.float32))))


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\S+) ([\w\-]+)\(", re.MULTILINE)


def hlo_instructions(compiled) -> list[tuple[str, str]]:
    """``(shape, opcode)`` of every instruction of the optimised HLO, fusion bodies included."""
    return _HLO_INSTRUCTION.findall(compiled.as_text())


def jaxpr_equations(scaled: bool, args: tuple) -> list[tuple[str, bool]]:
    """``(primitive, is_scalar)`` of every equation of the step, sub-jaxprs included."""
    closed = jax.make_jaxpr(step_function(scaled))(*args)
    return list(_walk_equations(closed.jaxpr))


def _walk_equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, all(getattr(v.aval, "shape", None) == () for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk_equations(inner)


def measure(variant: str, dtype: str, reps: int, steps: int, layers: int) -> dict:
    """Medians for the plain and scalified programs of one variant and dtype, interleaved."""
    inputs = {s: make_inputs(variant, jnp.dtype(dtype), s, layers) for s in (False, True)}
    phases = {s: {p: [] for p in PHASES} for s in inputs}
    step_times = {s: [] for s in inputs}
    finite, hlo = {}, {}
    for rep in range(reps):
        for scaled in (False, True) if rep % 2 == 0 else (True, False):
            times, compiled = time_phases(scaled, inputs[scaled])
            for phase, seconds in times.items():
                phases[scaled][phase].append(seconds)
            hlo[scaled] = len(hlo_instructions(compiled))
            step, finite[scaled] = time_steps(compiled, inputs[scaled], steps)
            step_times[scaled].extend(step)
    return {
        scaled: {
            **{p: statistics.median(phases[scaled][p]) for p in PHASES},
            "total": statistics.median(map(sum, zip(*phases[scaled].values(), strict=True))),
            "step": statistics.median(step_times[scaled]),
            "hlo": hlo[scaled],
            "eqns": len(jaxpr_equations(scaled, inputs[scaled])),
            "finite": finite[scaled],
        }
        for scaled in inputs
    }


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows (the first is the header) as an aligned markdown table."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_results(results: dict) -> str:
    """One row per (variant, dtype): trace+compile, phases, step time, program sizes."""
    header = (
        "variant", "dtype", "plain trace+compile s", "scalified trace+compile s", "ratio",
        "trace s (p/s)", "lower s (p/s)", "compile s (p/s)", "plain step ms",
        "scalified step ms", "step ratio", "jaxpr eqns (p/s)", "HLO instrs (p/s)",
        "loss finite (p/s)",
    )  # fmt: skip
    rows = [header]
    for (variant, dtype), r in results.items():
        p, s = r[False], r[True]
        pair = lambda key, fmt, p=p, s=s: f"{p[key]:{fmt}} / {s[key]:{fmt}}"  # noqa: E731
        rows.append(
            (
                variant, dtype, f"{p['total']:.2f}", f"{s['total']:.2f}",
                f"{s['total'] / p['total']:.2f}x", pair("trace", ".2f"), pair("lower", ".2f"),
                pair("compile", ".2f"), f"{1e3 * p['step']:.2f}", f"{1e3 * s['step']:.2f}",
                f"{s['step'] / p['step']:.2f}x", pair("eqns", "d"), pair("hlo", "d"),
                f"{'yes' if p['finite'] else 'NO'} / {'yes' if s['finite'] else 'NO'}",
            )
        )  # fmt: skip
    return markdown_table(rows)


def profile(variant: str, dtype: str, layers: int, top: int = 30) -> str:
    """Where the scalified program's time goes: cProfile of a trace, and program sizes.

    Traces once untimed (JAX's caches of the rules' helpers warm), then profiles a fresh
    trace; counts jaxpr equations and compiled HLO instructions of the plain and scalified
    programs, split into array and scalar (0-d, the scale arithmetic) ones.
    """
    args = {s: make_inputs(variant, jnp.dtype(dtype), s, layers) for s in (False, True)}
    time_phases(True, args[True], compile=False)
    jax.clear_caches()
    fn = step_function(True)
    profiler = cProfile.Profile()
    profiler.enable()
    jax.jit(fn).trace(*args[True])
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    sections = [out.getvalue()]
    for scaled in (False, True):
        name = "scalified" if scaled else "plain"
        times, compiled = time_phases(scaled, args[scaled])
        eqns = jaxpr_equations(scaled, args[scaled])
        instrs = hlo_instructions(compiled)
        scalar_eqns = collections.Counter(p for p, is_scalar in eqns if is_scalar)
        scalar_hlo = collections.Counter(op for shape, op in instrs if _is_scalar_shape(shape))
        sections.append(
            f"{name}: phases {', '.join(f'{k} {v:.2f} s' for k, v in times.items())}\n"
            f"  jaxpr equations {len(eqns)} ({sum(scalar_eqns.values())} scalar); top scalar: "
            f"{scalar_eqns.most_common(12)}\n"
            f"  HLO instructions {len(instrs)} ({sum(scalar_hlo.values())} scalar); top scalar: "
            f"{scalar_hlo.most_common(12)}"
        )
    return "\n".join(sections)


def _is_scalar_shape(shape: str) -> bool:
    return re.match(r"^[a-z0-9]+\[\]", shape) is not None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="fresh traces per program")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repetition")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers")
    parser.add_argument("--variants", default="unrolled,scan", help="comma-separated")
    parser.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,float16")
    parser.add_argument("--profile", metavar="VARIANT", help="profile one variant instead")
    args = parser.parse_args(argv)
    split = lambda text: [t.strip() for t in text.split(",") if t.strip()]  # noqa: E731
    device = jax.devices()[0]
    print(
        f"transformer: {args.layers} layers, width {WIDTH}, {HEADS} heads, seq {SEQ}, batch "
        f"{BATCH}, adam; {args.reps} reps x {args.steps} steps; jax {jax.__version__}, "
        f"{device.platform} ({device.device_kind}), {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}"
    )
    if args.profile:
        print(profile(args.profile, split(args.dtypes)[0], args.layers))
        return 0
    results = {}
    for variant in split(args.variants):
        for dtype in split(args.dtypes):
            results[variant, dtype] = measure(variant, dtype, args.reps, args.steps, args.layers)
            print(format_results(results), flush=True)  # so far: a long run keeps its rows
    print(f"goal: trace+compile ratio <= {GOAL}x (medians; ratio = scalified / plain; p/s = "
          "plain / scalified)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
