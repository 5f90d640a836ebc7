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
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from jax_scaled import _jax_internals as jxi
from jax_scaled.contraction_rules import (  # noqa: F401  (public names of this module too)
    ContractionSite,
    MatchingRule,
    Rule,
    UnmatchedExcludeWarning,
    UnmatchedRuleWarning,
    as_predicate,
    has_module_path,
    has_operand_shape,
    site_of,
)
from jax_scaled.dot_delayed import DelayedFormats, HistoryBook
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
from jax_scaled.nn.delayed_contraction import delayed_contraction
from jax_scaled.ops.delayed import DelayedScaling

_SCALINGS = (*SCALINGS, "delayed")
_CONTRACTIONS = (lax.dot_general_p, lax.conv_general_dilated_p)


def _is_opaque(primitive: jxi.Primitive) -> bool:
    """Higher-order primitives whose bodies trace only in their own context (a mesh's manual
    axes, a kernel's memory references): bound as they are, contractions inside included."""
    return primitive is jxi.shard_map_p or jxi.is_kernel_call(primitive)


def dot_formats(
    fn: Callable,
    *,
    lhs: DTypeLike | None = jnp.float8_e4m3fn,
    rhs: DTypeLike | None = jnp.float8_e4m3fn,
    grad: DTypeLike | None = jnp.float8_e5m2,
    exclude: Rule = None,
    block: BlockRecipe | BlockFormat | None = None,
    scaling: str | DelayedScaling = "current",
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
    ``"delayed"`` (or a :class:`~jax_scaled.ops.DelayedScaling` for its history length,
    margin and amax rule; ``"delayed"`` keeps 1024 steps and takes their largest amax, as
    Transformer Engine and flax do): each cast's scale comes from the amax of the previous
    steps, kept in an explicit state; casts saturate. The function returned is then a
    :class:`~jax_scaled.dot_delayed.DelayedFormats`, called ``f(state, *args)``, with
    ``state = f.init(*args)``; the next state is the gradient with respect to ``state``:
    ``loss, (state, grads) = jax.value_and_grad(f, argnums=(0, 1))(state, params, batch)``.
    Contractions in loop bodies, ``remat`` and custom-derivative functions are refused
    there (they do not run once per call); nested ``jit`` (``jnp.einsum``) is inlined.

    **FP8 kernels.** Forward contractions take both operands in ``lhs``/``rhs``. The
    backward ``dot_general`` take the ``grad`` cotangent with an operand; a backward
    convolution takes the cotangent in its other operand's format (JAX's convolution takes
    one operand dtype), so it is E4M3 x E4M3 with the defaults.

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
        scaling: ``"current"``, ``"none"``, ``"delayed"`` or a
            :class:`~jax_scaled.ops.DelayedScaling` (see above).
        include: like ``exclude``, the contractions to cast, the others kept as they are
            (None: all); ``exclude`` applies among them, e.g. qwix's selection of the
            blocks' layers, ``include="(.*/)?(qkv|proj|fc)"``.

    Returns:
        The transformed function (a :class:`~jax_scaled.dot_delayed.DelayedFormats` with
        delayed scaling).

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
        _format(lhs), _format(rhs), _format(grad), as_predicate(exclude, "exclude"), scaling,
        block, as_predicate(include, "include"),
    )  # fmt: skip
    if policy.delayed is not None:
        return DelayedFormats(fn, functools.partial(_call, policy=policy), policy.delayed)

    @functools.wraps(fn)
    def with_formats(*args, **kwargs):
        return _call(fn, args, kwargs, policy=policy)

    return with_formats


def _format(dtype: DTypeLike | None) -> jnp.dtype | None:
    return None if dtype is None else float_dtype(dtype)


