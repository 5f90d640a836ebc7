"""Block-scaled matmul recipes (issue 19): js.nn.block_linear and js.nn.linear(block=...).

Outside scalify every matmul must be the product of the operands quantized by js.quantize
along its contracting axis (the transposed operands quantized again from the high-precision
values); under scalify the same numbers come out for inputs at 2^-20 and 2^+20 in float16
(model invariance), with the narrow formats in the lowered program.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js
from jax_scaled.nn.block_linear import untiled_axes

RECIPES = {
    "MXFP8": js.nn.MXFP8,
    "MXFP8_E4M3_GRADS": js.nn.MXFP8_E4M3_GRADS,
    "MXFP4_WEIGHTS": js.nn.MXFP4_WEIGHTS,
    "FP8_BLOCK128": js.nn.FP8_BLOCK128,
}
M, K, N = 128, 256, 128


def operands(seed: int = 0):
    """float16-representable x, w and an output cotangent (scaled like unit-scaled layers)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    as16 = lambda a: a.astype(jnp.float16).astype(jnp.float32)  # noqa: E731
    x = as16(jax.random.normal(keys[0], (M, K)))
    w = as16(jax.random.normal(keys[1], (K, N)) / np.sqrt(K))
    g = as16(jax.random.normal(keys[2], (M, N)))
    return x, w, g


def dequantized(value, fmt, blocks) -> jax.Array:
    """``value`` quantized to ``fmt``'s elements, scale dtype and rounding in ``blocks``."""
    q = js.quantize(value, fmt.element_dtype, block_shape=blocks,
                    scale_rounding=fmt.scale_rounding, scale_dtype=fmt.scale_dtype)  # fmt: skip
    return q.to_array(jnp.float32)


def expected_products(x, w, g, recipe):
    """The three matmuls from js.quantize alone, each along its own contracting axis."""
    b, gb = recipe.x.block_size, recipe.grad.block_size
    y = dequantized(x, recipe.x, (1, b)) @ dequantized(w, recipe.w, recipe.w_block)
    dx = dequantized(g, recipe.grad, (1, gb)) @ dequantized(w, recipe.w, recipe.w_block[::-1]).T
    dw = dequantized(x, recipe.x, (b, 1)).T @ dequantized(g, recipe.grad, (gb, 1))
    return y, dx, dw


def vjp(fn, x, w, g):
    y, pullback = jax.vjp(fn, x, w)
    return (y, *pullback(g))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_matmul_takes_operands_quantized_along_its_contracting_axis(name):
    recipe = RECIPES[name]
    x, w, g = operands()
    got = jax.jit(lambda x, w, g: vjp(lambda x, w: js.nn.block_linear(x, w, recipe), x, w, g))(
        x, w, g
    )
    for actual, want in zip(got, expected_products(x, w, g, recipe), strict=True):
        np.testing.assert_allclose(actual, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20], ids=["2^-20", "2^+20"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_scalify_gives_the_same_products_at_any_scale(name, scale):
    """float16 ScaledArrays at 2^-20 (raw float16 underflows) and 2^+20 (it overflows): the
    forward and both gradients equal the plain-JAX recipe on the true values."""
    recipe = RECIPES[name]
    x, w, g = operands(1)
    args = [js.ScaledArray(a.astype(jnp.float16), jnp.float32(s)) for a, s in
            ((x, scale), (w, 1.0), (g, scale))]  # fmt: skip
    scalified = jax.jit(
        js.scalify(lambda x, w, g: vjp(lambda x, w: js.nn.block_linear(x, w, recipe), x, w, g))
    )(*args)
    reference = vjp(lambda x, w: js.nn.block_linear(x, w, recipe), x * scale, w, g * scale)
    for actual, want in zip(scalified, reference, strict=True):
        got = np.asarray(actual.to_array(jnp.float32), np.float64)
        want = np.asarray(want, np.float64)
        assert np.all(np.isfinite(got))
        # float16 output data: within float16 rounding of the largest output element.
        assert np.max(np.abs(got - want)) <= 2.0**-10 * np.max(np.abs(want))


def test_recipes_against_float64_gradients():
    """The whole recipe against float64, within the formats' rounding: MXFP8 (3 and 2
    mantissa bits) and MXFP4 weights (1 mantissa bit) give relative errors of a few
    roundings of their formats, never more."""
    x, w, g = operands(2)
    exact = vjp(lambda x, w: x @ w, *(np.asarray(a, np.float64) for a in (x, w, g)))
    for recipe, roundings in ((js.nn.MXFP8, (2**-4, 2**-3, 2**-3)), (js.nn.MXFP4_WEIGHTS,
                              (2**-2, 2**-2, 2**-3))):  # fmt: skip
        got = vjp(lambda x, w, r=recipe: js.nn.block_linear(x, w, r), x, w, g)
        for actual, want, bound in zip(got, exact, roundings, strict=True):
            error = np.linalg.norm(np.asarray(actual, np.float64) - want) / np.linalg.norm(want)
            assert error < bound, (recipe, error, bound)


def test_linear_block_argument():
    x, w, g = operands(3)
    b = jnp.arange(N, dtype=jnp.float32)
    by_size = js.nn.linear(
        x, w, b, x_dtype=jnp.float8_e4m3fn, w_dtype=jnp.float8_e4m3fn,
        grad_dtype=jnp.float8_e5m2, block=32,
    )  # fmt: skip
    np.testing.assert_array_equal(by_size, js.nn.linear(x, w, b, block=js.nn.MXFP8))
    np.testing.assert_array_equal(by_size, js.nn.block_linear(x, w, js.nn.MXFP8) + b)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x, w: js.nn.linear(x, w, block=js.nn.MXFP8, x_dtype=jnp.float8_e4m3fn),
         "takes its formats from the recipe"),
        (lambda x, w: js.nn.linear(x, w, block=32), "needs x_dtype, w_dtype and grad_dtype"),
        (lambda x, w: js.nn.linear(x, w, block=js.nn.MXFP8, wgrad_dtype=jnp.float16),
         "do not apply to block-scaled"),
        (lambda x, w: js.nn.block_linear(x[:, :200], w[:200], js.nn.MXFP8),
         r"K = 200 \(a multiple of 32\)"),
        (lambda x, w: js.nn.block_linear(x[:100], w, js.nn.FP8_BLOCK128),
         r"M \(the flattened batch\) = 100 \(a multiple of 128\)"),
    ],
)  # fmt: skip
def test_clear_errors(call, message):
    x, w, _ = operands()
    with pytest.raises(ValueError, match=message):
        call(x, w)


