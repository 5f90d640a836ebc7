"""ScalifyConfig: how scalify rounds scales and which dtype it stores them in."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jax_scaled import context
from jax_scaled.dtypes import BLOCK_SCALE_DTYPES
from jax_scaled.pow2.static import Rounding


@dataclasses.dataclass(frozen=True)
class ScalifyConfig:
    """Settings read by scale rules while ``scalify`` traces a function.

    Args:
        rounding: how estimated scales are rounded to powers of two: ``"down"`` (default, as
            the scalify paper recommends), ``"up"`` or ``"nearest"``.
        scale_dtype: dtype of the scales rules create: ``None`` (default) keeps the dtype of
            the input scales (float32 when there are none), or ``jnp.float32`` /
            ``jnp.float8_e8m0fnu`` to force one.
        guard: keep narrow data in range (default ``True``). Static scale estimates assume
            independent terms; correlated ones (a bias gradient summed over a batch, attention
            logits of a trained model) make the data drift from unit scale, and float16 or float8
            data then overflows or underflows. With ``guard``, the rules whose estimate can drift
            (matmuls, convolutions, sums, powers, quotients by a non-constant, narrowing casts, and
            the joins of independently scaled values: gradient accumulation ``add_any``,
            ``concatenate``, ``stack``) check the largest output datum of a float16/float8 result,
            and move a power of two into the scale when it leaves the format's comfortable range
            (one max reduction, fused with the op). Healthy data gives the static result exactly. It
            also keeps the float32 data of loop carries within ``2^+-8`` of 1, and gives a
            one-element result that is zero at run time the smallest scale. ``False`` keeps purely
            static scales.
        guard_sums: also guard the outputs of ``add`` and ``sub`` in float16/float8
            (default ``False``; only with ``guard``). A sum takes the larger operand
            scale; when that operand's values are far below its scale, the other operand's
            data underflows. With ``guard_sums`` the sum is formed in float32 and
            re-centred, as ``add_any`` always is under ``guard``. Each guarded sum costs a
            max reduction: more compile time and memory traffic. Under ``guard`` alone,
            the sums of two unbroadcast tensors read twice or more (a residual stream)
            are guarded already.

    Use it as a context manager around the call that traces (the first call of a jitted
    function), or pass it to ``scalify(fn, config=...)``:

    Example:
        >>> with ScalifyConfig(rounding="nearest"):
        ...     current_config().rounding
        <Rounding.NEAREST: 'nearest'>
    """

    rounding: Rounding | str = Rounding.DOWN
    scale_dtype: Any = None
    guard: bool = True
    guard_sums: bool = False

    def __post_init__(self):
        object.__setattr__(self, "rounding", Rounding(self.rounding))
        if self.scale_dtype is not None:
            dtype = jnp.dtype(self.scale_dtype)
            if dtype not in BLOCK_SCALE_DTYPES:
                raise ValueError(f"scale_dtype must be float32 or float8_e8m0fnu, got {dtype}.")
            object.__setattr__(self, "scale_dtype", dtype)

    def __enter__(self) -> ScalifyConfig:
        context.push(config=self)
        return self

    def __exit__(self, *exc) -> None:
        context.pop()


_DEFAULT = ScalifyConfig()


def current_config() -> ScalifyConfig:
    """The innermost active ScalifyConfig (the default one outside any ``with`` block).

    Example:
        >>> with ScalifyConfig(rounding="up"):
        ...     current_config().rounding
        <Rounding.UP: 'up'>
        >>> current_config().rounding
        <Rounding.DOWN: 'down'>
    """
    return context.current().config or _DEFAULT
