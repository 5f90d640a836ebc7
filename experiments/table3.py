"""The scalify paper's Table 3 on a small character-level GPT: FP32, raw FP16, FP16 with loss
scaling, the four scalify configurations (FP16 and FP8, FP32 or FP16 master weights and
optimizer state), and FP8 by a format policy on the unmodified model.

::

    python -m experiments.table3 --quick                 # all configurations, ~15 min on 2 cores
    python -m experiments.table3 --demo                  # a 5-configuration subset, ~3 min
    python -m experiments.table3 --report docs/results   # full run: table3.{md,json} + plot
    python -m experiments.table3 --configs fp32,fp8_scalify --steps 200 --text my.txt
    python -m experiments.table3 --plot-scales docs/results   # scales_<config>.png, no training

Every configuration trains the same model (:mod:`experiments.gpt`) from the same float32
initialisation, on the same batches, with the same optimizer (Adam, linear warmup then cosine
decay); only the numerics differ (:data:`PRECISIONS`). The scalify configurations run the
plain train step as ``jax.jit(js.scalify(step))`` with ScaledArray parameters and optimizer
state; the token ids stay plain integers.

Block-scaled recipes (``mxfp8_scalify``, ``fp8_block128_scalify``,
``mxfp4_weights_scalify``) are ``fp8_scalify`` with the blocks' weight matmuls on block
scales instead of per-tensor casts (:func:`jax_scaled.nn.block_linear`); block-128 needs a
width and a batch x context that are multiples of 128 (the full and quick sizes).

FP8 comes in two ways. ``fp8_scalify`` and ``fp8_scalify_fp16_opt`` (the paper's #3 and #4)
ask the model for it: :class:`experiments.gpt.Numerics` makes the blocks' weight matmuls
FP8 ``js.nn.linear`` calls and rescales the LayerNorm gradients. ``fp8_policy_scalify``
leaves the model as written (default ``Numerics``: 16-bit matmuls, no rescaling) and applies
:func:`jax_scaled.dot_formats` to the loss from outside,
``js.scalify(jax.value_and_grad(js.dot_formats(loss, ...)))``: every ``dot_general`` of the
model (the blocks' weight matmuls and both attention products) takes E4M3 operands forward
and an E5M2 output gradient backward, except the output head (logits), excluded by its
``[width, vocab]`` operand and kept in FP16, as FP8 recipes (Transformer Engine, torchao)
keep the output layer in 16 bits. Its master weights and Adam state are FP16, as in #4.

``--plot-scales DIR`` records one training step of each scalify configuration with
``js.diagnostics.record_scales()`` and writes its chart (``js.diagnostics.plot``) to
``DIR/scales_<config>.png``; the plain configurations hold no ScaledArray to record.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled as js
from experiments import corpus as corpus_lib
from experiments import gpt

F32, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)


@dataclasses.dataclass(frozen=True)
class Precision:
    """The numerics of one configuration (one row of Table 3)."""

    name: str
    paper: str  # the paper's experiment number, or "" for the non-scalify references
    compute_dtype: Any = F32  # activations and gradients
    master_dtype: Any = F32  # parameters between steps
    state_dtype: Any = F32  # Adam's moments between steps
    scalify: bool = False
    fp8_matmuls: bool = False  # the model's weight matmuls in FP8 (gpt.Numerics)
    fp8_policy: bool = False  # every contraction but the head in FP8 by js.dot_formats
    block: Any = None  # a js.nn.BlockRecipe for the model's weight matmuls (gpt.Numerics)
    rescale_layernorm_grad: bool = False
    rescale_grads: bool = False  # dynamic rescale of the gradients entering the optimizer
    flat_state: bool = False  # scaled_state(flat=True): state leaves in one buffer per block
    loss_scaling: bool = False

    @property
    def numerics(self) -> gpt.Numerics:
        return gpt.Numerics(self.fp8_matmuls, self.rescale_layernorm_grad, block=self.block)

    @property
    def fp8(self) -> bool:
        """True when some matmuls run in FP8 (in the model or by the policy)."""
        return self.fp8_matmuls or self.fp8_policy or self.block is not None


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", "#0"),
        Precision("fp16_raw", "", F16, F16, F16),
        Precision("fp16_loss_scaling", "", F16, loss_scaling=True),
        Precision("fp16_scalify", "#1", F16, scalify=True),
        Precision("fp16_scalify_fp16_master", "#2", F16, F16, scalify=True,
                  rescale_layernorm_grad=True),
        Precision("fp8_scalify", "#3", F16, F16, scalify=True, fp8_matmuls=True,
                  rescale_layernorm_grad=True),
        Precision("fp8_scalify_fp16_opt", "#4", F16, F16, F16, scalify=True, fp8_matmuls=True,
                  rescale_layernorm_grad=True, rescale_grads=True, flat_state=True),
        Precision("fp8_policy_scalify", "", F16, F16, F16, scalify=True, fp8_policy=True,
                  rescale_grads=True, flat_state=True),
        Precision("mxfp8_scalify", "", F16, F16, F32, scalify=True, block=js.nn.MXFP8,
                  rescale_layernorm_grad=True),
        Precision("fp8_block128_scalify", "", F16, F16, F32, scalify=True,
                  block=js.nn.FP8_BLOCK128, rescale_layernorm_grad=True),
        Precision("mxfp4_weights_scalify", "", F16, F16, F32, scalify=True,
                  block=js.nn.MXFP4_WEIGHTS, rescale_layernorm_grad=True),
    )
}  # fmt: skip
DEMO_CONFIGS = ("fp32", "fp16_raw", "fp16_scalify", "fp8_scalify", "fp8_policy_scalify")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model size, data and optimisation settings shared by every configuration."""

    steps: int = 500
    batch_size: int = 16
    context: int = 128
    width: int = 128
    layers: int = 4
    heads: int = 4
    learning_rate: float = 2e-3
    warmup_fraction: float = 0.1
    final_lr_fraction: float = 0.1
    b1: float = 0.9
    b2: float = 0.99
    # Adam's epsilon, the same for every configuration: optax's 1e-8 is below float16's
    # smallest subnormal and would be traced as 0 in the raw-float16 step.
    eps: float = 1e-7
    # Gradients are clipped to this global norm (0: no clipping), nanoGPT's default. Without
    # it this model's fp32 baseline is chaotic: a loss spike near the end of warmup makes
    # fp32 runs whose gradients differ by 1e-3 (relative noise) end -0.9% to +6.3% apart,
    # far more than the 1% goal. With it they end within 1e-4 (docs/results/table3.md).
    clip_norm: float = 1.0
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    corpus_chars: int = corpus_lib.DEFAULT_CHARS
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 200  # finite steps before the loss scale doubles

    def model_config(self, vocab_size: int) -> gpt.GPTConfig:
        return gpt.GPTConfig(vocab_size, self.context, self.width, self.layers, self.heads)


