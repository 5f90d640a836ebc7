"""js.quantize and js.formats: bit-exact against a float64 NumPy + ml_dtypes reference,
straight-through gradients, E8M0 scales, presets, and quantize under jit, vmap and scalify."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import HOW, built, compiled_computations, covering, random_data
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jax_scaled as js
from jax_scaled.array import expand_scale
from jax_scaled.block_quantization import _divide, quantize_value
from jax_scaled.formats import storage_dtype
from jax_scaled.quantize import quantize_read_elsewhere, tracing_for_scalify
from jax_scaled.scales import centre_exponent

ELEMENTS = [f.element_dtype for f in js.formats.MX_FORMATS]
ROUNDINGS = ["floor", "rceil"]
SHAPE = (128, 256)
LAYOUTS = {
    "per-tensor": None,
    "per-row": (1, 256),
    "1x32": (1, 32),
    "32x1": (32, 1),
    "128x128": (128, 128),
}
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


# -- the float64 reference ------------------------------------------------------------------


def _interleaved(shape, blocks):
    return [n for g, b in zip([s // b for s, b in zip(shape, blocks)], blocks) for n in (g, b)]


def reference(
    x: np.ndarray, dtype, block_shape, rounding: str, top: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(data in the element format, float64 scales)`` computed in float64 with numpy;
    ``top``: the value a block's largest magnitude maps near (the format's largest by
    default, as for 8 bits and fewer)."""
    x = np.asarray(x, np.float64)
    top = float(ml_dtypes.finfo(dtype).max) if top is None else top
    emax = np.frexp(top)[1] - 1
    blocks = x.shape if block_shape is None else block_shape
    tiled = x.reshape(_interleaved(x.shape, blocks))
    odd = tuple(range(1, 2 * x.ndim, 2))
    amax = np.where(np.isfinite(tiled), np.abs(tiled), 0).max(axis=odd, keepdims=True)
    if rounding == "floor":
        exponent = np.frexp(amax)[1] - 1 - emax  # floor(log2(amax)) - emax
    else:  # ceil(log2(amax / top)), exact: the quotient is never a power of two by rounding
        mantissa, exponent = np.frexp(amax / top)
        exponent = np.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = np.clip(np.where(amax == 0, -126, exponent), -126, 127)
    scale = np.ldexp(1.0, exponent)
    scaled = tiled / scale
    largest = float(ml_dtypes.finfo(dtype).max)
    scaled = np.where(np.isfinite(scaled), np.clip(scaled, -largest, largest), scaled)
    data = scaled.reshape(x.shape).astype(dtype)
    grid = [s // b for s, b in zip(x.shape, blocks)]
    return data, scale.reshape(grid if block_shape is not None else ())


def assert_matches_reference(
    q: js.ScaledArray, x, dtype, block_shape, rounding: str, top: float | None = None
) -> None:
    data, scale = reference(x, dtype, block_shape, rounding, top)
    assert q.data.dtype == storage_dtype(dtype)
    expected = data.astype(storage_dtype(dtype)).view(np.uint8)  # float6: exact in E4M3
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), expected)
    np.testing.assert_array_equal(np.asarray(q.scale, np.float64), scale)
    if q.scale.dtype == E8M0:
        np.testing.assert_array_equal(
            np.asarray(q.scale).view(np.uint8), scale.astype(E8M0).view(np.uint8)
        )


# -- strategies ------------------------------------------------------------------------------


