"""Where a compiled train step's HLO instructions go: the anatomy behind model_scale's counts.

    python benchmarks/hlo_anatomy.py                      # fp32 and fp16_scalify, 1 layer
    python benchmarks/hlo_anatomy.py --configs fp8_policy_scalify --layers 2 --lines 15
    python benchmarks/hlo_anatomy.py --configs fp16_raw,fp16_scalify --part grads
    python benchmarks/hlo_anatomy.py --configs fp16,fp16_scalify --part grads --per-layer

For each configuration of ``benchmarks/model_scale.py`` (the Table 3 GPT's train step, built
the same way), the optimised HLO module is split into:

* *tensor ops*: instructions with an array result (the data computation) in the kernels;
* *scalar ops in tensor kernels*: 0-d instructions inside a computation that also computes
  arrays: scale arithmetic XLA copied into a data kernel;
* *scalar-only computations*: 0-d instructions of computations with no array instruction:
  scale arithmetic compiled on its own, and the bodies of reductions;
* *entry*: the entry computation's own instructions (kernel calls, copies, tuples);
* *plumbing*: parameters and constants of every computation (what each kernel costs before
  it computes anything).

Then the most frequent scalar opcodes, and the user source lines (from the HLO's stack-frame
metadata) whose equations compiled to the most instructions. Equations scalify adds outside
any user equation (operand promotion, shared scales computed once, output scales) carry the
line that lowered the step, listed as ``(scalify's own)``; ``(none)`` is what has no
metadata (parameters, constants, kernel calls).

``--part`` compiles less than the step, to tell the model's share from the optimizer's:
``grads``, the loss's value and gradients only (forward and backward, in the
configuration's parameter storage); ``plain-optimizer``, those gradients turned into plain
float32 arrays and applied by the plain float32 optimizer of ``fp32``: the size a step
would have if the optimizer's update cost what a plain program's does.

``--per-layer`` compiles ``--layers`` and one layer more and reports the difference: what
one more layer costs, the part of the module that grows with depth (compile time follows
it), with each source line's most frequent opcodes (``:T`` an array result, ``:s`` a scalar
in a tensor kernel, ``:S`` a scalar-only computation, ``:E`` the entry computation).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import pathlib
import re
import sys
from collections.abc import Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import model_scale as ms  # noqa: E402
import optax  # noqa: E402
from compile_breakdown import hlo_computations  # noqa: E402

import jax_scaled as js  # noqa: E402

PARTS = ("step", "grads", "plain-optimizer")
KINDS = ("tensor ops", "scalar ops in tensor kernels", "scalar-only computations", "entry",
         "plumbing")  # fmt: skip
_RESULT = re.compile(r"= \(?(\w+)\[([^\]]*)\]\S* ([\w\-]+)\(")
_FRAME = re.compile(r"stack_frame_id=(\d+)")


@dataclasses.dataclass
class Anatomy:
    """Instruction counts of one HLO module by kind, scalar opcode and user source line."""

    computations: int = 0
    kinds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    scalar_opcodes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    line_opcodes: collections.defaultdict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )  # source line -> "opcode:where" -> instructions

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    @property
    def lines(self) -> collections.Counter:
        """Instructions by source line."""
        return collections.Counter({w: sum(c.values()) for w, c in self.line_opcodes.items()})

    def minus(self, other: Anatomy) -> Anatomy:
        """The counts of ``self`` less those of ``other`` (one module against a smaller one).

        Example:
            >>> big, small = Anatomy(computations=3), Anatomy(computations=1)
            >>> big.kinds["entry"], small.kinds["entry"] = 5, 2
            >>> (big.minus(small).computations, big.minus(small).kinds["entry"])
            (2, 3)
        """
        result = Anatomy(computations=self.computations - other.computations)
        for field in ("kinds", "scalar_opcodes"):
            counts = getattr(self, field).copy()
            counts.subtract(getattr(other, field))
            setattr(result, field, counts)
        for where in set(self.line_opcodes) | set(other.line_opcodes):
            counts = self.line_opcodes[where].copy()
            counts.subtract(other.line_opcodes[where])
            result.line_opcodes[where] = counts
        return result


def _source_lines(hlo_text: str) -> dict[int, str]:
    """``stack_frame_id -> "file:line"`` of the innermost frame, from the module's tables."""
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    section = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif not line.strip():
            section = None
        elif section:
            key, value = line.split(" ", 1)
            tables[section][int(key)] = value
    files = {k: v.strip('"').rsplit("/", 1)[-1] for k, v in tables["FileNames"].items()}
    locations = {}
    for key, value in tables["FileLocations"].items():
        fields = dict(re.findall(r"(\w+)=(\d+)", value))
        file = files[int(fields["file_name_id"])]
        own = file == pathlib.Path(__file__).name  # the line lowering the step
        locations[key] = "(scalify's own)" if own else f"{file}:{fields['line']}"
    return {
        key: locations[int(re.search(r"file_location_id=(\d+)", value).group(1))]
        for key, value in tables["StackFrames"].items()
    }


