"""Which contractions :func:`~jax_scaled.dot_policy.dot_formats` casts: the site a rule sees
and the rules that select sites (a predicate, operand shapes, flax module path patterns).

Shape and path rules remember what they matched during one call of the transformed function,
so that a rule that matched nothing (a typo, a transposed shape) is warned about at the
user's line.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_scaled import _jax_internals as jxi

Shape = tuple[int, ...]


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


class MatchingRule:
    """A rule of operand shapes or path patterns that reports the ones that matched nothing:
    :func:`~jax_scaled.dot_policy.dot_formats` resets it before a call, warns after."""

    def __init__(self, keys: tuple) -> None:
        self.keys = keys
        self.matched: set = set()
        self.seen: list[str] = []

    def __call__(self, site: ContractionSite) -> bool:
        if site.module_path not in self.seen:
            self.seen.append(site.module_path)
        found = {key for key in self.keys if self.matches(key, site)}
        self.matched |= found
        return bool(found)

    def matches(self, key: Any, site: ContractionSite) -> bool:
        raise NotImplementedError

    def reset(self) -> None:
        self.matched.clear()
        self.seen.clear()

    def warn_unmatched(self, role: str) -> None:
        """Warn, at the user's line, about the keys that matched no contraction."""
        missing = [key for key in self.keys if key not in self.matched]
        if missing:
            warnings.warn(
                self.unmatched_message(role, missing),
                self.warning_class(role),
                stacklevel=jxi.user_stacklevel(),
            )

    def unmatched_message(self, role: str, missing: list) -> str:
        raise NotImplementedError

    def warning_class(self, role: str) -> type[UserWarning]:
        return UnmatchedRuleWarning


class _PathRule(MatchingRule):
    """``has_module_path``'s predicate."""

    def matches(self, pattern: str, site: ContractionSite) -> bool:
        return re.fullmatch(pattern, site.module_path) is not None

    def unmatched_message(self, role: str, missing: list) -> str:
        seen = ", ".join(repr(p) for p in self.seen[:8]) or "none"
        return (
            f"dot_formats: {role} module path patterns {missing} match no contraction of "
            f"this function (re.fullmatch); its contractions' module paths: {seen}."
        )


class _ShapeRule(MatchingRule):
    """``has_operand_shape``'s predicate."""

    def matches(self, shape: Shape, site: ContractionSite) -> bool:
        return shape in (tuple(site.lhs.shape), tuple(site.rhs.shape))

    def unmatched_message(self, role: str, missing: list) -> str:
        return (
            f"dot_formats: {role} shapes {missing} match no operand of a contraction of this "
            "function (check the shape: operands are matched as written, e.g. (d_model, vocab))."
        )

    def warning_class(self, role: str) -> type[UserWarning]:
        return UnmatchedExcludeWarning if role == "exclude" else UnmatchedRuleWarning


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


def as_predicate(rule: Rule, role: str) -> Callable[[ContractionSite], bool] | None:
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


def site_of(eqn: jxi.JaxprEqn, lhs: Any, rhs: Any) -> ContractionSite:
    out = eqn.outvars[0].aval
    return ContractionSite(
        primitive=eqn.primitive.name,
        lhs=jax.ShapeDtypeStruct(np.shape(lhs), lhs.dtype),
        rhs=jax.ShapeDtypeStruct(np.shape(rhs), rhs.dtype),
        out=jax.ShapeDtypeStruct(out.shape, out.dtype),
        params=dict(eqn.params),
        source_line=jxi.eqn_source_line(eqn),
        module_path=jxi.eqn_module_path(eqn),
    )
