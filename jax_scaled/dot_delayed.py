"""Delayed scaling for :func:`~jax_scaled.dot_policy.dot_formats`: one amax history per
contraction, in an explicit state the training step carries.

``dot_formats(fn, scaling="delayed")`` returns a :class:`DelayedFormats`: ``init`` traces
``fn`` once and makes the state, a dict of
:class:`~jax_scaled.nn.delayed_contraction.ContractionHistory` keyed by the contractions in
program order (``"003:GPT/Block_0/fc"``); calling it with the state first runs ``fn`` with
each cast scaled from its contraction's history. As in flax's FP8 ops, the next state is the
gradient with respect to the state: differentiate with respect to it too,
``jax.grad(f, argnums=(0, 1))(state, params, ...)``, and carry that gradient as the state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jax_scaled.contraction_rules import ContractionSite
from jax_scaled.nn.delayed_contraction import ContractionHistory
from jax_scaled.ops.delayed import DelayedScaling

History = dict[str, ContractionHistory]


class HistoryBook:
    """The histories of one call, handed to its contractions in program order; a book
    without ``state`` (``init``) hands out empty ones and only lists the contractions."""

    def __init__(self, recipe: DelayedScaling, state: Mapping[str, Any] | None = None) -> None:
        self.recipe = recipe
        self.state = None if state is None else _checked_state(state)
        self.keys: list[str] = []

    def take(self, site: ContractionSite) -> ContractionHistory:
        """The history of the next contraction, ``site``."""
        key = f"{len(self.keys):03d}:{site.module_path or site.primitive}"
        self.keys.append(key)
        if self.state is None:
            return ContractionHistory.zeros(self.recipe.history_len)
        if key not in self.state:
            raise ValueError(
                f"dot_formats(scaling='delayed'): the state has no history for contraction "
                f"{key!r} ({site.source_line}); it holds {sorted(self.state)[:6]}. Make the "
                "state with .init(...) on arguments of the same structure and shapes."
            )
        return self.state[key]

    def check_complete(self) -> None:
        """Refuse a state with histories of contractions this call did not have."""
        extra = sorted(set(self.state or ()) - set(self.keys))
        if extra:
            raise ValueError(
                f"dot_formats(scaling='delayed'): the state holds histories of contractions "
                f"this function does not have: {extra[:6]}. Make the state with .init(...) "
                "for this function."
            )


def _checked_state(state: Any) -> Mapping[str, ContractionHistory]:
    if not isinstance(state, Mapping) or not all(
        isinstance(h, ContractionHistory) for h in state.values()
    ):
        raise TypeError(
            "dot_formats(scaling='delayed'): the first argument is the state made by .init(...) "
            "(a dict of ContractionHistory; restore a checkpoint into its structure with "
            f"js.tree.rebuild_like), got {type(state).__name__}."
        )
    return state


class DelayedFormats:
    """``fn`` with FP8 contractions scaled from amax histories: ``f(state, *args)``.

    Made by ``dot_formats(fn, scaling="delayed")`` (or ``scaling=js.ops.DelayedScaling(...)``).
    ``init(*args)`` gives the first state (empty histories: the first step scales as current
    scaling does). ``f(state, *args, **kwargs)`` returns ``fn(*args, **kwargs)``. The next
    state is the gradient with respect to ``state``. Call ``f`` once per step (a second call
    on the same state would add up the two gradients).

    Example:
        >>> import optax
        >>> def loss(w, x):
        ...     return jnp.mean((x @ w) ** 2)
        >>> f = dot_formats(loss, scaling="delayed")
        >>> w, x = jnp.full((16, 4), 0.25), jnp.full((8, 16), 2.0**-20)
        >>> state = f.init(w, x)
        >>> list(state), state["000:dot_general"].lhs.shape
        (['000:dot_general'], (1024,))
        >>> value, (state, g) = jax.value_and_grad(f, argnums=(0, 1))(state, w, x)
        >>> float(state["000:dot_general"].lhs[0]) * 2**20  # this step's amax of x
        1.0
        >>> bool(jnp.isclose(value, loss(w, x), rtol=0.07))  # E4M3 operands, scaled
        True
    """

    def __init__(self, fn: Callable, call: Callable, recipe: DelayedScaling) -> None:
        self.fn, self.recipe, self._call = fn, recipe, call
        functools.update_wrapper(self, fn)

    def init(self, *args: Any, **kwargs: Any) -> History:
        """Empty histories for every contraction ``fn(*args, **kwargs)`` casts (traced, not
        run).

        Example:
            >>> f = dot_formats(lambda x, w: jnp.tanh(x @ w) @ w.T, scaling="delayed")
            >>> sorted(f.init(jnp.ones((2, 8)), jnp.ones((8, 8))))
            ['000:dot_general', '001:dot_general']
        """
        book = HistoryBook(self.recipe)
        jax.eval_shape(lambda: self._call(self.fn, args, kwargs, book))
        return {key: ContractionHistory.zeros(self.recipe.history_len) for key in book.keys}

    def __call__(self, state: Mapping[str, ContractionHistory], *args: Any, **kwargs: Any):
        book = HistoryBook(self.recipe, state)
        out = self._call(self.fn, args, kwargs, book)
        book.check_complete()
        return out