SIZES: dict[str, TrainConfig] = {
    "full": TrainConfig(),
    "quick": TrainConfig(steps=150, eval_every=25),
    "demo": TrainConfig(steps=400, batch_size=8, context=64, width=64, layers=2, heads=2,
                        eval_every=50, eval_batches=4, corpus_chars=300_000),
}  # fmt: skip


class LossScale(NamedTuple):
    """Dynamic loss scaling state: the scale and the count of finite steps since a change."""

    scale: jax.Array
    good_steps: jax.Array


def next_loss_scale(state: LossScale, finite: jax.Array, period: int) -> LossScale:
    """Halve the scale after a non-finite gradient; double it after ``period`` finite steps.

    Example:
        >>> s = LossScale(jnp.float32(8.0), jnp.int32(1))
        >>> [float(next_loss_scale(s, jnp.bool_(f), 2).scale) for f in (False, True)]
        [4.0, 16.0]
    """
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= period
    scale = jnp.where(finite, jnp.where(grow, state.scale * 2, state.scale), state.scale / 2)
    return LossScale(jnp.maximum(scale, 1.0), jnp.where(grow, 0, good))


def all_finite(*trees: Any) -> jax.Array:
    """True when every floating leaf of ``trees`` is finite (works under scalify)."""
    leaves = [x for x in js.tree.tree_leaves(trees) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def make_optimizer(config: TrainConfig, precision: Precision) -> optax.GradientTransformation:
    """Adam with linear warmup and cosine decay after clipping the gradients' global norm;
    scalify configurations store its state with :func:`jax_scaled.optim.scaled_state`: scaled
    float16 for FP16 state (flat: one buffer per block length), float32 otherwise (both
    computed in plain float32)."""
    warmup = max(1, round(config.warmup_fraction * config.steps))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, warmup, max(config.steps, warmup + 1),
        config.learning_rate * config.final_lr_fraction,
    )  # fmt: skip
    adam = optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps)
    if config.clip_norm:
        adam = optax.chain(optax.clip_by_global_norm(config.clip_norm), adam)
    if precision.scalify:
        return js.optim.scaled_state(
            adam,
            precision.state_dtype,
            rescale_grads=precision.rescale_grads,
            flat=precision.flat_state,
        )
    return adam


