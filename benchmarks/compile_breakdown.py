"""Where the first call of the MLP train step of ``overhead.py`` spends its time.

    python benchmarks/compile_breakdown.py                  # defaults: --reps 3
    python benchmarks/compile_breakdown.py --dtypes float16 --reps 5

For each dtype it times, fresh each repetition, the trace, the lowering and the XLA
compilation of three programs: the plain step (``jax.jit(step)``), the scalified step without
the range guard (``ScalifyConfig(guard=False)``) and the scalified step as users get it
(guard on). Beside the medians it counts the jaxpr equations, the HLO instructions of the
compiled program, and its kernels: the fusions, dots and custom calls of the entry
computation, each compiled separately by XLA, and how many of them compute a single scalar.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import overhead

import jax_scaled as js

VARIANTS = {
    "plain": None,
    "scalified, no guard": js.ScalifyConfig(guard=False),
    "scalified": js.ScalifyConfig(),
}
KERNEL = re.compile(r"= (\([^)]*\)|\S+) (fusion|dot|custom-call)\(")
COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")  # a computation's first line
ONE_ELEMENT = re.compile(r"\w+\[(1(,1)*)?\](\{[\d,]*\})?")  # f32[], f32[1]{0}


def kernel_counts(hlo_text: str) -> tuple[int, int]:
    """``(kernels, scalar kernels)`` of the entry computation of a compiled HLO module: a
    scalar kernel computes one element (a 0-d value, or a 1-element array such as a lookup's).

    Example:
        >>> entry = "ENTRY %a = f32[] fusion() %b = f32[1]{0} fusion() %c = f32[8]{0} fusion()"
        >>> kernel_counts(entry)
        (3, 2)
    """
    entry = hlo_text[hlo_text.index("ENTRY") :]
    shapes = [m.group(1) for m in KERNEL.finditer(entry)]
    return len(shapes), sum(1 for s in shapes if ONE_ELEMENT.fullmatch(s))


def hlo_computations(hlo_text: str) -> dict[tuple[bool, str], list[str]]:
    r"""The instruction lines of each computation of an HLO module's text, keyed by
    ``(is_entry, name)``.

    Example:
        >>> hlo_computations("ENTRY %main (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}")
        {(True, 'main'): ['  ROOT %x = f32[] parameter(0)']}
    """
    computations: dict[tuple[bool, str], list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = COMPUTATION.match(line)
        if header and " = " not in line.split("{")[0]:
            current = computations.setdefault((bool(header.group(1)), header.group(2)), [])
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            current.append(line)
    return computations


def distinct_kernels(hlo_text: str) -> int:
    """How many of the entry computation's fusions differ as computations: XLA:CPU compiles
    one kernel for all fusions of one computation (equal up to the names of instructions and
    of the computations they call), so this, not the kernel count, is what code generation
    pays for.

    Example:
        >>> text = '''%f1 (p: f32[8]) -> f32[8] {
        ...   %p = f32[8]{0} parameter(0)
        ...   ROOT %n = f32[8]{0} negate(%p)
        ... }
        ... %f2 (q: f32[8]) -> f32[8] {
        ...   %q = f32[8]{0} parameter(0)
        ...   ROOT %m = f32[8]{0} negate(%q)
        ... }
        ... ENTRY %main (x: f32[8]) -> f32[8] {
        ...   %x = f32[8]{0} parameter(0)
        ...   %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%f1
        ...   ROOT %b = f32[8]{0} fusion(%a), kind=kLoop, calls=%f2
        ... }'''
        >>> distinct_kernels(text)
        1
    """
    bodies = {
        "ENTRY" if is_entry else name: [_bare(line) for line in lines]
        for (is_entry, name), lines in hlo_computations(hlo_text).items()
    }
    forms = {_canonical(bodies, line.split(" = ", 1)[1], {}) for line in bodies.get("ENTRY", [])
             if re.search(r" fusion\(", line)}  # fmt: skip
    return len(forms)


def _bare(line: str) -> str:
    """An instruction line without its metadata, indentation and ``ROOT`` marker."""
    return line.split(", metadata=")[0].strip().removeprefix("ROOT ")


def _canonical(bodies: dict[str, list[str]], text: str, names: dict[str, str]) -> str:
    """``text`` with instruction names numbered in order and each called computation's
    instructions in its place."""

    def name(match: re.Match) -> str:
        callee = match.group(1)
        if callee in bodies and callee not in names:
            names[callee] = f"%{len(names)}"
            inner = {}
            return "{" + ";".join(_canonical(bodies, line, inner) for line in bodies[callee]) + "}"
        return names.setdefault(callee, f"%{len(names)}")

    return re.sub(r"%([\w.\-]+)", name, text)


def measure(dtype, variant: str) -> dict[str, float]:
    """Seconds to trace, lower and compile one fresh step; sizes of what each produced."""
    step, _ = overhead.make_step()
    config = VARIANTS[variant]
    fn = step if config is None else js.scalify(step, config=config)
    args = overhead.make_inputs(dtype, scaled=config is not None)
    start = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    text = compiled.as_text()
    kernels, scalar_kernels = kernel_counts(text)
    return {
        "trace": traced_at - start,
        "lower": lowered_at - traced_at,
        "compile": compiled_at - lowered_at,
        "eqns": len(traced.jaxpr.jaxpr.eqns),
        "hlo": sum(1 for line in text.splitlines() if " = " in line),
        "kernels": kernels,
        "scalar": scalar_kernels,
    }


def run(dtypes: Sequence[str], reps: int) -> list[tuple[str, str, dict]]:
    measure(jnp.dtype(dtypes[0]), "plain")  # warm JAX's own caches once, untimed
    rows = []
    for dtype in dtypes:
        samples = {v: [measure(jnp.dtype(dtype), v) for _ in range(reps)] for v in VARIANTS}
        for variant, runs in samples.items():
            medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((dtype, variant, medians))
    return rows


def format_table(rows: list[tuple[str, str, dict]]) -> str:
    header = ("dtype", "program", "trace s", "lower s", "compile s", "jaxpr eqns", "HLO instrs",
              "kernels", "scalar kernels")  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for dtype, variant, m in rows:
        times = [f"{m[k]:.3f}" for k in ("trace", "lower", "compile")]
        counts = [f"{m[k]:.0f}" for k in ("eqns", "hlo", "kernels", "scalar")]
        cells = (dtype, variant, *times, *counts)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="fresh programs per variant")
    parser.add_argument("--dtypes", default="float32,float16", help="comma-separated dtypes")
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    print(format_table(run(dtypes, args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
