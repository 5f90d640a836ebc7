"""Scaling operations: dynamic rescaling, casts and delayed scaling (identities outside scalify).

Example:
    >>> from jax_scaled import ops
    >>> x = scaled_array(jnp.full(4, 2.0**-20), 1.0, jnp.float16)
    >>> y = scalify(lambda x: ops.cast_on_forward(ops.dynamic_rescale_l2(x), jnp.float8_e4m3fn))(x)
    >>> y.data.dtype, float(y.scale) == 2.0**-20
    (dtype(float8_e4m3fn), True)
"""

from jax_scaled.ops.blocks import merge_blocks
from jax_scaled.ops.casts import (
    cast_on_backward,
    cast_on_forward,
    reduce_precision_on_backward,
    reduce_precision_on_forward,
)
from jax_scaled.ops.delayed import DelayedScaling, DelayedScalingState, amax
from jax_scaled.ops.rescale import (
    dynamic_rescale_l1,
    dynamic_rescale_l1_grad,
    dynamic_rescale_l2,
    dynamic_rescale_l2_grad,
    dynamic_rescale_max,
    dynamic_rescale_max_grad,
)

__all__ = [
    "merge_blocks",
    "DelayedScaling",
    "DelayedScalingState",
    "amax",
    "cast_on_backward",
    "cast_on_forward",
    "dynamic_rescale_l1",
    "dynamic_rescale_l1_grad",
    "dynamic_rescale_l2",
    "dynamic_rescale_l2_grad",
    "dynamic_rescale_max",
    "dynamic_rescale_max_grad",
    "reduce_precision_on_backward",
    "reduce_precision_on_forward",
]
