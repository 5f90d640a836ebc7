"""The scale-rule checker: does a function keep unit-scaled inputs unit-scaled, both ways?

:func:`check_scaling` is the workflow for writing a :func:`~jax_scaled.custom_scale` rule or
scaling a new op: feed unit-normal data at scale 1, and see whether the outputs and the
input gradients (for unit-normal cotangents) come back with data of RMS near 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_scaled.array import ScaledArray
from jax_scaled.engine.interpreter import scalify
from jax_scaled.engine.recording import ScaleRecord, record_scales, worst


@dataclasses.dataclass(frozen=True)
class ScalingEntry:
    """The data statistics of one output (forward) or one input gradient (backward).

    ``rms_bits`` is log2 of the data's RMS (over its finite elements): the error against
    unit scale, ``-inf`` when the data is all zero. ``scale`` is the ScaledArray's scale
    (1 for a plain array, whose data is its value).

    Example:
        >>> from jax_scaled.diagnostics.check import ScalingEntry
        >>> e = ScalingEntry("out", False, (4,), "float16", 2.0, 8.0, 0, True, ok=False)
        >>> e.rms_bits, e.value_rms_bits
        (3.0, 4.0)
    """

    name: str
    backward: bool
    shape: tuple[int, ...]
    dtype: str
    scale: float
    data_rms: float
    nonfinite: int
    scaled: bool
    ok: bool

    @property
    def rms_bits(self) -> float:
        return math.log2(self.data_rms) if self.data_rms > 0 else -math.inf

    @property
    def value_rms_bits(self) -> float:
        return self.rms_bits + math.log2(self.scale) if self.scale > 0 else -math.inf


@dataclasses.dataclass(frozen=True)
class ScalingReport:
    """What :func:`check_scaling` found: one entry per output and per input gradient.

    ``ok`` is True when every entry's data RMS is finite and within ``tolerance_bits`` of
    unit scale. ``records`` holds the intermediate values recorded on the way when asked
    (``check_scaling(..., record=True)``, see :func:`~jax_scaled.diagnostics.record_scales`);
    they do not count towards ``ok``.

    Example:
        >>> report = js.diagnostics.check_scaling(js.nn.relu, jnp.zeros((16, 64)))
        >>> report.ok, [e.name for e in report.entries]
        (True, ['out', 'grad x'])
    """

    function: str
    dtype: str
    tolerance_bits: float
    entries: tuple[ScalingEntry, ...]
    records: tuple[ScaleRecord, ...] = ()

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    @property
    def failures(self) -> tuple[ScalingEntry, ...]:
        return tuple(e for e in self.entries if not e.ok)

    def entry(self, name: str) -> ScalingEntry:
        """The entry called ``name`` (``"out"``, ``"out[1]"``, ``"grad x"``...)."""
        return next(e for e in self.entries if e.name == name)

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAILED ({len(self.failures)} of {len(self.entries)})"
        lines = [
            f"check_scaling({self.function}) in {self.dtype}, "
            f"tolerance ±{self.tolerance_bits:g} bits: {verdict}",
            f"  {'pass':4}  {'name':16} {'shape':14} {'dtype':14} {'scale':>6} "
            f"{'data rms(bits)':>14} {'value rms(bits)':>15}",
        ]
        lines += [_entry_line(e) for e in self.entries]
        drifting = [
            r for r in worst(self.records, limit=5) if abs(r.rms_bits) > self.tolerance_bits
        ]
        if drifting:
            lines.append("  intermediates beyond the tolerance (not counted in ok):")
            lines += [f"    {_record_line(r)}" for r in drifting]
        return "\n".join(lines)


def _entry_line(e: ScalingEntry) -> str:
    scale = f"2^{math.log2(e.scale):.0f}" if e.scale > 0 else "0"
    problem = "non-finite" if e.nonfinite else "all zero" if e.data_rms == 0 else "off unit scale"
    note = "" if e.ok else f"  <-- {problem}"
    note += "" if e.scaled else "  (plain array)"
    return (
        f"  {'bwd' if e.backward else 'fwd':4}  {e.name:16} {str(e.shape):14} {e.dtype:14} "
        f"{scale:>6} {e.rms_bits:>+14.2f} {e.value_rms_bits:>+15.2f}{note}"
    )


def _record_line(r: ScaleRecord) -> str:
    return f"{'bwd' if r.backward else 'fwd'} {r.primitive} {r.rms_bits:+.1f} bits at {r.source}"


def check_scaling(
    fn: Callable,
    *example_args: Any,
    dtype: Any = jnp.float16,
    tolerance_bits: float = 2.0,
    seed: int = 0,
    record: bool = False,
) -> ScalingReport:
    """Run ``fn`` and its VJP under scalify on unit-normal data, and check the scales.

    Every floating leaf of ``example_args`` (an array or a ``jax.ShapeDtypeStruct``: only
    its shape and dtype are used) is replaced by unit-normal data of that shape in ``dtype``,
    at scale 1. The forward pass and the pullback of unit-normal cotangents (one per floating
    output, at scale 1) are traced together inside :func:`~jax_scaled.scalify`
    (``scalify(jax.vjp ...)``), so custom rules of the backward pass apply. The report gives,
    for every floating output and every gradient of a floating input, the data's RMS in bits
    (``log2``; 0 is unit scale) and flags those more than ``tolerance_bits`` away.
    Non-floating leaves (integer labels, boolean masks) are passed as given: they must be
    concrete arrays. Bind other inputs you want fixed (e.g. one-hot labels) with a closure.

    Args:
        fn: the function to check; positional arguments only.
        *example_args: pytrees of arrays or ``jax.ShapeDtypeStruct``, one per argument.
        dtype: the data format of the inputs and cotangents; None keeps each example's dtype.
        tolerance_bits: how far (in bits) a data RMS may be from 1 and still pass.
        seed: seed of the unit-normal inputs and cotangents.
        record: also record every intermediate value (:func:`record_scales`) into the
            report's ``records``, and list those beyond the tolerance in its text. Slower:
            it adds a host callback per value.

    Returns:
        A :class:`ScalingReport`: ``ok``, ``entries``, and a readable ``str``.

    Raises:
        ValueError: when ``fn`` has no floating argument, or a non-floating one is given as a
            ``jax.ShapeDtypeStruct``.

    Example:
        >>> @js.custom_scale
        ... def matmul(a, b):
        ...     return a @ b
        >>> @matmul.defscale
        ... def matmul_rule(a, b):  # wrong: forgets the sqrt(K) of the contraction
        ...     return js.ScaledArray(a.data @ b.data, a.scale * b.scale)
        >>> report = js.diagnostics.check_scaling(matmul, jnp.zeros((8, 256)), jnp.zeros((256, 8)))
        >>> report.ok, round(report.entry("out").rms_bits)  # log2(sqrt(256)) = 4
        (False, 4)
    """
    args = _Arguments.of(fn, example_args)
    input_key, cotangent_key = jax.random.split(jax.random.key(seed))
    inputs = _unit_normals(input_key, args.floating_leaves(), dtype)
    output_shapes = jax.eval_shape(args.floating_outputs, [_struct(x) for x in inputs], args.fixed)
    cotangents = _unit_normals(cotangent_key, output_shapes, None)
    with record_scales() if record else contextlib.nullcontext([]) as records:
        outputs, grads = _forward_and_backward(args, inputs, cotangents)
    output_names = ["out"] if len(outputs) == 1 else [f"out[{i}]" for i in range(len(outputs))]
    entries = [_entry(n, y, False, tolerance_bits) for n, y in zip(output_names, outputs)]
    grad_names = [f"grad {name}" for name in args.floating_names()]
    entries += [_entry(n, g, True, tolerance_bits) for n, g in zip(grad_names, grads)]
    return ScalingReport(_function_name(fn), str(inputs[0].dtype), tolerance_bits,
                         tuple(entries), tuple(records))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Arguments:
    """``fn``'s example arguments, flattened: the floating leaves vary, the others are fixed."""

    fn: Callable
    in_tree: Any
    leaves: list
    names: list[str]
    floating: list[bool]
    fixed: list

    @classmethod
    def of(cls, fn: Callable, example_args: tuple) -> _Arguments:
        leaves, in_tree = jax.tree.flatten(example_args)
        names = _leaf_names(fn, example_args)
        floating = [_is_floating(leaf) for leaf in leaves]
        if not any(floating):
            raise ValueError("check_scaling: fn has no floating argument to check")
        fixed = [_fixed_leaf(x, name) for x, name, f in zip(leaves, names, floating) if not f]
        return cls(fn, in_tree, leaves, names, floating, fixed)

    def floating_leaves(self) -> list:
        return [x for x, f in zip(self.leaves, self.floating) if f]

    def floating_names(self) -> list[str]:
        return [name for name, f in zip(self.names, self.floating) if f]

    def floating_outputs(self, floating_leaves: list, fixed_leaves: list) -> list:
        """``fn``'s floating outputs, flattened, for the given leaves."""
        floating, fixed = iter(floating_leaves), iter(fixed_leaves)
        leaves = [next(floating) if f else next(fixed) for f in self.floating]
        outputs = self.fn(*self.in_tree.unflatten(leaves))
        return [y for y in jax.tree.leaves(outputs) if _is_floating(y)]