@st.composite
def block_structured(draw, shape=SHAPE, tile=(32, 32)) -> np.ndarray:
    """float32 data whose 32x32 tiles are Gaussian at a random power of two, all zero,
    float32-subnormal, near float32's smallest normal (the scale clamp), spread over 2^24
    (the format's subnormals and flushes), or with values that saturate under ``floor``
    (mantissa 1.99 at the tile's top)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kinds = ["gaussian", "zero", "subnormal", "tiny", "spread", "saturating"]
    weights = np.array([draw(st.integers(0, 4)) for _ in kinds], np.float64) + 0.01
    low, high = sorted(draw(st.integers(-40, 40)) for _ in range(2))
    out = np.empty(shape, np.float32)
    for i in range(0, shape[0], tile[0]):
        for j in range(0, shape[1], tile[1]):
            kind = rng.choice(kinds, p=weights / weights.sum())
            out[i : i + tile[0], j : j + tile[1]] = _tile(rng, kind, tile, low, high)
    if draw(st.booleans()):  # a few outliers 2^10 above the rest
        where = rng.integers(0, out.size, 8)
        out.flat[where] *= np.float32(2.0**10)
    return out


def _tile(rng, kind: str, tile, low: int, high: int) -> np.ndarray:
    gaussian = rng.standard_normal(tile)
    if kind == "zero":
        return np.zeros(tile, np.float32) * np.sign(gaussian)  # signed zeros
    if kind == "subnormal":
        return (gaussian * 2.0**-135).astype(np.float32)
    if kind == "tiny":
        return (gaussian * 2.0**-122).astype(np.float32)
    if kind == "spread":
        return (gaussian * 2.0 ** rng.uniform(-24, 0, tile) * 2.0**low).astype(np.float32)
    if kind == "saturating":
        values = gaussian * 2.0 ** rng.integers(low, high + 1)
        values.flat[rng.integers(0, values.size)] = 1.99 * np.abs(values).max()
        return values.astype(np.float32)
    return (gaussian * 2.0 ** rng.integers(low, high + 1)).astype(np.float32)


# -- bit-exact against the reference ----------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", ELEMENTS, ids=str)
@given(x=block_structured(), e8m0=st.booleans())
def test_quantize_is_bit_exact(dtype, rounding, layout, x, e8m0):
    scale_dtype = E8M0 if e8m0 else np.float32
    block_shape = LAYOUTS[layout]
    q = js.quantize(
        x, dtype, block_shape=block_shape, scale_rounding=rounding, scale_dtype=scale_dtype
    )
    assert q.scale.dtype == scale_dtype
    assert_matches_reference(q, x, dtype, block_shape, rounding)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", ELEMENTS, ids=str)
@given(
    x=hnp.arrays(np.float32, (4, 32), elements=st.floats(width=32, allow_nan=False)),
    layout=st.sampled_from([None, (1, 32), (4, 1), (1, 8), (2, 16)]),
)
def test_quantize_is_bit_exact_on_any_float32(dtype, rounding, x, layout):
    """Every float32, subnormals, +-0, +-inf and the largest finite values included."""
    q = js.quantize(x, dtype, block_shape=layout, scale_rounding=rounding)
    assert_matches_reference(q, x, dtype, layout, rounding)


@pytest.mark.parametrize("layout", ["per-row", "1x32", "32x1"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=str)
@given(x=block_structured())
def test_wide_element_formats_are_bit_exact(dtype, rounding, layout, x):
    """16-bit elements (optimizer state in blocks): a block's largest magnitude maps just
    below ``2^(t+1)``, ``t`` the format's centre, so no element comes near the format's top.
    A bfloat16 element whose quotient by its scale is below float32's normal range may be
    flushed to zero of its sign (XLA's CPU backend flushes subnormal results; float16's
    smallest value is far above)."""
    top = float(np.nextafter(np.float32(2.0 ** (centre_exponent(dtype) + 1)), np.float32(0)))
    blocks = LAYOUTS[layout]
    q = js.quantize(x, dtype, block_shape=blocks, scale_rounding=rounding)
    data, scale = reference(x, dtype, blocks, rounding, top)
    np.testing.assert_array_equal(np.asarray(q.scale, np.float64), scale)
    quotient = x / np.asarray(expand_scale(scale, x.shape), np.float64)
    got, expected = np.asarray(q.data, np.float32), data.astype(np.float32)
    exact = got.view(np.uint32) == expected.view(np.uint32)
    flushed = (got == 0) & (np.signbit(got) == np.signbit(expected))
    assert np.all(exact | (flushed & (np.abs(quotient) < 2.0**-126)))
    assert q.data.dtype == dtype


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_narrow_inputs_are_quantized_from_their_value(dtype):
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(dtype)
    q = js.quantize(x, jnp.float8_e4m3fn, block_shape=(1, 32))
    assert_matches_reference(q, x.astype(np.float32), jnp.float8_e4m3fn, (1, 32), "floor")


def every_exponent_field_by_every_scale() -> tuple[np.ndarray, np.ndarray]:
    """``(x, scale)``: float32 ``x`` of every exponent field (zeros, subnormals, infinities
    and NaNs included) at four mantissas and both signs, broadcast against every block
    scale ``2^k`` that :func:`block_scales` can give."""
    fields = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mantissas = np.array([0, 1, 0x400000, 0x7FFFFF], np.uint32)
    signs = np.array([0, 1 << 31], np.uint32)
    bits = (signs[:, None, None] | fields[None, :, None] | mantissas[None, None, :]).ravel()
    x = np.broadcast_to(bits.view(np.float32), (253, bits.size))
    return x, np.exp2(np.arange(-126, 127, dtype=np.float32))[:, None]


def test_division_by_block_scales_is_exact_at_every_exponent_field():
    """The division inside quantize, ``x / 2^k``, for every float32 exponent field of ``x``
    (zeros, subnormals, infinities and NaNs included) at four mantissas and both signs, and
    every block scale ``2^k`` that :func:`block_scales` can give: the float64 quotient; one
    below float32's normal range may also be flushed to zero of its sign (XLA's CPU backend
    flushes subnormal results)."""
    x, scale = every_exponent_field_by_every_scale()
    got = np.asarray(jax.jit(_divide)(x, scale))
    quotient = x.astype(np.float64) / scale.astype(np.float64)
    expected = quotient.astype(np.float32)
    nan = np.isnan(quotient)
    np.testing.assert_array_equal(np.isnan(got), nan)
    exact = got.view(np.uint32) == expected.view(np.uint32)
    flushed = (got == 0) & (np.signbit(got) == np.signbit(quotient))
    below_normal = np.abs(quotient) < 2.0**-126
    assert np.all(nan | exact | (below_normal & flushed))


def as_the_platform_reads(x: np.ndarray) -> np.ndarray:
    """``x`` as this platform's float arithmetic reads it: a product by 1 that XLA cannot
    fold (float32 subnormals become zeros of their sign where it flushes them)."""
    return np.asarray(jax.jit(jnp.multiply)(x, np.ones_like(x)))


def test_division_without_exact_subnormals_differs_only_on_subnormals():
    """``exact_subnormals=False`` on the grid of the exact division's test: bit for bit the
    exact quotient wherever ``x`` is not a float32 subnormal; a subnormal gives the product
    the platform computes (a zero of its sign on XLA's CPU backend)."""
    x, scale = every_exponent_field_by_every_scale()
    fast = np.asarray(jax.jit(functools.partial(_divide, exact_subnormals=False))(x, scale))
    exact = np.asarray(jax.jit(_divide)(x, scale))
    bits = x.view(np.uint32)
    subnormal = (bits & 0x7F800000 == 0) & (bits & 0x7FFFFF != 0)
    product = np.asarray(jax.jit(jnp.multiply)(x, np.float32(1) / scale))
    expected = np.where(subnormal, product, exact)
    np.testing.assert_array_equal(fast.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("layout", ["per-tensor", "1x32", "32x1"])
@pytest.mark.parametrize("dtype", [*ELEMENTS, jnp.float16], ids=str)
@given(x=block_structured())
def test_quantize_without_exact_subnormals_is_quantize_of_what_the_platform_reads(dtype, layout, x):
    """Data with float32-subnormal tiles among Gaussian, zero, tiny and spread ones: the
    result of ``exact_subnormals=False`` is, bit for bit, the exact quantization of ``x`` as
    the platform's arithmetic reads it; of a value without subnormals, the exact one."""
    blocks, rounding = LAYOUTS[layout], "rceil"
    fast = js.quantize(x, dtype, block_shape=blocks, scale_rounding=rounding,
                       exact_subnormals=False)  # fmt: skip
    read = as_the_platform_reads(x)
    exact = js.quantize(read, dtype, block_shape=blocks, scale_rounding=rounding)
    np.testing.assert_array_equal(np.asarray(fast.data).view(np.uint8),
                                  np.asarray(exact.data).view(np.uint8))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(fast.scale), np.asarray(exact.scale))


def test_quantize_without_exact_subnormals_drops_the_subnormal_arithmetic():
    """The kernel writing the elements keeps the product by the block's reciprocal and
    nothing of the exact path's integer work on the elements' bits."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal(SHAPE), jnp.float32)

    def element_bit_work(exact: bool) -> int:
        fn = functools.partial(js.quantize, dtype=jnp.float16, block_shape=(1, 32),
                               scale_rounding="rceil", exact_subnormals=exact)  # fmt: skip
        bodies = compiled_computations(fn, x).values()
        writing = [b for b in bodies if b and re.search(r"= f16\[128,256\]", b[-1])]
        assert writing, "no kernel writes the float16 elements"
        return sum(bool(re.search(r"= s32\[128,256\]", line)) for b in writing for line in b)

    assert element_bit_work(True) > 0
    assert element_bit_work(False) == 0


SCALED_INPUTS = covering(HOW, [(jnp.float32, -140), (jnp.bfloat16, -20), (jnp.float16, 20)])


@pytest.mark.parametrize(("how", "dtype", "exponent"), SCALED_INPUTS)
@pytest.mark.parametrize("fmt", [js.formats.MXFP8_E4M3, js.formats.FP8_E4M3_BLOCK128])
def test_a_scaled_array_is_quantized_as_the_exact_division_of_its_value(fmt, how, dtype, exponent):
    """A ScaledArray (64k elements, built every way the API allows, its values at
    ``2^exponent``: at ``2^-140`` float32-subnormal) quantized from its float32 value, with
    and without scalify: bit for bit the exact division of that value. Its value is the
    product ``data * scale``, which the platform's arithmetic leaves without subnormals
    where it flushes them (or data whose subnormals are float32 normals), so the division
    skips the exact path for subnormals."""
    values = jnp.asarray(random_data(11, (256, 256), jnp.float32))
    x = built(how, values, dtype, 2.0**exponent)
    blocks = (1, fmt.block_size)
    exact = quantize_value(x.to_array(jnp.float32), fmt, blocks, True)
    for got in (js.quantize(x, fmt), jax.jit(js.scalify(lambda x: js.quantize(x, fmt)))(x)):
        assert got.block_shape == blocks
        np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8),
                                      np.asarray(exact.data).view(np.uint8))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(exact.scale))


def test_float32_data_at_a_static_scale_of_one_keeps_its_subnormals_exactly():
    """A ScaledArray whose scale is a trace-time 1 has its float32 data as its value, with no
    product to flush a subnormal: those are divided exactly (non-zero float16 elements)."""
    tiny = np.asarray(random_data(12, (8, 64), jnp.float32) * 2.0**-135, np.float32)
    q = js.quantize(js.ScaledArray(jnp.asarray(tiny), np.float32(1)), jnp.float16,
                    block_shape=(1, 32), scale_rounding="rceil")  # fmt: skip
    assert_matches_reference(q, tiny, jnp.float16, (1, 32), "rceil", top=float(np.nextafter(
        np.float32(2.0 ** (centre_exponent(jnp.float16) + 1)), np.float32(0))))  # fmt: skip
    assert np.count_nonzero(np.asarray(q.data)) > 0.9 * tiny.size


def test_a_scaled_operand_s_quantization_drops_the_subnormal_arithmetic():
    """Under scalify, an MX contraction's operands (ScaledArrays: activations, weights,
    gradients) are quantized without the exact path's integer work on their elements."""
    x = js.as_scaled_array(jnp.asarray(random_data(13, (128, 256), jnp.float16)))
    w = js.as_scaled_array(jnp.asarray(random_data(14, (256, 128), jnp.float16)))
    loss = js.scalify(jax.grad(lambda x, w: jnp.sum(js.nn.linear(x, w, block=js.nn.MXFP8))))
    bodies = compiled_computations(loss, x, w).values()
    # Bitcasts aside: the block maxima reduce the magnitudes' bits (a reinterpretation).
    work = [line for b in bodies for line in b if "bitcast-convert(" not in line]
    assert not any(re.search(r"= s32\[(128,256|256,128)\]", line) for line in work)


