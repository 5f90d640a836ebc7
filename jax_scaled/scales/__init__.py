"""Scale math on ScaledArrays, for scale rules, ``nn``, ``ops`` and ``optim``.

* :mod:`~jax_scaled.scales.values`: align operands to a common scale, rescale data exactly,
  round an estimate and cast it to the scale dtype;
* :mod:`~jax_scaled.scales.guard`: the range guard of narrow data;
* :mod:`~jax_scaled.scales.geometry`: the geometry of block scales (grids, block-major layout).

It sits above :class:`~jax_scaled.ScaledArray` and the power-of-two arithmetic of
:mod:`jax_scaled.pow2`, and re-exports the names of its modules.

Example:
    >>> import jax.numpy as jnp
    >>> from jax_scaled import scaled_array
    >>> from jax_scaled.scales import align
    >>> (a, b), scale = align(scaled_array(jnp.ones(2), 4.0), scaled_array(jnp.ones(2), 1.0))
    >>> float(scale), b.tolist()
    (4.0, [0.25, 0.25])
"""

from jax_scaled.scales.geometry import (
    common_blocks,
    from_block_major,
    grid,
    is_blocked,
    scale_on_grid,
    split_at_largest,
    to_block_major,
)
from jax_scaled.scales.guard import (
    WIDE_CARRY_BAND,
    carry_band,
    carry_largest_magnitude,
    cast_guarded,
    centre_exponent,
    centred,
    fitting_scale,
    guard_band,
    guard_factors,
    guard_factors_together,
    guarded,
    products_guarded,
    recentred_carry,
    sums_guarded,
    top_of_format,
    widened,
)
from jax_scaled.scales.values import (
    align,
    as_scaled,
    from_compute,
    make_scale,
    max_scale,
    min_scale,
    out_scale_dtype,
    per_tensor_scale,
    ratio_to_pow2,
    rescale,
    round_scale,
    rounded_l2_scale,
    safe_ratio,
    scale_f32,
    scale_mul,
    scale_reciprocal,
    sqrt_pow2,
    times_scalar,
    to_compute,
    wide_data,
)

__all__ = [
    "WIDE_CARRY_BAND",
    "align",
    "as_scaled",
    "carry_band",
    "carry_largest_magnitude",
    "cast_guarded",
    "centre_exponent",
    "centred",
    "common_blocks",
    "fitting_scale",
    "from_block_major",
    "from_compute",
    "grid",
    "guard_band",
    "guard_factors",
    "guard_factors_together",
    "guarded",
    "is_blocked",
    "make_scale",
    "max_scale",
    "min_scale",
    "out_scale_dtype",
    "per_tensor_scale",
    "products_guarded",
    "ratio_to_pow2",
    "recentred_carry",
    "rescale",
    "round_scale",
    "rounded_l2_scale",
    "safe_ratio",
    "scale_f32",
    "scale_mul",
    "scale_on_grid",
    "scale_reciprocal",
    "split_at_largest",
    "sqrt_pow2",
    "sums_guarded",
    "times_scalar",
    "to_block_major",
    "to_compute",
    "top_of_format",
    "widened",
    "wide_data",
]
