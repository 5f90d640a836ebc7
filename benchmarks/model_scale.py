"""Program size, build time and step time of the Table 3 GPT's train step as it grows.

    python benchmarks/model_scale.py                                   # everything: long
    python benchmarks/model_scale.py --layers 1 --reps 2 --builds 1   # one layer, quick
    python benchmarks/model_scale.py --layers 1,2 --layouts scan --configs fp32,fp8_scalify
    python benchmarks/model_scale.py --out docs/results/model_scale.md

One train step (loss, gradients, Adam update) of the GPT of ``experiments/gpt.py`` at
``experiments/table3.py``'s full size (width 128, 4 heads, batch 16 x context 128, vocabulary
96 as in ``benchmarks/table3_compile.py``), for each number of layers (``--layers``), layout
and configuration. Layouts:

* ``unrolled``: the model as written, one ``Block`` per layer in a Python loop;
* ``scan``: the same blocks under ``flax.linen.scan`` (``GPTConfig.scan_layers``), their parameters
  stacked on a leading axis, so the program holds one block whatever the depth.

Configurations (``--configs``): ``fp32`` and the scalify ones (``fp16_scalify``,
``fp8_scalify``, ``fp8_policy_scalify``, ``mxfp8_scalify``, any of ``table3.PRECISIONS``) are
built as ``experiments/table3.py`` builds them; ``bf16`` and ``fp16`` are plain bfloat16 and
float16 compute on float32 master weights and Adam state (``fp16`` is ``fp16_scalify``'s data
types without scale propagation: no loss scaling, so it does not train; its program is the
reference of size and speed); ``fp8_policy_f32_storage_scalify`` is ``fp8_policy_scalify``
with float32 master weights and Adam state, qwix's storage, where ``fp8_policy_scalify``
keeps both in float16; ``fp16_guard_floor`` is the ``fp16`` step with only the range guard's
work added (``benchmarks/guard_floor.py``: what no scalified float16 step compiles below);
``qwix_fp8`` is the same bf16 step with the unmodified model
handed to qwix's quantized training (``qwix.quantize_model(model, qwix.QtProvider([rule]))``,
rule :func:`qwix_rule`: the blocks' weight matmuls ``qkv``, ``proj`` and ``fc`` take E4M3
operands forward and an E5M2 output gradient backward; attention products and the output head
stay bf16, as in ``fp8_scalify``), ``qwix_fp8_all_dots`` the same with the attention products
in FP8 too (every dot but the head's, as ``fp8_policy_scalify`` and the issue's qwix row: 18
of 21 FP8 dots at one layer), and ``qwix_mxfp8`` the same with qwix's MXFP8 blocks of 32
(the peer of ``mxfp8_scalify``). The qwix rows are skipped, with a message, without qwix
(``pip install -e '.[bench]'``).

Columns:

* *jaxpr eqns*: equations of the traced step's jaxpr, sub-jaxprs included (a ``scan`` or
  ``pjit`` body counted once where it appears, not once per iteration);
* *HLO instrs*: instructions of the compiled (optimised) HLO module, all computations;
* *kernels*: the fusions, dots and custom calls of its entry computation, each compiled on
  its own by XLA (``compile_breakdown.kernel_counts``);
* *distinct*: those fusions that differ as computations (``compile_breakdown.
  distinct_kernels``: equal up to names): XLA:CPU compiles one kernel for all fusions of one
  computation, so its code generation time follows this count (its own count, logged by
  ``TF_CPP_VMODULE=fusion_compiler=1``, was 13% to 17% lower on the 4-layer steps measured:
  its equality is looser than this one);
* *temp MiB*: the compiled step's temporary buffers (``compiled.memory_analysis()``), the
  activations kept for the backward pass among them; parameters, optimizer state and
  outputs are the same in every configuration of one set of data types, and left out;
* *trace / lower / compile s*: ``jax.jit(step).trace(...)``, ``.lower()``, ``.compile()``,
  fresh (a new ``jax.jit``, nothing of it cached), each the median of ``--builds`` builds; the
  rows of a group are built in turn, ``--builds`` rounds, like the steps (one compile on a
  2-core machine varies by up to 25% from run to run);
* *step ms*: median wall time of one step (blocked); after one untimed call, the rows of a
  (layers, layout) group run one step each in turn, ``--reps`` rounds, so machine noise falls
  on all of them alike;
* *FP8 dots*: ``stablehlo.dot_general`` and ``stablehlo.convolution`` ops of the lowered
  StableHLO text with an 8-bit float operand (forward and backward; a ``scan`` body counted
  once). On CPU, XLA later computes them in wider types; the count is what each method asks of
  the compiler;
* *vs fp32*: (trace + lower + compile) and step time over ``fp32``'s, same layers and layout;
* *vs qwix*: HLO instructions, build and step time and temporary memory over those of the
  configuration's qwix peer (:func:`qwix_peer`), for the scalify FP8 configurations: the
  qwix row with the same FP8 dots when it is in the group (``qwix_mxfp8`` for the
  block-scaled recipes, ``qwix_fp8_all_dots`` for ``fp8_policy_scalify``), ``qwix_fp8``
  otherwise;
* *vs plain of its types*: HLO instructions, build and step time and temporary memory of a
  scalify configuration over those of the plain program with its data types
  (:func:`plain_twin`: the same compute, master-weight and Adam-state dtypes, no scale
  propagation, no FP8) when that program is in the group: ``fp16`` for ``fp16_scalify``,
  ``fp16_guard_floor`` and
  ``fp8_policy_f32_storage_scalify``.

Rows print as each (layers, layout) group finishes; ``--out`` also (re)writes the markdown
table to a file after each group.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Jaxpr, jaxprs_in_params

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from compile_breakdown import distinct_kernels, kernel_counts  # noqa: E402
from guard_floor import guard_floor  # noqa: E402

import jax_scaled as js  # noqa: E402
from experiments import gpt, table3  # noqa: E402

BF16 = jnp.dtype(jnp.bfloat16)
QWIX = "qwix_fp8"
QWIX_ALL = "qwix_fp8_all_dots"
QWIX_MX = "qwix_mxfp8"
QWIX_PEERS = (QWIX, QWIX_ALL, QWIX_MX)
VOCAB = 96  # benchmarks/table3_compile.py's
SIZE = table3.SIZES["full"]  # width 128, heads 4, batch 16 x context 128
POLICY_F32_STORAGE = "fp8_policy_f32_storage_scalify"
GUARD_FLOOR = "fp16_guard_floor"  # the fp16 step with only the range guard's work added
PRECISIONS: dict[str, table3.Precision] = {
    **table3.PRECISIONS,
    "bf16": table3.Precision("bf16", "", compute_dtype=BF16),
    "fp16": table3.Precision("fp16", "", compute_dtype=table3.F16),
    GUARD_FLOOR: table3.Precision(GUARD_FLOOR, "", compute_dtype=table3.F16),
    QWIX: table3.Precision(QWIX, "", compute_dtype=BF16),
    QWIX_ALL: table3.Precision(QWIX_ALL, "", compute_dtype=BF16),
    QWIX_MX: table3.Precision(QWIX_MX, "", compute_dtype=BF16),
    POLICY_F32_STORAGE: dataclasses.replace(
        table3.PRECISIONS["fp8_policy_scalify"], name=POLICY_F32_STORAGE,
        master_dtype=table3.F32, state_dtype=table3.F32),
}  # fmt: skip
DEFAULT_CONFIGS = ("fp32", "bf16", "fp16", QWIX, QWIX_ALL, QWIX_MX, "fp16_scalify",
                   "fp8_scalify", "fp8_policy_scalify", POLICY_F32_STORAGE,
                   "mxfp8_scalify")  # fmt: skip
LAYOUTS = ("unrolled", "scan")
QWIX_RULE_PATH = r"(.*/)?(qkv|proj|fc)"  # the blocks' Dense modules, unrolled or scanned
QWIX_FP8_PATHS = {QWIX: QWIX_RULE_PATH, QWIX_ALL: r"(.*/)?(qkv|proj|fc|attn)"}  # + attention
FP8_DOT = re.compile(r"stablehlo\.(?:dot_general|convolution)\b.*: \(([^)]*)\) ->")
HEADER = ("layers", "layout", "config", "jaxpr eqns", "HLO instrs", "kernels", "distinct",
          "temp MiB", "trace s", "lower s", "compile s", "step ms", "FP8 dots",
          "vs fp32 (build, step)", "vs qwix (HLO, build, step, temp)",
          "vs plain of its types (HLO, build, step, temp)")  # fmt: skip


@dataclasses.dataclass
class Row:
    """One configuration's measurements (``step_s`` filled by :func:`time_steps`)."""

    layers: int
    layout: str
    config: str
    eqns: int = 0
    hlo: int = 0
    trace: float = 0.0
    lower: float = 0.0
    compile: float = 0.0
    fp8_dots: int = 0
    step_s: float = float("nan")
    error: str = ""
    kernels: int = 0  # the compiled step's entry kernels (compile_breakdown.kernel_counts)
    distinct: int = 0  # of which distinct computations (compile_breakdown.distinct_kernels)
    temp_mib: float = float("nan")  # the compiled step's temporary buffers (memory_analysis)

    @property
    def build(self) -> float:
        """Trace + lower + compile seconds."""
        return self.trace + self.lower + self.compile


