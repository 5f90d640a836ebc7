"""ScaledArray with block scales: construction, conversion, pytrees, jit, vmap, sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scaled as js
from jax_scaled.array import block_shape_of, check_block_sharding, expand_scale

E8M0 = jnp.float8_e8m0fnu


def blocked(shape=(8, 64), grid=(8, 2), dtype=jnp.float16, scale_dtype=jnp.float32, seed=0):
    """A ScaledArray with random data and random power-of-two block scales on ``grid``."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal(shape).astype(dtype)
    scale = np.ldexp(1.0, rng.integers(-12, 12, grid)).astype(np.float32)
    return js.ScaledArray(jnp.asarray(data), jnp.asarray(scale).astype(scale_dtype))


def value64(x: js.ScaledArray) -> np.ndarray:
    """``data * scale`` in float64 numpy, block scales repeated with np.repeat."""
    scale = np.asarray(x.scale, np.float64)
    for axis, block in enumerate(x.block_shape if scale.ndim else ()):
        scale = np.repeat(scale, block, axis=axis)
    return np.asarray(x.data, np.float64) * scale


# -- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, blocks",
    [((), (8, 64)), ((8, 1), (1, 64)), ((1, 64), (8, 1)), ((8, 2), (1, 32)), ((1, 1), (8, 64))],
    ids=["per-tensor", "per-row", "per-channel", "1x32", "one-block"],
)
def test_block_shape_is_data_shape_over_scale_shape(grid, blocks):
    x = js.ScaledArray(jnp.ones((8, 64)), jnp.ones(grid, jnp.float32))
    assert x.block_shape == blocks
    assert block_shape_of((8, 64), grid) == blocks


@pytest.mark.parametrize(
    "scale, error",
    [
        (jnp.ones(64), ValueError),  # broadcasts, but not of the data's rank
        (jnp.ones((8, 3)), ValueError),  # 3 does not divide 64
        (jnp.ones((16, 1)), ValueError),  # more scales than rows
        (jnp.ones((8, 64, 1)), ValueError),  # rank above the data's
        (jnp.ones((8, 0)), ValueError),  # an empty grid for non-empty data
        (jnp.ones((8, 2), jnp.float16), TypeError),  # block scales: float32 or E8M0
        (jnp.ones((8, 2), jnp.int32), TypeError),
        (jnp.full((8, 2), 3.0), ValueError),  # not powers of two
    ],
)
def test_malformed_block_scales_are_refused(scale, error):
    with pytest.raises(error):
        js.ScaledArray(jnp.ones((8, 64)), scale)


def test_error_message_says_what_a_scale_may_be():
    with pytest.raises(ValueError, match="0-d .* or has the data's rank"):
        js.ScaledArray(jnp.ones((8, 64)), jnp.ones((8, 3)))


def test_empty_data_takes_an_empty_grid():
    assert js.ScaledArray(jnp.ones((0, 64)), jnp.ones((0, 2))).block_shape == (1, 32)


# -- conversion ------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(8, 1), (1, 64), (8, 2), (2, 64), (4, 8), (8, 64)])
@pytest.mark.parametrize("scale_dtype", [jnp.float32, E8M0])
def test_to_array_repeats_block_scales_exactly(grid, scale_dtype):
    x = blocked(grid=grid, scale_dtype=scale_dtype)
    np.testing.assert_array_equal(x.to_array(jnp.float32), value64(x).astype(np.float32))
    np.testing.assert_array_equal(js.asarray(x), value64(x).astype(np.float32))  # exact
    np.testing.assert_array_equal(np.asarray(x), value64(x).astype(np.float16))  # data dtype


def test_expand_scale_repeats_each_scale_over_its_block():
    scale = jnp.arange(6.0).reshape(2, 3)
    expanded = np.asarray(expand_scale(scale, (4, 6)))
    np.testing.assert_array_equal(expanded, np.repeat(np.repeat(scale, 2, 0), 2, 1))
    assert expand_scale(jnp.float32(2.0), (2, 3)).shape == (2, 3)


def test_as_scaled_array_stays_per_tensor_and_keeps_block_scaled_leaves():
    x = blocked()
    tree = js.as_scaled_array({"plain": jnp.ones((8, 64)), "blocks": x})
    assert tree["plain"].scale.shape == ()
    assert tree["blocks"] is x
    e8m0 = js.as_scaled_array(x, scale_dtype=E8M0)
    assert e8m0.scale.dtype == E8M0
    np.testing.assert_array_equal(e8m0.to_array(jnp.float32), x.to_array(jnp.float32))


def test_tree_astype_casts_data_and_keeps_block_scales():
    x = blocked(dtype=jnp.float32)
    cast = js.tree.astype({"x": x}, jnp.bfloat16)["x"]
    assert cast.dtype == jnp.bfloat16 and cast.scale is x.scale and cast.block_shape == (1, 32)


# -- pytrees and transformations -------------------------------------------------------------


