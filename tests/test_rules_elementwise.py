"""Elementwise scale rules (selections, powers, roots, rounding, predicates, casts) vs float64."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    assert_close,
    check_e8m0_matches,
    check_scaled,
    expected_scale,
    scaled_arrays,
    shapes,
    value64,
)
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled._jax_internals import lax_primitives
from jax_scaled.scales.guard import guard_band


def resolution(dtype, scale) -> float:
    """Smallest normal of ``dtype`` at ``scale``: what aligning data to ``scale`` may lose."""
    return float(ml_dtypes.finfo(jnp.dtype(dtype)).smallest_normal) * float(scale)


def top_scale(*xs) -> float:
    return max(float(x.scale) for x in xs)


def run(fn, *inputs):
    return jax.jit(js.scalify(fn))(*inputs)


@st.composite
def same_value(draw, x: js.ScaledArray) -> js.ScaledArray:
    """``x`` re-expressed exactly at a scale 2^-k smaller (data times 2^k, k in [0, 4])."""
    k = np.float32(2.0 ** draw(st.integers(0, 4)))  # float32 under numpy 1's promotion too
    data = (np.asarray(x.data, np.float32) * k).astype(x.dtype)  # numpy: no compile per shape
    return js.ScaledArray(jax.device_put(data), jax.device_put(np.float32(x.scale) / k))


# --- exact unary rules: the scale is kept, or the value is computed exactly -----------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_exact_unary(dtype, data):
    shape = data.draw(shapes())
    x = data.draw(scaled_arrays(shape, dtype))
    near_one = data.draw(scaled_arrays(shape, dtype, min_exp=-6, max_exp=14))
    special = js.ScaledArray(x.data.at[..., 0].set(np.inf).at[..., -1].set(np.nan), x.scale)
    away = lax.RoundingMethod.AWAY_FROM_ZERO

    def fn(x, z, w):
        keep = jnp.abs(x), jnp.sign(x), jnp.copy(x), lax.stop_gradient(x)
        rounded = jnp.floor(z), jnp.ceil(z), jnp.round(z), lax.round(z, away), z.astype(jnp.int32)
        precision = lax.reduce_precision(x, 8, 3), lax.reduce_precision(x, 8, 7)
        literals = jnp.maximum(x, 0.0), x * 2.0, x > 0, x < 0.5
        return (
            keep,
            rounded,
            precision,
            literals,
            x.astype(jnp.float32),
            x.astype(bool),
            jnp.isfinite(w),
        )

    out = check_scaled(fn, [x, near_one, special], dtype, ulps=0)
    (abs_x, sign_x, *_), rounded, _, (relu, *_), *_ = out
    # relu's zero literal takes any scale: x's.
    assert float(abs_x.scale) == expected_scale(abs_x, x.scale)
    assert float(relu.scale) == expected_scale(relu, x.scale)
    assert float(sign_x.scale) == expected_scale(sign_x, 1.0)
    assert all(
        float(r.scale) == expected_scale(r, max(float(near_one.scale), 1.0)) for r in rounded[:4]
    )


@given(data=st.data())
def test_where_literal_float32(data):
    x = data.draw(scaled_arrays(data.draw(shapes()), jnp.float32))
    check_scaled(lambda x: jnp.where(x > 0, x, 0.0), [x], jnp.float32, ulps=0)


def test_where_literal_keeps_small_scale_float16():
    x = js.ScaledArray(jnp.array([-1.5, 0.25, 3.0], jnp.float16), jnp.float32(2.0**-30))
    check_scaled(lambda x: jnp.where(x > 0, x, 0.0), [x], jnp.float16, ulps=0)


def test_reduce_precision_uses_the_data_exponent_range():
    x = js.ScaledArray(jnp.array([1.0, 3.3, -70000.0, 0.01], jnp.float32), jnp.float32(2.0**20))
    out = run(lambda x: lax.reduce_precision(x, 5, 10), x)  # float16's format, on the data
    np.testing.assert_array_equal(np.asarray(out.data), np.asarray(x.data.astype(jnp.float16)))
    assert float(out.scale) == 2.0**20


# --- selections and comparisons: aligned to the largest scale -------------------------------


def comparisons(x, y):
    return lax.eq(x, y), lax.ne(x, y), lax.lt(x, y), lax.le(x, y), lax.gt(x, y), lax.ge(x, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_selections_and_comparisons(dtype, data):
    shape = data.draw(shapes())
    x, y, z = (data.draw(scaled_arrays(shape, dtype)) for _ in range(3))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    which = jax.device_put(rng.integers(0, 3, shape))
    twin = data.draw(same_value(x))  # the same values at another scale

    def fn(x, y, z, which, twin):
        selected = lax.max(x, y), lax.min(x, y), lax.select_n(which, x, y, z)
        return selected, comparisons(x, y), comparisons(x, twin)

    top = top_scale(x, y, z)
    selected, _, with_twin = check_scaled(
        fn, [x, y, z, which, twin], dtype, ulps=0.5, atol=resolution(dtype, top)
    )
    assert float(selected[0].scale) == top_scale(x, y) and float(selected[2].scale) == top
    assert np.all(with_twin[0]) and not np.any(with_twin[1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_clamp(dtype, data):
    shape = data.draw(shapes())
    exp = data.draw(st.integers(-36, 36))
    x = data.draw(scaled_arrays(shape, dtype, min_exp=exp, max_exp=exp))
    lo = data.draw(scaled_arrays(shape, dtype, min_exp=exp - 4, max_exp=exp + 4, low=-2, high=-0.5))
    hi = data.draw(scaled_arrays(shape, dtype, min_exp=exp - 4, max_exp=exp + 4, low=0.5, high=2))

    def fn(lo, x, hi):  # literal bounds far from x's scale are +-inf or 0 at it
        unit = jnp.asarray(1.0, x.dtype)
        return lax.clamp(lo, x, hi), lax.clamp(-unit, x, unit), jnp.clip(x, -1.0, 1.0)

    atol = resolution(dtype, max(float(x.scale), 1.0))
    out = check_scaled(fn, [lo, x, hi], dtype, ulps=0.5, atol=atol)
    # x's scale, or that of a bound picked everywhere (the unit's own: 1)
    values, lows, highs = (np.asarray(v.to_array(jnp.float32)) for v in (x, lo, hi))
    assert float(out[0].scale) == _clamp_scale(values, lows, highs, lo.scale, x.scale, hi.scale)
    assert float(out[1].scale) == _clamp_scale(values, -1.0, 1.0, 1.0, x.scale, 1.0)


def _clamp_scale(values, lows, highs, *scales) -> float:
    picks = np.where(values < lows, 0, np.where(values > highs, 2, 1)).ravel()
    uniform = picks.size and np.all(picks == picks[0])
    return float(scales[picks[0]] if uniform else scales[1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_nextafter_steps_one_data_ulp_at_x_scale(dtype, data):
    shape = data.draw(shapes())
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))
    out, up = run(lambda x, y: (jnp.nextafter(x, y), jnp.nextafter(x, jnp.inf)), x, y)
    with np.errstate(over="ignore"):  # y may overflow the data format at x's scale: inf
        y_at_x_scale = (value64(y) / float(x.scale)).astype(dtype)
    for got, towards in ((out, y_at_x_scale), (up, np.full(shape, np.inf, dtype))):
        assert float(got.scale) == float(x.scale)
        np.testing.assert_array_equal(
            np.asarray(got.data), np.nextafter(np.asarray(x.data), towards)
        )


# --- sums and remainders ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_add_any(dtype, data):
    shape = data.draw(shapes())
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))
    check_scaled(lax_primitives.add_jaxvals_p.bind, [x, y], dtype, normwise=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_rem(dtype, data):
    shape = data.draw(shapes())
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))
    smaller = min(float(x.scale), float(y.scale))  # |rem(x, y)| <= min(|x|, |y|)
    out = check_scaled(lax.rem, [x, y], dtype, ulps=0.5, atol=resolution(dtype, smaller))
    assert float(out.scale) == expected_scale(out, smaller)


# --- powers and roots: exact splits of the scale --------------------------------------------

POWERS = (-3, -2, -1, 0, 1, 2, 3, 4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_powers_and_roots(dtype, data):
    shape = data.draw(shapes())
    base = data.draw(scaled_arrays(shape, dtype, min_exp=-31, max_exp=31, low=0.5, high=2))
    positive = data.draw(scaled_arrays(shape, dtype, low=0.05, high=4.0))

    def fn(b, p):
        powers = [lax.integer_pow(b, n) for n in POWERS] + [jnp.square(b), (-b) ** 3]
        return powers, (jnp.sqrt(p), lax.rsqrt(p), jnp.cbrt(p), jnp.cbrt(-p))

    powers, roots = check_scaled(fn, [base, positive], dtype, ulps=3)
    assert [float(p.scale) for p in powers[: len(POWERS)]] == [
        float(base.scale) ** n for n in POWERS
    ]


NEGATIVE_POWERS = (-1, -2, -3)
SPREAD = {  # data from deep in the format's range up: a negative power's largest datum
    jnp.float16: 2.0**-14,  # 2^28 at y = -2, beyond float16
    jnp.bfloat16: 2.0**-14,
    jnp.float32: 2.0**-14,
    jnp.float8_e4m3fn: 2.0**-6,  # 2^12 at y = -2, beyond E4M3's 448
}


@st.composite
def spread_arrays(draw, shape, dtype, smallest: float) -> js.ScaledArray:
    """Data of random signs and magnitudes log-uniform in ``[smallest, 4]``, ``smallest``
    itself among them, at a random power-of-two scale."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    exponents = rng.uniform(np.log2(smallest), 2.0, shape)
    exponents.flat[0] = np.log2(smallest)
    magnitudes = np.exp2(exponents) * rng.choice([-1.0, 1.0], shape)
    scale = np.float32(2.0 ** draw(st.integers(-30, 30)))
    return js.ScaledArray(jax.device_put(magnitudes.astype(dtype)), jax.device_put(scale))


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, jnp.float8_e4m3fn])
@given(data=st.data())
def test_negative_powers_of_data_far_below_one_stay_finite(dtype, data):
    """Unguarded, ``d^-2`` of float16 data below ``2^-8`` overflowed: the largest datum of a
    negative power comes from the smallest ``|d|``."""
    base = data.draw(spread_arrays(data.draw(shapes()), dtype, SPREAD[dtype]))
    powers = run(lambda b: [lax.integer_pow(b, n) for n in NEGATIVE_POWERS], base)
    for power, n in zip(powers, NEGATIVE_POWERS, strict=True):
        assert np.all(np.isfinite(np.asarray(power.data, np.float32)))
        # one scale for a power spanning more binades than the format's normal range: the
        # smallest elements are kept to the format's resolution at that scale
        want = value64(base) ** n
        assert_close(power, want, dtype, ulps=3, atol=resolution(dtype, power.scale))


