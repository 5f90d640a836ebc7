"""The range guard's factors (``scales/guard.py``): the largest magnitude they read, and
``(down, up)`` looked up by its binade, against a float64 definition of the band for every
exponent field, one guard at a time and several together; one small kernel a guard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compiled_computations
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jax_scaled.memo import scale_memo
from jax_scaled.pow2.xla import largest_magnitude
from jax_scaled.scales.guard import guard_band, guard_factors, guard_factors_together, guarded

NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


def every_exponent_field() -> np.ndarray:
    """A float32 in each of the 512 sign-and-exponent patterns (zeros, subnormals,
    infinities and NaNs of both signs included), mantissas varied."""
    tops = np.arange(512, dtype=np.uint32) << np.uint32(23)
    mantissas = np.resize(np.array([0, 1, 0x400000, 0x7FFFFF], np.uint32), 512)
    return (tops | mantissas).view(np.float32)


@pytest.mark.parametrize("size", [7, 4096, 5000])
@given(data=st.data())
def test_largest_magnitude_is_max_abs(size, data):
    finite = st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=True)
    x = data.draw(hnp.arrays(np.float32, (size,), elements=finite))
    assert float(largest_magnitude(jnp.asarray(x))) == float(np.max(np.abs(x)))
    assert float(jax.jit(largest_magnitude)(jnp.asarray(x.reshape(-1, 1)))) == np.max(np.abs(x))


@pytest.mark.parametrize("size", [7, 5000])
def test_data_with_an_infinity_is_not_shifted(size):
    x = np.full((size,), 2.0**30, np.float32)
    target = guard_band(jnp.float16)[2]
    assert float(guard_factors(jnp.asarray(x), jnp.float16)[1]) == 2.0 ** (30 - target)
    x[size // 2] = -np.inf
    assert float(guard_factors(jnp.asarray(x), jnp.float16)[1]) == 1.0


@pytest.mark.parametrize("size", [7, 5000])
def test_nan_gives_no_shift_or_is_ignored(size):
    """XLA's reductions differ on NaN (the small form propagates it, the large one may skip
    it): either way the guard stays sane, shifting by the finite data or not at all."""
    x = np.full((size,), 2.0**30, np.float32)
    x[size // 2] = np.nan
    target = guard_band(jnp.float16)[2]
    up = float(guard_factors(jnp.asarray(x), jnp.float16)[1])
    assert up in (1.0, 2.0 ** (30 - target))


def reference_guard(wide: np.ndarray, dtype, divisor_exponent: int) -> tuple[float, float]:
    """``(down, up)`` of the range guard, from its definition (float64, no bit tricks)."""
    low, high, target = guard_band(dtype)
    neutral = (2.0**-divisor_exponent, 1.0)
    largest = float(np.max(np.abs(wide.astype(np.float64))))
    if not np.isfinite(largest) or largest < 2.0**-126:  # overflowed, zero or subnormal
        return neutral
    exponent = int(np.floor(np.log2(largest))) - divisor_exponent
    if low <= exponent < high:
        return neutral
    shift = max(exponent - target, -126)
    return 2.0 ** (-shift - divisor_exponent), 2.0**shift


@pytest.mark.parametrize("dtype", NARROW)
@given(data=st.data())
def test_guard_factors_match_their_definition(dtype, data):
    """The guard's factors (looked up by the largest datum's binade) against the plain
    definition, for data anywhere in float32's range, zeros, subnormals and infinities, with
    a folded power-of-two divisor."""
    magnitude = data.draw(st.integers(-149, 127))
    values = st.floats(-(2.0**magnitude), 2.0**magnitude, width=32, allow_nan=False)
    wide = data.draw(hnp.arrays(np.float32, data.draw(st.integers(1, 40)), elements=values))
    if data.draw(st.booleans()):
        wide[0] = data.draw(st.sampled_from([0.0, np.inf, -np.inf, 2.0**-140, 2.0**127]))
    divisor_exponent = data.draw(st.integers(0, 12))
    down, up = jax.jit(guard_factors, static_argnums=(1, 2))(wide, dtype, divisor_exponent)
    assert (float(down), float(up)) == reference_guard(wide, dtype, divisor_exponent)


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("divisor_exponent", [0, 1, 5, 12])
def test_guard_factors_at_every_exponent_field(dtype, divisor_exponent):
    """Every float32 sign and exponent field of the largest datum (zeros, subnormals,
    infinities, NaNs), against the plain definition: ``down`` is worked out from ``up`` by a
    division, exact only while both stay normal."""
    largest = every_exponent_field()
    wide = np.stack([largest, -largest / 4], axis=1)  # the largest magnitude is the first
    factors = jax.jit(jax.vmap(lambda w: guard_factors(w, dtype, divisor_exponent)))
    down, up = (np.asarray(f) for f in factors(wide))
    for row, d, u in zip(wide, down, up, strict=True):
        assert (float(d), float(u)) == reference_guard(row, dtype, divisor_exponent), row[0]


GUARD_INPUTS = (jax.random.normal(jax.random.key(0), (64, 64)), jnp.float32(2.0**-20))


def guarded_and_read_twice(wide: jax.Array, scale: jax.Array) -> tuple[jax.Array, ...]:
    """Float16 data range-guarded, its data read by two kernels, its scale by two more."""
    y = guarded(wide, scale, jnp.float16)
    data = y.data.astype(jnp.float32)
    return jnp.sin(data), jnp.exp(data).T, y.scale * 3.0, y.scale - 1.0


def test_guard_factors_take_one_small_kernel_and_no_reduction_of_their_own():
    # ``up`` is stored by an exact remainder, which XLA does not copy into its readers, and
    # ``down`` divided out of it: a variadic reduction carrying both (and the reduction's
    # region, and two tuple reads per guard) cost the 1-layer GPT's float16 step 4% more.
    lines = [line for body in compiled_computations(guarded_and_read_twice, *GUARD_INPUTS).values()
             for line in body]  # fmt: skip
    float_reductions = [line for line in lines if " reduce(" in line and "= pred[]" not in line]
    assert len(float_reductions) == 1  # the largest magnitude only
    assert sum(" remainder(" in line for line in lines) == 1


@pytest.mark.parametrize("dtype", NARROW)
def test_guard_factors_worked_out_together_are_those_of_the_definition(dtype):
    """The vector form (one kernel for a step's parameter casts) at every exponent field."""
    largest = every_exponent_field()

    def together(values):
        wides = [jnp.reshape(v, (1,)) + 0 for v in values]  # traced: they qualify
        with scale_memo():
            guard_factors_together(wides, dtype)
            return [jnp.stack(guard_factors(w, dtype)) for w in wides]

    factors = [f for chunk in np.split(largest, 8) for f in jax.jit(together)(list(chunk))]
    for value, (down, up) in zip(largest, factors, strict=True):
        assert (float(down), float(up)) == reference_guard(np.array([value]), dtype, 0), value


def test_a_guard_factor_is_one_lookup_and_no_range_test():
    bodies = compiled_computations(guarded_and_read_twice, *GUARD_INPUTS).values()
    lookups = [body for body in bodies if any(" dynamic-slice(" in line for line in body)]
    assert len(lookups) == 1
    assert not any(" compare(" in line for line in lookups[0])
