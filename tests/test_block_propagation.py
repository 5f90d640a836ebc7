"""Block scales through scalify (issue 19): layout ops exact, pointwise ops per block,
reductions and contractions against float64, fallbacks warned and recorded.

Every case draws block scales at random powers of two in [2^-20, 2^20] (one per block),
runs ``jax.jit(js.scalify(f))`` and compares with ``f`` on the represented values in float64,
and checks the output's block structure.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, reference64, value64
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled.array import expand_scale
from jax_scaled.engine.block_dispatch import BlockScaleFallbackWarning

few = settings(max_examples=6, deadline=None)
DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def blocked(seed: int, shape, blocks, dtype=jnp.float32, low=-20, high=20) -> js.ScaledArray:
    """Standard-normal data with one random power-of-two scale per block."""
    rng = np.random.default_rng(seed)
    grid = tuple(n // b for n, b in zip(shape, blocks, strict=True))
    scale = np.exp2(rng.integers(low, high + 1, grid)).astype(np.float32)
    data = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    return js.ScaledArray(jnp.asarray(data), jnp.asarray(scale))


def run(fn, *args):
    out = jax.jit(js.scalify(fn))(*args)
    return out, reference64(fn, *args)


# --- layout ops: exact, blocks kept -----------------------------------------------------------

LAYOUT = {
    "transpose": (lambda x: x.T, (8, 64), (1, 32), (32, 1)),
    "broadcast_new_axis": (lambda x: jnp.broadcast_to(x, (3, 8, 64)), (8, 64), (1, 32), (3, 1, 32)),
    "expand_dims": (lambda x: x[None], (8, 64), (1, 32), (1, 1, 32)),
    "reshape_split": (lambda x: x.reshape(8, 2, 32), (8, 64), (1, 32), (1, 1, 32)),
    "reshape_merge": (lambda x: x.reshape(8, 2, 32).reshape(8, 64), (8, 64), (1, 32), (1, 32)),
    "reshape_flatten_rows": (lambda x: x.reshape(-1), (8, 64), (1, 32), (32,)),
    "slice_at_boundary": (lambda x: x[2:6, 32:], (8, 64), (1, 32), (1, 32)),
    "rev": (lambda x: x[::-1, ::-1], (8, 64), (1, 32), (1, 32)),
    "squeeze": (lambda x: x[:, None, :].squeeze(1), (8, 64), (1, 32), (1, 32)),
    "pad_zero_blocks": (lambda x: jnp.pad(x, ((1, 2), (32, 0))), (8, 64), (1, 32), (1, 32)),
    "concatenate": (lambda x: jnp.concatenate([x, -x], axis=1), (8, 64), (1, 32), (1, 32)),
    "dynamic_slice_rows": (
        lambda x: lax.dynamic_slice_in_dim(x, jnp.int32(3), 2, axis=0),
        (8, 64),
        (1, 32),
        (1, 32),
    ),
    "gather_rows": (lambda x: x[jnp.array([[1, 7], [3, 3]])], (8, 64), (1, 32), (1, 1, 32)),
    "gather_rows_out_of_bounds_fill": (
        lambda x: jnp.take(x, jnp.array([2, 11, -1]), axis=0, mode="fill"),
        (8, 64),
        (1, 32),
        (1, 32),
    ),
    "gather_index_vector_in_axis_order_1_0": (
        lambda x: lax.gather(
            x,
            jnp.array([[40, 1], [5, 7], [63, 0]]),
            lax.GatherDimensionNumbers(
                offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(1, 0)
            ),
            slice_sizes=(1, 1),
            mode="promise_in_bounds",
        ),
        (8, 64),
        (1, 64),
        (1,),
    ),  # fmt: skip
    "gather_within_one_block": (
        lambda x: jnp.take(x, jnp.array([5, 0, 63]), axis=1),
        (8, 64),
        (4, 64),
        (4, 1),
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUT))
@few
@given(seed=st.integers(0, 2**31 - 1))
def test_layout_ops_are_exact_and_keep_blocks(name, seed):
    fn, shape, blocks, out_blocks = LAYOUT[name]
    x = blocked(seed, shape, blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockScaleFallbackWarning)
        out, expected = run(fn, x)
    np.testing.assert_array_equal(value64(out), expected)
    assert out.block_shape == out_blocks


# --- pointwise ops: per block -----------------------------------------------------------------

POINTWISE = {
    "neg": lambda x, y: -x,
    "abs": lambda x, y: jnp.abs(x),
    "mul": lambda x, y: x * y,
    "mul_constant": lambda x, y: x * 3.0,
    "div": lambda x, y: x / (jnp.abs(y) + 1.0),
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - 2.0 * y,
    "maximum": lambda x, y: jnp.maximum(x, y),
    "where": lambda x, y: jnp.where(x > 0, x, y),
    "relu": lambda x, y: jax.nn.relu(x),
    "exp": lambda x, y: jnp.exp(jnp.tanh(x)),
    "tanh": lambda x, y: jnp.tanh(x),
    "gelu": lambda x, y: jax.nn.gelu(x),
    "square_sqrt": lambda x, y: jnp.sqrt(jnp.square(x)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(POINTWISE))
@few
@given(seed=st.integers(0, 2**31 - 1))
def test_pointwise_ops_keep_blocks(name, dtype, seed):
    x = blocked(seed, (8, 64), (1, 32), dtype)
    y = blocked(seed + 1, (8, 64), (8, 16), dtype)  # another grid: the common one is (1, 16)
    out, expected = run(POINTWISE[name], x, y)
    assert out.block_shape[0] == 1 and out.block_shape[1] in (16, 32)
    # Each element within its block's rounding: compare per block (the scales span 2^40).
    got = value64(out)
    scale = np.repeat(np.repeat(np.asarray(out.scale, np.float64), out.block_shape[0], 0),
                      out.block_shape[1], 1)  # fmt: skip
    tolerance = 4 * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(got - expected) <= tolerance * np.maximum(np.abs(expected), scale)), name


def test_mul_by_per_tensor_scale_is_exact():
    x = blocked(0, (8, 64), (1, 32))
    w = js.ScaledArray(jnp.full((8, 64), -1.0, jnp.float32), jnp.float32(2.0**-10))  # a pow2
    out, expected = run(lambda x, w: x * w, x, w)
    np.testing.assert_array_equal(value64(out), expected)
    assert out.block_shape == (1, 32)


# --- reductions ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sum_along_an_unblocked_axis_keeps_blocks(dtype):
    x = blocked(1, (8, 64), (8, 32), dtype)  # one scale per column block, rows unblocked
    out, expected = run(lambda x: jnp.sum(x, axis=0), x)
    assert out.block_shape == (32,)
    assert_close(out, expected, dtype, ulps=16, normwise=True)


@pytest.mark.parametrize("reduce", [jnp.sum, jnp.max, jnp.min])
def test_reduction_across_blocks_gives_one_scale_per_remaining_block(reduce):
    x = blocked(2, (8, 64), (1, 32))
    out, expected = run(lambda x: reduce(x, axis=1), x)
    assert out.block_shape == (1,)  # one scale per row: the row's blocks aligned
    assert_close(out, expected, jnp.float32, ulps=64, normwise=True)


# --- contractions -----------------------------------------------------------------------------


def assert_matmul_close(out, x, w, dtype, roundings: float = 4.0) -> None:
    """Each output within ``roundings`` of ``dtype`` (plus float32 accumulation over ``K``)
    of ``sum_k |x_ik| |w_kj|``: the classical bound of a dot product, which stays meaningful
    when block scales make rows and columns span 2^40 and sums cancel. An output element far
    below its block's scale is a subnormal of ``dtype``: half its step at that scale more."""
    xv, wv = value64(x), value64(w)
    magnitude = np.abs(xv) @ np.abs(wv)
    tolerance = roundings * float(jnp.finfo(dtype).eps) + xv.shape[-1] * 2.0**-24
    step = np.asarray(expand_scale(out.scale.astype(jnp.float32), out.shape), np.float64)
    step *= float(jnp.finfo(out.dtype).smallest_subnormal) / 2
    assert np.all(np.abs(value64(out) - xv @ wv) <= tolerance * magnitude + step)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matmul_consumes_contracting_blocks(dtype):
    """MX layout: blocks of 32 along the contracting axis of both operands."""
    x = blocked(3, (16, 128), (1, 32), dtype, low=-8, high=8)
    w = blocked(4, (128, 24), (32, 1), dtype, low=-8, high=8)
    out = jax.jit(js.scalify(lambda x, w: x @ w))(x, w)
    assert out.shape == (16, 24)
    assert_matmul_close(out, x, w, dtype)


