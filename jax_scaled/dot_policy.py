"""The format policy: every contraction of a function in FP8, wherever it is.

:func:`dot_formats` traces a function to a jaxpr and re-runs it with every ``dot_general`` and
``conv_general_dilated`` on floating operands replaced by a
:func:`~jax_scaled.nn.cast_contraction.cast_contraction`: forward operands cast to ``lhs`` /
``rhs``, backward cotangent cast to ``grad``, with the semantics of :func:`jax_scaled.nn.linear`.
Contractions inside higher-order primitives are reached too: the jaxpr-valued parameters of
``jit``, ``scan``, ``while``, ``cond``, ``remat``, ``closed_call`` and ``custom_linear_solve``
are re-traced through the same evaluation, and the equation is re-bound with them.

Custom derivatives: the function of a ``custom_jvp`` / ``custom_vjp`` is transformed, and so is
the ``fwd`` of a ``custom_vjp`` (which computes the primal outputs under ``jax.grad``). The
user's derivative rules (a ``custom_vjp``'s ``bwd``, a ``custom_jvp``'s ``jvp``) are kept as
written, and so is the scale rule of a :func:`~jax_scaled.custom_scale` function. Under
``jax.grad`` a ``custom_jvp`` function's outputs come from its ``jvp`` rule, not transformed.
``shard_map`` and ``pallas_call`` bodies are left as they are (they trace only in their own
context: a mesh's axes, a kernel's memory references).

Apply the policy to the function that is differentiated, ``jax.grad(dot_formats(loss))``, not
to its gradient, ``dot_formats(jax.grad(loss))``: in a jaxpr that already contains a backward
pass the gradient contractions would be cast as forward ones (to ``lhs`` / ``rhs``, not
``grad``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled.dtypes import float_dtype
from jax_scaled.engine.tracing import bind_eqn, call_traced, evaluate_jaxpr
from jax_scaled.formats import BlockFormat, as_recipe
from jax_scaled.nn.block_linear import BlockRecipe, block_linear, untiled_axes
from jax_scaled.nn.cast_contraction import (
    SCALINGS,
    CastFormats,
    Contraction,
    accumulation_dtype,
    cast_contraction,
)

Shape = tuple[int, ...]
_CONTRACTIONS = (lax.dot_general_p, lax.conv_general_dilated_p)


def _is_opaque(primitive: jxi.Primitive) -> bool:
    """Higher-order primitives whose bodies trace only in their own context (a mesh's manual
    axes, a kernel's memory references): bound as they are, contractions inside included."""
    return primitive is jxi.shard_map_p or jxi.is_kernel_call(primitive)


@dataclasses.dataclass(frozen=True)
class ContractionSite:
    """One contraction of the program, as an ``exclude`` predicate sees it.

    Attributes:
        primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
        lhs: shape and dtype of the left operand.
        rhs: shape and dtype of the right operand.
        out: shape and dtype of the result.
        params: the equation's parameters (``dimension_numbers``, padding, ...).
        source_line: the user's source location, ``file:line (function)``.
        module_path: the flax ``linen`` module path of the contraction, root module first
            (``"GPT/Block_0/qkv"``): JAX's name stack without its transforms (``jvp(...)``).
            ``""`` outside named modules; ``flax.nnx`` modules do not name their calls, so
            their contractions have the path of the ``jax.named_scope`` around them, if any.

    Example:
        >>> def small_contractions(site):  # an exclude predicate: keep small ones 16-bit
        ...     return site.rhs.shape[-1] < 16
        >>> f = dot_formats(lambda x, w: x @ w, exclude=small_contractions)
        >>> f(jnp.ones((2, 4)), jnp.ones((4, 8))).dtype
        dtype('float32')
    """

    primitive: str
    lhs: jax.ShapeDtypeStruct
    rhs: jax.ShapeDtypeStruct
    out: jax.ShapeDtypeStruct
    params: Mapping[str, Any]
    source_line: str
    module_path: str = ""

    @property
    def dimension_numbers(self) -> Any:
        """The contraction's ``dimension_numbers`` parameter."""
        return self.params["dimension_numbers"]


Rule = Callable[[ContractionSite], bool] | Sequence[Shape] | str | Sequence[str] | None


def has_operand_shape(*shapes: Shape) -> Callable[[ContractionSite], bool]:
    """A predicate for ``exclude``: true for a contraction with an operand of one of ``shapes``.

    Args:
        *shapes: operand shapes, e.g. ``(d_model, vocab)`` for a language model's head.

    Returns:
        A function of a :class:`ContractionSite`.

    Example:
        >>> from jax_scaled import has_operand_shape
        >>> head = dot_formats(lambda x, w: x @ w, exclude=has_operand_shape((4, 3)))
        >>> head(jnp.ones((2, 4)) / 3, jnp.ones((4, 3))).tolist()[0][0]  # float32, not FP8
        1.3333333730697632
    """
    return _ShapeRule(tuple(_checked_shape(s) for s in shapes))


class UnmatchedRuleWarning(UserWarning):
    """An ``include`` or ``exclude`` rule of :func:`dot_formats` (an operand shape, a module
    path pattern) matched no contraction of the function."""


class UnmatchedExcludeWarning(UnmatchedRuleWarning):
    """An ``exclude`` shape of :func:`dot_formats` matched no contraction of the function."""


def has_module_path(*patterns: str) -> Callable[[ContractionSite], bool]:
    """A predicate for ``include`` / ``exclude``: true for a contraction whose
    :attr:`ContractionSite.module_path` matches one of the regular expressions ``patterns``
    in full (``re.fullmatch``, as qwix's rules match module paths). :func:`dot_formats` warns
    (:class:`UnmatchedRuleWarning`) about a pattern that matched no contraction, naming the
    paths it saw.

    Args:
        *patterns: regular expressions, e.g. ``".*/head"`` or ``"(.*/)?(qkv|proj|fc)"``.

    Example:
        >>> import flax.linen as nn
        >>> model = nn.Sequential([nn.Dense(8), nn.Dense(3)])  # paths Sequential/layers_0, _1
        >>> x = jnp.ones((2, 4))
        >>> params = model.init(jax.random.key(0), x)
        >>> last_kept = dot_formats(model.apply, exclude=has_module_path(".*/layers_1"))
        >>> last_kept(params, x).shape
        (2, 3)
    """
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"has_module_path takes regular expressions (str), got {pattern!r}")
        re.compile(pattern)  # a malformed pattern fails here, where the user wrote it
    return _PathRule(patterns)