def test_pytree_flattening_and_jit_keep_the_blocks():
    x = blocked()
    leaves, treedef = jax.tree.flatten(x)
    assert [leaf.shape for leaf in leaves] == [(8, 64), (8, 2)]
    y = jax.jit(lambda s: js.ScaledArray(s.data * 2, s.scale))(x)
    assert y.block_shape == (1, 32)
    np.testing.assert_array_equal(jax.jit(lambda s: s.to_array(jnp.float32))(y), 2 * value64(x))


@pytest.mark.parametrize("axis", [0, 1])
def test_vmap_maps_data_and_scale_along_an_unblocked_axis(axis):
    x = blocked(shape=(4, 8, 64), grid=(4, 8, 2))
    x = jax.tree.map(lambda a: jnp.moveaxis(a, 0, axis), x)  # the batch axis at `axis`
    out = jax.vmap(lambda s: js.ScaledArray(s.data * 2, s.scale), in_axes=axis)(x)
    assert out.block_shape == (1, 1, 32)
    values = jax.vmap(lambda s: s.to_array(jnp.float32), in_axes=axis, out_axes=axis)(x)
    np.testing.assert_array_equal(values, value64(x).astype(np.float32))
    np.testing.assert_array_equal(js.asarray(out, jnp.float32), 2 * np.moveaxis(values, axis, 0))


def test_vmap_over_a_blocked_axis_is_refused():
    x = blocked(shape=(4, 64), grid=(2, 2))  # blocks of 2 examples
    with pytest.raises(ValueError, match="inconsistent sizes"):
        jax.vmap(lambda s: s.to_array())(x)


def test_vmap_with_a_shared_per_tensor_scale_is_unchanged():
    x = js.scaled_array(jnp.ones((3, 4)), 4.0)
    in_axes = jax.tree.unflatten(jax.tree.structure(x), [0, None])
    np.testing.assert_array_equal(jax.vmap(lambda s: s.to_array(), in_axes=(in_axes,))(x), 4.0)


# -- sharding --------------------------------------------------------------------------------

MESH = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("rows", "cols"))


def test_block_scales_are_sharded_like_their_data():
    x = blocked(shape=(16, 128), grid=(16, 4))
    sharding = NamedSharding(MESH, P("rows", "cols"))
    shardings = js.scaled_shardings(sharding, x)
    assert shardings.data == sharding and shardings.scale == sharding
    put = jax.device_put(x, shardings)
    assert put.scale.sharding == sharding and put.scale.addressable_shards[0].data.shape == (4, 2)
    value = jax.jit(lambda s: s.to_array(jnp.float32))(put)
    np.testing.assert_array_equal(value, value64(x).astype(np.float32))
    per_tensor = js.scaled_shardings(sharding, js.as_scaled_array(jnp.ones((16, 128))))
    assert per_tensor.scale.spec == P()  # a 0-d scale stays replicated


@pytest.mark.parametrize(
    "grid, spec",
    [
        ((2, 8), P("rows", None)),  # blocks of 8 rows, shards of 4 rows
        ((16, 4), P(None, ("rows", "cols"))),  # blocks of 32 columns, shards of 16
    ],
)
def test_a_sharding_that_splits_blocks_is_refused(grid, spec):
    x = blocked(shape=(16, 128), grid=grid)
    with pytest.raises(ValueError, match="splits the scale blocks"):
        js.scaled_shardings(NamedSharding(MESH, spec), x)
    with pytest.raises(ValueError, match="splits the scale blocks"):
        check_block_sharding(x, NamedSharding(MESH, spec))


def test_shard_map_gets_each_shard_with_its_block_scales():
    x = blocked(shape=(16, 128), grid=(16, 4))
    specs = js.scaled_shardings(P("rows", "cols"), x)

    def body(s):
        assert s.data.shape == (4, 64) and s.scale.shape == (4, 2)
        return js.ScaledArray(s.data * 2, s.scale)

    out = jax.shard_map(body, mesh=MESH, in_specs=(specs,), out_specs=specs)(x)
    assert out.block_shape == (1, 32)
    np.testing.assert_array_equal(js.asarray(out, jnp.float32), 2 * value64(x))


def test_e8m0_block_scales_round_trip_through_quantize():
    q = js.quantize(np.ones((4, 64), np.float32), js.formats.MXFP8_E4M3)
    assert q.scale.dtype == E8M0 and q.scale.dtype == ml_dtypes.float8_e8m0fnu
    rebuilt = js.ScaledArray(q.data, q.scale)  # validated construction accepts it
    np.testing.assert_array_equal(rebuilt.to_array(jnp.float32), np.ones((4, 64)))


def test_shard_map_specs_that_split_blocks_are_refused_by_jax():
    x = blocked(shape=(16, 128), grid=(2, 4))  # blocks of 8 rows, 4 shards of 4 rows
    specs = js.scaled_shardings(P("rows", None), x)
    with pytest.raises(ValueError, match="not evenly divisible"):
        jax.shard_map(lambda s: s, mesh=MESH, in_specs=(specs,), out_specs=specs)(x)