def make_loss(model: gpt.GPT, precision: Precision) -> Callable:
    """``(params, inputs, targets) -> loss`` with the parameters cast to the compute dtype
    (and the FP8 format policy applied, for a ``fp8_policy`` configuration)."""

    def loss(params, inputs, targets):
        params = js.tree.astype(params, precision.compute_dtype)
        return gpt.next_char_loss(model, params, inputs, targets)

    return fp8_policy(loss, model.config) if precision.fp8_policy else loss


def fp8_policy(loss: Callable, model: gpt.GPTConfig) -> Callable:
    """``loss`` with every ``dot_general`` of the model in FP8 (:func:`jax_scaled.dot_formats`):
    E4M3 operands forward, E5M2 output gradient backward; the output head (logits), the
    contraction with a ``[width, vocab]`` operand, stays in the compute dtype.

    Example:
        >>> config = gpt.GPTConfig(vocab_size=10, width=16)
        >>> fp8_policy(lambda x, w: x @ w, config)(jnp.ones((2, 16)), jnp.ones((16, 10))).dtype
        dtype('float32')
    """
    head = (model.width, model.vocab_size)
    kernels = {(model.width, n * model.width) for n in (1, 3, model.mlp_ratio)}
    if head in kernels:
        raise ValueError(f"vocab_size {model.vocab_size}: the head's shape {head} is also a "
                         "block kernel's, so it cannot tell the head apart")  # fmt: skip
    return js.dot_formats(loss, lhs=gpt.E4M3, rhs=gpt.E4M3, grad=gpt.E5M2, exclude=[head])


def make_step(loss: Callable, opt: optax.GradientTransformation, precision: Precision) -> Callable:
    """The train step ``(params, opt_state, aux, inputs, targets) -> (params, opt_state, aux,
    loss, finite)``; ``aux`` is the :class:`LossScale` or ``None``."""
    scaled_master = precision.scalify and precision.master_dtype != F32
    apply_updates = js.optim.apply_updates if scaled_master else optax.apply_updates

    def step(params, opt_state, aux, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = opt.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, aux, value, all_finite(value, grads)

    return step


def make_loss_scaled_step(
    loss: Callable, opt: optax.GradientTransformation, period: int
) -> Callable:
    """The conventional FP16 recipe: float32 master weights, float16 forward and backward of
    ``loss * scale``, gradients unscaled in float32; a non-finite step is skipped."""

    def step(params, opt_state, aux, inputs, targets):
        def scaled_loss(p):
            value = loss(p, inputs, targets)
            return value.astype(F32) * aux.scale, value

        (_, value), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g / aux.scale, grads)
        finite = all_finite(value, grads)
        updates, new_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
        aux = next_loss_scale(aux, finite, period)
        return keep(new_params, params), keep(new_state, opt_state), aux, value, finite

    return step


@dataclasses.dataclass(frozen=True)
class Runner:
    """A configuration ready to train: its initial state, compiled step and evaluation."""

    precision: Precision
    state: tuple[Any, Any, Any]  # params, opt_state, aux as stored between steps
    step: Callable
    evaluate: Callable