def anatomy(hlo_text: str) -> Anatomy:
    """The :class:`Anatomy` of an optimised HLO module's text.

    Example:
        >>> text = '''HloModule m
        ... %fused (p: f32[]) -> f32[4] {
        ...   %p = f32[] parameter(0)
        ...   %m = f32[] multiply(%p, %p)
        ...   ROOT %b = f32[4]{0} broadcast(%m), dimensions={}
        ... }
        ... '''
        >>> a = anatomy(text)
        >>> a.total, a.kinds["plumbing"], a.kinds["scalar ops in tensor kernels"], a.computations
        (3, 1, 1, 1)
    """
    frames = _source_lines(hlo_text)
    result = Anatomy()
    for (is_entry, _), lines in hlo_computations(hlo_text).items():
        result.computations += 1
        parsed = [(line, _RESULT.search(line)) for line in lines]
        has_tensor = any(m and m.group(2) and m.group(3) not in ("parameter", "constant")
                         for _, m in parsed)  # fmt: skip
        for line, match in parsed:
            opcode = match.group(3) if match else "tuple"
            tensor = bool(match and match.group(2))
            if is_entry:
                where_computed = "E"
            else:
                where_computed = "T" if tensor else ("s" if has_tensor else "S")
            if opcode in ("parameter", "constant"):
                kind = "plumbing"
            elif is_entry:
                kind = "entry"
            elif tensor:
                kind = "tensor ops"
            else:
                kind = "scalar ops in tensor kernels" if has_tensor else "scalar-only computations"
                result.scalar_opcodes[opcode] += 1
            result.kinds[kind] += 1
            frame = _FRAME.search(line)
            where = frames.get(int(frame.group(1)), "?") if frame else "(none)"
            result.line_opcodes[where][f"{opcode}:{where_computed}"] += 1
    return result


def report(
    name: str, layers: int | str, layout: str, found: Anatomy, lines: int, opcodes: int = 0
) -> list[str]:
    """Markdown lines describing ``found``; with ``opcodes``, that many of each listed source
    line's most frequent opcodes in a third column."""
    total = found.total
    out = [f"### {name}, {layers} layer(s), {layout}: {total:,} HLO instructions, "
           f"{found.computations} computations", "", "| kind | instructions | share |",
           "| --- | --- | --- |"]  # fmt: skip
    out += [f"| {k} | {found.kinds[k]:,} | {found.kinds[k] / total:.0%} |" for k in KINDS]
    scalar_opcodes = ", ".join(f"{op} {n:,}" for op, n in _nonzero(found.scalar_opcodes, 10))
    out += ["", f"Scalar opcodes: {scalar_opcodes}.", ""]
    if not opcodes:
        out += ["| source line | instructions |", "| --- | --- |"]
        out += [f"| {where} | {n:,} |" for where, n in _nonzero(found.lines, lines)]
        return out + [""]
    out += ["| source line | instructions | most frequent opcodes |", "| --- | --- | --- |"]
    for where, n in _nonzero(found.lines, lines):
        common = _nonzero(found.line_opcodes[where], opcodes)
        out.append(f"| {where} | {n:,} | {', '.join(f'{op} {k:,}' for op, k in common)} |")
    return out + [""]


def _nonzero(counts: collections.Counter, most: int) -> list[tuple[str, int]]:
    """The ``most`` largest of ``counts`` but its zeros (a difference of two modules has
    them, and negative counts where the larger module has fewer)."""
    return [(key, n) for key, n in counts.most_common() if n][:most]


def compiled_step_text(name: str, size, layout: str, params, batch) -> str:
    """The optimised HLO text of configuration ``name``'s train step (``model_scale.build``),
    lowered here, so that scalify's own equations carry this file's line."""
    runner = ms.build(name, size, layout, params)
    return runner.step.lower(*runner.state, *batch).compile().as_text()


def compiled_part_text(name: str, size, layout: str, params, batch, part: str) -> str:
    """The optimised HLO text of ``part`` (one of :data:`PARTS`, see the module notes) of
    configuration ``name``'s train step."""
    if part == "step":
        return compiled_step_text(name, size, layout, params, batch)
    precision = ms.PRECISIONS[name]
    model = ms.make_model(name, size.model_config(ms.VOCAB), layout)
    grads = jax.value_and_grad(ms.table3.make_loss(model, precision))
    grads = js.scalify(grads) if precision.scalify else grads
    grads = ms.guard_floor(grads) if name == ms.GUARD_FLOOR else grads
    stored = ms.build(name, size, layout, params).state[0]
    if part == "grads":
        return jax.jit(grads).lower(stored, *batch).compile().as_text()
    opt = ms.table3.make_optimizer(size, ms.PRECISIONS["fp32"])

    def step(stored, params, opt_state, inputs, targets):
        value, g = js.asarray(grads(stored, inputs, targets))
        g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (stored, params, opt.init(params), *batch)
    return jax.jit(step).lower(*args).compile().as_text()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="fp32,fp16_scalify")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--layout", default="unrolled", choices=("unrolled", "scan"))
    parser.add_argument("--lines", type=int, default=10, help="source lines to list")
    parser.add_argument(
        "--part", default="step", choices=PARTS, help="what to compile (see the module notes)"
    )
    parser.add_argument(
        "--per-layer", action="store_true", help="report what one layer more than --layers adds"
    )
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = sorted(set(args.configs) - set(ms.PRECISIONS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {sorted(ms.PRECISIONS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [dataclasses.replace(ms.SIZE, layers=args.layers + extra)
             for extra in ((0, 1) if args.per_layer else (0,))]  # fmt: skip
    params = [ms.init_params(size.model_config(ms.VOCAB), args.layout, 0) for size in sizes]
    batch = ms.batch_of(sizes[0])
    for name in args.configs:
        label = name if args.part == "step" else f"{name} ({args.part})"
        found = [
            anatomy(compiled_part_text(name, size, args.layout, p, batch, args.part))
            for size, p in zip(sizes, params, strict=True)
        ]
        if args.per_layer:
            layers = f"{args.layers + 1} minus {args.layers}"
            table = report(label, layers, args.layout, found[1].minus(found[0]), args.lines, 8)
        else:
            table = report(label, args.layers, args.layout, found[0], args.lines)
        print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
