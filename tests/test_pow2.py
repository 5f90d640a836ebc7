"""Power-of-two splits and rounding: exact in every float format, subnormals included."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_scaled.engine.promotion import zero_factor_scale
from jax_scaled.pow2.static import is_pow2, static_pow2_round
from jax_scaled.pow2.traced import (
    pow2_exponent,
    pow2_reciprocal,
    pow2_round,
    pow2_round_positive,
    pow2_round_sqrt,
    pow2_smallest_normal_over,
    pow2_split,
    pow2_sqrt_split,
)

FORMATS = [
    jnp.float32,
    jnp.float16,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
]


def all_finite_values(dtype, count=4096, seed=0):
    """Every value of an 8-bit format, or a random bit-pattern sample of a wider one."""
    dtype = jnp.dtype(dtype)
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]
    if dtype.itemsize == 1:
        pattern = np.arange(256, dtype=bits)
    else:
        pattern = np.random.default_rng(seed).integers(0, np.iinfo(bits).max, count, dtype=bits)
        info = ml_dtypes.finfo(dtype)
        extra = np.array([info.smallest_subnormal, info.smallest_normal, info.max], dtype)
        pattern = np.concatenate([pattern, extra.view(bits), (-extra).view(bits)])
    values = pattern.view(dtype)
    with np.errstate(invalid="ignore"):
        return values[np.isfinite(values.astype(np.float64))]


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("rounding", ["down", "up", "nearest"])
def test_split_is_exact_for_every_format(dtype, rounding):
    values = all_finite_values(dtype)
    mantissa, scale = jax.jit(pow2_split, static_argnums=1)(values, rounding)
    assert mantissa.dtype == values.dtype and scale.dtype == jnp.float32
    product = np.asarray(mantissa, np.float64) * np.asarray(scale, np.float64)
    np.testing.assert_array_equal(product, values.astype(np.float64))
    assert np.all(is_pow2(np.asarray(scale)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_split_mantissa_ranges(dtype):
    values = all_finite_values(dtype)
    magnitude = np.abs(values.astype(np.float64))
    values = values[(magnitude >= 2.0**-126) & (magnitude < 2.0**127)]  # inside the clamp
    for rounding, low, high in [("down", 1, 2), ("up", 0.5, 1), ("nearest", 2**-0.5, 2**0.5)]:
        mantissa, _ = pow2_split(values, rounding)
        m = np.abs(np.asarray(mantissa, np.float64))
        m = m[m != 0]
        below_high = m <= high if rounding == "up" else m < high
        assert np.all(m >= low * (1 - 2**-23)) and np.all(below_high), rounding


def test_special_values():
    x = jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    mantissa, scale = pow2_split(x)
    np.testing.assert_array_equal(np.asarray(scale), np.ones(5))
    np.testing.assert_array_equal(np.asarray(mantissa), np.asarray(x))


def test_float32_subnormals_split_without_flush():
    tiny = np.array([1e-45, -3e-39, 2.0**-140], np.float32)
    mantissa, scale = jax.jit(pow2_split)(tiny)
    assert np.all(np.asarray(scale) == np.float32(2.0**-126))
    product = np.asarray(mantissa, np.float64) * np.asarray(scale, np.float64)
    np.testing.assert_array_equal(product, tiny.astype(np.float64))


@given(st.floats(min_value=2.0**-126, max_value=2.0**127, allow_subnormal=False, width=32))
def test_round_matches_static_round(value):
    for rounding in ["down", "up", "nearest"]:
        dynamic = float(pow2_round(jnp.float32(value), rounding))
        assert dynamic == static_pow2_round(float(np.float32(value)), rounding)
        if rounding == "down":
            assert dynamic <= float(np.float32(value)) < 2 * dynamic


def test_scales_cast_exactly_to_e8m0():
    scales = pow2_round(jnp.array([2.0**-126, 3e-20, 1.0, 7.0, 2.0**127]))
    e8m0 = scales.astype(jnp.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(e8m0.astype(jnp.float32)), np.asarray(scales))


def test_split_rejects_integers():
    with pytest.raises(TypeError):
        pow2_split(jnp.arange(3))


@given(st.floats(min_value=2.0**-126, max_value=2.0**127, allow_subnormal=False))
def test_fast_positive_round_matches_general_round(value):
    for rounding in ["down", "up", "nearest"]:
        fast = float(pow2_round_positive(jnp.float32(value), rounding))
        assert fast == float(pow2_round(jnp.float32(value), rounding))


def test_fast_positive_round_clamps():
    out = pow2_round_positive(jnp.array([0.0, 1e-45, jnp.inf], jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), [2.0**-126, 2.0**-126, 2.0**127])


@given(st.floats(min_value=2.0**-100, max_value=2.0**100, allow_subnormal=False))
def test_rounded_sqrt_matches_rounding_the_sqrt(value):
    for rounding in ["down", "up", "nearest"]:
        expected = static_pow2_round(float(np.sqrt(np.float64(np.float32(value)))), rounding)
        assert float(pow2_round_sqrt(jnp.float32(value), rounding)) == expected, rounding


@pytest.mark.parametrize("exponent", [-126, -60, 0, 60, 126])
def test_pow2_reciprocal_is_exact(exponent):
    assert float(pow2_reciprocal(jnp.float32(2.0**exponent))) == 2.0**-exponent


def _edge_patterns() -> np.ndarray:
    """float32 bit patterns at every exponent field: mantissas at the rounding thresholds
    (zero, one ulp, float32's sqrt(2) and one below, all ones), both signs, NaNs included."""
    fields = np.arange(256, dtype=np.uint32) << 23
    sqrt2 = np.float32(np.sqrt(2.0)).view(np.uint32) & np.uint32(0x7FFFFF)
    mantissas = np.array([0, 1, sqrt2 - 1, sqrt2, 0x7FFFFF], np.uint32)
    patterns = (fields[:, None] | mantissas[None, :]).ravel()
    return np.concatenate([patterns, patterns | np.uint32(0x80000000)])


def _reference_exponent(value: np.float32, rounding: str) -> int:
    """The exponent :func:`pow2_exponent` documents, from float64 arithmetic: ``floor(log2
    |x|)`` moved up for "up" (unless a power of two) and "nearest" (at or past float32's
    sqrt(2)); -126 for zeros and subnormals, 0 for infinities and NaNs; clamped to float32's
    normal range."""
    magnitude = abs(float(value))
    if not np.isfinite(magnitude):
        return 0
    if magnitude < 2.0**-126:
        return -126
    mantissa, exponent = np.frexp(magnitude)  # magnitude = mantissa * 2^exponent, [0.5, 1)
    exponent -= 1
    if rounding == "up" and mantissa != 0.5:
        exponent += 1
    if rounding == "nearest" and 2 * mantissa >= float(np.float32(np.sqrt(2.0))):
        exponent += 1
    return min(exponent, 127)


@pytest.mark.parametrize("rounding", ["down", "up", "nearest"])
def test_exponent_and_round_at_every_exponent_field(rounding):
    values = _edge_patterns().view(np.float32)
    exponents = np.asarray(jax.jit(pow2_exponent, static_argnums=1)(values, rounding))
    rounded = np.asarray(jax.jit(pow2_round, static_argnums=1)(values, rounding))
    for value, exponent, power in zip(values, exponents, rounded, strict=True):
        expected = _reference_exponent(value, rounding)
        assert exponent == expected, (hex(value.view(np.uint32)), rounding)
        no_scale = value == 0 or not np.isfinite(value)  # zeros and non-finite round to 1
        assert power == (1.0 if no_scale else 2.0**expected), hex(value.view(np.uint32))


@pytest.mark.parametrize("quotient", [zero_factor_scale, pow2_smallest_normal_over])
def test_zero_factor_scale_at_every_exponent_field(quotient):
    values = _edge_patterns().view(np.float32)
    got = np.asarray(jax.jit(jax.vmap(quotient))(values))
    for value, scale in zip(values, got, strict=True):
        expected = 2.0 ** min(max(-126 - _reference_exponent(value, "down"), -126), 0)
        assert scale == expected, hex(value.view(np.uint32))


def test_sqrt_split_at_every_exponent_field():
    """A square root's scale and data factor: ``2^floor(e/2)`` and ``2^(e mod 2)`` for the
    exponent ``e`` :func:`pow2_exponent` documents, so zeros, subnormals, infinities, NaNs,
    negative and non-power-of-two patterns keep the results of the exponent's halving."""
    values = _edge_patterns().view(np.float32)
    roots, remainders = (np.asarray(v) for v in jax.jit(pow2_sqrt_split)(values))
    for value, root, remainder in zip(values, roots, remainders, strict=True):
        exponent = _reference_exponent(value, "down")
        assert (root, remainder) == (2.0 ** (exponent // 2), 2.0 ** (exponent % 2)), hex(
            value.view(np.uint32)
        )
