"""Per-trace memo of scale arithmetic: derive each traced quantity once per scalified call.

Scale rules derive the same quantities from the same traced scales over and over: the two
sides of an ``add`` both need the reciprocal of the common scale, and a traced scalar
(optax's bias correction, a scheduled learning rate) is split into mantissa and power of
two once for every parameter it meets. Each repetition is a few more equations to trace,
lower and compile. :func:`memoized` computes such a quantity once per traced key and trace,
for the duration of a :func:`scale_memo` block (``scalify`` opens one per call).

Entries hold the key and the trace they were computed under, so an id is never reused while
the memo lives, and a value computed under one trace (a loop body's) is never handed to
another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from jax_scaled import _jax_internals as jxi
from jax_scaled import context

T = TypeVar("T")


@contextlib.contextmanager
def scale_memo() -> Iterator[None]:
    """A block in which :func:`memoized` reuses what it computed (nested blocks start empty).

    Example:
        >>> with scale_memo():
        ...     memo_size()
        0
    """
    with context.entered(memo={}):
        yield


def memoized(kind: str, key: Any, compute: Callable[[], T]) -> T:
    """``compute()``, reused for the same traced ``key``, ``kind`` and trace in the innermost
    :func:`scale_memo` block. Outside any block, or for a concrete ``key``, it just computes.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> reused = []
        >>> def f(x):
        ...     with scale_memo():
        ...         doubled = memoized("double", x, lambda: x * 2)
        ...         reused.append(doubled is memoized("double", x, lambda: x * 2))
        ...     return doubled
        >>> float(jax.jit(f)(jnp.float32(1.0))), reused
        (2.0, [True])
    """
    memo = context.current().memo
    if memo is None or not isinstance(key, jxi.Tracer):
        return compute()
    trace = jxi.current_trace()
    entry_key = (kind, id(key), id(trace))
    entry = memo.get(entry_key)
    if entry is not None and entry[0] is key and entry[1] is trace:
        return entry[2]
    value = compute()
    memo[entry_key] = (key, trace, value)
    return value


def recorded(kind: str, key: Any) -> Any | None:
    """What :func:`memoized` holds for ``kind`` and the traced ``key`` under the current trace,
    or None (nothing computed yet, no :func:`scale_memo` block, a concrete ``key``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> seen = []
        >>> def f(x):
        ...     with scale_memo():
        ...         seen.append(recorded("double", x))
        ...         doubled = memoized("double", x, lambda: x * 2)
        ...         seen.append(recorded("double", x) is doubled)
        ...     return doubled
        >>> float(jax.jit(f)(jnp.float32(1.0))), seen
        (2.0, [None, True])
    """
    memo = context.current().memo
    if memo is None or not isinstance(key, jxi.Tracer):
        return None
    trace = jxi.current_trace()
    entry = memo.get((kind, id(key), id(trace)))
    if entry is None or entry[0] is not key or entry[1] is not trace:
        return None
    return entry[2]


def memo_size() -> int:
    """Entries in the innermost :func:`scale_memo` block (0 outside any)."""
    memo = context.current().memo
    return 0 if memo is None else len(memo)