def initial_state(params, opt, precision: Precision, config: TrainConfig) -> tuple:
    """``(params, opt_state, aux)`` from float32 ``params``, in the configuration's storage."""
    if precision.loss_scaling:
        aux = LossScale(jnp.float32(config.loss_scale_init), jnp.int32(0))
        return params, opt.init(params), aux
    if not precision.scalify:
        params = js.tree.astype(params, precision.master_dtype)
        return params, opt.init(params), None
    opt_state = opt.init(params)  # scaled_state's init stores its state scaled itself
    if precision.master_dtype == F32:
        return js.as_scaled_array(params), opt_state, None
    return js.optim.as_master(params, precision.master_dtype), opt_state, None


def build(precision: Precision, config: TrainConfig, params: Any, vocab_size: int) -> Runner:
    """Compile ``precision``'s step and evaluation for the model of ``config``."""
    model = gpt.GPT(config.model_config(vocab_size), precision.numerics)
    loss, opt = make_loss(model, precision), make_optimizer(config, precision)
    if precision.loss_scaling:
        step = make_loss_scaled_step(loss, opt, config.loss_scale_period)
    else:
        step = make_step(loss, opt, precision)
    compile_ = (lambda f: jax.jit(js.scalify(f))) if precision.scalify else jax.jit
    state = initial_state(params, opt, precision, config)
    return Runner(precision, state, compile_(step), compile_(loss))


def to_float(x: Any) -> float:
    """A (possibly scaled) scalar as a Python float."""
    return float(js.asarray(x, jnp.float32))


def validation_loss(runner: Runner, params: Any, batches: Sequence) -> float:
    """Mean loss over the fixed validation batches."""
    return float(np.mean([to_float(runner.evaluate(params, x, y)) for x, y in batches]))


