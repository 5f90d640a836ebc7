"""ScaledArray construction, validation, conversion and pytree behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js


def test_properties_describe_the_represented_tensor():
    x = js.ScaledArray(jnp.ones((2, 3), jnp.float16), jnp.float32(4.0))
    assert x.shape == (2, 3) and x.ndim == 2 and x.size == 6
    assert x.dtype == jnp.float16
    assert x.aval == jax.core.ShapedArray((2, 3), jnp.float16)


def test_to_array_and_numpy_conversion():
    x = js.scaled_array([1.0, -1.5], 0.25, dtype=jnp.float16)
    np.testing.assert_array_equal(x.to_array(), np.array([0.25, -0.375], np.float16))
    assert x.to_array(jnp.float32).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x), np.array([0.25, -0.375], np.float16))


def test_to_array_in_wider_dtype_does_not_overflow():
    x = js.scaled_array([2.0], 2.0**20, dtype=jnp.float16)
    assert float(x.to_array(jnp.float32)[0]) == 2.0**21
    assert np.isinf(np.asarray(x.to_array())[0])  # float16 cannot hold 2^21


def test_astype_changes_data_only():
    x = js.scaled_array([1.0, 2.0], 8.0).astype(jnp.bfloat16)
    assert x.data.dtype == jnp.bfloat16 and x.scale.dtype == jnp.float32
    assert float(x.scale) == 8.0


@pytest.mark.parametrize(
    "data, scale, error",
    [
        ([1.0, 2.0], jnp.float32(1), TypeError),  # data not an array
        (jnp.ones(3), 1.0, TypeError),  # scale not an array
        (jnp.ones(3), jnp.int32(1), TypeError),  # integer scale
        (jnp.ones(3, jnp.int32), jnp.float32(1), TypeError),  # integer data
        (jnp.ones(3), jnp.ones(4), ValueError),  # not broadcastable
        (jnp.ones(3), jnp.ones((2, 3)), ValueError),  # broadcasts, but changes the shape
    ],
)
def test_malformed_construction_is_refused(data, scale, error):
    with pytest.raises(error):
        js.ScaledArray(data, scale)


def test_per_axis_scale_is_a_valid_representation():
    x = js.ScaledArray(jnp.ones((2, 3)), jnp.array([[1.0], [2.0]]))
    np.testing.assert_array_equal(x.to_array(), [[1, 1, 1], [2, 2, 2]])


def test_pytree_round_trip_and_jit():
    x = js.scaled_array([1.0, 2.0], 0.5)
    leaves, treedef = jax.tree.flatten(x)
    assert len(leaves) == 2
    y = jax.jit(lambda s: js.ScaledArray(s.data * 2, s.scale))(x)
    np.testing.assert_array_equal(y.to_array(), [1.0, 2.0])


def test_as_scaled_array_on_pytrees():
    tree = {"w": jnp.ones(3), "b": jnp.float32(6.0), "step": jnp.int32(3), "flag": True}
    out = js.as_scaled_array(tree)
    assert isinstance(out["w"], js.ScaledArray) and float(out["w"].scale) == 1.0
    assert float(out["b"].data) == 1.5 and float(out["b"].scale) == 4.0
    assert out["step"] is tree["step"] and out["flag"] is True
    np.testing.assert_array_equal(js.asarray(out)["w"], tree["w"])
    assert float(js.asarray(out)["b"]) == 6.0


def test_as_scaled_array_with_explicit_scale_and_e8m0():
    out = js.as_scaled_array(jnp.array([2.0, 4.0]), scale=2.0, scale_dtype=jnp.float8_e8m0fnu)
    assert out.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(out.data, [1.0, 2.0])
    np.testing.assert_array_equal(js.asarray(out), [2.0, 4.0])


@pytest.mark.parametrize("exponent", [-126, -40, 0, 40, 127])
def test_e8m0_scale_round_trips(exponent):
    x = js.as_scaled_array(jnp.float32(1.5 * 2.0**exponent), scale_dtype=jnp.float8_e8m0fnu)
    assert x.scale.dtype == jnp.float8_e8m0fnu
    assert float(x.scale.astype(jnp.float32)) == 2.0**exponent
    assert float(js.asarray(x, jnp.float32)) == 1.5 * 2.0**exponent


def test_asarray_casts_every_float_leaf():
    out = js.asarray({"a": js.scaled_array([1.0], 2.0), "b": jnp.ones(2), "i": 3}, jnp.float16)
    assert out["a"].dtype == jnp.float16 and out["b"].dtype == jnp.float16 and out["i"] == 3


# Values float16 cannot hold: subnormal (2^-20: low bits lost), flushed (2^-30), overflow (2^20).
@pytest.mark.parametrize("exponent", [-20, -30, 20])
def test_asarray_of_narrow_data_is_the_exact_float32_value(exponent):
    data = np.array([1.0 + 2.0**-10, -3.0, 1.5, 0.0], np.float16)
    x = js.ScaledArray(jnp.asarray(data), jnp.float32(2.0**exponent))
    out = js.asarray(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, data.astype(np.float64) * 2.0**exponent)
    old = np.asarray(js.asarray(x, jnp.float16), np.float64)  # the data dtype loses the value
    assert not np.array_equal(old, data.astype(np.float64) * 2.0**exponent)


def test_asarray_of_bfloat16_data_is_float32():
    x = js.scaled_array([1.0 + 2.0**-7, 3.0], 2.0**-100, dtype=jnp.bfloat16)
    out = js.asarray(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.array([1.0 + 2.0**-7, 3.0]) * 2.0**-100)


def test_asarray_of_mx_quantized_data_mixes_with_float32():
    x = (jnp.arange(64.0).reshape(2, 32) % 16 - 8) * 2.0**-20
    q = js.quantize(x, "mxfp8_e4m3", axis=-1)
    assert q.dtype == jnp.float8_e4m3fn and q.scale.shape == (2, 1)
    mixed = js.asarray(q) + jnp.zeros((2, 32), jnp.float32)  # float8 would refuse to mix
    assert mixed.dtype == jnp.float32
    np.testing.assert_array_equal(mixed, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_asarray_keeps_float32_and_wider_data_dtypes(dtype):
    with jax.enable_x64(True):
        x = js.scaled_array([1.0, 3.0], 0.5, dtype=dtype)
        assert js.asarray(x).dtype == dtype


def test_asarray_with_explicit_dtype_casts_in_that_dtype():
    x = js.scaled_array([1.0, 3.0], 2.0**-30, dtype=jnp.float16)
    out = js.asarray(x, jnp.float16)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, x.to_array())  # flushed, as to_array() in float16


def test_asarray_of_a_mixed_tree():
    plain16, step = jnp.ones(2, jnp.float16), jnp.int32(3)
    tree = {
        "h": js.scaled_array([3.0], 2.0**-30, dtype=jnp.float16),
        "f": js.scaled_array([3.0], 2.0**-30),
        "p": plain16,
        "step": step,
        "flag": True,
    }
    out = js.asarray(tree)
    assert out["h"].dtype == jnp.float32 and float(out["h"][0]) == 3.0 * 2.0**-30
    assert out["f"].dtype == jnp.float32 and float(out["f"][0]) == 3.0 * 2.0**-30
    assert out["p"] is plain16 and out["step"] is step and out["flag"] is True


def test_to_array_and_numpy_conversion_keep_the_data_dtype():
    x = js.scaled_array([3.0], 2.0**-30, dtype=jnp.float16)
    assert x.to_array().dtype == jnp.float16 and np.asarray(x).dtype == np.float16


def test_tree_helpers_stop_at_scaled_arrays():
    tree = {"a": js.scaled_array(jnp.ones(2), 2.0), "b": jnp.zeros(3)}
    assert len(js.tree.tree_leaves(tree)) == 2
    leaves, treedef = js.tree.tree_flatten(tree)
    assert isinstance(leaves[0], js.ScaledArray)
    shapes = js.tree.tree_map(lambda x: x.shape, tree)
    assert shapes == {"a": (2,), "b": (3,)}
    cast = js.tree.astype(tree, jnp.float16)
    assert cast["a"].dtype == jnp.float16 and float(cast["a"].scale) == 2.0
    assert js.is_scaled_leaf(tree["a"]) and not js.is_scaled_leaf(tree)


def test_all_zero_arrays_get_the_smallest_scale():
    bias = js.as_scaled_array(jnp.zeros(4, jnp.float16))
    assert float(bias.scale) == 2.0**-126
    np.testing.assert_array_equal(js.asarray(bias), np.zeros(4))
    tiny = js.scaled_array(jnp.ones(4, jnp.float16), 2.0**-20)
    out = js.scalify(lambda x, b: x + b)(tiny, bias)  # the zero bias does not set the scale
    assert float(out.scale) == 2.0**-20
    e8m0 = js.as_scaled_array(jnp.zeros(2), scale_dtype=jnp.float8_e8m0fnu)
    assert float(e8m0.scale.astype(jnp.float32)) == 2.0**-126


def test_scales_must_be_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        js.scaled_array([1.0], 0.3)
    with pytest.raises(ValueError, match="power of two"):
        js.as_scaled_array(jnp.ones(2), scale=3.0)
    with pytest.raises(ValueError, match="power of two"):
        js.ScaledArray(jnp.ones(2), jnp.float32(-2.0))
    assert float(js.scaled_array([1.0], 0.0).scale) == 0.0  # zero is allowed


def test_set_scaling_rounds_a_non_power_of_two_scale_down():
    out = js.scalify(js.set_scaling)(jnp.array([3.0]), jnp.float32(3.0))
    assert float(out.scale) == 2.0 and float(js.asarray(out)[0]) == 3.0


@pytest.mark.parametrize("fn", [jnp.sum, jnp.asarray, jax.nn.relu, lambda x: jnp.dot(x, x)])
def test_jax_functions_outside_scalify_say_what_to_do(fn):
    x = js.as_scaled_array(jnp.ones(4, jnp.float16))
    with pytest.raises(TypeError, match=r"outside js.scalify.*js.asarray\(x\)"):
        fn(x)
    scalified = js.asarray(js.scalify(fn)(x), jnp.float32)  # under scalify the same call works
    np.testing.assert_array_equal(scalified, fn(jnp.ones(4, jnp.float32)))
