"""Scale-aware neural-network building blocks: FP8-aware linear, activations, norms, softmax.

Each function computes the same values as its ``jax.nn`` counterpart outside scalify; under
scalify it brings its own scale rule (:func:`jax_scaled.custom_scale`) instead of relying on
automatic propagation through its body.
"""

from jax_scaled.nn.activations import elu, gelu, leaky_relu, relu, silu, softplus, swish
from jax_scaled.nn.block_linear import (
    FP8_BLOCK128,
    MXFP4_WEIGHTS,
    MXFP8,
    MXFP8_E4M3_GRADS,
    BlockRecipe,
    block_linear,
)
from jax_scaled.nn.linear import linear
from jax_scaled.nn.normalization import layer_norm, rms_norm
from jax_scaled.nn.readout import linear_readout
from jax_scaled.nn.residual import residual_add, residual_split, residual_weights
from jax_scaled.nn.softmax import (
    dot_product_attention,
    log_softmax,
    softmax,
    softmax_cross_entropy,
)

__all__ = [
    "FP8_BLOCK128",
    "MXFP4_WEIGHTS",
    "MXFP8",
    "MXFP8_E4M3_GRADS",
    "BlockRecipe",
    "block_linear",
    "dot_product_attention",
    "elu",
    "gelu",
    "layer_norm",
    "leaky_relu",
    "linear",
    "linear_readout",
    "log_softmax",
    "relu",
    "residual_add",
    "residual_split",
    "residual_weights",
    "rms_norm",
    "silu",
    "softmax",
    "softmax_cross_entropy",
    "softplus",
    "swish",
]