def qwix_missing() -> str | None:
    """Why the qwix rows cannot run (qwix not importable), or ``None``."""
    try:
        import qwix  # noqa: F401
    except ImportError as e:
        rows = ", ".join(QWIX_PEERS)
        return f"{rows}: skipped, qwix is not installed ({e}); pip install -e '.[bench]'"
    return None


def qwix_rule(name: str) -> Any:
    """The qwix quantized-training rule of ``name``: the blocks' Dense modules (and, for
    ``qwix_fp8_all_dots``, the attention products).

    ``qwix_fp8``: per-tensor E4M3 forward, E5M2 output gradient backward.
    ``qwix_fp8_all_dots``: the same for the attention products too (qwix intercepts the
    einsums that ``js.nn.dot_product_attention`` calls inside the ``attn`` module): every
    ``dot_general`` but the output head's, as ``fp8_policy_scalify``. ``qwix_mxfp8``:
    qwix's ``"mxfp8"`` (E4M3 elements, a power-of-two scale per 32 along the contracting
    axis) for both operands of all three matmuls, forward and backward. qwix has no MX
    E5M2, so its gradients are E4M3 where ``mxfp8_scalify``'s are E5M2, and by default its
    backward pass reads the unquantized forward operands (blocks along the forward
    contracting axis do not serve the backward's): the residuals are quantized again along
    the backward's axes, and the input gradient's output-gradient operand is tiled too, as
    ``js.nn.block_linear`` does.
    """
    import qwix

    if name in QWIX_FP8_PATHS:
        return qwix.QtRule(module_path=QWIX_FP8_PATHS[name], weight_qtype=gpt.E4M3,
                           act_qtype=gpt.E4M3, bwd_qtype=gpt.E5M2)  # fmt: skip
    mx = "mxfp8"
    backward = dict(dlhs_tile_size=32, dlhs_residual_qtype=mx, drhs_residual_qtype=mx)
    return qwix.QtRule(module_path=QWIX_RULE_PATH, weight_qtype=mx, act_qtype=mx,
                       bwd_qtype=mx, tile_size=32, bwd_weight_grad_tile_size=32,
                       additional_qt_config=backward)  # fmt: skip


