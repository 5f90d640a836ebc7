"""Operator coverage: how scalify handles every primitive of the installed JAX.

Generates ``docs/operators.md`` from the primitive records of the registry (rules,
higher-order rules and properties), so the document never drifts from the code::

    python -m jax_scaled.coverage            # rewrite docs/operators.md
    python -m jax_scaled.coverage --check    # exit 1 if docs/operators.md is out of date

Each primitive gets the status the interpreter would apply to it, in the interpreter's order:
``interpreted`` (a higher-order rule recurses into its sub-jaxprs), ``rule`` (a scale rule),
``forwarded`` (its operands are never floating point, so never scaled: it runs untouched) or
``not supported`` (it can carry floating-point data but has no rule: scalify raises
NotImplementedError when it meets a ScaledArray input).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

from jax_scaled import _jax_internals as jxi
from jax_scaled.engine.registry import (
    Property,
    higher_order_primitives,
    record,
    records,
    registered_primitives,
)

INTERPRETED = "interpreted"
RULE = "rule"
FORWARDED = "forwarded: never carries floating-point data"
NOT_SUPPORTED = "not supported"
STATUSES = (RULE, INTERPRETED, FORWARDED, NOT_SUPPORTED)

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "operators.md"
REGENERATE = "python -m jax_scaled.coverage"

_INTEGER_ONLY = "integer or boolean operands only"
_KEYS_ONLY = "PRNG keys or their uint32 key data only"
_NO_OPERANDS = "no operands"

# Reviewed classification of the primitives whose operands can never be floating point.
# A ScaledArray always holds floating-point data (array.py refuses anything else), so these
# primitives never see a scaled input: the interpreter binds them untouched. Only list a
# primitive here after checking its dtype rule in jax/_src (a primitive that accepts a float
# operand, even optionally, belongs in the registry instead). Reviewed for JAX 0.10.2;
# tests/test_coverage_doc.py checks the entries still exist and spot-checks dtype rules.
NEVER_FLOAT_OPERANDS: dict[str, str] = {
    # Bitwise and integer arithmetic (lax.bitwise_*, shifts, population_count, clz, mulhi).
    "and": _INTEGER_ONLY,
    "or": _INTEGER_ONLY,
    "not": _INTEGER_ONLY,
    "xor": _INTEGER_ONLY,
    "shift_left": _INTEGER_ONLY,
    "shift_right_arithmetic": _INTEGER_ONLY,
    "shift_right_logical": _INTEGER_ONLY,
    "population_count": _INTEGER_ONLY,
    "clz": _INTEGER_ONLY,
    "mulhi": _INTEGER_ONLY,
    # Reductions of booleans and integers (jnp.all, jnp.any, ...).
    "reduce_and": _INTEGER_ONLY,
    "reduce_or": _INTEGER_ONLY,
    "reduce_xor": _INTEGER_ONLY,
    # Integer permutations built from LU pivots.
    "lu_pivots_to_permutation": "int32 pivots only",
    # Complex-only parts: a float operand is a dtype error (complex data is never scaled).
    "real": "complex operands only",
    "imag": "complex operands only",
    # Pseudo-random number generation: keys in, keys or integer bits out. (random_gamma and
    # rng_uniform take float operands and are not listed.)
    "random_bits": _KEYS_ONLY,
    "random_seed": "integer seed only",
    "random_split": _KEYS_ONLY,
    "random_fold_in": _KEYS_ONLY,
    "random_wrap": _KEYS_ONLY,
    "random_unwrap": _KEYS_ONLY,
    "random_clone": _KEYS_ONLY,
    "threefry2x32": "uint32 counters and keys only",
    "threefry4x32": "uint32 counters and keys only",
    "philox2x32": "uint32 counters and keys only",
    "philox4x32": "uint32 counters and keys only",
    "iota_2x32_shape": _NO_OPERANDS,
    "rng_bit_generator": "uint32 key only",
    # No operands at all: nothing to scale (iota may produce floats; they start unscaled).
    "iota": _NO_OPERANDS,
    "axis_index": _NO_OPERANDS,
    "platform_index": _NO_OPERANDS,
    "empty": _NO_OPERANDS,
    "empty2": _NO_OPERANDS,
    # Ordering tokens of side effects.
    "create_token": _NO_OPERANDS,
    "after_all": "tokens only",
}


@dataclasses.dataclass(frozen=True)
class PrimitiveCoverage:
    """How scalify handles one primitive: its status, the module or reason behind it, and the
    properties of its record (:class:`~jax_scaled.engine.registry.Property`)."""

    name: str
    status: str
    detail: str
    properties: str = ""
    blocks: str = ""


def block_behaviour(primitive: jxi.Primitive) -> str:
    """What ``primitive``'s rule does with block-scaled operands
    (:mod:`jax_scaled.engine.block_dispatch`).

    Example:
        >>> from jax import lax
        >>> block_behaviour(lax.mul_p), block_behaviour(lax.dot_general_p)
        ('keeps (per block)', 'consumes')
    """
    found = record(primitive)
    if found.rule is None and found.higher_order is None:
        return ""
    if found.block_behaviour is not None:
        return found.block_behaviour
    if found.has(Property.POINTWISE):
        return "keeps (per block)"
    if found.higher_order is not None and found.has(Property.BLOCKS_INSIDE):
        return "passed to the body"
    return "falls back"


def record_properties(primitive: jxi.Primitive) -> str:
    """The properties of ``primitive``'s record, and whether it has an estimate or a fold.

    Example:
        >>> from jax import lax
        >>> record_properties(lax.mul_p)
        'folds scalars, any-scale preserving, absorbing, multiplicative, pointwise, estimate, fold'
    """
    found = record(primitive)
    names = [_PROPERTY_NAMES[p] for p in _PROPERTY_NAMES if p in found.properties]
    names += [name for name in ("estimate", "fold") if getattr(found, name) is not None]
    return ", ".join(names)


_PROPERTY_NAMES = {
    Property.SHAPE_ONLY: "shape only",
    Property.FOLDS_SCALARS: "folds scalars",
    Property.ANY_SCALE_PRESERVING: "any-scale preserving",
    Property.ABSORBING: "absorbing",
    Property.MULTIPLICATIVE: "multiplicative",
    Property.SELECTING: "selecting",
    Property.ADDING: "adding",
    Property.LAYOUT: "layout",
    Property.FACTS_INSIDE: "facts inside",
    Property.POINTWISE: "pointwise",
}


def primitive_status(
    name: str, rules: dict[str, str], higher_order: dict[str, str]
) -> tuple[str, str]:
    """``(status, detail)`` of the primitive ``name``, in the interpreter's order of precedence.

    Example:
        >>> primitive_status("add", {"add": "jax_scaled.rules.elementwise"}, {})
        ('rule', 'jax_scaled.rules.elementwise')
        >>> primitive_status("and", {}, {})
        ('forwarded: never carries floating-point data', 'integer or boolean operands only')
    """
    if name in higher_order:
        return INTERPRETED, higher_order[name]
    if name in rules:
        return RULE, rules[name]
    if name in NEVER_FLOAT_OPERANDS:
        return FORWARDED, NEVER_FLOAT_OPERANDS[name]
    return NOT_SUPPORTED, "no scale rule; a ScaledArray input raises NotImplementedError"


def lax_coverage() -> list[PrimitiveCoverage]:
    """Coverage of every primitive of the installed JAX's lax layer, sorted by name.

    Example:
        >>> coverage = {c.name: c.status for c in lax_coverage()}
        >>> coverage["dot_general"], coverage["jit"], coverage["iota"]
        ('rule', 'interpreted', 'forwarded: never carries floating-point data')
    """
    rules, higher_order = registered_primitives(), higher_order_primitives()
    primitives = jxi.all_lax_primitives()
    return [
        PrimitiveCoverage(
            name,
            *primitive_status(name, rules, higher_order),
            record_properties(primitives[name]),
            block_behaviour(primitives[name]),
        )
        for name in sorted(primitives)
    ]


def own_primitives() -> list[PrimitiveCoverage]:
    """jax_scaled's own primitives (``set_scaling``, ...): rules on primitives outside lax.

    Example:
        >>> [c.name for c in own_primitives() if c.name == "set_scaling"]
        ['set_scaling']
    """
    lax_names = set(jxi.all_lax_primitives())
    return [
        PrimitiveCoverage(
            r.primitive.name,
            RULE,
            r.module,
            record_properties(r.primitive),
            block_behaviour(r.primitive),
        )  # fmt: skip
        for r in records()
        if r.rule is not None
        and r.primitive.name not in lax_names
        and (r.module or "").startswith("jax_scaled.")
    ]


def render_markdown(lax: Sequence[PrimitiveCoverage], own: Sequence[PrimitiveCoverage]) -> str:
    """The operators document for the given coverage rows (deterministic: rows are sorted).

    Example:
        >>> text = render_markdown([PrimitiveCoverage("add", RULE, "m", "adding")], [])
        >>> "| `add` | rule | `m` | adding |" in text
        True
    """
    lines = _header(lax) + ["## All lax primitives", ""] + _table(lax)
    if own:
        lines += ["", "## jax_scaled's own primitives", "", *_table(own)]
    return "\n".join(lines) + "\n"


def _header(lax: Sequence[PrimitiveCoverage]) -> list[str]:
    counts = {status: sum(c.status == status for c in lax) for status in STATUSES}
    unsupported = ", ".join(f"`{c.name}`" for c in lax if c.status == NOT_SUPPORTED)
    return [
        "# Operator coverage",
        "",
        f"<!-- Generated by `{REGENERATE}`: do not edit by hand. -->",
        "",
        f"How `scalify` handles each of the {len(lax)} primitives of the `jax.lax` layer of "
        f"JAX {jax.__version__} (`jax.extend.core.primitives` and the primitives defined in "
        "`jax._src.lax` and `jax._src.random`), with the rules registered by "
        "`import jax_scaled`.",
        "",
        "- **block scales**: what the rule does with block-scaled operands: keeps them "
        "(layout ops, reductions along other axes), keeps them per block (pointwise "
        "primitives: the rule runs on every block), consumes them (a contraction over "
        "blocked axes), passes them to the body (calls: `jit`, checkpoint, custom "
        "derivatives) or falls back to one scale per tensor (recorded and warned; loops, "
        "`cond` and `shard_map` too).",
        "- **record properties**: what the interpreter may assume about the primitive "
        "besides its rule (`jax_scaled.engine.registry.Property`), and whether its record "
        "says how a static magnitude estimate propagates (estimate) or how a trace-time "
        "constant folds (fold) through it.",
        "- **rule**: a scale rule (in the module named) runs when an input is a ScaledArray.",
        "- **interpreted**: a higher-order primitive: scalify interprets its sub-jaxprs and "
        "re-binds it.",
        f"- **{FORWARDED}**: its operands are never floating point (integers, booleans, "
        "PRNG keys, tokens, or none), so never ScaledArrays: it runs untouched.",
        f"- **{NOT_SUPPORTED}**: it can carry floating-point data but has no rule yet. It runs "
        "untouched on plain inputs; on a ScaledArray input scalify raises NotImplementedError "
        "naming it (leave such values unscaled with `jax_scaled.stop_scaling`).",
        "",
        "| status | primitives |",
        "| --- | ---: |",
        *[f"| {status} | {counts[status]} |" for status in STATUSES],
        f"| total | {len(lax)} |",
        "",
        f"Not supported yet: {unsupported or 'none'}.",
        "",
    ]


def _table(rows: Sequence[PrimitiveCoverage]) -> list[str]:
    body = [
        f"| `{c.name}` | {c.status} | {_detail(c)} | {c.properties} | {c.blocks} |" for c in rows
    ]
    header = "| primitive | status | handled by / why | record properties | block scales |"
    return [header, "| --- | --- | --- | --- | --- |", *body]


def _detail(c: PrimitiveCoverage) -> str:
    return f"`{c.detail}`" if c.status in (RULE, INTERPRETED) else c.detail


def generate() -> str:
    """The text of ``docs/operators.md`` for the installed JAX and the registered rules.

    Example:
        >>> generate().startswith("# Operator coverage")
        True
    """
    return render_markdown(lax_coverage(), own_primitives())


def stale_message(path: Path) -> str:
    """Why the check failed and the command that fixes it."""
    return f"{path} is out of date with the rule registry. Regenerate it with: {REGENERATE}"


def main(argv: Sequence[str] | None = None) -> int:
    """Write the operators document, or with ``--check`` only compare it; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    parser.add_argument("--output", type=Path, default=DOC_PATH, help="document path")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(stale_message(args.output), file=sys.stderr)
            return 1
        print(f"{args.output} is up to date.")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