class _PathRule:
    """``has_module_path``'s predicate; remembers which patterns matched during one call."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self.patterns = patterns
        self.matched: set[str] = set()
        self.seen: list[str] = []

    def __call__(self, site: ContractionSite) -> bool:
        if site.module_path not in self.seen:
            self.seen.append(site.module_path)
        found = {p for p in self.patterns if re.fullmatch(p, site.module_path)}
        self.matched |= found
        return bool(found)

    def reset(self) -> None:
        self.matched.clear()
        self.seen.clear()

    def warn_unmatched(self, role: str) -> None:
        missing = [p for p in self.patterns if p not in self.matched]
        if missing:
            seen = ", ".join(repr(p) for p in self.seen[:8]) or "none"
            warnings.warn(
                f"dot_formats: {role} module path patterns {missing} match no contraction of "
                f"this function (re.fullmatch); its contractions' module paths: {seen}.",
                UnmatchedRuleWarning,
                stacklevel=jxi.user_stacklevel(),
            )


class _ShapeRule:
    """``has_operand_shape``'s predicate; remembers the shapes it matched during one call, so
    that :func:`dot_formats` can warn about the ones that matched nothing (a typo, a
    transposed shape)."""

    def __init__(self, shapes: tuple[Shape, ...]) -> None:
        self.shapes = shapes
        self.matched: set[Shape] = set()

    def __call__(self, site: ContractionSite) -> bool:
        found = {s for s in self.shapes if s in (tuple(site.lhs.shape), tuple(site.rhs.shape))}
        self.matched |= found
        return bool(found)

    def reset(self) -> None:
        self.matched.clear()

    def warn_unmatched(self, role: str) -> None:
        missing = [s for s in self.shapes if s not in self.matched]
        if missing:
            warnings.warn(
                f"dot_formats: {role} shapes {missing} match no operand of a contraction of "
                "this function (check the shape: operands are matched as written, e.g. "
                "(d_model, vocab)).",
                UnmatchedExcludeWarning if role == "exclude" else UnmatchedRuleWarning,
                stacklevel=jxi.user_stacklevel(),
            )


def _checked_shape(shape: Any, role: str = "exclude") -> Shape:
    if isinstance(shape, str) or not isinstance(shape, Sequence):
        raise TypeError(_RULE_HELP.format(role=role, got=repr(shape)))
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in shape):
        raise TypeError(_RULE_HELP.format(role=role, got=repr(shape)))
    return tuple(int(d) for d in shape)


_RULE_HELP = (
    "dot_formats: {role} takes None, a predicate of a js.ContractionSite, a list of operand "
    "shapes such as [(512, 10)] (js.has_operand_shape), or module path patterns such as "
    "'.*/head' or ['.*/qkv', '.*/fc'] (js.has_module_path); got {got}."
)


def dot_formats(
    fn: Callable,
    *,
    lhs: DTypeLike | None = jnp.float8_e4m3fn,
    rhs: DTypeLike | None = jnp.float8_e4m3fn,
    grad: DTypeLike | None = jnp.float8_e5m2,
    exclude: Rule = None,
    block: BlockRecipe | BlockFormat | None = None,
    scaling: str = "current",
    include: Rule = None,
) -> Callable:
    """``fn`` with its matmuls and convolutions on ``lhs``/``rhs`` operands and ``grad`` cotangents.

    Every ``dot_general`` and ``conv_general_dilated`` whose operands and result are floating
    (flax ``Dense``/``DenseGeneral``/``Conv``, attention einsums, ``x @ w``), at any depth of
    ``jit``, ``scan``, ``while``, ``cond``, ``remat`` and custom-derivative functions, becomes
    :func:`~jax_scaled.nn.cast_contraction.cast_contraction`, with the semantics of
    :func:`jax_scaled.nn.linear`:

    * forward: the operands are cast to ``lhs`` and ``rhs`` and the contraction takes the
      casts directly, accumulating in the original result dtype (float32 when that is an
      8-bit format, or with current scaling); the result has the original dtype and shape;
    * backward (``jax.grad`` of the returned function): the cotangent, cast to ``grad``,
      multiplies the cast forward operands; gradients come back in the operands' dtypes.

    The returned function has ``fn``'s signature and output avals. Leaves of its arguments
    that are not arrays (Python numbers, strings) are static: baked into the trace.

    **Scaling.** ``"current"`` (default): before each cast, a plain operand (and the
    cotangent) is divided by the power of two that brings its absolute maximum within the
    format's range, and the result multiplied back by the scales: per-tensor current scaling,
    so that values of magnitude 2^-20 or 2^20 survive FP8 (an FP8 simulation of plain JAX).
    Under :func:`jax_scaled.scalify`, ScaledArray operands are not rescaled: the cast acts on
    their data and keeps their scale, which scalify already keeps in range. ``"none"``: the
    casts quantise values as they are (raw FP8: tiny values flush to zero, large overflow).

    Compose with a training step as ``js.scalify(jax.value_and_grad(dot_formats(loss)))``:
    apply the policy to the function that is differentiated.

    Args:
        fn: the function to transform.
        lhs: format of a contraction's left operand (``jnp.float8_e4m3fn``); None: no cast.
        rhs: format of its right operand; None: no cast.
        grad: format of the cotangent of its result (``jnp.float8_e5m2``); None: no cast.
        exclude: contractions to keep as they are: a predicate on :class:`ContractionSite`
            (primitive, operand shapes and dtypes, dimension numbers, source line, flax
            module path), a sequence of operand shapes (see :func:`has_operand_shape`),
            e.g. a language model's output head ``[(d_model, vocab)]``, or module path
            patterns, a string or a sequence of strings (see :func:`has_module_path`), e.g.
            ``".*/head"``. A shape or pattern that matches nothing is warned about.
        block: a block-scaled recipe (:class:`jax_scaled.formats.BlockRecipe`:
            ``js.nn.MXFP8``, ``js.nn.FP8_BLOCK128``, ...; or a
            :class:`~jax_scaled.formats.BlockFormat` ``F``, meaning ``F`` everywhere:
            ``js.formats.MXFP8_E4M3``; anything else is a ``TypeError``) for the dense
            contractions, ``x (..., K) @ w (K, N)`` (flax ``Dense``, ``x @ w``) whose sizes
            its blocks tile: those become
            :func:`jax_scaled.nn.block_linear` (every matmul, forward and backward, on
            operands block-quantized along its contracting axis; the recipe's formats
            replace ``lhs``/``rhs``/``grad`` there, and ``scaling`` does not apply: block
            scales are current scales). Other contractions (attention einsums with batch
            axes, convolutions, sizes the blocks do not tile) keep the per-tensor formats.
        scaling: ``"current"`` or ``"none"`` (see above).
        include: like ``exclude``, the contractions to cast, the others kept as they are
            (None: all); ``exclude`` applies among them, e.g. qwix's selection of the
            blocks' layers, ``include="(.*/)?(qkv|proj|fc)"``.

    Returns:
        The transformed function.

    Example:
        >>> from jax_scaled import dot_formats
        >>> x, w = jnp.full((2, 16), 2.0**-20), jnp.full((16, 3), 1.1)
        >>> fp8 = dot_formats(lambda x, w: x @ w)
        >>> float(fp8(x, w)[0, 0]) * 2**20  # 1.1 rounds to 1.125 in E4M3; 2^-20 survives
        18.0
        >>> float(dot_formats(lambda x, w: x @ w, scaling="none")(x, w)[0, 0])  # raw FP8
        0.0
        >>> g = jax.grad(lambda w: jnp.sum(fp8(x, w)))(w)  # E5M2 cotangent, float32 gradient
        >>> g.dtype, float(g[0, 0]) * 2**19
        (dtype('float32'), 1.0)
        >>> mx = dot_formats(lambda x, w: x @ w, block=js.formats.MXFP8_E4M3)  # E4M3 blocks
        >>> float(mx(jnp.full((32, 32), 3.0), jnp.full((32, 32), 0.5))[0, 0])
        48.0
    """
    block = None if block is None else as_recipe(block, "dot_formats(block=...)")
    policy = _Policy(
        _format(lhs), _format(rhs), _format(grad), _predicate(exclude, "exclude"), scaling,
        block, _predicate(include, "include"),
    )  # fmt: skip

    @functools.wraps(fn)
    def with_formats(*args, **kwargs):
        return _call(fn, policy, args, kwargs)

    return with_formats


def _format(dtype: DTypeLike | None) -> jnp.dtype | None:
    return None if dtype is None else float_dtype(dtype)


def _predicate(rule: Rule, role: str) -> Callable[[ContractionSite], bool] | None:
    """The predicate of an ``include`` / ``exclude`` argument (None for None)."""
    if rule is None or callable(rule):
        return rule
    if isinstance(rule, str):
        return has_module_path(rule)
    if not isinstance(rule, Sequence):
        raise TypeError(_RULE_HELP.format(role=role, got=repr(rule)))
    if rule and all(isinstance(p, str) for p in rule):
        return has_module_path(*rule)
    if any(isinstance(s, int | np.integer) for s in rule):
        got = f"{rule!r} (one shape: write [{rule!r}])"
        raise TypeError(_RULE_HELP.format(role=role, got=got))
    if any(isinstance(s, str) for s in rule):
        raise TypeError(_RULE_HELP.format(role=role, got=f"{rule!r} (shapes and patterns mixed)"))
    return _ShapeRule(tuple(_checked_shape(shape, role) for shape in rule))


@dataclasses.dataclass(frozen=True)
class _Policy:
    """The formats of :func:`dot_formats`, and which contractions they apply to."""

    lhs: jnp.dtype | None
    rhs: jnp.dtype | None
    grad: jnp.dtype | None
    exclude: Callable[[ContractionSite], bool] | None
    scaling: str
    block: BlockRecipe | None = None
    include: Callable[[ContractionSite], bool] | None = None

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"dot_formats: scaling must be one of {SCALINGS}, got {self.scaling!r}"
            )

    def selects(self, site: ContractionSite) -> bool:
        """True for a contraction the formats apply to (``include``, then ``exclude``)."""
        if self.include is not None and not self.include(site):
            return False
        return self.exclude is None or not self.exclude(site)

    def rules(self) -> list[tuple[str, Any]]:
        """``(role, rule)`` of the rules that report what they matched."""
        pairs = [("include", self.include), ("exclude", self.exclude)]
        return [(role, r) for role, r in pairs if isinstance(r, _ShapeRule | _PathRule)]

    def formats(self, eqn: jxi.JaxprEqn, lhs: Any, rhs: Any) -> CastFormats | None:
        """The casts of this contraction, or None to leave it as it is."""
        out = eqn.outvars[0].aval
        dtypes = (jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype), jnp.dtype(out.dtype))
        if not all(jnp.issubdtype(d, jnp.floating) for d in dtypes):
            return None
        if dtypes[:2] == (self.lhs, self.rhs):
            return None  # already in these formats (e.g. the forward of an FP8 nn.linear)
        if not self.selects(_site(eqn, lhs, rhs)):
            return None
        return CastFormats(
            lhs=None if dtypes[0] == self.lhs else self.lhs,
            rhs=None if dtypes[1] == self.rhs else self.rhs,
            grad=self.grad,
            lhs_grad=dtypes[0],
            rhs_grad=dtypes[1],
            accumulation=accumulation_dtype(dtypes[2], self.scaling),
            output=dtypes[2],
            scaling=self.scaling,
        )


def _site(eqn: jxi.JaxprEqn, lhs: Any, rhs: Any) -> ContractionSite:
    out = eqn.outvars[0].aval
    return ContractionSite(
        primitive=eqn.primitive.name,
        lhs=jax.ShapeDtypeStruct(np.shape(lhs), lhs.dtype),
        rhs=jax.ShapeDtypeStruct(np.shape(rhs), rhs.dtype),
        out=jax.ShapeDtypeStruct(out.shape, out.dtype),
        params=dict(eqn.params),
        source_line=jxi.eqn_source_line(eqn),
        module_path=_TRANSFORMS.sub("", str(eqn.source_info.name_stack)).replace(")", ""),
    )


_TRANSFORMS = re.compile(r"\w+\(")  # jvp(, transpose(, vmap(: name stack wrappers


# ---------------------------------------------------------------------------------------
# The transformation: trace, then evaluate with the contractions replaced
# ---------------------------------------------------------------------------------------


def _call(fn: Callable, policy: _Policy, args: tuple, kwargs: dict) -> Any:
    def run(traced):
        return _evaluate(traced.closed.jaxpr, traced.closed.consts, traced.arrays, policy)

    for _, rule in policy.rules():
        rule.reset()
    outs = call_traced(fn, args, kwargs, run)  # ScaledArray arguments: their data and scale
    for role, rule in policy.rules():
        rule.warn_unmatched(role)
    return outs


def _evaluate(jaxpr: jxi.Jaxpr, consts: Sequence, args: Sequence, policy: _Policy) -> list:
    """Run ``jaxpr`` on ``args`` in the current trace, contractions replaced per ``policy``."""

    def eval_eqn(eqn: jxi.JaxprEqn, invals: list) -> list:
        with jxi.eqn_user_context(eqn):
            return _evaluate_eqn(eqn, invals, policy)

    return evaluate_jaxpr(jaxpr, consts, args, eval_eqn)


def _evaluate_eqn(eqn: jxi.JaxprEqn, invals: list, policy: _Policy) -> list:
    if eqn.primitive in _CONTRACTIONS:
        formats = policy.formats(eqn, *invals)
        if formats is not None and _is_block_dense(eqn, *invals, policy.block):
            out = block_linear(*invals, policy.block).astype(eqn.outvars[0].aval.dtype)
            return [jxi.with_weak_type(out) if eqn.outvars[0].aval.weak_type else out]
        if formats is not None:
            out = cast_contraction(*invals, Contraction.of(eqn.primitive, eqn.params), formats)
            return [jxi.with_weak_type(out) if eqn.outvars[0].aval.weak_type else out]
    elif not _is_opaque(eqn.primitive) and _has_contraction_inside(eqn):
        eqn = jxi.map_jaxpr_params(eqn, functools.partial(_transform, policy=policy))
    return bind_eqn(eqn, invals)


def _is_block_dense(eqn: jxi.JaxprEqn, lhs: Any, rhs: Any, block: BlockRecipe | None) -> bool:
    """True for a ``dot_general`` ``x (..., K) @ w (K, N)`` that ``block``'s blocks tile."""
    if block is None or eqn.primitive is not lax.dot_general_p:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    dense = not lb and not rb and tuple(lc) == (np.ndim(lhs) - 1,) and tuple(rc) == (0,)
    return dense and np.ndim(rhs) == 2 and not untiled_axes(np.shape(lhs), np.shape(rhs), block)


def _transform(closed: jxi.ClosedJaxpr, policy: _Policy) -> jxi.ClosedJaxpr:
    """``closed`` with its contractions replaced (itself if it has none)."""
    if not _has_contraction(closed.jaxpr):
        return closed
    return jxi.retrace_closed_jaxpr(closed, functools.partial(_evaluate, policy=policy))


def _has_contraction(jaxpr: jxi.Jaxpr) -> bool:
    return any(e.primitive in _CONTRACTIONS or _has_contraction_inside(e) for e in jaxpr.eqns)


def _has_contraction_inside(eqn: jxi.JaxprEqn) -> bool:
    return any(_has_contraction(sub) for sub in jxi.eqn_subjaxprs(eqn))