@dataclasses.dataclass(frozen=True)
class _Policy:
    """The formats of :func:`dot_formats`, and which contractions they apply to."""

    lhs: jnp.dtype | None
    rhs: jnp.dtype | None
    grad: jnp.dtype | None
    exclude: Callable[[ContractionSite], bool] | None
    scaling: str | DelayedScaling
    block: BlockRecipe | None = None
    include: Callable[[ContractionSite], bool] | None = None

    def __post_init__(self):
        if isinstance(self.scaling, DelayedScaling):
            return
        if self.scaling not in _SCALINGS:
            raise ValueError(
                f"dot_formats: scaling must be one of {_SCALINGS} or a js.ops.DelayedScaling, "
                f"got {self.scaling!r}"
            )
        if self.scaling == "delayed":  # Transformer Engine's and flax's history length
            object.__setattr__(self, "scaling", DelayedScaling(history_len=1024))

    @property
    def delayed(self) -> DelayedScaling | None:
        """The delayed scaling recipe, None for current or no scaling."""
        return self.scaling if isinstance(self.scaling, DelayedScaling) else None

    @property
    def scaling_name(self) -> str:
        return "delayed" if self.delayed is not None else self.scaling

    def selects(self, site: ContractionSite) -> bool:
        """True for a contraction the formats apply to (``include``, then ``exclude``)."""
        if self.include is not None and not self.include(site):
            return False
        return self.exclude is None or not self.exclude(site)

    def rules(self) -> list[tuple[str, Any]]:
        """``(role, rule)`` of the rules that report what they matched."""
        pairs = [("include", self.include), ("exclude", self.exclude)]
        return [(role, r) for role, r in pairs if isinstance(r, MatchingRule)]

    def formats(self, site: ContractionSite) -> CastFormats | None:
        """The casts of this contraction, or None to leave it as it is."""
        dtypes = (site.lhs.dtype, site.rhs.dtype, site.out.dtype)
        if not all(jnp.issubdtype(d, jnp.floating) for d in dtypes):
            return None
        if dtypes[:2] == (self.lhs, self.rhs):
            return None  # already in these formats (e.g. the forward of an FP8 nn.linear)
        if not self.selects(site):
            return None
        return CastFormats(
            lhs=None if dtypes[0] == self.lhs else self.lhs,
            rhs=None if dtypes[1] == self.rhs else self.rhs,
            grad=self.grad,
            lhs_grad=dtypes[0],
            rhs_grad=dtypes[1],
            accumulation=accumulation_dtype(dtypes[2], self.scaling_name),
            output=dtypes[2],
            scaling=self.scaling_name,
        )


# ---------------------------------------------------------------------------------------
# The transformation: trace, then evaluate with the contractions replaced
# ---------------------------------------------------------------------------------------


def _call(
    fn: Callable, args: tuple, kwargs: dict, book: HistoryBook | None = None, *, policy: _Policy
) -> Any:
    def run(traced):
        closed = traced.closed
        return _evaluate(closed.jaxpr, closed.consts, traced.arrays, policy, book)

    for _, rule in policy.rules():
        rule.reset()
    outs = call_traced(fn, args, kwargs, run)  # ScaledArray arguments: their data and scale
    for role, rule in policy.rules():
        rule.warn_unmatched(role)
    return outs


def _evaluate(
    jaxpr: jxi.Jaxpr,
    consts: Sequence,
    args: Sequence,
    policy: _Policy,
    book: HistoryBook | None = None,
) -> list:
    """Run ``jaxpr`` on ``args`` in the current trace, contractions replaced per ``policy``
    (with delayed scaling, their histories taken from ``book``)."""

    def eval_eqn(eqn: jxi.JaxprEqn, invals: list) -> list:
        with jxi.eqn_user_context(eqn):
            return _evaluate_eqn(eqn, invals, policy, book)

    return evaluate_jaxpr(jaxpr, consts, args, eval_eqn)


def _evaluate_eqn(
    eqn: jxi.JaxprEqn, invals: list, policy: _Policy, book: HistoryBook | None
) -> list:
    if eqn.primitive in _CONTRACTIONS:
        site = site_of(eqn, *invals)
        formats = policy.formats(site)
        if formats is not None:
            out = _contraction(eqn, invals, formats, site, policy, book)
            return [jxi.with_weak_type(out) if eqn.outvars[0].aval.weak_type else out]
    elif not _is_opaque(eqn.primitive) and _has_contraction_inside(eqn):
        if book is not None:
            return _inlined(eqn, invals, policy, book)
        eqn = jxi.map_jaxpr_params(eqn, functools.partial(_transform, policy=policy))
    return bind_eqn(eqn, invals)


def _contraction(eqn, invals, formats, site, policy: _Policy, book: HistoryBook | None):
    """The replacement of one selected contraction, in its original dtype."""
    if _is_block_dense(eqn, *invals, policy.block):
        return block_linear(*invals, policy.block).astype(eqn.outvars[0].aval.dtype)
    contraction = Contraction.of(eqn.primitive, eqn.params)
    if book is None:
        return cast_contraction(*invals, contraction, formats)
    return delayed_contraction(*invals, book.take(site), contraction, formats, policy.delayed)


_INLINED_CALLS = {jxi.jit_p: "jaxpr", jxi.closed_call_p: "call_jaxpr"}


def _inlined(eqn: jxi.JaxprEqn, invals: list, policy: _Policy, book: HistoryBook) -> list:
    """A call's body evaluated in place, so that its contractions take their histories from
    ``book`` (values unchanged: a nested ``jit`` is inlined into the outer one anyway)."""
    if eqn.primitive not in _INLINED_CALLS:
        raise NotImplementedError(
            f"dot_formats(scaling='delayed'): contractions inside {eqn.primitive.name} (at "
            f"{jxi.eqn_source_line(eqn)}) are not supported: an amax history belongs to a "
            "contraction that runs once per call (a loop body runs many times; a remat or "
            "custom-derivative body is re-run or replaced). Use scaling='current', or leave "
            "them out with exclude=."
        )
    closed = eqn.params[_INLINED_CALLS[eqn.primitive]]
    return _evaluate(closed.jaxpr, closed.consts, invals, policy, book)


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
