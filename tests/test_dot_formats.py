"""js.dot_formats: every contraction of a function in FP8, with the semantics of js.nn.linear.

Numerics are checked against a float64 reference of those semantics: operands quantised to
E4M3 (after per-tensor power-of-two current scaling), cotangent quantised to E5M2, exact
products; FP8 products are exact in float32, so only the float32 accumulation differs.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_scaled as js
from experiments import gpt
from jax_scaled.dot_policy import (
    ContractionSite,
    UnmatchedExcludeWarning,
    dot_formats,
    has_operand_shape,
)
from jax_scaled.nn.linear import linear

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
ACCUMULATION_RTOL = 1e-5  # float32 accumulation of exact FP8 products, normwise
FP8_RTOL = 0.1  # relative L2 error of FP8 results against float32 (E5M2 gradients: ~0.03-0.1)


def normal(seed: int, shape, scale: float = 1.0, dtype=jnp.float32) -> jax.Array:
    return (jax.random.normal(jax.random.key(seed), shape) * scale).astype(dtype)


def rel_l2(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return math.inf
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


# ---------------------------------------------------------------------------------------
# Float64 reference of the semantics
# ---------------------------------------------------------------------------------------


def quantised64(x, dtype, scaling: str = "current") -> np.ndarray:
    """``x`` rounded to ``dtype`` after division by the smallest power of two ``2^k`` with
    ``max|x| / 2^k`` in range (``"current"``), then multiplied back, in float64."""
    x = np.asarray(x, np.float64)
    scale = 1.0
    amax, largest = np.max(np.abs(x)), float(ml_dtypes.finfo(dtype).max)
    if scaling == "current" and amax > 0:
        k = math.ceil(math.log2(amax / largest))
        k += 1 if amax / 2.0**k > largest else -1 if amax / 2.0 ** (k - 1) <= largest else 0
        scale = 2.0**k
    return (x / scale).astype(dtype).astype(np.float64) * scale


def reference_and_grads(contract, lhs, rhs, cotangent, scaling: str = "current", grad=E5M2):
    """``(y, (d_lhs, d_rhs))`` in float64 of the FP8 semantics of ``contract(lhs, rhs)``."""
    with jax.enable_x64(True):
        qa, qb = (jnp.asarray(quantised64(v, E4M3, scaling)) for v in (lhs, rhs))
        y, vjp = jax.vjp(contract, qa, qb)
        grads = vjp(jnp.asarray(quantised64(cotangent, grad, scaling)))
        return np.asarray(y), tuple(np.asarray(g) for g in grads)


def value_and_grads(fn, lhs, rhs, cotangent):
    y, vjp = jax.vjp(fn, lhs, rhs)
    return y, vjp(cotangent)


def assert_accumulation_close(actual, expected):
    expected = np.asarray(expected, np.float64)
    atol = ACCUMULATION_RTOL * np.max(np.abs(expected))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=atol)


def check_against_reference(contract, lhs, rhs, scaling: str = "current", grad=E5M2):
    cotangent = normal(9, jax.eval_shape(contract, lhs, rhs).shape)
    y, grads = jax.jit(functools.partial(value_and_grads, dot_formats(contract, scaling=scaling)))(
        lhs, rhs, cotangent
    )
    y_ref, grads_ref = reference_and_grads(contract, lhs, rhs, cotangent, scaling, grad)
    assert y.dtype == jnp.float32 and [g.dtype for g in grads] == [jnp.float32] * 2
    for got, want in zip([y, *grads], [y_ref, *grads_ref], strict=True):
        assert_accumulation_close(got, want)
    exact = value_and_grads(contract, lhs, rhs, cotangent)
    assert rel_l2(y, exact[0]) > 1e-3  # the casts really happened


# ---------------------------------------------------------------------------------------
# Numerics: dimension numbers, convolutions, gradients
# ---------------------------------------------------------------------------------------

DOT_CASES = {
    "matmul": ((6, 16), (16, 5), (((1,), (0,)), ((), ()))),
    "rhs_transposed": ((6, 16), (5, 16), (((1,), (1,)), ((), ()))),
    "batched": ((3, 6, 16), (3, 16, 5), (((2,), (1,)), ((0,), (0,)))),
    "two_contracting_dims": ((6, 4, 8), (8, 4, 5), (((1, 2), (1, 0)), ((), ()))),
    "batch_last": ((16, 6, 3), (5, 16, 3), (((0,), (1,)), ((2,), (2,)))),
}


@pytest.mark.parametrize("case", DOT_CASES, ids=list(DOT_CASES))
def test_dot_general_matches_float64_reference(case):
    lhs_shape, rhs_shape, dims = DOT_CASES[case]
    check_against_reference(
        lambda a, b: lax.dot_general(a, b, dims), normal(0, lhs_shape), normal(1, rhs_shape)
    )


def test_einsum_attention_matches_float64_reference():
    q, k = normal(0, (2, 6, 3, 8)), normal(1, (2, 7, 3, 8))
    check_against_reference(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), q, k)


CONV_CASES = {
    "nchw_strided_dilated": dict(
        shapes=((2, 4, 9, 9), (6, 4, 3, 3)),
        window_strides=(2, 1), padding=((1, 2), (0, 1)), rhs_dilation=(1, 2),
    ),
    "nhwc_feature_groups": dict(
        shapes=((2, 8, 8, 4), (3, 3, 2, 6)), dimension_numbers=("NHWC", "HWIO", "NHWC"),
        window_strides=(1, 1), padding="SAME", feature_group_count=2,
    ),
    "1d_lhs_dilated": dict(
        shapes=((2, 3, 10), (4, 3, 3)), window_strides=(1,), padding=((1, 0),), lhs_dilation=(2,),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CONV_CASES, ids=list(CONV_CASES))
def test_convolution_matches_float64_reference(case):
    """A convolution's backward takes the cotangent in its E4M3 operands' format (JAX's
    convolution takes one operand dtype): the reference rounds it to E4M3."""
    params = dict(CONV_CASES[case])
    lhs_shape, rhs_shape = params.pop("shapes")
    check_against_reference(
        lambda a, b: lax.conv_general_dilated(a, b, **params),
        normal(0, lhs_shape),
        normal(1, rhs_shape),
        grad=E4M3,
    )


@pytest.mark.parametrize("exponent", [-20, 0, 20])
def test_convolution_gradients_run_as_fp8_kernels(exponent):
    """Forward and both backward convolutions take FP8 operands (none widened to float32),
    and the gradients stay within FP8 accuracy of float32 at magnitudes 2^-20 to 2^20."""
    conv = functools.partial(
        lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # fmt: skip
    x, w = normal(0, (4, 16, 16, 32), 2.0**exponent), normal(1, (3, 3, 32, 64), 2.0**exponent)
    r = normal(2, (4, 16, 16, 64), 2.0**exponent)
    fp8 = jax.jit(functools.partial(value_and_grads, dot_formats(conv)))
    assert count_contractions(fp8.lower(x, w, r).as_text()) == (3, 3)
    y, (dx, dw) = fp8(x, w, r)
    exact = value_and_grads(conv, x, w, r)
    for got, want in zip([y, dx, dw], [exact[0], *exact[1]], strict=True):
        assert rel_l2(got, want) < FP8_RTOL


def test_no_scaling_quantises_the_values_as_they_are():
    contract = lambda a, b: a @ b  # noqa: E731
    check_against_reference(contract, normal(0, (6, 16)), normal(1, (16, 5)), scaling="none")


@pytest.mark.parametrize("exponent", [-20, 20])
def test_current_scaling_keeps_extreme_magnitudes_accurate(exponent):
    scale = 2.0**exponent
    x, w, r = normal(0, (8, 32), scale), normal(1, (32, 8), scale), normal(2, (8, 8), scale)
    fp8 = jax.jit(functools.partial(value_and_grads, dot_formats(jnp.matmul)))
    exact = value_and_grads(jnp.matmul, x, w, r)
    y, (dx, dw) = fp8(x, w, r)
    assert rel_l2(y, exact[0]) < FP8_RTOL
    assert rel_l2(dx, exact[1][0]) < FP8_RTOL and rel_l2(dw, exact[1][1]) < FP8_RTOL
    raw = jax.jit(functools.partial(value_and_grads, dot_formats(jnp.matmul, scaling="none")))
    raw_y, (_, raw_dw) = raw(x, w, r)
    assert rel_l2(raw_y, exact[0]) > 0.5 and rel_l2(raw_dw, exact[1][1]) > 0.5  # flush/NaN


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtypes_of_output_and_gradients_are_the_originals(dtype):
    x, w = normal(0, (4, 16), dtype=dtype), normal(1, (16, 8), dtype=dtype)
    y, (dx, dw) = value_and_grads(dot_formats(jnp.matmul), x, w, jnp.ones((4, 8), dtype))
    assert y.dtype == dx.dtype == dw.dtype == dtype
    assert rel_l2(y, (x.astype(jnp.float32) @ w.astype(jnp.float32))) < FP8_RTOL


def test_same_semantics_as_nn_linear():
    x, w, r = normal(0, (2, 6, 16)), normal(1, (16, 5)), normal(2, (2, 6, 5))
    fp8_linear = functools.partial(linear, x_dtype=E4M3, w_dtype=E4M3, grad_dtype=E5M2)
    expected = value_and_grads(fp8_linear, x, w, r)
    got = value_and_grads(dot_formats(linear, scaling="none"), x, w, r)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------
# The transformed function: signature, avals, options
# ---------------------------------------------------------------------------------------


def test_output_avals_are_the_original_ones():
    def fn(params, x, *, activation="tanh", repeat=2):
        h = x
        for _ in range(repeat):
            h = getattr(jnp, activation)(h @ params["w"]).astype(x.dtype)
        return {"h": h, "n": jnp.argmax(h, axis=-1), "s": 2.0 * jnp.sum(h)}

    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        params = {"w": normal(0, (8, 8), dtype=dtype)}
        x = normal(1, (3, 8), dtype=dtype)
        for args in [(params, x), (params, jnp.full((3, 8), 0.5))]:  # the latter weakly typed
            for kwargs in [{}, {"activation": "sin", "repeat": 3}]:
                expected = jax.eval_shape(functools.partial(fn, **kwargs), *args)
                got = jax.eval_shape(functools.partial(dot_formats(fn), **kwargs), *args)
                assert got == expected


def count_contractions(lowered_text: str) -> tuple[int, int]:
    """``(contractions, those with FP8 operands)`` in a lowered StableHLO module."""
    operands = re.findall(
        r"stablehlo\.(?:dot_general|convolution)[^\n]*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)",
        lowered_text,
    )
    return len(operands), sum("f8E" in a and "f8E" in b for a, b in operands)


@jax.custom_vjp
def custom_tanh_layer(x, w):
    return jnp.tanh(x @ w)


def _custom_fwd(x, w):
    return custom_tanh_layer(x, w), (x, w)


def _custom_bwd(residuals, g):  # two float32 contractions: the user's rule is kept
    x, w = residuals
    return g @ w.T, x.T @ g


custom_tanh_layer.defvjp(_custom_fwd, _custom_bwd)


@jax.custom_jvp
def custom_matmul(x, w):
    return x @ w


@custom_matmul.defjvp
def _custom_matmul_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return custom_matmul(x, w), dx @ w + x @ dw


def nested(x, w):
    """One contraction in each of jit, scan, remat, cond, custom_vjp and custom_jvp."""
    y = jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)
    y, _ = lax.scan(lambda c, _: (jnp.tanh(c @ w), None), y, None, length=3)
    y = jax.checkpoint(lambda a: jnp.sin(a @ w))(y)
    y = lax.cond(jnp.sum(y) > 0, lambda a: a @ w, lambda a: a @ w.T, y)
    return jnp.sum(custom_matmul(custom_tanh_layer(y, w), w) ** 2)


def test_nested_contractions_are_reached():
    x, w = normal(0, (4, 8)), normal(1, (8, 8), 0.3)
    assert count_contractions(jax.jit(nested).lower(x, w).as_text()) == (7, 0)
    assert count_contractions(jax.jit(dot_formats(nested)).lower(x, w).as_text()) == (7, 7)
    # The program is unchanged but for the casts: in bfloat16 (8 bits of precision) it stays
    # close to float32. (FP8 errors of 3-5% per contraction compound through this chain.)
    bf16 = dot_formats(nested, lhs=jnp.bfloat16, rhs=jnp.bfloat16, grad=jnp.bfloat16)
    assert 1e-4 < rel_l2(bf16(x, w), nested(x, w)) < 0.02


def test_nested_contractions_are_reached_in_the_backward_pass():
    x, w = normal(0, (4, 8)), normal(1, (8, 8), 0.3)
    grad = jax.jit(jax.grad(dot_formats(nested), argnums=(0, 1)))
    total, fp8 = count_contractions(grad.lower(x, w).as_text())
    # Kept as written: the custom_vjp's bwd (2 contractions) and, under grad, the custom_jvp's
    # jvp rule (its primal contraction and the transposes of its 2 tangent ones).
    # Forward: 7 (both branches of cond); backward: jit 2, scan 2, remat 3 (the recomputed
    # forward too), cond 4, custom_vjp 2, custom_jvp 2.
    assert (total, fp8) == (22, 17)
    bf16 = dot_formats(nested, lhs=jnp.bfloat16, rhs=jnp.bfloat16, grad=jnp.bfloat16)
    expected = jax.grad(nested, argnums=(0, 1))(x, w)
    for got, want in zip(jax.grad(bf16, argnums=(0, 1))(x, w), expected, strict=True):
        assert 1e-4 < rel_l2(got, want) < 0.02


def test_while_loop_body_is_reached():
    def loop(x, w):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    x, w = normal(0, (4, 8)), normal(1, (8, 8), 0.3)
    assert count_contractions(jax.jit(dot_formats(loop)).lower(x, w).as_text()) == (1, 1)


def test_exclude_predicate_sees_each_contraction():
    sites: list[ContractionSite] = []

    def keep_the_projection(site: ContractionSite) -> bool:
        sites.append(site)
        return site.rhs.shape == (8, 3)

    def fn(x, w, head):
        h = jnp.tanh(x @ w)
        return h @ head

    x, w, head = normal(0, (4, 16)), normal(1, (16, 8)), normal(2, (8, 3))
    lowered = jax.jit(dot_formats(fn, exclude=keep_the_projection)).lower(x, w, head)
    assert count_contractions(lowered.as_text()) == (2, 1)
    assert [s.primitive for s in sites] == ["dot_general"] * 2
    assert [s.lhs.shape for s in sites] == [(4, 16), (4, 8)]
    assert sites[0].dimension_numbers == (((1,), (0,)), ((), ()))
    assert sites[0].out == jax.ShapeDtypeStruct((4, 8), jnp.float32)
    assert all("test_dot_formats.py" in s.source_line for s in sites)
    assert sites[0].source_line != sites[1].source_line


def test_exclude_by_operand_shape():
    def fn(x, w, head):
        return jnp.tanh(x @ w) @ head

    x, w, head = normal(0, (4, 16)), normal(1, (16, 8)), normal(2, (8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every shape matches: no warning
        lowered = jax.jit(dot_formats(fn, exclude=[(8, 3)])).lower(x, w, head)
    assert count_contractions(lowered.as_text()) == (2, 1)
    with pytest.warns(UnmatchedExcludeWarning, match=r"\[\(99, 1\)\]") as caught:
        predicate = has_operand_shape((8, 3), (99, 1))
        lowered = jax.jit(dot_formats(fn, exclude=predicate)).lower(x, w, head)
    assert count_contractions(lowered.as_text()) == (2, 1)
    assert caught[0].filename == __file__  # the warning points at the user's call


@pytest.mark.parametrize(
    ("exclude", "hint"),
    [(5, "got 5"), (["head", (8, 3)], "shapes and patterns mixed"),
     ((8, 3), r"write \[\(8, 3\)\]"), ([(8, "3")], r"got \(8, '3'\)"), ([8.0], "got 8.0")],
)  # fmt: skip
@pytest.mark.parametrize("role", ["exclude", "include"])
def test_a_rule_of_a_wrong_type_is_refused_with_the_forms_it_takes(role, exclude, hint):
    with pytest.raises(TypeError, match=f"{role} takes None, a predicate") as raised:
        dot_formats(lambda x, w: x @ w, **{role: exclude})
    assert re.search(hint, str(raised.value)), str(raised.value)
    assert "js.has_module_path" in str(raised.value)


class TwoBlocks(nn.Module):
    """Two blocks of two named Dense layers, and a head: module paths to select from."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = nn.Dense(16, name=f"block{i}_fc")(jnp.tanh(nn.Dense(16, name=f"block{i}_qkv")(x)))
        return nn.Dense(10, name="head")(x)


