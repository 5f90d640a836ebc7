"""ScalifyConfig: how scalify rounds scales and which dtype it stores them in."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax.numpy as jnp

from jax_scaled.pow2 import Rounding

_SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e8m0fnu))


@dataclasses.dataclass(frozen=True)
class ScalifyConfig:
    """Settings read by scale rules while ``scalify`` traces a function.

    Args:
        rounding: how estimated scales are rounded to powers of two: ``"down"`` (default, as
            the scalify paper recommends), ``"up"`` or ``"nearest"``.
        scale_dtype: dtype of the scales rules create: ``None`` (default) keeps the dtype of
            the input scales (float32 when there are none), or ``jnp.float32`` /
            ``jnp.float8_e8m0fnu`` to force one.

    Use it as a context manager around the call that traces (the first call of a jitted
    function), or pass it to ``scalify(fn, config=...)``:

    Example:
        >>> with ScalifyConfig(rounding="nearest"):
        ...     current_config().rounding
        <Rounding.NEAREST: 'nearest'>
    """

    rounding: Rounding | str = Rounding.DOWN
    scale_dtype: Any = None

    def __post_init__(self):
        object.__setattr__(self, "rounding", Rounding(self.rounding))
        if self.scale_dtype is not None:
            dtype = jnp.dtype(self.scale_dtype)
            if dtype not in _SCALE_DTYPES:
                raise ValueError(f"scale_dtype must be float32 or float8_e8m0fnu, got {dtype}.")
            object.__setattr__(self, "scale_dtype", dtype)

    def __enter__(self) -> ScalifyConfig:
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()


_local = threading.local()


def _stack() -> list[ScalifyConfig]:
    if not hasattr(_local, "stack"):
        _local.stack = [ScalifyConfig()]
    return _local.stack


def current_config() -> ScalifyConfig:
    """The innermost active ScalifyConfig (the default one outside any ``with`` block)."""
    return _stack()[-1]