# -- scale roundings, zeros and non-finite values ---------------------------------------------


@pytest.mark.parametrize("dtype", ELEMENTS, ids=str)
@given(x=block_structured())
def test_rceil_never_saturates_and_floor_does(dtype, x):
    top = float(ml_dtypes.finfo(dtype).max)
    q = js.quantize(x, dtype, block_shape=(1, 32), scale_rounding="rceil")
    scale = np.repeat(np.asarray(q.scale, np.float64), 32, axis=1)
    assert np.all(np.abs(x / scale) <= top)
    saturating = np.array([[1.0] * 31 + [1.99]], np.float32)
    floor = js.quantize(saturating, dtype, block_shape=(1, 32))
    assert float(np.asarray(floor.data, np.float32)[0, -1]) == top


def test_zero_blocks_get_the_smallest_scale_in_e8m0():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 3.0
    q = js.quantize(x, js.formats.MXFP8_E4M3, axis=-1)
    scales = np.asarray(q.scale, np.float32)
    assert scales.tolist() == [[2.0**-126, 2.0**-126], [2.0**-126, 2.0**-7]]
    assert not np.isnan(scales).any()
    np.testing.assert_array_equal(q.to_array(jnp.float32), x)


def test_non_finite_values_take_no_part_in_the_scale():
    x = np.array([[np.inf, -2.0, 1.0, np.nan]], np.float32)
    q = js.quantize(x, jnp.float8_e5m2, block_shape=(1, 4))
    assert q.scale.tolist() == [[2.0**-14]]  # from amax 2: floor(log2(2)) - 15
    np.testing.assert_array_equal(q.to_array(jnp.float32), x)
    e4m3 = js.quantize(x, jnp.float8_e4m3fn, block_shape=(1, 4)).to_array(jnp.float32)
    assert np.isnan(e4m3[0, 0]) and np.isnan(e4m3[0, 3])  # no inf in E4M3: NaN


