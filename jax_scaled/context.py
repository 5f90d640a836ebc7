"""The per-call context: the state of the innermost ``scalify`` call, in a stack per thread.

A :class:`Context` holds what the engine and the ops read while scalify traces and then
interprets a function: the active config, the call's scale memo and recovered constants, the
scale recorder, whether scalify is tracing the user's function or running its rules, and
the source line of the enclosing higher-order equation. Each ``with`` block that changes
one of them (``ScalifyConfig``, ``record_scales``, one ``scalify`` call, ...) pushes a copy
of the innermost context with that change (:func:`entered`), and pops it on exit; the
modules read it with :func:`current`. A call also pauses Python's cyclic garbage collector
(:func:`collector_paused`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any


class ThreadStack(threading.local):
    """A list of its own in every thread (``items``), started from ``initial()``.

    Example:
        >>> configs = ThreadStack(lambda: ["default"])
        >>> configs.items.append("inner")
        >>> configs.items
        ['default', 'inner']
    """

    def __init__(self, initial: Callable[[], list] = list) -> None:
        self.items: list[Any] = initial()


@dataclasses.dataclass
class Context:
    """The state read while scalify traces and interprets a function (see :func:`current`).

    Attributes:
        config: the active ``ScalifyConfig`` (None: the default one, see
            :func:`jax_scaled.config.current_config`).
        memo: the scale memo of the call's rules (:mod:`jax_scaled.memo`); None: no memo.
        constants: the call's literals that a narrow trace rounded away
            (``engine.constants.TrueConstants``); None: none recovered.
        recorder: the innermost ``record_scales`` recorder; None: not recording.
        scalify_tracing: scalify is tracing the user's function (``js.quantize`` then binds
            its primitive).
        engine_builds: scalify's rules are running: the ScaledArrays they build have power
            of two scales already (the constructor skips the normalisation of user values).
        enclosing_line: the user's source line of the innermost higher-order equation being
            interpreted ("" outside any).

    Example:
        >>> Context().memo is None, Context().scalify_tracing
        (True, False)
    """

    config: Any = None
    memo: dict | None = None
    constants: Any = None
    recorder: Any = None
    scalify_tracing: bool = False
    engine_builds: bool = False
    enclosing_line: str = ""


_contexts = ThreadStack(lambda: [Context()])


def current() -> Context:
    """The innermost context of this thread (an empty :class:`Context` outside any block).

    Example:
        >>> with entered(enclosing_line="model.py:3"):
        ...     current().enclosing_line
        'model.py:3'
        >>> current().enclosing_line
        ''
    """
    return _contexts.items[-1]


def push(**changes: Any) -> Context:
    """Make a copy of the innermost context, with ``changes``, the innermost; returns it.
    Undo with :func:`pop` (a ``with`` block: :func:`entered`)."""
    context = dataclasses.replace(_contexts.items[-1], **changes)
    _contexts.items.append(context)
    return context


def pop() -> None:
    """Drop the innermost context (the one the last :func:`push` made)."""
    _contexts.items.pop()


@contextlib.contextmanager
def entered(**changes: Any) -> Iterator[Context]:
    """A block whose context is the enclosing one with ``changes`` (fields of :class:`Context`).

    Example:
        >>> with entered(scalify_tracing=True) as inner:
        ...     inner is current(), current().scalify_tracing
        (True, True)
        >>> current().scalify_tracing
        False
    """
    context = push(**changes)
    try:
        yield context
    finally:
        pop()


@contextlib.contextmanager
def scalify_call(config: Any = None) -> Iterator[Context]:
    """The one context of a ``scalify`` call: under ``config`` (default: the active one), it
    starts tracing the user's function; :func:`start_rules` then switches it to running the
    rules, with a fresh scale memo and the call's recovered ``constants``.

    Example:
        >>> with scalify_call() as call:
        ...     tracing = call.scalify_tracing, call.engine_builds
        ...     start_rules(constants=None)
        ...     rules = call.scalify_tracing, call.engine_builds, call.memo
        >>> tracing, rules
        ((True, False), (False, True, {}))
    """
    changes = {} if config is None else {"config": config}
    with collector_paused(), entered(scalify_tracing=True, **changes) as context:
        yield context


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, and on again after it if it was
    on (the outermost block decides; a nested one, or one entered with the collector off,
    leaves it as it is).

    A trace builds tens of thousands of live objects (equations, variables, avals) and frees
    none in cycles, but each of the collector's full passes walks all of them: about a
    third of the 8-layer Table 3 GPT's float16 trace under ``jax.jit`` (``docs/benchmarks.md``,
    "... the trace without the garbage collector"). Objects in cycles made meanwhile wait
    for the collector's next pass after the block.

    Example:
        >>> with collector_paused():
        ...     paused = not gc.isenabled()
        >>> paused, gc.isenabled()
        (True, True)
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def start_rules(constants: Any) -> None:
    """Switch the innermost :func:`scalify_call` context from tracing to running rules."""
    context, enclosing = _contexts.items[-1], _contexts.items[-2]
    context.scalify_tracing = enclosing.scalify_tracing  # a nested call keeps the outer trace's
    context.engine_builds = True
    context.memo = {}
    context.constants = constants