F8_DOT = re.compile(r"stablehlo\.dot_general .*tensor<[^>]*xf8E4M3FN>.*tensor<[^>]*xf8E4M3FN>")


def test_scalified_program_has_fp8_operands():
    """Under scalify the block matmuls take the E4M3 data themselves (the partial products
    of the block rule), forward and backward."""
    x, w, g = operands()
    args = [js.as_scaled_array(a.astype(jnp.float16)) for a in (x, w, g)]
    step = jax.jit(
        js.scalify(lambda x, w, g: vjp(lambda x, w: js.nn.block_linear(x, w, js.nn.MXFP8), x, w, g))
    )
    text = step.lower(*args).as_text()
    assert len(F8_DOT.findall(text)) >= 1, "no E4M3 x E4M3 dot_general in the lowered program"
    e5m2 = re.findall(r"stablehlo\.dot_general .*xf8E5M2>", text)
    assert len(e5m2) == 2  # both gradient matmuls take the E5M2 cotangent


# -- one vocabulary: a format where a recipe is expected means it everywhere (issue 26) --------


def test_linear_takes_a_format_as_that_format_everywhere():
    """js.nn.linear(x, w, block=js.formats.MXFP8_E4M3): the recipe MXFP8_E4M3_GRADS, forward
    and both gradients, outside and under scalify."""
    x, w, g = operands(4)
    fmt, recipe = js.formats.MXFP8_E4M3, js.nn.MXFP8_E4M3_GRADS
    assert js.formats.as_recipe(fmt) == recipe
    by_format = vjp(lambda x, w: js.nn.linear(x, w, block=fmt), x, w, g)
    by_recipe = vjp(lambda x, w: js.nn.linear(x, w, block=recipe), x, w, g)
    for a, b in zip(by_format, by_recipe, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(by_format, expected_products(x, w, g, recipe), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.abs(b).max()))
    args = [js.as_scaled_array(a.astype(jnp.float16)) for a in (x, w, g)]
    scalified = [
        js.scalify(lambda x, w, g, b=b: vjp(lambda x, w: js.nn.linear(x, w, block=b), x, w, g))(
            *args
        )
        for b in (fmt, recipe)
    ]
    for a, b in zip(*scalified, strict=True):
        np.testing.assert_array_equal(a.to_array(jnp.float32), b.to_array(jnp.float32))


def test_presets_are_one_definition():
    """js.nn's recipes are js.formats' objects, built from js.formats' formats."""
    for name in ("MXFP8", "MXFP8_E4M3_GRADS", "MXFP4_WEIGHTS", "FP8_BLOCK128"):
        assert getattr(js.nn, name) is getattr(js.formats, name)
    assert js.nn.BlockRecipe is js.formats.BlockRecipe
    assert js.nn.MXFP8.x is js.formats.MXFP8_E4M3 and js.nn.MXFP8.grad is js.formats.MXFP8_E5M2
    assert js.nn.MXFP4_WEIGHTS.w is js.formats.MXFP4_E2M1
    block128 = js.nn.FP8_BLOCK128
    assert block128.x is block128.w is block128.grad is js.formats.FP8_E4M3_BLOCK128
    assert block128.w_block == (128, 128)


@pytest.mark.parametrize(
    "call",
    [
        lambda x, w: js.nn.linear(x, w, block="MXFP8"),
        lambda x, w: js.nn.linear(x, w, block=jnp.float8_e4m3fn),
        lambda x, w: js.nn.block_linear(x, w, (1, 32)),
        lambda x, w: js.dot_formats(jnp.matmul, block=jnp.float8_e4m3fn)(x, w),
        lambda x, w: untiled_axes(x.shape, w.shape, 32),
    ],
    ids=["linear-str", "linear-dtype", "block_linear-tuple", "dot_formats-dtype", "untiled"],
)
def test_what_is_no_recipe_or_format_is_refused_with_the_presets_listed(call):
    x, w, _ = operands()
    with pytest.raises(TypeError, match=r"BlockRecipe \(MXFP8, .*FP8_BLOCK128.*MXFP8_E4M3, "):
        call(x, w)


def test_recipes_check_their_formats():
    e4m3 = js.formats.MXFP8_E4M3
    with pytest.raises(TypeError, match="BlockFormat"):
        js.formats.BlockRecipe(jnp.float8_e4m3fn, e4m3, e4m3)
    with pytest.raises(ValueError, match="w_block"):
        js.formats.BlockRecipe(e4m3, e4m3, e4m3, w_block=(128, 128))  # K blocks are w's 32
    per_call = js.formats.BlockFormat("E4M3", jnp.float8_e4m3fn, block_size=None)
    with pytest.raises(ValueError, match="needs a block_size"):
        js.formats.BlockRecipe(per_call, e4m3, e4m3)
