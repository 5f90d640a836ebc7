"""Scale rules for dot_general and conv_general_dilated against a float64 reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    assert_close,
    assert_static_or_guarded_scale,
    check_e8m0_matches,
    check_scaled,
    float32_values,
    reference64,
    scaled_arrays,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

# Every example compiles two programs: run a third of the profile's examples per test.
few = settings(max_examples=max(3, settings.default.max_examples // 3))


def _ulps(k: int) -> float:
    """Normwise tolerance of a K-term contraction accumulated in the output dtype."""
    return 2 * k + 4


def _pow2_sqrt(k: int) -> float:
    return 2.0 ** math.floor(math.log2(math.sqrt(k)))  # default rounding: down


# name -> (x shape, y shape, dimension numbers), from sizes m, n, k, k2, b.
DOT_CASES = {
    "vector.vector": lambda m, n, k, k2, b: ((k,), (k,), (((0,), (0,)), ((), ()))),
    "matrix.vector": lambda m, n, k, k2, b: ((m, k), (k,), (((1,), (0,)), ((), ()))),
    "vector.matrix": lambda m, n, k, k2, b: ((k,), (k, n), (((0,), (0,)), ((), ()))),
    "outer": lambda m, n, k, k2, b: ((m,), (n,), (((), ()), ((), ()))),
    "matmul": lambda m, n, k, k2, b: ((m, k), (k, n), (((1,), (0,)), ((), ()))),
    "transposed": lambda m, n, k, k2, b: ((k, m), (n, k), (((0,), (1,)), ((), ()))),
    "two_contracting": lambda m, n, k, k2, b: (
        (m, k, k2),
        (k2, n, k),
        (((1, 2), (2, 0)), ((), ())),
    ),
    "batch_leading": lambda m, n, k, k2, b: ((b, m, k), (b, k, n), (((2,), (1,)), ((0,), (0,)))),
    "batch_moved": lambda m, n, k, k2, b: ((m, b, k), (k, n, b), (((2,), (0,)), ((1,), (2,)))),
}


def _contraction_size(x_shape, dimension_numbers) -> int:
    return math.prod(x_shape[d] for d in dimension_numbers[0][0])


def _dot_case(data, name: str):
    sizes = [data.draw(st.integers(1, 7)) for _ in range(5)]
    return DOT_CASES[name](*sizes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(DOT_CASES))
@few
@given(data=st.data())
def test_dot_general_dimension_numbers(name, dtype, data):
    x_shape, y_shape, dn = _dot_case(data, name)
    x = data.draw(scaled_arrays(x_shape, dtype))
    y = data.draw(scaled_arrays(y_shape, dtype))
    k = _contraction_size(x_shape, dn)
    out = check_scaled(
        lambda x, y: lax.dot_general(x, y, dn), [x, y], dtype, ulps=_ulps(k), normwise=True
    )
    assert out.dtype == dtype
    assert_static_or_guarded_scale(out, float(x.scale) * float(y.scale) * _pow2_sqrt(k))


@pytest.mark.parametrize(
    "x_dtype,y_dtype",
    [
        (jnp.float16, jnp.float16),
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float32),
        (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
        (jnp.float8_e4m3fn, jnp.float8_e5m2),
        (jnp.float8_e5m2, jnp.float8_e4m3fn),
    ],
)
@few
@given(data=st.data())
def test_dot_general_preferred_float32(x_dtype, y_dtype, data):
    name = data.draw(st.sampled_from(["matmul", "transposed", "batch_moved"]))
    x_shape, y_shape, dn = _dot_case(data, name)
    x = data.draw(scaled_arrays(x_shape, x_dtype))
    y = data.draw(scaled_arrays(y_shape, y_dtype))

    def fn(x, y):
        return lax.dot_general(x, y, dn, preferred_element_type=jnp.float32)

    # Narrow products are exact in float32: only float32 accumulation rounding remains.
    out = check_scaled(
        fn, [x, y], jnp.float32, ulps=_ulps(_contraction_size(x_shape, dn)), normwise=True
    )
    assert out.dtype == jnp.float32


@few
@given(data=st.data())
def test_dot_general_float8_output(data):
    """float8 x float8 without preferred type: float8 result, within float8 rounding."""
    x = data.draw(scaled_arrays((3, 4), jnp.float8_e4m3fn))
    y = data.draw(scaled_arrays((4, 5), jnp.float8_e4m3fn))
    out = check_scaled(jnp.matmul, [x, y], jnp.float8_e4m3fn, ulps=_ulps(4), normwise=True)
    assert out.dtype == jnp.float8_e4m3fn


def test_dot_general_fp16_fidelity_at_extreme_scales():
    """Values of 2^-20 and 2^20 in float16: the raw format under/overflows, scaled does not."""
    x = js.ScaledArray(jnp.full((4, 64), 1.5, jnp.float16), jnp.float32(2.0**-20))
    y = js.ScaledArray(jnp.full((64, 3), -1.25, jnp.float16), jnp.float32(2.0**-12))
    out = check_scaled(jnp.matmul, [x, y], jnp.float16, ulps=1)
    assert float(out.scale) == 2.0**-29
    assert float(jnp.matmul(x.to_array(), y.to_array())[0, 0]) == 0.0  # raw float16 underflows


def _conv_config(data, ndim: int) -> dict:
    """Random conv shapes and parameters over ``ndim`` spatial dimensions (NC... layout)."""
    groups = data.draw(st.integers(1, 3))
    grouping = data.draw(st.sampled_from(["feature", "batch"]))
    fgc, bgc = (groups, 1) if grouping == "feature" else (1, groups)
    cin = data.draw(st.integers(1, 3)) * fgc
    cout = data.draw(st.integers(1, 3)) * groups
    batch = data.draw(st.integers(1, 2)) * bgc
    spatial = tuple(data.draw(st.integers(5, 7)) for _ in range(ndim))
    kernel = tuple(data.draw(st.integers(1, 3)) for _ in range(ndim))
    ints = lambda lo, hi: tuple(data.draw(st.integers(lo, hi)) for _ in range(ndim))  # noqa: E731
    lhs_dilation = ints(1, 2)
    padding = data.draw(st.sampled_from(["SAME", "VALID", "explicit"]))
    if padding != "explicit" and lhs_dilation != (1,) * ndim:
        padding = "explicit"  # string padding is not defined for transposed convolutions
    return dict(
        lhs_shape=(batch, cin) + spatial,
        rhs_shape=(cout, cin // fgc) + kernel,
        window_strides=ints(1, 2),
        padding=tuple((lo, hi) for lo, hi in zip(ints(0, 2), ints(0, 2), strict=True))
        if padding == "explicit"
        else padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=ints(1, 2),
        feature_group_count=fgc,
        batch_group_count=bgc,
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("ndim", [1, 2])
@few
@given(data=st.data())
def test_conv_general_dilated(ndim, dtype, data):
    config = _conv_config(data, ndim)
    lhs = data.draw(scaled_arrays(config.pop("lhs_shape"), dtype))
    rhs = data.draw(scaled_arrays(config.pop("rhs_shape"), dtype))
    k = math.prod(rhs.shape[1:])

    def fn(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, **config)

    out = check_scaled(fn, [lhs, rhs], dtype, ulps=_ulps(k), normwise=True)
    assert out.dtype == dtype
    assert float(out.scale) == float(lhs.scale) * float(rhs.scale) * _pow2_sqrt(k)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@few
@given(data=st.data())
def test_conv_nhwc_preferred_float32(dtype, data):
    lhs = data.draw(scaled_arrays((2, 5, 6, 4), dtype))
    rhs = data.draw(scaled_arrays((3, 2, 4, 8), dtype))  # HWIO

    def fn(lhs, rhs):
        # The float64 reference cannot ask for a narrower preferred type.
        preferred = None if lhs.dtype == jnp.float64 else jnp.float32
        return lax.conv_general_dilated(
            lhs,
            rhs,
            (1, 2),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            preferred_element_type=preferred,
        )

    out = check_scaled(fn, [lhs, rhs], jnp.float32, ulps=_ulps(24), normwise=True)
    assert out.dtype == jnp.float32
    assert float(out.scale) == float(lhs.scale) * float(rhs.scale) * 4.0  # sqrt(24) -> 4


@few
@given(data=st.data())
def test_linalg_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((2, 3, 7, 5), jnp.float16))
    w = data.draw(scaled_arrays((4, 3, 2, 3), jnp.float16))
    check_e8m0_matches(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"), [x, w])
    check_e8m0_matches(lambda x, w: lax.dot_general(x, w, (((1,), (1,)), ((), ()))), [x, w])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data(), groups=st.lists(st.integers(0, 4), min_size=1, max_size=3))
def test_ragged_dot(dtype, data, groups):
    """Rows of ``lhs`` in consecutive groups, each multiplied by its group's ``rhs``."""
    k, n = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
    lhs = data.draw(scaled_arrays((sum(groups), k), dtype))
    rhs = data.draw(scaled_arrays((len(groups), k, n), dtype))
    group_sizes = jnp.asarray(groups, jnp.int32)
    out = check_scaled(
        lambda x, y: lax.ragged_dot(x, y, group_sizes),
        [lhs, rhs],
        dtype,
        ulps=_ulps(k),
        normwise=True,
    )
    assert out.dtype == dtype
    assert_static_or_guarded_scale(out, float(lhs.scale) * float(rhs.scale) * _pow2_sqrt(k))