def _forward_and_backward(args: _Arguments, inputs: list, cotangents: list) -> tuple[list, list]:
    """The outputs and the pullback of ``cotangents``, both traced inside scalify."""

    def outputs_and_grads(inputs: list, fixed: list, cotangents: list) -> tuple:
        outputs, pullback = jax.vjp(lambda xs: args.floating_outputs(xs, fixed), inputs)
        return outputs, pullback(cotangents)[0]

    results = jax.jit(scalify(outputs_and_grads))(inputs, args.fixed, cotangents)
    return jax.block_until_ready(results)


def _function_name(fn: Callable) -> str:
    """``fn``'s name, or that of the function a ``functools.partial`` wraps."""
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "")


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _fixed_leaf(x: Any, name: str) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "dtype"):
        raise ValueError(
            f"check_scaling: argument {name} is not floating, so it is passed as given; "
            f"give a concrete array for it, not {x!r}"
        )
    return x


def _unit_normals(key: jax.Array, likes: Sequence[Any], dtype: Any) -> list[ScaledArray]:
    """Unit-normal data of each ``like``'s shape, in ``dtype`` (None: ``like``'s), scale 1."""
    keys = jax.random.split(key, max(len(likes), 1))
    return [
        ScaledArray(
            jax.random.normal(k, x.shape, jnp.float32).astype(dtype or x.dtype),
            jnp.ones((), jnp.float32),
        )
        for k, x in zip(keys, likes)
    ]