def two_blocks_loss():
    model, x = TwoBlocks(), normal(0, (8, 32))
    params = model.init(jax.random.key(0), x)
    return (lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params, x


ALL_LAYERS = ("block0_qkv", "block0_fc", "block1_qkv", "block1_fc", "head")


@pytest.mark.parametrize(
    ("rules", "selected"),
    [({}, ALL_LAYERS), ({"exclude": ".*/head"}, ALL_LAYERS[:4]),
     ({"include": ".*_qkv"}, ("block0_qkv", "block1_qkv")),
     ({"include": [".*_qkv", ".*_fc"], "exclude": "TwoBlocks/block1_.*"}, ALL_LAYERS[:2]),
     ({"exclude": js.has_module_path(".*/head", ".*/block0_fc")},
      ("block0_qkv", "block1_qkv", "block1_fc"))],
)  # fmt: skip
def test_contractions_selected_by_flax_module_path(rules, selected):
    loss, params, x = two_blocks_loss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every pattern matches: no warning
        grad_fn = jax.jit(jax.value_and_grad(dot_formats(loss, **rules)))
        lowered = grad_fn.lower(params, x)
    # FP8 dots: each selected layer's forward and weight gradient, and its input gradient
    # except the first layer's (x is not differentiated)
    fp8 = 2 * len(selected) + sum(layer != "block0_qkv" for layer in selected)
    assert count_contractions(lowered.as_text()) == (14, fp8)
    value, grads = grad_fn(params, x)
    assert np.isfinite(float(value))
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_module_paths_seen_by_a_predicate_and_a_pattern_that_matches_nothing():
    loss, params, x = two_blocks_loss()
    paths = []
    dot_formats(loss, exclude=lambda site: paths.append(site.module_path) or False)(params, x)
    assert paths == ["TwoBlocks/block0_qkv", "TwoBlocks/block0_fc", "TwoBlocks/block1_qkv",
                     "TwoBlocks/block1_fc", "TwoBlocks/head"]  # fmt: skip
    with pytest.warns(js.dot_policy.UnmatchedRuleWarning, match="'head'.*TwoBlocks/head"):
        dot_formats(loss, include="head")(params, x)  # fullmatch: the path has its parents


def test_block_recipe_on_dense_contractions():
    """block=js.nn.MXFP8: the dense matmuls become js.nn.block_linear (forward and both
    gradients the same numbers), an attention-like batched einsum keeps the per-tensor
    formats, and so does a dense matmul whose sizes the blocks do not tile."""

    def fn(x, w, v):
        h = jnp.tanh(x @ w)  # (64, 32) @ (32, 64): MX blocks tile it
        a = jnp.einsum("bij,bjk->bik", h.reshape(2, 32, 64), v)  # batched: per tensor
        return a.reshape(64, 64)[:, :48] @ w[:, :48].T[:48, :20]  # K = 48: not tiled

    x, w, v = normal(0, (64, 32)), normal(1, (32, 64)), normal(2, (2, 64, 64))
    r = normal(3, (64, 20))

    def value_and_grads3(fn):
        y, vjp = jax.vjp(fn, x, w, v)
        return y, vjp(r)

    got = value_and_grads3(dot_formats(fn, block=js.nn.MXFP8))

    def by_hand(x, w, v):
        h = jnp.tanh(js.nn.block_linear(x, w, js.nn.MXFP8))
        per_tensor = dot_formats(lambda h, v: jnp.einsum("bij,bjk->bik", h, v))
        a = per_tensor(h.reshape(2, 32, 64), v)
        return dot_formats(lambda a, b: a @ b)(a.reshape(64, 64)[:, :48], w[:, :48].T[:48, :20])

    expected = value_and_grads3(by_hand)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="BlockRecipe"):
        dot_formats(jnp.matmul, block=(1, 32))


