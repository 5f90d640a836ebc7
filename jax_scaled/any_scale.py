"""ANY_SCALE: the static fact that a value does not depend on its scale (scalify paper §3.4).

Zeros, infinities and NaNs are the same whatever scale multiplies them, and so is any
selection among them, such as an attention mask built with ``jnp.where(mask, 0., -inf)``.
When such a value meets a ScaledArray (in ``select_n``, ``max``, ``min``, ``add``,
``concatenate``, ...), scalify gives it the other operand's scale instead of estimating one,
so the result's scale is the meaningful operand's. The interpreter tracks the fact on its own
for constants and for values computed from them; a scale rule can assert it for an output.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class AnyScaleValue:
    """A rule output marked scale-independent (built by calling :data:`ANY_SCALE`)."""

    value: Any


class _AnyScale:
    """The ANY_SCALE marker. Call it on a rule's output to assert it is scale-independent.

    Example:
        >>> mask = jnp.where(jnp.arange(4) < 2, 0.0, -jnp.inf)  # the same at any scale
        >>> out = scalify(lambda x: x + mask)(scaled_array([1.0, 2.0, 3.0, 4.0], 2.0**-20))
        >>> float(out.scale) == 2.0**-20  # the mask took the other operand's scale
        True
    """

    def __call__(self, value: Any) -> AnyScaleValue:
        """Mark ``value`` (a plain array of zeros, infinities or NaNs) as scale-independent.

        Example:
            >>> from jax.extend.core import Primitive
            >>> blank_p = Primitive("blank_like")  # a user primitive: -inf shaped like x
            >>> @register_scale_rule(blank_p)
            ... def blank_rule(x):
            ...     return ANY_SCALE(jnp.full(x.shape, -jnp.inf, x.dtype))
        """
        if isinstance(value, AnyScaleValue):
            return value
        return AnyScaleValue(value)

    def __repr__(self) -> str:
        return "ANY_SCALE"


ANY_SCALE = _AnyScale()