# --- conversions ------------------------------------------------------------------------------

NARROW = (jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_convert_narrowing_round_trip_keeps_scale_without_guard(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype))
    with js.ScalifyConfig(guard=False):
        out = run(lambda x: [(x.astype(n), x.astype(n).astype(dtype)) for n in NARROW], x)
    for narrow, (cast, back) in zip(NARROW, out, strict=True):
        expected = x.data.astype(narrow)
        np.testing.assert_array_equal(np.asarray(cast.data), np.asarray(expected))
        np.testing.assert_array_equal(np.asarray(back.data), np.asarray(expected.astype(dtype)))
        assert float(cast.scale) == float(back.scale) == float(x.scale)
        assert_close(back, value64(x), narrow, ulps=0.5, atol=resolution(narrow, x.scale))


@pytest.mark.parametrize("narrow", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@given(data=st.data())
def test_guarded_narrowing_cast_keeps_drifted_data_in_range(narrow, data):
    """float32 data drifted by 2^shift: the guard moves the drift into the scale, so the
    cast neither overflows nor underflows; data in the band is cast exactly as without it."""
    x = data.draw(scaled_arrays(data.draw(shapes()), jnp.float32, min_exp=-60, max_exp=60))
    drift = data.draw(st.integers(-40, 40))
    drifted = js.ScaledArray(x.data * np.float32(2.0**drift), x.scale * np.float32(2.0**-drift))
    cast = run(lambda x: x.astype(narrow), drifted)
    low, high, _ = guard_band(narrow)
    largest = float(np.max(np.abs(np.asarray(cast.data, np.float32))))
    assert 2.0**low <= largest <= 2.0**high
    assert_close(cast, value64(x), narrow, ulps=0.5, normwise=True)
    if 2.0**low <= float(np.max(np.abs(drifted.data))) < 2.0**high:  # in band: untouched
        assert float(cast.scale) == float(drifted.scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_bitcast_convert_type_bitcasts_the_value(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype, min_exp=-8, max_exp=8))
    bits = {4: np.int32, 2: np.int16}[jnp.dtype(dtype).itemsize]
    out = run(lambda x: lax.bitcast_convert_type(x, bits), x)
    assert not isinstance(out, js.ScaledArray)
    np.testing.assert_array_equal(np.asarray(out), value64(x).astype(dtype).view(bits))


# --- E8M0 scales --------------------------------------------------------------------------


def many_rules(x, y):
    return (
        (jnp.maximum(x, y), jnp.minimum(x, 0.5), lax.clamp(-y, x, y), lax.select_n(x > y, x, y)),
        (lax.integer_pow(x, 3), jnp.square(y), lax.integer_pow(y, -1), jnp.cbrt(x)),
        (jnp.sqrt(jnp.abs(x)), lax.rsqrt(y), jnp.floor(x), lax.rem(x, y), jnp.sign(y)),
        (x.astype(jnp.float8_e4m3fn), y.astype(jnp.float32), x.astype(jnp.int32), x < y),
    )


@given(data=st.data())
def test_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((3, 4), jnp.float16, min_exp=-30, max_exp=30))
    y = data.draw(scaled_arrays((3, 4), jnp.float16, min_exp=-30, max_exp=30, low=0.5, high=2))
    check_e8m0_matches(many_rules, [x, y])