# -- presets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", js.formats.MX_FORMATS, ids=lambda f: f.name)
def test_presets_block_32_elements_along_an_axis_with_e8m0_scales(fmt):
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    q = js.quantize(x, fmt, axis=0)
    assert q.block_shape == (32, 1) and q.scale.dtype == E8M0
    assert_matches_reference(q, x, fmt.element_dtype, (32, 1), "floor")
    rows = js.quantize(x, fmt, scale_rounding="rceil")  # axis=-1 by default
    assert rows.block_shape == (1, 32)
    assert_matches_reference(rows, x, fmt.element_dtype, (1, 32), "rceil")
    bits = {8: 8.25, 6: 6.25, 4: 4.25}[ml_dtypes.finfo(fmt.element_dtype).bits]
    assert fmt.bits_per_element == bits


def test_float6_data_is_stored_in_e4m3():
    q = js.quantize(jnp.array([[0.3] * 31 + [9.0]]), js.formats.MXFP6_E2M3)
    assert q.data.dtype == jnp.float8_e4m3fn and q.scale.tolist() == [[2.0]]
    assert q.to_array(jnp.float32)[0, -2:].tolist() == [0.25, 9.0]  # 0.15 -> 0.125 at scale 2
    assert storage_dtype(jnp.float6_e3m2fn) == jnp.float8_e4m3fn


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"dtype": jnp.float8_e4m3fn, "block_shape": (3, 32)}, ValueError),  # 3 does not tile
        ({"dtype": jnp.float8_e4m3fn, "block_shape": (32,)}, ValueError),  # rank
        ({"dtype": jnp.float8_e4m3fn, "axis": 0}, ValueError),  # axis needs a preset
        ({"dtype": js.formats.MXFP8_E4M3, "block_shape": (1, 32)}, ValueError),
        ({"dtype": js.formats.MXFP8_E4M3, "axis": 2}, ValueError),
        ({"dtype": jnp.float8_e4m3fn, "scale_rounding": "ceil"}, ValueError),
        ({"dtype": jnp.float8_e4m3fn, "scale_dtype": jnp.float16}, ValueError),
        ({"dtype": jnp.int8}, TypeError),
    ],
)
def test_bad_arguments_are_refused(kwargs, error):
    with pytest.raises(error):
        js.quantize(jnp.ones((64, 64)), **kwargs)