def train(
    runner: Runner,
    train_batches: Sequence,
    val_batches: Sequence,
    eval_every: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``runner`` over ``train_batches``; the result dict of one configuration."""
    from tqdm import tqdm

    params, opt_state, aux = runner.state
    bytes_stored = js.optim.state_bytes(runner.state)
    curve = [(0, validation_loss(runner, params, val_batches))]
    losses, times, nan_steps = [], [], 0
    # disable=None: a bar that updates in place on a terminal, nothing in a file or CI log
    # (each configuration still prints its summary line when it ends).
    bar = tqdm(train_batches, desc=runner.precision.name, disable=None if progress else True,
               leave=False)  # fmt: skip
    for i, (x, y) in enumerate(bar, start=1):
        start = time.perf_counter()
        params, opt_state, aux, loss, finite = runner.step(params, opt_state, aux, x, y)
        losses.append(to_float(loss))
        times.append(time.perf_counter() - start)
        nan_steps += not bool(finite)
        if i % eval_every == 0 or i == len(train_batches):
            curve.append((i, validation_loss(runner, params, val_batches)))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", val=f"{curve[-1][1]:.3f}")
    tail = losses[-max(1, len(losses) // 20) :]
    return {
        "val_loss": curve[-1][1],
        "train_loss": float(np.mean(tail)),
        "nan_steps": nan_steps,
        "step_time_s": statistics.median(times[2:] or times),
        "state_bytes": bytes_stored,
        "first_step_s": times[0],
        "val_curve": curve,
    }


def training_batches(config: TrainConfig, corpus: corpus_lib.Corpus) -> list:
    """The ``config.steps`` training batches ``(inputs, targets)``, the same for every run."""
    rng = np.random.default_rng(config.seed)
    sample = corpus_lib.sample_windows
    return [
        sample(corpus.train, config.context, config.batch_size, rng) for _ in range(config.steps)
    ]


def run(
    names: Sequence[str], config: TrainConfig, corpus: corpus_lib.Corpus, progress: bool = True
) -> dict[str, dict[str, Any]]:
    """Train every configuration in ``names`` on ``corpus``; results keyed by name."""
    train_batches = training_batches(config, corpus)
    val_batches = corpus_lib.fixed_windows(
        corpus.validation, config.context, config.batch_size, config.eval_batches, config.seed + 1
    )
    params = gpt.init_params(config.model_config(corpus.vocab_size), config.seed)
    results = {}
    for name in names:
        start = time.perf_counter()
        runner = build(PRECISIONS[name], config, params, corpus.vocab_size)
        results[name] = train(runner, train_batches, val_batches, config.eval_every, progress)
        results[name]["wall_s"] = time.perf_counter() - start
        print(summary_line(name, results[name]), flush=True)
    return results


def plot_scales(
    names: Sequence[str],
    config: TrainConfig,
    corpus: corpus_lib.Corpus,
    directory: str | pathlib.Path,
    metric: str = "rms",
) -> list[pathlib.Path]:
    """Record the first training step of each scalify configuration in ``names``
    (``js.diagnostics.record_scales``) and chart it to ``directory/scales_<name>.png``
    (``js.diagnostics.plot``); the paths written. Plain configurations are skipped: they hold
    no ScaledArray, so there is nothing to record."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    inputs, targets = training_batches(dataclasses.replace(config, steps=1), corpus)[0]
    params = gpt.init_params(config.model_config(corpus.vocab_size), config.seed)
    paths = []
    for name in names:
        if not PRECISIONS[name].scalify:
            print(f"{name}: not scalified, no scales to record (skipped)", flush=True)
            continue
        runner = build(PRECISIONS[name], config, params, corpus.vocab_size)
        with js.diagnostics.record_scales() as records:
            runner.step(*runner.state, inputs, targets)  # traced here: recorded
        paths.append(out / f"scales_{name}.png")
        title = f"{name}: {metric} of every scaled value of one training step (log2 axes)"
        js.diagnostics.plot(records, path=str(paths[-1]), metric=metric, title=title)
        print(f"{name}: {len(records)} records -> {paths[-1]}", flush=True)
    return paths


GOALS = {  # allowed |val_loss / fp32's - 1|: (full run, quick run)
    "fp16_scalify": (0.01, 0.02),
    "fp16_scalify_fp16_master": (0.01, 0.02),
    "fp8_scalify": (0.02, 0.02),
    "fp8_scalify_fp16_opt": (0.02, 0.02),
    "fp8_policy_scalify": (0.02, 0.02),
    "mxfp8_scalify": (0.01, 0.02),
    "fp8_block128_scalify": (0.01, 0.02),
    "mxfp4_weights_scalify": (0.03, 0.03),
    "fp16_loss_scaling": (0.01, 0.02),
}
# parameters and optimizer state in FP16
FP16_STATE = ("fp16_raw", "fp8_scalify_fp16_opt", "fp8_policy_scalify")


def relative_to_fp32(results: dict[str, dict], name: str) -> float:
    """``val_loss / fp32's - 1`` (NaN when either is missing or not finite)."""
    ref, val = results.get("fp32", {}).get("val_loss"), results[name]["val_loss"]
    ok = ref is not None and val is not None and math.isfinite(ref) and math.isfinite(val)
    return val / ref - 1 if ok else math.nan


@dataclasses.dataclass(frozen=True)
class Goals:
    lines: list[str]
    scalify_ok: bool


def check_goals(results: dict[str, dict], quick: bool) -> Goals:
    """The issue's goals, one line each: PASS/MISS and the measured number."""
    lines, scalify_ok = [], True
    if "fp32" not in results:
        return Goals(["(goals need the fp32 run)"], True)
    for name, (full_tol, quick_tol) in GOALS.items():
        if name in results:
            tol, diff = quick_tol if quick else full_tol, relative_to_fp32(results, name)
            nans = results[name]["nan_steps"] if PRECISIONS[name].scalify else 0
            ok = abs(diff) <= tol and nans == 0
            scalify_ok &= ok or not PRECISIONS[name].scalify
            extra = f", nan_steps {nans}" if PRECISIONS[name].scalify else ""
            shown = "diverged" if math.isnan(diff) else f"{100 * diff:+.2f}% vs fp32"
            lines.append(f"{_mark(ok)} {name}: {shown} (goal ±{100 * tol:g}%){extra}")
    if "fp16_raw" in results:
        diff = relative_to_fp32(results, "fp16_raw")
        ok = not math.isfinite(diff) or diff > 0.02
        shown = "diverged" if not math.isfinite(diff) else f"{100 * diff:+.2f}% vs fp32"
        lines.append(f"{_mark(ok)} fp16_raw visibly worse or diverged: {shown}")
    for name in (n for n in FP16_STATE if n in results):
        ratio = results[name]["state_bytes"] / results["fp32"]["state_bytes"]
        lines.append(f"{_mark(ratio <= 0.55)} {name} state_bytes {ratio:.3f}x fp32 (goal <= 0.55x)")
    return Goals(lines, scalify_ok)


def _mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _loss(x: float | None) -> str:
    return "diverged" if x is None or not math.isfinite(x) else f"{x:.4f}"


def summary_line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<26} val {_loss(r['val_loss'])}  train {_loss(r['train_loss'])}  "
        f"nan_steps {r['nan_steps']}  {1e3 * r['step_time_s']:.0f} ms/step  "
        f"{r['state_bytes'] / 2**20:.2f} MiB state  ({r['wall_s']:.0f} s)"
    )


