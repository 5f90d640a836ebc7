"""Power-of-two arithmetic below :class:`~jax_scaled.ScaledArray`.

Every scale jax_scaled produces is an exact power of two in ``[2^-126, 2^127]``: the normal
range of float32, which is also inside E8M0 (``float8_e8m0fnu``). Staying in that range keeps
scales exact on backends that flush float32 subnormals (XLA's CPU backend does), and makes the
float32 and E8M0 scale dtypes agree bit for bit.

* :mod:`~jax_scaled.pow2.static`: trace-time arithmetic (Python and numpy): a static scale
  costs nothing in the compiled program;
* :mod:`~jax_scaled.pow2.traced`: the same on traced float32 scales, with ``lax`` operations
  on exponent fields: exact splits, ratios and reciprocals, roundings to a power of two;
* :mod:`~jax_scaled.pow2.xla`: the few XLA-specific choices, with the measurements behind
  them.
"""