def _struct(x: ScaledArray) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _leaf_names(fn: Callable, example_args: tuple) -> list[str]:
    """``name`` or ``name['key'][0]`` for every leaf, from ``fn``'s parameter names."""
    params = _parameter_names(fn, len(example_args))
    names = []
    for param, arg in zip(params, example_args):
        paths = jax.tree_util.tree_flatten_with_path(arg)[0]
        names += [param + jax.tree_util.keystr(path) for path, _ in paths]
    return names


def _parameter_names(fn: Callable, count: int) -> list[str]:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind is p.VAR_POSITIONAL for p in parameters) or len(positional) < count:
        return [f"arg{i}" for i in range(count)]
    return positional[:count]


def _entry(name: str, value: Any, backward: bool, tolerance_bits: float) -> ScalingEntry:
    scaled = isinstance(value, ScaledArray)
    data = np.asarray(value.data if scaled else value, np.float64)
    finite = np.isfinite(data)
    rms = float(np.sqrt(np.mean(np.square(data[finite])))) if finite.any() else 0.0
    nonfinite = int(data.size - finite.sum())
    scale = float(np.max(np.asarray(value.scale, np.float64))) if scaled else 1.0
    ok = nonfinite == 0 and rms > 0 and abs(math.log2(rms)) <= tolerance_bits
    return ScalingEntry(name, backward, tuple(data.shape), str(value.dtype), scale, rms,
                        nonfinite, scaled, ok)  # fmt: skip
