"""Scale rules for reductions, cumulative ops, sort, top_k and reduce_window against float64."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    assert_static_or_guarded_scale,
    check_e8m0_matches,
    check_named,
    check_scaled,
    scaled_arrays,
    shapes,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

# Every example compiles two programs: run a third of the profile's examples per test.
few = settings(max_examples=max(3, settings.default.max_examples // 3))


def _axes(data, shape) -> tuple[int, ...]:
    """A random non-empty subset of the axes of ``shape``."""
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True))
    return tuple(sorted(axes))


def _sum_ulps(n: int) -> float:
    """Tolerance of an n-term sum accumulated in the data dtype (normwise)."""
    return 2 * n + 4


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_sum(dtype, data):
    shape = data.draw(shapes(max_side=8))
    axes = _axes(data, shape)
    x = data.draw(scaled_arrays(shape, dtype))
    n = math.prod(shape[a] for a in axes)
    out = check_scaled(
        lambda x: jnp.sum(x, axes, dtype=x.dtype), [x], dtype, ulps=_sum_ulps(n), normwise=True
    )
    assert out.dtype == dtype
    sqrt_n = 2.0 ** math.floor(math.log2(math.sqrt(n)))  # default rounding: down
    assert float(out.scale) == float(x.scale) * sqrt_n


def test_reduce_sum_of_one_term_is_the_data_unguarded():
    """Summing a size-1 axis (the gradient of a broadcast bias) copies each datum: no float32
    accumulation and no range guard, even for float16 data outside the guard band."""
    x = js.ScaledArray(jnp.full((1, 8), 2.0**13, jnp.float16), jnp.float32(2.0**-5))

    def f(x):
        return lax.reduce_sum_p.bind(x, axes=(0,), out_sharding=None)

    out = js.scalify(f)(x)
    np.testing.assert_array_equal(out.data, x.data[0])
    assert float(out.scale) == 2.0**-5
    names = {e.primitive.name for e in jax.make_jaxpr(js.scalify(f))(x).jaxpr.eqns}
    assert names == {"reduce_sum"}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_max_min(dtype, data):
    op = data.draw(st.sampled_from([jnp.max, jnp.min]))
    shape = data.draw(shapes())
    axes = _axes(data, shape)
    x = data.draw(scaled_arrays(shape, dtype))
    out = check_scaled(lambda x: op(x, axes), [x], dtype, ulps=0)
    assert float(out.scale) == float(x.scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_prod(dtype, data):
    shape = data.draw(shapes(max_side=4))
    axis = data.draw(st.integers(0, len(shape) - 1))
    # |data| in [0.5, 2], N <= 4 and |log2 s| <= 30: the value stays inside float32's range.
    x = data.draw(scaled_arrays(shape, dtype, min_exp=-30, max_exp=30, low=0.5, high=2.0))
    out = check_scaled(lambda x: jnp.prod(x, axis, dtype=x.dtype), [x], dtype, ulps=1)
    assert float(out.scale) == float(x.scale) ** shape[axis]


def test_reduce_prod_scale_beyond_float32_range_is_folded_into_data():
    x = js.ScaledArray(jnp.full((4,), 1.5, jnp.float32), jnp.float32(2.0**40))
    out = jax.jit(js.scalify(lambda x: jnp.prod(x)))(x)
    assert float(out.scale) == 2.0**127
    np.testing.assert_allclose(float(out.data) * 2.0**127, 1.5**4 * 2.0**160)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_argmax_argmin(dtype, data):
    op = data.draw(st.sampled_from([jnp.argmax, jnp.argmin]))
    shape = data.draw(shapes())
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = data.draw(scaled_arrays(shape, dtype))
    out = check_scaled(lambda x: op(x, axis), [x], dtype)
    assert not isinstance(out, js.ScaledArray) and out.dtype == jnp.int32


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_cumsum(dtype, data):
    shape = data.draw(shapes(max_side=8))
    axis = data.draw(st.integers(0, len(shape) - 1))
    reverse = data.draw(st.booleans())
    x = data.draw(scaled_arrays(shape, dtype))
    fn = lambda x: lax.cumsum(x, axis, reverse=reverse)  # noqa: E731
    check_scaled(fn, [x], dtype, ulps=_sum_ulps(shape[axis]), normwise=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_cumprod_small_axis_is_exact(dtype, data):
    shape = data.draw(shapes(max_side=5))
    axis = data.draw(st.integers(0, len(shape) - 1))
    reverse = data.draw(st.booleans())
    # Prefix values span s^1..s^N around the output scale ~s^((N+1)/2): keep them in range.
    x = data.draw(scaled_arrays(shape, dtype, min_exp=-4, max_exp=4, low=0.5, high=2.0))
    out = check_scaled(lambda x: lax.cumprod(x, axis, reverse=reverse), [x], dtype, ulps=1)
    exponent = int(np.log2(float(x.scale)))
    assert float(out.scale) == 2.0 ** ((exponent * (shape[axis] + 1)) // 2)


def test_cumprod_float32_wide_scales():
    x = js.ScaledArray(jnp.asarray([1.5, -0.75, 1.25, 1.0, 0.5], jnp.float32), jnp.float32(2.0**20))
    check_scaled(lambda x: jnp.cumprod(x), [x], jnp.float32, ulps=1)


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_cumprod_two_float16_prefixes_fit_around_the_middle_scale(scale):
    """Prefixes s and s^2 sit at 2^±10 around the output scale s^1.5: both normal float16."""
    data = jnp.asarray([[1.5, -0.75], [0.3, 1.7], [-1.1, 0.9]], jnp.float16)
    x = js.ScaledArray(data, jnp.float32(scale))
    out = check_scaled(lambda x: jnp.cumprod(x, axis=1), [x], jnp.float16, ulps=1)
    assert float(out.scale) == scale**1.5  # 2^-30 or 2^30


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_cummax_cummin(dtype, data):
    op = data.draw(st.sampled_from([lax.cummax, lax.cummin]))
    shape = data.draw(shapes())
    axis = data.draw(st.integers(0, len(shape) - 1))
    reverse = data.draw(st.booleans())
    x = data.draw(scaled_arrays(shape, dtype))
    check_scaled(lambda x: op(x, axis, reverse=reverse), [x], dtype, ulps=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_cumlogsumexp(dtype, data):
    shape = data.draw(shapes(max_side=6))
    axis = data.draw(st.integers(0, len(shape) - 1))
    reverse = data.draw(st.booleans())
    x = data.draw(scaled_arrays(shape, dtype))
    out = check_scaled(
        lambda x: lax.cumlogsumexp(x, axis, reverse=reverse), [x], dtype, ulps=4, normwise=True
    )
    if shape[axis] > 1:
        assert float(out.scale) == max(float(x.scale), 1.0)


def test_cumlogsumexp_along_a_length_one_axis_is_the_identity():
    """Found by hypothesis: a tiny float16 value at scale 1 (the rule's general scale) was
    subnormal and lost its precision; along a length-1 axis the input comes back as it is."""
    x = js.ScaledArray(jnp.array([[0.1257, -3.0]], jnp.float16), jnp.float32(2.0**-15))
    out = js.scalify(lambda v: lax.cumlogsumexp(v, axis=0))(x)
    np.testing.assert_array_equal(out.data, x.data)
    assert float(out.scale) == 2.0**-15


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_sort_single_operand(dtype, data):
    shape = data.draw(shapes())
    axis = data.draw(st.integers(0, len(shape) - 1))
    x = data.draw(scaled_arrays(shape, dtype))
    out = check_scaled(lambda x: jnp.sort(x, axis), [x], dtype, ulps=0)
    assert float(out.scale) == float(x.scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_sort_multi_operand(dtype, data):
    num_keys = data.draw(st.integers(1, 2))
    shape = data.draw(shapes())
    dim = data.draw(st.integers(0, len(shape) - 1))
    # Few distinct key values, so that ties exercise the second key and stability.
    keys = data.draw(scaled_arrays(shape, dtype, low=-2.0, high=2.0)).data.round()
    x = js.ScaledArray(keys, data.draw(scaled_arrays(shape, dtype)).scale)
    y = data.draw(scaled_arrays(shape, dtype))
    z = data.draw(scaled_arrays(shape, dtype))
    iota = lax.broadcasted_iota(jnp.int32, shape, dim)

    def fn(x, y, z, i):
        return lax.sort((x, y, z, i), dimension=dim, is_stable=True, num_keys=num_keys)

    outs = check_scaled(fn, [x, y, z, iota], dtype, ulps=0)
    assert [float(o.scale) for o in outs[:3]] == [float(a.scale) for a in (x, y, z)]
    assert not isinstance(outs[3], js.ScaledArray)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_argsort_with_plain_payload(dtype, data):
    x = data.draw(scaled_arrays(data.draw(shapes(max_dims=2)), dtype))
    check_scaled(lambda x: jnp.argsort(x, axis=-1, stable=True), [x], dtype)


# name -> (x, k) -> a tuple of (values, indices) pairs.
TOP_K = {
    "top_k": lambda x, k: (lax.top_k(x, k),),
    "approx_max_min_k": lambda x, k: (lax.approx_max_k(x, k), lax.approx_min_k(x, k)),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", sorted(TOP_K))
@few
@given(data=st.data())
def test_top_k(name, dtype, data):
    shape = data.draw(shapes())
    k = data.draw(st.integers(1, shape[-1]))
    x = data.draw(scaled_arrays(shape, dtype))
    outs = check_scaled(lambda x: TOP_K[name](x, k), [x], dtype, ulps=0)
    for values, indices in outs:
        assert float(values.scale) == float(x.scale)
        assert not isinstance(indices, js.ScaledArray)


def _max_with_payload(a, b):
    """Largest key (lowest index on ties) with its payload: a selecting computation."""
    (key_a, payload_a, index_a), (key_b, payload_b, index_b) = a, b
    take = (key_a > key_b) | ((key_a == key_b) & (index_a < index_b))
    pick = lambda u, v: jnp.where(take, u, v)  # noqa: E731
    return pick(key_a, key_b), pick(payload_a, payload_b), pick(index_a, index_b)


def _product_and_sum(a, b):
    """Multiplies one lane and adds the other: computed on the represented values."""
    return a[0] * b[0], a[1] + b[1]


def _zero_one(x) -> tuple:
    return jnp.zeros((), x.dtype), jnp.ones((), x.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_with_a_computation(dtype, data):
    """Generic ``lax.reduce``: a selecting computation keeps each lane's scale (bit exact), an
    adding one takes ``s * sqrt(N)``, any other runs on the represented values in float32."""
    shape = data.draw(shapes(min_dims=2, max_side=4))
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = shape[axis]
    x, y = data.draw(scaled_arrays(shape, dtype)), data.draw(scaled_arrays(shape, dtype))
    # Positive factors and terms, |log2 s| <= 20: products of n <= 4 values stay in range.
    positive = dict(min_exp=-20, max_exp=20, low=0.5, high=2.0)
    p, q = (
        data.draw(scaled_arrays(shape, dtype, **positive)),
        data.draw(scaled_arrays(shape, dtype, **positive)),
    )
    index = lax.broadcasted_iota(jnp.int32, shape, axis)

    def fn(x, y, p, q, index):
        zero, one = _zero_one(x)
        lowest = jnp.array(-jnp.inf, x.dtype)
        return {
            "select": lax.reduce(
                (x, y, index), (lowest, zero, jnp.int32(2**30)), _max_with_payload, [axis]
            ),
            "add": lax.reduce(x, zero, lambda a, b: a + b, [axis]),
            "values": lax.reduce((p, q), (one, zero), _product_and_sum, [axis]),
        }

    out = check_named(
        fn,
        [x, y, p, q, index],
        dtype,
        {
            "select": dict(ulps=0),
            "add": dict(ulps=_sum_ulps(n), normwise=True),
            "values": dict(ulps=n + 2),  # n float32 roundings, then one into dtype
        },
    )
    key, payload, _ = out["select"]
    assert (key.scale, payload.scale) == (x.scale, y.scale)  # the lanes are not mixed
    sqrt_n = 2.0 ** math.floor(math.log2(math.sqrt(n)))
    assert float(out["add"].scale) == float(x.scale) * sqrt_n
    for value in out["values"]:
        assert_static_or_guarded_scale(value, 1.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_window_with_a_computation(dtype, data):
    """Generic ``lax.reduce_window`` (computations other than ``lax.add/max/min``)."""
    shape = data.draw(shapes(min_dims=2, max_dims=3, max_side=6))
    config = _window_config(data, len(shape))
    size = math.prod(config["window_dimensions"])
    x = data.draw(scaled_arrays(shape, dtype))
    # Windowed products of 4 values in [0.5, 2] at |log2 s| <= 8 (no padding: no mixing
    # with the init value 1 at another magnitude).
    p = data.draw(scaled_arrays((3, 4), dtype, min_exp=-8, max_exp=8, low=0.5, high=2.0))

    def fn(x, p):
        zero, one = _zero_one(x)
        lowest = jnp.array(-jnp.inf, x.dtype)
        return {
            "max": lax.reduce_window(x, lowest, jnp.maximum, **config),
            "add": lax.reduce_window(x, zero, lambda a, b: a + b, **config),
            "prod": lax.reduce_window(p, one, lax.mul, (2, 2), (1, 1), "VALID"),
        }

    out = check_named(
        fn,
        [x, p],
        dtype,
        {
            "max": dict(ulps=0),
            "add": dict(ulps=_sum_ulps(size), normwise=True),
            "prod": dict(ulps=6),
        },
    )
    assert float(out["max"].scale) == float(x.scale)
    sqrt_size = 2.0 ** math.floor(math.log2(math.sqrt(size)))
    assert float(out["add"].scale) == float(x.scale) * sqrt_size
    assert_static_or_guarded_scale(out["prod"], 1.0)


def _select_and_scatter(operand, source, init, select, scatter, window):
    """``lax.select_and_scatter_p`` (no public wrapper) over non-overlapping windows."""
    scalar = jax.ShapeDtypeStruct((), operand.dtype)
    select, scatter = (
        jax.make_jaxpr(select)(scalar, scalar),
        jax.make_jaxpr(scatter)(scalar, scalar),
    )
    return lax.select_and_scatter_p.bind(
        operand,
        source,
        init,
        select_jaxpr=select.jaxpr,
        select_consts=tuple(select.consts),
        scatter_jaxpr=scatter.jaxpr,
        scatter_consts=tuple(scatter.consts),
        window_dimensions=window,
        window_strides=window,
        padding=((0, 0),) * len(window),  # XLA:CPU's SelectAndScatter mishandles padding
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_select_and_scatter(dtype, data):
    """Each source value lands, unchanged, on its window's selected operand element."""
    window = tuple(data.draw(st.integers(1, 3)) for _ in range(2))
    counts = tuple(data.draw(st.integers(1, 3)) for _ in range(2))
    operand = data.draw(scaled_arrays(tuple(w * c for w, c in zip(window, counts)), dtype))
    source = data.draw(scaled_arrays(counts, dtype))

    def fn(operand, source):
        zero = jnp.zeros((), operand.dtype)
        by_magnitude = lambda a, b: a * a >= b * b  # noqa: E731  (not scale-commuting)
        return {
            "max": _select_and_scatter(operand, source, zero, lax.ge, lax.add, window),
            "magnitude": _select_and_scatter(operand, source, zero, by_magnitude, lax.add, window),
        }

    out = check_named(
        fn, [operand, source], dtype, {"max": dict(ulps=0), "magnitude": dict(ulps=0)}
    )
    assert out["max"].scale == source.scale
    assert_static_or_guarded_scale(out["magnitude"], 1.0)


def _window_config(data, ndim: int) -> dict:
    sizes = tuple(data.draw(st.integers(1, 3)) for _ in range(ndim))
    return dict(
        window_dimensions=sizes,
        window_strides=tuple(data.draw(st.integers(1, 2)) for _ in range(ndim)),
        padding=data.draw(st.sampled_from(["VALID", "SAME"])),
        base_dilation=tuple(data.draw(st.integers(1, 2)) for _ in range(ndim)),
        window_dilation=tuple(data.draw(st.integers(1, 2)) for _ in range(ndim)),
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_window_sum(dtype, data):
    shape = data.draw(shapes(min_dims=2, max_dims=3, max_side=6))
    config = _window_config(data, len(shape))
    x = data.draw(scaled_arrays(shape, dtype))
    fn = lambda x: lax.reduce_window(x, 0.0, lax.add, **config)  # noqa: E731
    check_scaled(
        fn, [x], dtype, ulps=_sum_ulps(math.prod(config["window_dimensions"])), normwise=True
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_reduce_window_max_min(dtype, data):
    op, init = data.draw(st.sampled_from([(lax.max, -jnp.inf), (lax.min, jnp.inf)]))
    shape = data.draw(shapes(min_dims=2, max_dims=3, max_side=6))
    config = _window_config(data, len(shape))
    x = data.draw(scaled_arrays(shape, dtype))
    out = check_scaled(lambda x: lax.reduce_window(x, init, op, **config), [x], dtype, ulps=0)
    assert float(out.scale) == float(x.scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_flax_pooling(dtype, data):
    x = data.draw(scaled_arrays((2, 6, 5, 3), dtype))
    check_scaled(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), [x], dtype, ulps=0)
    check_scaled(
        lambda x: nn.avg_pool(x, (2, 3), padding="SAME"),
        [x],
        dtype,
        ulps=_sum_ulps(6),
        normwise=True,
    )


@few
@given(data=st.data())
def test_reductions_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((4, 6), jnp.float16))
    check_e8m0_matches(lambda x: jnp.sum(x, 1, dtype=x.dtype), [x])
    check_e8m0_matches(lambda x: jnp.cumsum(x, 0), [x])
    check_e8m0_matches(lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (1, 1), "SAME"), [x])
    check_e8m0_matches(lambda x: jnp.cumprod(x, 1), [x])
    check_e8m0_matches(
        lambda x: lax.reduce(x, jnp.zeros((), x.dtype), lambda a, b: a + b, [1]), [x]
    )
