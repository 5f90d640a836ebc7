"""One kernel for all the scales a scalified program returns.

XLA:CPU compiles every kernel of a program separately, at a fixed cost of several
milliseconds each, and it gives every program output that it cannot fuse into another
kernel a kernel of its own. A scalified training step returns one new scale per parameter,
each a short chain of scalar arithmetic: without help that is one kernel per parameter.
:func:`bundle_scales` routes them through one multi-output operation instead
(``benchmarks/compile_breakdown.py`` counts the kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray


def bundle_scales(values: list, inputs: list) -> list:
    """``values`` with the traced scalar scales of their ScaledArrays (except those passed in
    unchanged from ``inputs``) computed by one multi-output operation: an identity, a
    variadic ``max`` over two copies of each scale, which XLA compiles as one kernel.
    Values are unchanged, under every transform.

    Example:
        >>> def rescaled(x):
        ...     outs = [ScaledArray(x.data, x.scale * 2), ScaledArray(x.data, x.scale * 4)]
        ...     return bundle_scales(outs, [x])
        >>> out = jax.jit(rescaled)(ScaledArray(jnp.ones(2), jnp.float32(2.0)))
        >>> [float(y.scale) for y in out]
        [4.0, 8.0]
    """
    passed_in = {id(x.scale) for x in inputs if isinstance(x, ScaledArray)}
    picked: dict[int, jax.Array] = {}
    for x in values:
        if _bundles(x) and id(x.scale) not in passed_in:
            picked.setdefault(id(x.scale), x.scale)
    if len(picked) < 2:
        return values
    scales = list(picked.values())
    copies = [lax.broadcast(s, (2,)) for s in scales]
    lowest = [np.array(-np.inf, s.dtype) for s in scales]
    bundled = dict(zip(picked, lax.reduce(copies, lowest, _elementwise_max, (0,)), strict=True))
    return [
        ScaledArray(x.data, bundled[id(x.scale)]) if id(getattr(x, "scale", None)) in bundled else x
        for x in values
    ]


def _bundles(x: object) -> bool:
    return (
        isinstance(x, ScaledArray)
        and isinstance(x.scale, jxi.Tracer)
        and x.scale.ndim == 0
        and x.scale.dtype in (jnp.float32, jnp.float16, jnp.bfloat16)
    )


def _elementwise_max(a: tuple, b: tuple) -> tuple:
    return tuple(lax.max(p, q) for p, q in zip(a, b, strict=True))