def qwix_model(model: nn.Module, name: str = QWIX) -> nn.Module:
    """``model`` under qwix quantized training with :func:`qwix_rule` of ``name``."""
    import qwix

    return qwix.quantize_model(model, qwix.QtProvider([qwix_rule(name)]))


def _laid_out(config: gpt.GPTConfig, layout: str) -> gpt.GPTConfig:
    return dataclasses.replace(config, scan_layers=layout == "scan")


def make_model(name: str, config: gpt.GPTConfig, layout: str) -> nn.Module:
    """The flax model of configuration ``name`` in ``layout`` (qwix-wrapped for the qwix rows)."""
    model = gpt.GPT(_laid_out(config, layout), PRECISIONS[name].numerics)
    return qwix_model(model, name) if name in QWIX_PEERS else model


def init_params(config: gpt.GPTConfig, layout: str, seed: int) -> Any:
    """Float32 parameters of the plain model in ``layout``."""
    model = gpt.GPT(_laid_out(config, layout))
    tokens = jnp.zeros((1, config.context), jnp.int32)
    return jax.jit(model.init)(jax.random.key(seed), tokens)["params"]  # jit: one compile


def build(name: str, size: table3.TrainConfig, layout: str, params: Any) -> table3.Runner:
    """``name``'s jitted step and initial state, as ``table3.build`` makes them."""
    precision = PRECISIONS[name]
    model = make_model(name, size.model_config(VOCAB), layout)
    loss, opt = table3.make_loss(model, precision), table3.make_optimizer(size, precision)
    if precision.loss_scaling:
        step = table3.make_loss_scaled_step(loss, opt, size.loss_scale_period)
    else:
        step = table3.make_step(loss, opt, precision)
    if name == GUARD_FLOOR:
        step = guard_floor(step)
    step = jax.jit(js.scalify(step) if precision.scalify else step)
    state = table3.initial_state(params, opt, precision, size)
    return table3.Runner(precision, state, step, loss)