# -- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", js.formats.MX_FORMATS, ids=lambda f: f.name)
def test_gradient_is_straight_through(fmt):
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    x[0, 0] = 1.99 * np.abs(x[0]).max()  # saturates under floor: still gets its gradient

    def loss(x):
        return jnp.sum(js.quantize(x, fmt).to_array(jnp.float32))

    np.testing.assert_array_equal(jax.grad(loss)(x), np.ones_like(x))
    np.testing.assert_array_equal(jax.jit(jax.grad(loss))(x), np.ones_like(x))


def test_tangent_is_divided_by_the_scale_and_cast_to_the_element_format():
    x = jnp.array([[4.0, 1.0]])
    q, dq = jax.jvp(lambda x: js.quantize(x, jnp.float8_e4m3fn), (x,), (jnp.array([[0.5, 2.0]]),))
    assert float(q.scale) == 2.0**-6
    assert dq.data.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(dq.data, np.float32), [[32.0, 128.0]])


# -- transformations --------------------------------------------------------------------------


def test_quantize_under_jit_matches_eager():
    x = np.random.default_rng(3).standard_normal((32, 64)).astype(np.float32)
    fmt = js.formats.MXFP4_E2M1
    eager, jitted = js.quantize(x, fmt), jax.jit(lambda x: js.quantize(x, fmt))(x)
    np.testing.assert_array_equal(np.asarray(eager.data), np.asarray(jitted.data))
    np.testing.assert_array_equal(np.asarray(eager.scale), np.asarray(jitted.scale))


