"""The range guard's factors for every binade of the largest magnitude, against a float64
reference of the band (``scales/guard.py``): looked up by the magnitude's sign and exponent
bits, they must be what the band says for each of them, zeros, subnormals, infinities and
NaNs of either sign included, one guard at a time and several together."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_scaled.memo import scale_memo
from jax_scaled.scales.guard import guard_band, guard_factors, guard_factors_together

NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def _every_binade() -> np.ndarray:
    """A float32 in each of the 512 sign-and-exponent patterns, mantissas varied."""
    tops = np.arange(512, dtype=np.uint32) << np.uint32(23)
    mantissas = np.resize(np.array([0, 1, 0x400000, 0x7FFFFF], np.uint32), 512)
    return (tops | mantissas).view(np.float32)


def _reference_up(largest: float, band: tuple[int, int, int], divisor_exponent: int) -> float:
    """The guard's ``up``, from the band's definition in float64."""
    low, high, target = (e + divisor_exponent for e in band)
    magnitude = abs(largest)
    if not math.isfinite(magnitude) or magnitude < 2.0**-126:  # zero and subnormals too
        return 1.0
    exponent = math.floor(math.log2(magnitude))
    if low <= exponent < high:
        return 1.0
    return 2.0 ** (max(exponent, target - 126) - target)


def _factors_one_by_one(values, dtype, divisor_exponent):
    def factors(value):
        with scale_memo():
            return guard_factors(jnp.reshape(value, (1,)), dtype, divisor_exponent)

    return jax.jit(jax.vmap(factors))(values)


@pytest.mark.parametrize("divisor_exponent", [0, 5])
@pytest.mark.parametrize("dtype", NARROW)
def test_the_guard_factor_of_every_binade_is_the_band_s(dtype, divisor_exponent):
    values = _every_binade()
    down, up = (
        np.asarray(f, np.float64) for f in _factors_one_by_one(values, dtype, divisor_exponent)
    )
    band = guard_band(dtype)
    expected = [_reference_up(float(v), band, divisor_exponent) for v in values]
    assert up.tolist() == expected
    assert (down * up).tolist() == [2.0**-divisor_exponent] * len(values)


@pytest.mark.parametrize("dtype", NARROW)
def test_guard_factors_worked_out_together_are_those_of_each_binade(dtype):
    values = _every_binade()

    def together(values):
        wides = [jnp.reshape(v, (1,)) + 0 for v in values]  # traced: they qualify
        with scale_memo():
            guard_factors_together(wides, dtype)
            return jnp.stack([guard_factors(w, dtype)[1] for w in wides])

    chunks = np.split(values, 8)  # 64 guards a kernel, as a step's parameter casts
    up = np.concatenate([np.asarray(jax.jit(together)(list(c))) for c in chunks])
    expected = [_reference_up(float(v), guard_band(dtype), 0) for v in values]
    assert up.astype(np.float64).tolist() == expected


def test_a_guard_factor_is_one_lookup_in_a_kernel_of_its_own():
    def guarded_scale(x):
        with scale_memo():
            return guard_factors(x, jnp.float16)[1]

    compiled = jax.jit(guarded_scale).lower(jnp.ones(4096)).compile().as_text()
    assert compiled.count("dynamic-slice(") == 1
    assert "compare(" not in compiled  # no range tests left in the arithmetic