def all_jaxprs(jaxpr: Jaxpr) -> Iterator[Jaxpr]:
    """``jaxpr`` and its sub-jaxprs at every depth (each occurrence once)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in jaxprs_in_params(eqn.params):
            yield from all_jaxprs(sub)


def count_eqns(jaxpr: Jaxpr) -> int:
    """Equations of ``jaxpr``, sub-jaxprs included."""
    return sum(len(j.eqns) for j in all_jaxprs(jaxpr))


def hlo_instructions(hlo_text: str) -> int:
    """Instructions of an HLO module's text (as ``benchmarks/compile_breakdown.py`` counts)."""
    return sum(1 for line in hlo_text.splitlines() if " = " in line)


def fp8_dots(stablehlo_text: str) -> int:
    """``dot_general`` / ``convolution`` ops of a StableHLO module with an f8 operand.

    Example:
        >>> fp8_dots("%2 = stablehlo.dot_general %0, %1 : (tensor<4xf8E4M3FN>, "
        ...          "tensor<4xbf16>) -> tensor<bf16>")
        1
    """
    return sum("f8" in m.group(1) for m in FP8_DOT.finditer(stablehlo_text))


def measure(row: Row, runner: table3.Runner, batch: tuple[np.ndarray, np.ndarray]) -> Callable:
    """Trace, lower and compile ``runner``'s step fresh, filling ``row``; the executable."""
    start = time.perf_counter()
    traced = runner.step.trace(*runner.state, *batch)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    row.trace, row.lower = traced_at - start, lowered_at - traced_at
    row.compile = time.perf_counter() - lowered_at
    row.eqns = count_eqns(traced.jaxpr.jaxpr)
    hlo_text = compiled.as_text()
    row.hlo, row.kernels = hlo_instructions(hlo_text), kernel_counts(hlo_text)[0]
    row.distinct = distinct_kernels(hlo_text)
    row.temp_mib = temporary_mib(compiled)
    row.fp8_dots = fp8_dots(lowered.as_text())
    return compiled


def temporary_mib(compiled: Any) -> float:
    """MiB of ``compiled``'s temporary buffers, or NaN where the backend does not tell.

    Example:
        >>> compiled = jax.jit(lambda x: (x * 2.0).sum()).lower(np.ones(4, np.float32)).compile()
        >>> temporary_mib(compiled) >= 0
        True
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return float("nan")
    return analysis.temp_size_in_bytes / 2**20


def batch_of(size: table3.TrainConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Fixed random ``(inputs, targets)`` token ids, ``[batch, context]`` each."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (size.batch_size, size.context + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def prepare(
    name: str, size: table3.TrainConfig, layout: str, params: Any, batch: tuple
) -> tuple[Row, Callable | None, tuple]:
    """``name``'s row (counts and build times) and its compiled step with its arguments;
    ``None`` for the step when it failed (``row.error`` says why)."""
    row = Row(size.layers, layout, name)
    try:
        runner = build(name, size, layout, params)
        compiled = measure(row, runner, batch)
        args = (*runner.state, *batch)
        jax.block_until_ready(compiled(*args))  # untimed first run
        return row, compiled, args
    except Exception as e:  # a configuration that fails still leaves its row
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row, None, ()


def time_steps(steps: Sequence[tuple[Row, Callable | None, tuple]], reps: int) -> None:
    """``reps`` rounds of one step of each compiled program in turn; medians into the rows."""
    times: dict[int, list[float]] = {i: [] for i, (_, step, _) in enumerate(steps) if step}
    for _ in range(reps):
        for i in times:
            _, step, args = steps[i]
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[i].append(time.perf_counter() - start)
    for i, samples in times.items():
        steps[i][0].step_s = statistics.median(samples)


def run_group(
    names: Sequence[str],
    size: table3.TrainConfig,
    layout: str,
    reps: int,
    builds: int = 1,
    seed: int = 0,
) -> list[Row]:
    """Every configuration of ``names`` at ``size.layers`` layers in ``layout``: built
    ``builds`` times in turn (median times, :func:`median_builds`), the last builds timed."""
    params, batch = init_params(size.model_config(VOCAB), layout, seed), batch_of(size, seed)
    samples: dict[str, list[Row]] = {name: [] for name in names}
    for _ in range(builds):
        steps = []  # only the last round's executables are kept
        for name in names:
            steps.append(prepare(name, size, layout, params, batch))
            row = steps[-1][0]
            samples[name].append(row)
            print(f"  built {size.layers} x {layout} {name}: {row.build:.1f} s {row.error}",
                  file=sys.stderr, flush=True)  # fmt: skip
    for row, _, _ in steps:
        median_builds(row, samples[row.config])
    time_steps(steps, reps)
    return [row for row, _, _ in steps]


def median_builds(row: Row, samples: Sequence[Row]) -> None:
    """``row``'s trace, lower and compile seconds: the medians of ``samples`` (its builds);
    the first error of any build is ``row``'s.

    Example:
        >>> rows = [Row(1, "scan", "fp32", compile=c) for c in (3.0, 1.0, 2.0)]
        >>> median_builds(rows[0], rows); rows[0].compile
        2.0
    """
    if errors := [r.error for r in samples if r.error]:
        row.error = errors[0]
        return
    for phase in ("trace", "lower", "compile"):
        setattr(row, phase, statistics.median(getattr(r, phase) for r in samples))


def ratio(row: Row, ref: Row | None) -> str:
    """``build, step`` of ``row`` over ``ref``'s, or ``-``."""
    if ref is None or row is ref or row.error or ref.error:
        return "-"
    return f"{row.build / ref.build:.2f}x, {row.step_s / ref.step_s:.2f}x"