# --- a uniform selection picks a whole case, data and scale ---------------------------------


def uniform_selections(x, y, z, flag):
    """A 0-d select, and a where whose test is a broadcast scalar (optax's safe_norm)."""
    return jnp.where(flag, y, z), jnp.where(flag, 1.5, x), jnp.where(jnp.sum(x) > 0, x, 0.25)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_uniform_selection_is_exact(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype))
    y, z = (data.draw(scaled_arrays((), dtype)) for _ in range(2))
    flag = jnp.asarray(data.draw(st.booleans()))
    picked, filled, kept = check_scaled(uniform_selections, [x, y, z, flag], dtype, ulps=0)
    assert float(picked.scale) == float((y if flag else z).scale)
    if not flag:  # x is kept at its own scale, however far from the fill's
        assert float(filled.scale) == float(x.scale)
    check_e8m0_matches(uniform_selections, [x, y, z, flag])


# --- huge constant fills: the constant fits the data format, the tensor keeps its data --------


def _fill_floor(fill: float, dtype) -> float:
    """The scale a constant fill may raise a selection to: its pow2 / the format's headroom."""
    headroom = 2.0 ** (int(np.log2(float(ml_dtypes.finfo(jnp.dtype(dtype)).max))) // 2)
    return 2.0 ** np.floor(np.log2(abs(fill))) / headroom


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data(), kind=st.sampled_from(["finfo_min", "attention", "large"]))
def test_huge_constant_fill_does_not_flush_the_tensor(dtype, data, kind):
    x = data.draw(scaled_arrays(data.draw(shapes()), dtype, min_exp=-30, max_exp=30))
    big = float(ml_dtypes.finfo(jnp.dtype(dtype)).max)
    fill = {"finfo_min": -big, "attention": -0.7 * big, "large": 2.0**12 * 1.25}[kind]
    fill = float(np.asarray(fill, dtype))

    def fn(x):
        full = jnp.full_like(x, fill)
        return jnp.where(x > 0, x, fill), jnp.minimum(x, fill), jnp.concatenate([x, full])

    scale = max(float(x.scale), _fill_floor(fill, dtype))
    _, minimum, joined = check_scaled(fn, [x], dtype, ulps=0, atol=resolution(dtype, scale))
    assert float(joined.scale) == scale
    # A minimum that picks the same operand everywhere is that operand, scale and data.
    values = np.asarray(x.to_array(jnp.float32))
    fill_everywhere, x_everywhere = np.all(values > fill), np.all(values <= fill)
    fill_scale = 2.0 ** np.floor(np.log2(abs(fill)))  # its exact split: data in [1, 2)
    expected = fill_scale if fill_everywhere else float(x.scale) if x_everywhere else scale
    assert float(minimum.scale) == expected


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_total_order_comparisons(dtype, data):
    """``eq_to``/``lt_to``/``le_to`` (jnp.searchsorted, jnp.interp) on the aligned values."""
    shape = data.draw(shapes())
    x = data.draw(scaled_arrays(shape, dtype))
    twin = data.draw(same_value(x))
    y = js.ScaledArray(x.data.at[..., 0].set(-0.0).at[..., -1].set(np.nan), x.scale)
    ops = (lax_primitives.eq_to_p, lax_primitives.lt_to_p, lax_primitives.le_to_p)

    def fn(x, twin, y):
        return [(op.bind(x, twin), op.bind(y, -y), op.bind(x, y)) for op in ops]

    (eq, lt, le) = check_scaled(fn, [x, twin, y], dtype, expect_scaled=False)
    assert np.all(eq[0]) and not np.any(lt[0]) and np.all(le[0])