def test_matmul_keeps_row_and_column_scales():
    """Per-row scales of x and per-column scales of w factor out: the output has both."""
    x = blocked(5, (16, 128), (1, 128))
    w = blocked(6, (128, 24), (128, 1))
    out = jax.jit(js.scalify(lambda x, w: x @ w))(x, w)
    assert out.block_shape == (1, 1) and out.scale.shape == (16, 24)
    assert_matmul_close(out, x, w, jnp.float32)


def test_matmul_against_lax_scaled_dot():
    """The same MX product through jax.lax.scaled_dot (block scales as its operands)."""
    x = blocked(7, (4, 64), (1, 32), low=-6, high=6)
    w = blocked(8, (64, 8), (32, 1), low=-6, high=6)
    ours = value64(jax.jit(js.scalify(lambda x, w: x @ w))(x, w))
    lhs = x.data.astype(jnp.float8_e4m3fn)[None]
    rhs = w.data.T.astype(jnp.float8_e4m3fn)[None]
    lhs_scale = x.scale.astype(jnp.float8_e8m0fnu)[None]
    rhs_scale = w.scale.T.astype(jnp.float8_e8m0fnu)[None]
    reference = lax.scaled_dot(
        lhs, rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale,
        dimension_numbers=(((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32,
    )[0]  # fmt: skip
    rounded = js.ScaledArray(x.data.astype(jnp.float8_e4m3fn).astype(jnp.float32), x.scale)
    rounded_w = js.ScaledArray(w.data.astype(jnp.float8_e4m3fn).astype(jnp.float32), w.scale)
    ours_on_fp8 = value64(jax.jit(js.scalify(lambda x, w: x @ w))(rounded, rounded_w))
    np.testing.assert_allclose(ours_on_fp8, np.asarray(reference, np.float64), rtol=1e-5, atol=0)
    assert np.all(np.isfinite(ours))


def conv_nhwc(x, w):
    dims = ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dims)


CONV_BLOCKS = {  # (input blocks, kernel blocks, output blocks)
    "per_channel_kernel": ((4, 8, 8, 64), (3, 3, 64, 1), (4, 8, 8, 1)),
    "per_example_and_channel_tiles": ((1, 8, 8, 64), (3, 3, 64, 8), (1, 8, 8, 8)),
    "mx_input_features": ((1, 1, 1, 32), (3, 3, 32, 16), (1, 8, 8, 16)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(CONV_BLOCKS))
def test_conv_keeps_batch_and_output_channel_blocks(name, dtype):
    """Per-example and per-output-channel blocks factor out of a convolution; blocks along
    its input features (MX) are consumed: each output within float32 accumulation plus one
    rounding of ``dtype`` of the float64 convolution, relative to ``conv(|x|, |w|)``, plus
    half a subnormal step of ``dtype`` at the output's scale (block scales from 2^-20 to
    2^20: an output far below its block's scale is a subnormal there)."""
    x_blocks, w_blocks, out_blocks = CONV_BLOCKS[name]
    x = blocked(13, (4, 8, 8, 64), x_blocks, dtype, low=-20, high=20)
    w = blocked(14, (3, 3, 64, 16), w_blocks, dtype, low=-20, high=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockScaleFallbackWarning)
        out = jax.jit(js.scalify(conv_nhwc))(x, w)
    assert out.block_shape == out_blocks and out.dtype == dtype
    expected = reference64(conv_nhwc, x, w)
    magnitude = reference64(lambda x, w: conv_nhwc(jnp.abs(x), jnp.abs(w)), x, w)
    tolerance = 2 * float(jnp.finfo(dtype).eps) + 9 * 64 * 2.0**-24
    step = np.asarray(expand_scale(out.scale.astype(jnp.float32), out.shape), np.float64)
    step *= float(jnp.finfo(dtype).smallest_subnormal) / 2
    assert np.all(np.abs(value64(out) - expected) <= tolerance * magnitude + step)


def e8m0(x: js.ScaledArray) -> js.ScaledArray:
    return js.ScaledArray(x.data, x.scale.astype(jnp.float8_e8m0fnu))


LEAVING_BLOCKS = {  # each leaves its E8M0 blocks for one scale per tensor
    "mx_matmul": lambda x, w: x @ w,
    "merge_blocks": lambda x, w: js.ops.merge_blocks(x) + 1.0,
    "fallback": lambda x, w: jnp.cumsum(x, axis=1),
}


@pytest.mark.filterwarnings("ignore::jax_scaled.engine.block_dispatch.BlockScaleFallbackWarning")
@pytest.mark.parametrize("name", sorted(LEAVING_BLOCKS))
def test_per_tensor_results_of_e8m0_blocks_have_float32_scales(name):
    """E8M0 stores block scales; a value that leaves its blocks gets the per-tensor default
    (float32), or the configured scale dtype."""
    x = e8m0(blocked(11, (16, 64), (1, 32), low=-6, high=6))
    w = e8m0(blocked(12, (64, 8), (32, 1), low=-6, high=6))
    fn = LEAVING_BLOCKS[name]
    out = jax.jit(js.scalify(fn))(x, w)
    assert np.ndim(out.scale) == 0 and out.scale.dtype == jnp.float32
    forced = js.scalify(fn, config=js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu))(x, w)
    assert forced.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(value64(forced), value64(out))


# --- fallback: never a wrong number, never silent -------------------------------------------------


def test_fallback_warns_records_and_is_exact():
    x = blocked(9, (8, 64), (1, 32), low=-4, high=4)
    fn = lambda x: jnp.cumsum(x, axis=1)  # noqa: E731  (no block rule for cumsum)
    with pytest.warns(BlockScaleFallbackWarning, match="cumsum"):
        with js.diagnostics.record_scales() as records:
            out = jax.jit(js.scalify(fn))(x)
    assert np.ndim(out.scale) == 0
    assert_close(out, reference64(fn, x), jnp.float32, ulps=64, normwise=True)
    assert any(r.block_fallback and r.primitive == "cumsum" for r in records)
    assert not any(r.block_fallback for r in records if r.primitive != "cumsum")


def test_slice_across_a_block_falls_back():
    x = blocked(10, (8, 64), (1, 32), low=-4, high=4)
    with pytest.warns(BlockScaleFallbackWarning, match="slice"):
        out, expected = run(lambda x: x[:, 16:48], x)
    np.testing.assert_array_equal(value64(out), expected)


def test_per_tensor_programs_are_unchanged():
    """The same jaxpr as before block scales existed: no extra operation on 0-d scales."""
    x = js.as_scaled_array(jnp.ones((4, 8), jnp.float16))
    jaxpr = str(jax.make_jaxpr(js.scalify(lambda x: jnp.exp(x) * x + 1.0))(x))
    assert "reduce_max" not in jaxpr and "transpose" not in jaxpr


# --- library code and higher-order primitives -------------------------------------------------

LIBRARY = {
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
    "layer_norm": lambda x: (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True)),
    "gelu_times_sigmoid": lambda x: jax.nn.gelu(x) * jax.nn.sigmoid(x),
    "clip": lambda x: jnp.clip(x, -1.0, 1.0),
    "where_relu": lambda x: jnp.where(x > 0, x, 0.0),
    "inner_jit": lambda x: jax.jit(lambda a: jnp.tanh(a) * 2)(x),
    "checkpoint": lambda x: jax.checkpoint(lambda a: jnp.sin(a) * a)(x),
    "grad_through_matmul": lambda x: jax.grad(lambda a: jnp.sum(jnp.tanh(a @ a.T)))(x),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_code_keeps_blocks(name):
    """jax.nn and jax.numpy as published, size-1 broadcasting (``x - mean(keepdims)``) and
    calls (jit, checkpoint, grad): block scales kept, values as in float64, no fallback."""
    x = blocked(11, (8, 64), (1, 32), low=-6, high=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockScaleFallbackWarning)
        out, expected = run(LIBRARY[name], x)
    # The gradient's last matmul contracts MX blocks on both sides: one scale, by design.
    assert out.block_shape == ((8, 64) if name == "grad_through_matmul" else (1, 32))
    assert_close(out, expected, jnp.float32, ulps=64, normwise=True)


HIGHER_ORDER = {
    "scan": lambda x: lax.scan(lambda c, r: (c + jnp.sum(r), r * 2), 0.0, x)[1],
    "fori_loop": lambda x: lax.fori_loop(0, 3, lambda i, a: a * 2, x),
    "cond": lambda x: lax.cond(True, lambda a: a * 2, lambda a: a + 1, x),
}


@pytest.mark.parametrize("name", sorted(HIGHER_ORDER))
def test_loops_and_cond_take_blocks_at_one_scale_warned_and_recorded(name):
    x = blocked(12, (8, 64), (1, 32), low=-6, high=6)
    fn = HIGHER_ORDER[name]
    with pytest.warns(BlockScaleFallbackWarning, match="does not carry block scales"):
        with js.diagnostics.record_scales() as records:
            out = jax.jit(js.scalify(fn))(x)
    assert np.ndim(out.scale) == 0
    np.testing.assert_array_equal(value64(out), reference64(fn, x))
    assert any(r.block_fallback for r in records)


@pytest.mark.parametrize("table_scale", [2.0**-20, 1.0, 2.0**20], ids=["2^-20", "1", "2^+20"])
def test_flax_embed_and_conv_keep_blocks(table_scale):
    """flax.linen as published: an embedding table with a scale per row (a gather) feeding a
    convolution whose kernel has a scale per output channel, the table at 2^-20, 1 and 2^20;
    no fallback, the output has one scale per example (the largest of its rows') and output
    channel, values as in float64."""
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(32, 64)(ids)  # (batch, length, 64)
            return nn.Conv(16, (3,), padding="SAME", use_bias=False)(x)

    ids = jnp.arange(24).reshape(3, 8) % 32
    params = Model().init(jax.random.key(0), ids)["params"]
    table = params["Embed_0"]["embedding"]
    kernel = params["Conv_0"]["kernel"]  # (3, 64, 16)
    scaled = {
        "Embed_0": {
            "embedding": js.quantize(table * table_scale, jnp.float16, block_shape=(1, 64))
        },
        "Conv_0": {"kernel": js.quantize(kernel, jnp.float16, block_shape=(3, 64, 1))},
    }

    def apply(p, ids):
        return Model().apply({"params": p}, ids)

    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockScaleFallbackWarning)
        out = jax.jit(js.scalify(apply))(scaled, ids)
    assert out.block_shape == (1, 8, 1)
    assert_close(out, reference64(apply, scaled, ids), jnp.float16, ulps=64, normwise=True)