def test_block_recipe_under_scalify_matches_plain_jax():
    """js.scalify(jax.grad(dot_formats(loss, block=MXFP8))) on float16 ScaledArrays at 2^-20
    gives the plain-JAX recipe's gradient on the true values, within a few roundings of the
    float16 intermediates (tanh, its square, the cotangents) that scalify computes."""

    def loss(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    x, w = normal(4, (64, 64)), normal(5, (64, 32), 1 / 8)
    x16, w16 = x.astype(jnp.float16), w.astype(jnp.float16)
    grad = jax.grad(dot_formats(loss, block=js.nn.MXFP8), argnums=(0, 1))
    scale = 2.0**-20
    args = (js.ScaledArray(x16, jnp.float32(scale)), js.ScaledArray(w16, jnp.float32(1.0)))
    got = jax.jit(js.scalify(grad))(*args)
    want = grad(x16.astype(jnp.float32) * scale, w16.astype(jnp.float32))
    for a, b in zip(got, want, strict=True):
        assert rel_l2(a.to_array(jnp.float32), b) < 8 * float(jnp.finfo(jnp.float16).eps)


@pytest.mark.parametrize("scaling", ["dynamic", "Delayed", None])
def test_bad_scaling_is_refused(scaling):
    with pytest.raises(ValueError, match="scaling must be one of.*DelayedScaling"):
        dot_formats(jnp.matmul, scaling=scaling)


def test_fp8_nn_linear_is_left_as_it_is():
    def fn(x, w):
        return linear(x, w, x_dtype=E4M3, w_dtype=E4M3, grad_dtype=E5M2)

    x, w, r = normal(0, (4, 16)), normal(1, (16, 8)), normal(2, (4, 8))
    expected = value_and_grads(fn, x, w, r)
    got = value_and_grads(dot_formats(fn), x, w, r)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flax_layers_are_reached():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3))(x)
            x = nn.DenseGeneral((2, 3), axis=(-2, -1))(x.reshape(x.shape[0], -1, 4))
            return nn.Dense(5)(x.reshape(x.shape[0], -1))

    x = normal(0, (2, 6, 6, 3))
    params = Model().init(jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(Model().apply(params, x) ** 2)

    lowered = jax.jit(jax.grad(dot_formats(loss))).lower(params, x)
    # 3 forward, 5 backward (no input gradient for the convolution), all on FP8 operands: the
    # convolution's weight gradient takes its cotangent in E4M3, the input's format.
    assert count_contractions(lowered.as_text()) == (8, 8)
    bf16 = dot_formats(loss, lhs=jnp.bfloat16, rhs=jnp.bfloat16, grad=jnp.bfloat16)
    got, expected = jax.grad(bf16)(params, x)["params"], jax.grad(loss)(params, x)["params"]
    for layer in ("Conv_0", "DenseGeneral_0", "Dense_0"):  # (bias gradients: cancellation)
        assert 1e-4 < rel_l2(got[layer]["kernel"], expected[layer]["kernel"]) < 0.02


# ---------------------------------------------------------------------------------------
# Under scalify
# ---------------------------------------------------------------------------------------


def mlp_loss(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


@pytest.mark.parametrize("exponent", [0, -20, 20])
def test_scalified_training_step_matches_float32(exponent):
    params = {
        "w1": normal(0, (16, 32), 2.0**exponent / 4),
        "b1": jnp.zeros((32,)),
        "w2": normal(1, (32, 8), 0.2),
    }
    x = normal(2, (8, 16))
    step = jax.jit(js.scalify(jax.value_and_grad(dot_formats(mlp_loss))))
    loss, grads = step(js.as_scaled_array(params), js.as_scaled_array(x))
    assert isinstance(loss, js.ScaledArray) and isinstance(grads["w1"], js.ScaledArray)
    expected_loss, expected_grads = jax.value_and_grad(mlp_loss)(params, x)
    assert rel_l2(js.asarray(loss), expected_loss) < FP8_RTOL
    for name, expected in expected_grads.items():
        assert rel_l2(js.asarray(grads[name]), expected) < FP8_RTOL, name
    lowered = step.lower(js.as_scaled_array(params), js.as_scaled_array(x)).as_text()
    assert count_contractions(lowered) == (5, 5)  # x needs no gradient


def test_scalify_casts_the_data_without_current_scaling():
    """Under scalify a ScaledArray operand is not rescaled: both scalings give one program."""
    params = {"w1": normal(0, (16, 32)), "b1": jnp.zeros((32,)), "w2": normal(1, (32, 8))}
    args = js.as_scaled_array((params, normal(2, (8, 16))))
    outputs = [
        jax.jit(js.scalify(jax.value_and_grad(dot_formats(mlp_loss, scaling=s))))(*args)
        for s in ("current", "none")
    ]
    for a, b in zip(*(js.tree.tree_leaves(o) for o in outputs), strict=True):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


# ---------------------------------------------------------------------------------------
# Acceptance: the GPT of experiments/gpt.py, unmodified
# ---------------------------------------------------------------------------------------

TINY = gpt.GPTConfig(vocab_size=11, context=8, width=16, layers=1, heads=2)


def gpt_problem():
    params = gpt.init_params(TINY, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, TINY.context), 0, TINY.vocab_size)
    targets = jax.random.randint(jax.random.key(2), (2, TINY.context), 0, TINY.vocab_size)
    return functools.partial(gpt.next_char_loss, gpt.GPT(TINY)), params, tokens, targets


def test_gpt_training_step_has_fp8_contractions_but_the_head():
    loss, params, tokens, targets = gpt_problem()
    head = (TINY.width, TINY.vocab_size)  # tied embeddings: x @ wte.T
    step = jax.jit(js.scalify(jax.value_and_grad(dot_formats(loss, exclude=[head]))))
    scaled = js.as_scaled_array(params)
    lowered = step.lower(scaled, tokens, targets)
    total, fp8 = count_contractions(lowered.as_text())
    # Per block 4 weight matmuls and 2 attention einsums, each with 2 backward contractions;
    # the head (1 forward, 2 backward) is excluded and stays in float32.
    assert total == TINY.layers * 6 * 3 + 3
    assert fp8 == total - 3
    value, grads = lowered.compile()(scaled, tokens, targets)
    expected_value, expected_grads = jax.jit(jax.value_and_grad(loss))(params, tokens, targets)
    assert rel_l2(js.asarray(value), expected_value) < 0.01
    for got, want in zip(js.tree.tree_leaves(grads), jax.tree.leaves(expected_grads)):
        assert rel_l2(js.asarray(got), want) < 0.2


def test_nnx_contractions_take_the_path_of_their_named_scope():
    # flax.nnx modules do not name their calls in JAX's name stack: a jax.named_scope does.
    from flax import nnx

    model = nnx.Linear(32, 16, rngs=nnx.Rngs(0))

    def forward(x):
        with jax.named_scope("encoder"):
            hidden = model(x)
        return model.kernel[...] @ hidden.T  # outside any scope: path ""

    paths = []
    dot_formats(forward, exclude=lambda site: paths.append(site.module_path) or False)(
        normal(0, (8, 32))
    )
    assert paths == ["encoder", ""]
    lowered = jax.jit(dot_formats(forward, include="encoder")).lower(normal(0, (8, 32)))
    assert count_contractions(lowered.as_text()) == (2, 1)
