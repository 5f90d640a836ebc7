"""jax_scaled: FP16 and FP8 training in JAX by scale propagation.

Example:
    >>> import jax, jax.numpy as jnp, jax_scaled as js
    >>> f = js.scalify(lambda x: x @ x.T)
    >>> out = f(js.as_scaled_array(jnp.ones((2, 4), jnp.float16)))
    >>> float(js.asarray(out)[0, 0])
    4.0
"""

from jax_scaled import diagnostics, formats, nn, ops, optim, tree
from jax_scaled import rules as _rules  # noqa: F401  (registers the scale rules)
from jax_scaled.any_scale import ANY_SCALE
from jax_scaled.array import ScaledArray
from jax_scaled.config import ScalifyConfig, current_config
from jax_scaled.construction import as_scaled_array, asarray, is_scaled_leaf, scaled_array
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dot_policy import ContractionSite, dot_formats, has_module_path, has_operand_shape
from jax_scaled.engine.constants import ConstantPrecisionWarning
from jax_scaled.engine.interpreter import scalify
from jax_scaled.engine.registry import register_scale_rule, registered_primitives
from jax_scaled.pow2.static import Rounding
from jax_scaled.pow2.traced import pow2_round, pow2_split
from jax_scaled.primitives import get_data_and_scale, rebalance, set_scaling, stop_scaling
from jax_scaled.quantize import quantize
from jax_scaled.rules.higher_order.collectives import scaled_shardings

__version__ = "0.1.0"

__all__ = [
    "ANY_SCALE",
    "ConstantPrecisionWarning",
    "ContractionSite",
    "Rounding",
    "ScaledArray",
    "ScalifyConfig",
    "as_scaled_array",
    "asarray",
    "current_config",
    "diagnostics",
    "custom_scale",
    "dot_formats",
    "formats",
    "get_data_and_scale",
    "has_module_path",
    "has_operand_shape",
    "is_scaled_leaf",
    "nn",
    "ops",
    "optim",
    "pow2_round",
    "pow2_split",
    "quantize",
    "rebalance",
    "register_scale_rule",
    "registered_primitives",
    "scalify",
    "scaled_array",
    "scaled_shardings",
    "set_scaling",
    "stop_scaling",
    "tree",
]