BLOCK_LABELS = {
    js.nn.MXFP8: "MXFP8",
    js.nn.FP8_BLOCK128: "FP8 1x128 / 128x128",
    js.nn.MXFP4_WEIGHTS: "MXFP4 W, MXFP8 A",
}


def _columns(p: Precision) -> list[str]:
    """The paper's Table 3 columns: matmul, master weights, weight gradients, optimizer state,
    dynamic rescaling, loss scaling."""
    fmt = {F32: "FP32", F16: "FP16"}
    rescaling = ["LayerNorm bwd"] * p.rescale_layernorm_grad + ["grads"] * p.rescale_grads
    matmul = BLOCK_LABELS.get(p.block)
    if matmul is None:
        matmul = "FP8 (js.dot_formats)" if p.fp8_policy else "FP8" if p.fp8_matmuls else None
    # js.nn.linear (and dot_formats) return FP8 weight gradients only with wgrad_dtype set;
    # the model leaves it at its default, the weight's own (compute) dtype.
    return [
        matmul or fmt[p.compute_dtype],
        fmt[p.master_dtype],
        fmt[p.compute_dtype],
        fmt[p.state_dtype],
        " & ".join(rescaling) or "x",
        "dynamic" if p.loss_scaling else "x",
    ]


def markdown_table(results: dict[str, dict]) -> str:
    """Table 3: each configuration's numerics, final losses and difference from FP32."""
    head = ["Config", "Paper", "Matmul", "Master", "Weight grads", "Opt. state", "Dyn. rescaling",
            "Loss scaling", "Val loss", "vs FP32", "Train loss", "NaN steps", "ms/step",
            "State (x FP32)"]  # fmt: skip
    rows = [head, ["---"] * len(head)]
    ref_bytes = results.get("fp32", {}).get("state_bytes")
    for name, r in results.items():
        diff = relative_to_fp32(results, name)
        rows.append([f"`{name}`", PRECISIONS[name].paper or "-", *_columns(PRECISIONS[name]),
                     _loss(r["val_loss"]), "-" if math.isnan(diff) else f"{100 * diff:+.2f}%",
                     _loss(r["train_loss"]), str(r["nan_steps"]), f"{1e3 * r['step_time_s']:.0f}",
                     f"{r['state_bytes'] / ref_bytes:.2f}" if ref_bytes else "-"])  # fmt: skip
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def metadata(size: str, config: TrainConfig, corpus, n_params: int, command: str) -> dict:
    return {
        "command": command,
        "size": size,
        "settings": dataclasses.asdict(config),
        "parameters": n_params,
        "corpus": {"source": corpus.source, "vocab_size": corpus.vocab_size,
                   "train_chars": len(corpus.train), "validation_chars": len(corpus.validation)},
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
    }  # fmt: skip


