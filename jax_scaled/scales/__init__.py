"""The scale-math library: power-of-two arithmetic for scale rules, ``nn``, ``ops`` and ``optim``.

Every scale jax_scaled produces is an exact power of two in ``[2^-126, 2^127]``: the normal
range of float32, which is also inside E8M0 (``float8_e8m0fnu``). Staying in that range keeps
scales exact on backends that flush float32 subnormals (XLA's CPU backend does), and makes the
float32 and E8M0 scale dtypes agree bit for bit. The library has one module per layer:

* :mod:`jax_scaled.scales.static`: trace-time power-of-two arithmetic (Python and numpy): a
  static scale costs nothing in the compiled program;
* :mod:`jax_scaled.scales.traced`: the same on traced float32 scales, with ``lax`` operations
  on exponent fields; exact splits, ratios and reciprocals, roundings to a power of two;
* :mod:`jax_scaled.scales.values`: arithmetic on ScaledArrays for scale rules (align operands
  to a common scale, rescale data exactly, round an estimate and cast it to the scale dtype);
* :mod:`jax_scaled.scales.guard`: the range guard of narrow data;
* :mod:`jax_scaled.scales.xla`: the few XLA-specific choices, with the measurements behind
  them.

Import from the module that holds a name (``from jax_scaled.scales.values import align``):
this package imports none of them, so that :mod:`jax_scaled.array` can use the power-of-two
modules without a cycle.

Example:
    >>> from jax_scaled.scales.static import static_pow2_split
    >>> static_pow2_split(-6.0)
    (-1.5, 4.0)
"""