def block_inputs_of_the_data_kernel(fn, x) -> list[str]:
    """The root opcode of each kernel whose block-shaped output is read by the kernel that
    writes the data of the compiled ``fn(x)`` (a ScaledArray)."""
    computations = compiled_computations(fn, x)
    entry = {line.split(" = ")[0]: line for line in computations["ENTRY"]}
    data, scale = re.search(r"tuple\((%\S+), (%\S+)\)", computations["ENTRY"][-1]).groups()
    block_shape = entry[scale].split(" = ")[1].split("{")[0]  # e.g. f8e8m0fnu[512,8]
    roots = []
    for operand in re.search(r"fusion\(([^)]*)\)", entry[data]).group(1).split(", "):
        kernel = entry[operand]
        if kernel.split(" = ")[1].split("{")[0].endswith(block_shape[block_shape.index("[") :]):
            called = re.search(r"calls=(%\S+)", kernel).group(1).rstrip(",")
            root = computations[called][-1]
            roots.append(re.search(r" ([a-z\-]+)\(", root.split(" = ")[1]).group(1))
    return roots


STATE_BLOCKS = js.formats.BlockFormat("F16", jnp.float16, 32, scale_rounding="rceil")


@pytest.mark.parametrize("fmt", [js.formats.MXFP8_E4M3, STATE_BLOCKS], ids=["MXFP8", "F16"])
def test_the_kernel_writing_the_data_reads_block_scales_not_block_maxima(fmt):
    # XLA copied the scales' derivation from the blocks' maxima into the kernel writing the
    # elements (a quarter of a quantization's block operations, once per optimizer state
    # leaf stored in blocks): the scales are computed once and read there.
    x = np.random.default_rng(6).standard_normal((512, 256)).astype(np.float32)

    def value(x):  # exact to one rounding however a kernel computes it (no FMA ambiguity)
        return jnp.maximum(x, -0.5) * 4.0 - x

    roots = block_inputs_of_the_data_kernel(lambda x: js.quantize(value(x), fmt), x)
    assert roots and "reduce" not in roots, roots
    computed_in_jit = jax.jit(lambda x: js.quantize(value(x), fmt))(x)
    passed_in = js.quantize(jax.jit(value)(x), fmt)
    assert np.asarray(computed_in_jit.data).tobytes() == np.asarray(passed_in.data).tobytes()
    assert np.asarray(computed_in_jit.scale).tobytes() == np.asarray(passed_in.scale).tobytes()


@pytest.mark.parametrize("shape", [(64, 32), (512, 256), (8192,)], ids=str)
@pytest.mark.parametrize("fmt", [js.formats.MXFP8_E4M3, STATE_BLOCKS], ids=["MXFP8", "F16"])
def test_block_maxima_of_a_large_tensor_take_one_kernel_with_their_magnitudes(fmt, shape):
    # XLA:CPU handed a float maximum over 4096 elements or more to its YNNPACK reduction,
    # which first materialised the masked magnitudes (and their producers) in a kernel of
    # their own: three kernels for the block scales of a large tensor instead of one
    # (once per Adam moment stored in blocks, once per MX operand).
    x = np.random.default_rng(9).standard_normal(shape).astype(np.float32)

    def quantized(x):
        return js.quantize(jnp.maximum(x, -0.5) * 4.0 - x, fmt)

    def kernels(x):
        return [line for line in compiled_computations(quantized, x)["ENTRY"] if " fusion(" in line]

    small = x[:1] if x.ndim == 2 else x[:32]  # under 4096 elements: no YNNPACK
    assert not any("ynn" in line for line in kernels(x)), kernels(x)
    assert len(kernels(x)) == len(kernels(small))


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("scale", [2.0**-20, 1.0, 2.0**20], ids=["2^-20", "1", "2^20"])
def test_a_value_read_elsewhere_is_quantized_to_the_same_bits(how, scale):
    # js.optim stores its new moments without the quantization's own stored copy (the
    # update reads them too): the same data and block scales as js.quantize, built every
    # way, in and outside scalify, and with other readers in the program.
    values = jnp.asarray(np.random.default_rng(8).standard_normal((256, 128)), jnp.float32)
    x = built(how, values, jnp.float16, scale)
    quantizations = (js.quantize, quantize_read_elsewhere)

    def both(x):
        value = x * 3.0 - 1.0  # a producer both read, and an output read elsewhere too
        out = [q(value, jnp.float16, block_shape=(1, 32), scale_rounding="rceil") for q in
               quantizations]  # fmt: skip
        return out, value

    plain = jax.jit(lambda x: both(x.to_array(jnp.float32)))
    for step in (plain, jax.jit(js.scalify(both))):
        (want, got), _ = step(x)
        assert np.asarray(got.data).tobytes() == np.asarray(want.data).tobytes()
        assert np.asarray(got.scale).tobytes() == np.asarray(want.scale).tobytes()