def plain_twin(name: str, names: Sequence[str]) -> str | None:
    """The configuration of ``names`` that computes and stores in the data types of the
    scalified ``name`` (compute, master weights, Adam state) with no scale propagation, no
    FP8 and no loss scaling: ``fp16`` for ``fp16_scalify`` and for the guard's floor
    (``fp16_guard_floor``); None when there is none.

    Example:
        >>> plain_twin("fp16_scalify", ["fp32", "fp16_guard_floor", "fp16_raw", "fp16"])
        'fp16'
        >>> plain_twin("fp16_guard_floor", ["fp16"])
        'fp16'
        >>> plain_twin("fp8_policy_scalify", ["fp32", "fp16"]) is None  # float16 storage
        True
    """
    precision = PRECISIONS[name]
    if not (precision.scalify or name == GUARD_FLOOR):
        return None
    types = (precision.compute_dtype, precision.master_dtype, precision.state_dtype)
    for other in names:
        p = PRECISIONS[other]
        plain = not (p.scalify or p.fp8 or p.loss_scaling or other in (*QWIX_PEERS, GUARD_FLOOR))
        if plain and (p.compute_dtype, p.master_dtype, p.state_dtype) == types:
            return other
    return None


def plain_ratio(row: Row, ref: Row | None) -> str:
    """``HLO, build, step, temp`` of ``row`` over ``ref``'s (its plain twin, its qwix
    peer), or ``-``; the temporary memory ``-`` where a backend does not tell it.

    Example:
        >>> row, ref = Row(1, "scan", "fp16_scalify", hlo=30), Row(1, "scan", "fp16", hlo=20)
        >>> row.compile = row.step_s = row.temp_mib = 3.0
        >>> ref.compile = ref.step_s = ref.temp_mib = 2.0
        >>> plain_ratio(row, ref)
        '1.50x, 1.50x, 1.50x, 1.50x'
    """
    if ref is None or row.error or ref.error:
        return "-"
    temp = row.temp_mib / ref.temp_mib if ref.temp_mib > 0 else float("nan")
    temp_cell = f"{temp:.2f}x" if math.isfinite(temp) else "-"
    return f"{row.hlo / ref.hlo:.2f}x, " + ratio(row, ref) + ", " + temp_cell