@few
@given(data=st.data())
def test_scaled_dot_keeps_block_scales_with_the_data(data):
    """MX-style block-scaled float8 dot: per-block E8M0 scales stay in the data path, the
    ScaledArrays' own scales (and a scaled block-scale operand's) go to the output scale."""
    m, k, n, block = 3, 64, 2, 32
    lhs = data.draw(scaled_arrays((m, k), jnp.float8_e4m3fn))
    rhs = data.draw(scaled_arrays((k, n), jnp.float8_e4m3fn))
    exponents = st.lists(st.integers(-4, 4), min_size=m * k // block, max_size=m * k // block)
    lhs_blocks = jnp.asarray(2.0 ** np.array(data.draw(exponents)), jnp.float8_e8m0fnu)
    rhs_blocks = js.ScaledArray(
        jnp.full((k // block, n), 0.5, jnp.float8_e8m0fnu), jnp.float32(2.0**-7)
    )

    def fn(x, y, xs, ys):
        return lax.scaled_dot(x, y, lhs_scale=xs, rhs_scale=ys, preferred_element_type=jnp.float32)

    args = [lhs, rhs, lhs_blocks.reshape(m, k // block), rhs_blocks]
    out = check_scaled(fn, args, jnp.float32, ulps=_ulps(k), normwise=True)
    assert float(out.scale) == float(lhs.scale) * float(rhs.scale) * 2.0**-7 * _pow2_sqrt(k)


# Dot algorithms XLA:CPU refuses ("The precision 'F16_F16_F32' is not supported by
# dot_general on CPU"): under scalify the rule widens the operands on CPU instead.
PRESETS = {
    "F16_F16_F32": (jnp.float16, jnp.float32),
    "BF16_BF16_BF16": (jnp.bfloat16, jnp.bfloat16),
    "F16_F16_F16": (jnp.float16, jnp.float16),
    "TF32_TF32_F32": (jnp.float32, jnp.float32),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@few
@given(data=st.data())
def test_dot_general_with_a_dot_algorithm_preset(preset, data):
    dtype, out_dtype = PRESETS[preset]
    x_shape, y_shape, dn = _dot_case(data, data.draw(st.sampled_from(["matmul", "batch_moved"])))
    x = data.draw(scaled_arrays(x_shape, dtype))
    y = data.draw(scaled_arrays(y_shape, dtype))
    algorithm = getattr(lax.DotAlgorithmPreset, preset)

    def fn(x, y):
        return lax.dot_general(x, y, dn, precision=algorithm, preferred_element_type=out_dtype)

    out = jax.jit(js.scalify(fn))(x, y)
    assert out.dtype == out_dtype
    # The float64 reference without the algorithm (which XLA:CPU refuses in float64 too).
    expected = reference64(lambda x, y: lax.dot_general(x, y, dn), x, y)
    k = _contraction_size(x_shape, dn)
    assert_close(out, expected, out_dtype, ulps=_ulps(k), normwise=True)


def test_float16_attention_runs_on_cpu_under_scalify():
    """jax.nn.dot_product_attention asks for F16_F16_F32 with float16 inputs."""
    q = jax.random.normal(jax.random.key(0), (2, 5, 2, 8)).astype(jnp.float16)
    for scale in (2.0**-20, 2.0**20):
        qkv = [js.ScaledArray(q, jnp.float32(scale)) for _ in range(3)]
        out = jax.jit(js.scalify(jax.nn.dot_product_attention))(*qkv)
        expected = reference64(jax.nn.dot_product_attention, *float32_values(qkv))
        assert out.dtype == jnp.float16
        assert_close(out, expected, jnp.float16, ulps=8, normwise=True)