def test_float16_state_blocks_are_quantized_without_range_checks():
    # Block storage of optimizer state (float16, rceil, a top with a full mantissa): no
    # amax's mantissa is above the top's and no element passes the format's largest value,
    # so the compiled quantization holds no round-up comparison and no clamp (it held three
    # clamps and one comparison: 132 HLO instructions a leaf, 88 without).
    x = np.random.default_rng(7).standard_normal((128, 512)).astype(np.float32)

    def compiled_lines(fmt):
        bodies = compiled_computations(lambda x: js.quantize(x, fmt), x).values()
        return [line for body in bodies for line in body]

    checks = [line for line in compiled_lines(STATE_BLOCKS) if " clamp(" in line or "=GT" in line]
    assert not checks, checks
    assert any(" clamp(" in line for line in compiled_lines(js.formats.MXFP8_E4M3))  # saturates


def test_quantize_under_vmap_quantizes_each_example():
    x = np.random.default_rng(4).standard_normal((3, 8, 64)).astype(np.float32)
    mapped = jax.vmap(lambda a: js.quantize(a, jnp.float8_e5m2, block_shape=(1, 32)))(x)
    assert mapped.scale.shape == (3, 8, 2)
    assert_matches_reference(mapped, x, jnp.float8_e5m2, (1, 1, 32), "floor")
    whole = jax.vmap(lambda a: js.quantize(a, jnp.float8_e5m2, block_shape=(-1, -1)))(x)
    assert whole.scale.shape == (3, 1, 1)  # one scale per example
    assert_matches_reference(whole, x, jnp.float8_e5m2, (1, 8, 64), "floor")


def test_scaled_array_inputs_are_requantized_from_their_value():
    x = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    for scaled in [js.as_scaled_array(x), js.quantize(x, jnp.float8_e4m3fn, block_shape=(8, 1))]:
        value = np.asarray(scaled.to_array(jnp.float32))
        q = js.quantize(scaled, js.formats.MXFP8_E5M2)
        assert_matches_reference(q, value, jnp.float8_e5m2, (1, 32), "floor")


# -- under scalify ----------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [False, True])
def test_scalify_returns_the_block_scaled_array(scaled):
    x = np.random.default_rng(6).standard_normal((8, 64)).astype(np.float32)
    arg = js.as_scaled_array(x) if scaled else x
    q = js.scalify(lambda x: js.quantize(x, js.formats.MXFP8_E4M3))(arg)
    assert isinstance(q, js.ScaledArray) and q.block_shape == (1, 32)
    value = np.asarray(js.as_scaled_array(x).to_array(jnp.float32)) if scaled else x
    assert_matches_reference(q, value, jnp.float8_e4m3fn, (1, 32), "floor")