def qwix_peer(name: str, by_name: dict[str, Row]) -> Row | None:
    """The qwix row a scalify FP8 configuration is compared with, the one doing the same FP8
    work when the group has it: ``qwix_mxfp8`` for a block-scaled recipe,
    ``qwix_fp8_all_dots`` for a ``fp8_policy`` one (every dot but the head's), ``qwix_fp8``
    (the blocks' Dense modules) otherwise and as the fallback.

    Example:
        >>> rows = {n: Row(1, "scan", n) for n in (QWIX, QWIX_ALL, QWIX_MX)}
        >>> [qwix_peer(n, rows).config for n in ("mxfp8_scalify", "fp8_policy_scalify",
        ...                                      "fp8_scalify")]
        ['qwix_mxfp8', 'qwix_fp8_all_dots', 'qwix_fp8']
    """
    precision = PRECISIONS[name]
    if precision.block is not None and QWIX_MX in by_name:
        return by_name[QWIX_MX]
    if precision.fp8_policy and QWIX_ALL in by_name:
        return by_name[QWIX_ALL]
    return by_name.get(QWIX)


def table_lines(rows: Sequence[Row], header: bool = True) -> list[str]:
    """Markdown rows for ``rows`` (one layers x layout group), with ratio columns."""
    by_name = {r.config: r for r in rows}
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)] if header else []
    for r in rows:
        if r.error:
            cells = [str(r.layers), r.layout, f"`{r.config}`", f"failed: {r.error}"]
            lines.append("| " + " | ".join(cells + [""] * (len(HEADER) - 4)) + " |")
            continue
        fp8_scalify = PRECISIONS[r.config].scalify and PRECISIONS[r.config].fp8
        cells = [str(r.layers), r.layout, f"`{r.config}`", str(r.eqns), str(r.hlo),
                 str(r.kernels), str(r.distinct),
                 f"{r.temp_mib:.1f}" if math.isfinite(r.temp_mib) else "-", f"{r.trace:.2f}",
                 f"{r.lower:.2f}", f"{r.compile:.2f}", f"{1e3 * r.step_s:.1f}", str(r.fp8_dots),
                 ratio(r, by_name.get("fp32")),
                 plain_ratio(r, qwix_peer(r.config, by_name)) if fp8_scalify else "-",
                 plain_ratio(r, by_name.get(plain_twin(r.config, list(by_name))))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def warm_up() -> None:
    """Build and run a tiny ``fp32`` step once, untimed, so the first row pays no JAX
    start-up cost."""
    tiny = dataclasses.replace(SIZE, width=16, heads=2, context=8, batch_size=2, layers=1)
    params = init_params(tiny.model_config(VOCAB), "unrolled", 0)
    prepare("fp32", tiny, "unrolled", params, batch_of(tiny))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; ``--configs`` checked against :data:`PRECISIONS`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2,4,8", help="comma-separated layer counts")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from: {', '.join(PRECISIONS)}")  # fmt: skip
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="unrolled and/or scan")
    parser.add_argument("--reps", type=int, default=10, help="timed rounds of steps")
    parser.add_argument("--builds", type=int, default=3, help="builds of each row (median)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    args.layers = [int(n) for n in args.layers.split(",") if n.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.layouts = [c.strip() for c in args.layouts.split(",") if c.strip()]
    if unknown := sorted(set(args.configs) - PRECISIONS.keys()):
        parser.error(f"unknown configuration(s) {unknown}; known: {list(PRECISIONS)}")
    if unknown := sorted(set(args.layouts) - set(LAYOUTS)):
        parser.error(f"unknown layout(s) {unknown}; known: {list(LAYOUTS)}")
    if args.builds < 1 or args.reps < 1:
        parser.error(f"--builds and --reps must be at least 1, not {args.builds}, {args.reps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if set(QWIX_PEERS) & set(args.configs) and (message := qwix_missing()):
        print(message, flush=True)
        args.configs = [c for c in args.configs if c not in QWIX_PEERS]
    command = "python benchmarks/model_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = f"jax {jax.__version__} on {jax.devices()[0].device_kind}"
    sizes = f"width {SIZE.width}, batch {SIZE.batch_size} x context {SIZE.context}"
    intro = [f"`{command.strip()}`", "", f"{device}, {sizes}", ""]
    warm_up()
    lines = table_lines([])
    print("\n".join(intro + lines), flush=True)
    for layers in args.layers:
        size = dataclasses.replace(SIZE, layers=layers)
        for layout in args.layouts:
            rows = run_group(args.configs, size, layout, args.reps, args.builds)
            group = table_lines(rows, header=False)
            print("\n".join(group), flush=True)
            lines += group
            if args.out:
                pathlib.Path(args.out).write_text("\n".join(intro + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
