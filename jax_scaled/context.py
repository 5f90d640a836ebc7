"""A list per thread: the stacks of active configs, scale memos and scale recorders."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