def test_quantize_primitive_feeds_later_operations_under_scalify():
    """While scalify traces under tracing_for_scalify, the quantized value is held as a
    block-scaled ScaledArray that later operations propagate."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = rng.standard_normal((64, 16)).astype(np.float32)
    fmt = js.formats.MXFP8_E4M3

    def f(x, w):
        q = js.quantize(x, fmt)
        return q.astype(jnp.float32) * 2, q.astype(jnp.float32) @ w

    with tracing_for_scalify(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall back to one scale per tensor
        doubled, product = js.scalify(f)(js.as_scaled_array(x), js.as_scaled_array(w))
    dequantized = np.asarray(js.quantize(x, fmt).to_array(jnp.float32))
    assert doubled.block_shape == (1, 32)
    np.testing.assert_array_equal(js.asarray(doubled), 2 * dequantized)
    np.testing.assert_allclose(js.asarray(product), dequantized @ w, rtol=1e-5, atol=1e-5)


def test_quantize_primitive_is_straight_through_and_batches_under_scalify():
    x = np.random.default_rng(8).standard_normal((3, 4, 64)).astype(np.float32)
    fmt = js.formats.MXFP6_E3M2

    def loss(x):
        return jnp.sum(js.quantize(x, fmt).astype(jnp.float32) * 3.0)

    with tracing_for_scalify():
        grad = js.scalify(jax.grad(loss))(js.as_scaled_array(x))
        mapped = js.scalify(jax.vmap(lambda a: js.quantize(a, fmt)))(x)
    np.testing.assert_array_equal(js.asarray(grad), np.full_like(x, 3.0))
    assert mapped.block_shape == (1, 1, 32)
    assert_matches_reference(mapped, x, fmt.element_dtype, (1, 1, 32), "floor")


def test_scalify_quantizes_in_the_traced_program():
    x = np.random.default_rng(9).standard_normal((8, 64)).astype(np.float32)
    out = js.scalify(lambda x: js.quantize(x, js.formats.MXFP8_E4M3) * 2)(x)
    assert out.block_shape == (1, 32)
    expected = 2 * js.quantize(x, js.formats.MXFP8_E4M3).to_array(jnp.float32)
    np.testing.assert_array_equal(out.to_array(jnp.float32), expected)


def test_quantize_primitive_outside_scalify_rounds_at_scale_one():
    from jax_scaled.quantize import quantize_p

    out = quantize_p.bind(
        jnp.array([0.3, 1000.0]),
        element_dtype=np.dtype(jnp.float8_e4m3fn),
        block_shape=None,
        scale_rounding="floor",
        scale_dtype=np.dtype(np.float32),
    )
    assert out.dtype == jnp.float8_e4m3fn
    assert np.asarray(out, np.float32).tolist() == [0.3125, 448.0]


def test_a_format_named_by_a_string_is_a_preset_or_a_clear_error():
    x = jnp.ones((2, 64))
    assert js.quantize(x, "mxfp8_e4m3", axis=-1).block_shape == (1, 32)
    with pytest.raises(ValueError, match="unknown format 'mxfp8'.*MXFP8_E4M3"):
        js.quantize(x, "mxfp8", axis=-1)


# -- one vocabulary: formats carry their scale rounding (issue 26) ------------------------------


def test_scale_rule_is_a_deprecated_alias_of_scale_rounding():
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    new = js.quantize(x, jnp.float8_e4m3fn, block_shape=(1, 32), scale_rounding="rceil")
    with pytest.warns(DeprecationWarning, match="scale_rounding"):
        old = js.quantize(x, jnp.float8_e4m3fn, block_shape=(1, 32), scale_rule="rceil")
    np.testing.assert_array_equal(old.to_array(jnp.float32), new.to_array(jnp.float32))
    np.testing.assert_array_equal(old.scale, new.scale)
    with pytest.raises(TypeError), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        js.quantize(x, jnp.float8_e4m3fn, scale_rule="rceil", scale_rounding="floor")


def test_a_format_carries_its_scale_rounding_and_scale_dtype():
    x = np.random.default_rng(4).standard_normal((8, 256)).astype(np.float32) * 100
    fmt = js.formats.FP8_E4M3_BLOCK128  # 128 elements, float32 scales, "rceil"
    q = js.quantize(x, fmt)
    assert q.block_shape == (1, 128) and q.scale.dtype == np.float32
    assert_matches_reference(q, x, jnp.float8_e4m3fn, (1, 128), "rceil")
    floor = js.quantize(x, fmt, scale_rounding="floor", scale_dtype=E8M0)  # overridden
    assert floor.scale.dtype == E8M0
    assert_matches_reference(floor, x, jnp.float8_e4m3fn, (1, 128), "floor")
    free = js.formats.BlockFormat("E5M2", jnp.float8_e5m2, block_size=None)  # blocks per call
    tiles = js.quantize(x, free, block_shape=(8, 128))
    assert tiles.block_shape == (8, 128) and tiles.scale.dtype == E8M0
    assert js.quantize(x, free).scale.shape == ()


@pytest.mark.parametrize("bad", [js.nn.MXFP8, (1, 32), object()], ids=["recipe", "tuple", "obj"])
def test_what_is_no_format_is_refused_with_the_presets_listed(bad):
    with pytest.raises(TypeError, match="MXFP8_E4M3, MXFP8_E5M2.*FP8_E4M3_BLOCK128"):
        js.quantize(jnp.ones((2, 64)), bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"element_dtype": jnp.int8},
        {"element_dtype": jnp.float8_e4m3fn, "scale_dtype": jnp.float16},
        {"element_dtype": jnp.float8_e4m3fn, "scale_rounding": "ceil"},
        {"element_dtype": jnp.float8_e4m3fn, "block_size": 0},
    ],
)
def test_a_malformed_format_is_refused(kwargs):
    with pytest.raises((TypeError, ValueError)):
        js.formats.BlockFormat("BAD", **kwargs)