def header(meta: dict) -> str:
    c, s = meta["corpus"], meta["settings"]
    return (
        f"{meta['size']} run: GPT {s['layers']} layers x width {s['width']} "
        f"({meta['parameters']:,} parameters), context {s['context']}, batch {s['batch_size']}, "
        f"{s['steps']} steps, lr {s['learning_rate']}, clip {s['clip_norm']}\n"
        f"corpus: {c['source']} "
        f"({c['train_chars']:,} + {c['validation_chars']:,} chars, vocab {c['vocab_size']}); "
        f"jax {meta['jax']} on {meta['device']}"
    )


def _json_safe(x: Any) -> Any:
    """Non-finite floats as None (JSON has no NaN); tuples as lists."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(path: str | pathlib.Path, meta: dict, results: dict) -> None:
    payload = {"meta": meta, **results}
    pathlib.Path(path).write_text(json.dumps(_json_safe(payload), indent=1) + "\n")


def plot_curves(path: str | pathlib.Path, results: dict[str, dict], title: str) -> None:
    """Validation loss against step for every configuration, from the initial loss down
    (non-finite points left out; a run ending above the initial loss is marked off scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    curves = {name: [(s, v) for s, v in r["val_curve"] if math.isfinite(v)]
              for name, r in results.items()}  # fmt: skip
    top = max(c[0][1] for c in curves.values() if c) + 0.1  # the initial loss, the same for all
    low = min(v for c in curves.values() for _, v in c)
    for i, (name, curve) in enumerate(curves.items()):
        final = results[name]["val_loss"]
        note = " (diverged)" if not math.isfinite(final) else ""
        note = note or (f" (ends at {final:.3g}, off scale)" if final > top else "")
        ax.plot(*zip(*curve, strict=True), ["-", "--", "-.", ":"][i % 4], marker="o",
                markersize=3, lw=1.5, label=name + note)  # fmt: skip
    ax.set_ylim(low - 0.05, top)
    ax.set(xlabel="step", ylabel="validation loss (nats/char)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


CITATION = (
    "*Paper*: the experiment's number in Table 3 of P. Balança, S. Hosegood, C. Luschi and "
    'A. Fitzgibbon, "Scalify: scale propagation for efficient low-precision LLM training", '
    "WANT@ICML 2024 (arXiv:2407.17353), whose scale rules follow C. Blake, D. Orr and "
    'C. Luschi, "Unit Scaling: Out-of-the-Box Low-Precision Training" '
    "(arXiv:2303.11257). *FP8 (js.dot_formats)*: the unmodified model under "
    "`js.dot_formats`, not a configuration of the paper."
)

READING = """\
Every configuration starts from the same float32 initialisation and sees the same batches
and learning-rate schedule (gradients clipped to global norm 1, then Adam, linear warmup
from 0 over the first 10% of steps, then cosine decay to 10%). *Val loss*: mean
cross-entropy (nats per character) on fixed validation batches after the last step, computed
in the configuration's own precision; *vs FP32*: its relative difference from `fp32`'s;
*Train loss*: mean of the last 5% of training-batch losses; *NaN steps*: steps whose loss or
gradients were not finite (for `fp16_loss_scaling` these are the skipped steps); *ms/step*:
median wall time of a step on a shared machine; *State*: bytes of parameters and optimizer
state between steps (a ScaledArray counts its data and its scale), relative to `fp32`'s.
*Weight grads* is the format of the weight gradients the backward pass produces
(`js.nn.linear` computes FP8 products but returns the weight gradient in the weight's
compute dtype unless `wgrad_dtype` asks for FP8). *Matmul* FP8: the transformer blocks'
weight matmuls take E4M3 operands forward and an E5M2 output gradient backward, asked for
by the model (`js.nn.linear` with FP8 formats); the attention products and the output head
(logits) stay FP16. *FP8 (policy)*: the model is left as written (16-bit matmuls, no
LayerNorm rescaling) and `js.dot_formats` makes every contraction of its loss FP8 from
outside, `js.scalify(jax.value_and_grad(js.dot_formats(loss, exclude=[(width, vocab)])))`:
the weight matmuls and both attention products; the output head is excluded and stays FP16,
as FP8 recipes keep the output layer in 16 bits. *MXFP8*, *FP8 1x128 / 128x128*, *MXFP4 W,
MXFP8 A*: the blocks' weight matmuls on block-scaled operands (`js.nn.linear(block=...)`,
recipes `js.nn.MXFP8`, `js.nn.FP8_BLOCK128`, `js.nn.MXFP4_WEIGHTS`): every matmul, forward
and both gradients, quantizes its operands with one power-of-two scale per block along its
contracting axis (MX: 32 elements, E8M0 scales; block-128: 1x128 activation and gradient
tiles, 128x128 weight tiles), the transposed operands re-quantized from the 16-bit values;
E4M3 (E2M1 for the MXFP4 weights) forward, E5M2 gradients for the MX recipes, E4M3 for
block-128. Head and attention products stay FP16."""


def write_report(directory: str, meta: dict, results: dict, goals: Goals) -> None:
    """table3.md, table3.json and table3_loss.png in ``directory``."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "table3.json", meta, results)
    plot_curves(out / "table3_loss.png", results, "Table 3 on a character-level GPT")
    text = [
        "# Table 3 of the scalify paper on a small character-level GPT", "",
        "Produced by `experiments/table3.py` with:", "", f"    {meta['command']}", "",
        header(meta).replace("\n", "; ") + f"; total {meta['total_wall_s']:.0f} s.", "",
        markdown_table(results), "", CITATION, "", READING, "", "Goals:", "",
        *[f"- {line}" for line in goals.lines], "", "![validation loss](table3_loss.png)", "",
    ]  # fmt: skip
    (out / "table3.md").write_text("\n".join(text))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.table3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer steps (all configurations)")
    size.add_argument("--demo", action="store_true", help=f"tiny model, {DEMO_CONFIGS} only")
    parser.add_argument("--steps", type=int, help="train steps per configuration")
    parser.add_argument("--configs", help=f"comma-separated, from: {', '.join(PRECISIONS)}")
    parser.add_argument("--text", help="train on this text file instead of stdlib docstrings")
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--report", help="write table3.md, table3.json, table3_loss.png here")
    parser.add_argument(
        "--plot-scales", metavar="DIR",
        help="record one training step of each scalify configuration and write "
        "DIR/scales_<config>.png (js.diagnostics.plot); no training",
    )  # fmt: skip
    parser.add_argument("--scales-metric", choices=("rms", "max_abs"), default="rms",
                        help="the statistic --plot-scales charts")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none off a terminal anyway)"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 if a scalify goal is missed"
    )
    args = parser.parse_args(argv)
    default = DEMO_CONFIGS if args.demo else tuple(PRECISIONS)
    args.configs = [c.strip() for c in (args.configs or ",".join(default)).split(",") if c]
    unknown = sorted(set(args.configs) - PRECISIONS.keys())
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; known: {list(PRECISIONS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    size = "demo" if args.demo else "quick" if args.quick else "full"
    config = dataclasses.replace(SIZES[size], seed=args.seed)
    config = config if args.steps is None else dataclasses.replace(config, steps=args.steps)
    if args.text:
        corpus = corpus_lib.load_text(args.text)
    else:
        corpus = corpus_lib.load_stdlib_docstrings(config.corpus_chars)
    model = config.model_config(corpus.vocab_size)
    n_params = gpt.count_params(gpt.init_params(model, config.seed))
    command = "python -m experiments.table3 " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = metadata(size, config, corpus, n_params, command.strip())
    print(header(meta), flush=True)
    if args.plot_scales:
        plot_scales(args.configs, config, corpus, args.plot_scales, args.scales_metric)
        return 0
    start = time.perf_counter()
    results = run(args.configs, config, corpus, progress=not args.no_progress)
    meta["total_wall_s"] = round(time.perf_counter() - start, 1)
    goals = check_goals(results, quick=size != "full")
    print("\n" + markdown_table(results) + "\n\n" + CITATION + "\n\n" + "\n".join(goals.lines))
    if args.json:
        write_json(args.json, meta, results)
    if args.report:
        write_report(args.report, meta, results, goals)
    return int(args.check and not goals.scalify_ok)


if __name__ == "__main__":
    raise SystemExit(main())
