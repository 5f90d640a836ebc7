"""Dynamic rescaling (js.ops.dynamic_rescale_*): data re-centred, value kept, identity outside."""

import functools
import re
from itertools import product

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    HOW,
    all_eqns,
    assert_pow2_scales,
    built,
    check_e8m0_matches,
    compiled_computations,
    covering,
    heavy_tailed,
    random_data,
    value64,
)
from hypothesis import given
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled import ops
from jax_scaled.ops import rescale as rescale_module
from jax_scaled.rules.casts import saturate

RESCALE = {
    "l1": ops.dynamic_rescale_l1,
    "l2": ops.dynamic_rescale_l2,
    "max": ops.dynamic_rescale_max,
}
RESCALE_GRAD = {
    "l1": ops.dynamic_rescale_l1_grad,
    "l2": ops.dynamic_rescale_l2_grad,
    "max": ops.dynamic_rescale_max_grad,
}
ALL_OPS = [*RESCALE.values(), *RESCALE_GRAD.values()]


@functools.cache
def jitted_scalify(fn):
    """One compiled ``jit(scalify(fn))`` per function, reused across hypothesis examples."""
    return jax.jit(js.scalify(fn))


SHAPE = (4, 8)  # one shape: each jitted test compiles once, examples vary values and scales

# Data exponents ("imbalance": how far the data sits from unit scale) each format can hold
# for normal samples without overflowing: float16 tops out at 2^16.
IMBALANCE = {jnp.float32: (-30, 30), jnp.bfloat16: (-30, 30), jnp.float16: (-12, 12)}


def statistic64(data, norm: str) -> float:
    """The norm statistic of ``data`` in float64 numpy."""
    magnitude = np.abs(np.asarray(data, np.float64))
    if norm == "l1":
        return float(np.mean(magnitude))
    if norm == "l2":
        return float(np.sqrt(np.mean(magnitude**2)))
    return float(np.max(magnitude))


def assert_same_value(y: js.ScaledArray, x: js.ScaledArray) -> None:
    """Equal values; only data pushed into the format's subnormals (or flushed) may differ,
    the smallest normal included (what a subnormal quotient rounds up to)."""
    got, want = value64(y), value64(x)
    tiny = float(ml_dtypes.finfo(y.dtype).smallest_normal) * float(y.scale)
    normal = np.abs(np.asarray(y.data, np.float64)) > float(
        ml_dtypes.finfo(y.dtype).smallest_normal
    )
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.all(np.abs(got - want) <= tiny)


@st.composite
def imbalanced(draw, dtype) -> js.ScaledArray:
    """A ScaledArray whose data is normal samples times 2^k (k up to ±30) at a random scale."""
    low, high = IMBALANCE[dtype]
    exponent = draw(st.integers(low, high))
    seed = draw(st.integers(0, 2**31 - 1))
    raw = random_data(seed, SHAPE, jnp.float32) * np.float32(2.0**exponent)
    scale = 2.0 ** draw(st.integers(-20, 20))
    return js.ScaledArray(jnp.asarray(raw.astype(jnp.dtype(dtype))), jnp.float32(scale))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("norm", list(RESCALE))
@given(data=st.data())
def test_rescale_recentres_data_and_keeps_value(dtype, norm, data):
    x = data.draw(imbalanced(dtype))
    y = jitted_scalify(RESCALE[norm])(x)
    assert isinstance(y, js.ScaledArray) and y.dtype == x.dtype
    assert_pow2_scales(y)
    assert 1.0 <= statistic64(y.data, norm) < 2.0  # default rounding: down
    assert_same_value(y, x)


IN_RANGE = {
    "down": lambda s: 1.0 <= s < 2.0,
    "up": lambda s: 0.5 < s <= 1.0,
    "nearest": lambda s: 2**-0.5 <= s < 2**0.5,
}


@pytest.mark.parametrize("rounding", list(IN_RANGE))
@pytest.mark.parametrize("norm", list(RESCALE))
def test_rescale_follows_configured_rounding(rounding, norm):
    x = js.ScaledArray(jnp.asarray(random_data(3, (5, 7), jnp.float32) * 2.0**-17), jnp.float32(8))
    with js.ScalifyConfig(rounding=rounding):
        y = js.scalify(RESCALE[norm])(x)
    assert IN_RANGE[rounding](statistic64(y.data, norm))
    assert_same_value(y, x)


def test_rescale_without_it_data_stays_off():
    """The baseline the tests above rely on: without rescaling, data stays badly scaled."""
    x = js.ScaledArray(jnp.full((4,), 2.0**-20, jnp.float32), jnp.float32(1))
    kept = js.scalify(lambda x: x * 1.0)(x)
    assert statistic64(kept.data, "l2") == 2.0**-20
    rescaled = js.scalify(ops.dynamic_rescale_l2)(x)
    assert statistic64(rescaled.data, "l2") == 1.0 and float(rescaled.scale) == 2.0**-20


@pytest.mark.parametrize("data", [[0.0, 0.0, 0.0], [np.inf, 1.0, 2.0], [np.nan, 1.0, 2.0]])
def test_rescale_leaves_zero_and_nonfinite_data_alone(data):
    x = js.ScaledArray(jnp.array(data, jnp.float16), jnp.float32(2.0**-10))
    for rescale in RESCALE.values():
        y = js.scalify(rescale)(x)
        np.testing.assert_array_equal(np.asarray(y.data), np.asarray(x.data))
        assert float(y.scale) == float(x.scale)  # 2^-10, or 2^-126 for the zeros


def test_rescale_clamps_scale_to_its_range():
    """A scale that would fall below 2^-126 is clamped; the data keeps the remainder."""
    x = js.ScaledArray(jnp.full((3,), 2.0**-20, jnp.float32), jnp.float32(2.0**-120))
    y = js.scalify(ops.dynamic_rescale_l2)(x)
    assert float(y.scale) == 2.0**-126
    np.testing.assert_array_equal(np.asarray(y.data), np.full(3, 2.0**-14, np.float32))
    assert_same_value(y, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", list(RESCALE))
def test_rescale_of_data_near_the_format_s_largest_value_keeps_it(dtype, norm):
    """Data whose statistic is 2^127 or more (float32 or bfloat16 near their largest value)
    moves at most 2^126 into the scale: its factor, the old scale over the new, stays a normal
    float32. At 2^-127 XLA:CPU read it as zero, and the rescaled data was all zeros."""
    data = jnp.asarray(np.full((4, 64), 1.5 * 2.0**127, np.float32)).astype(dtype)
    x = js.ScaledArray(data, jnp.float32(2.0**-126))
    y = jax.jit(js.scalify(RESCALE[norm]))(x)
    assert float(y.scale) == 1.0
    assert_same_value(y, x)


def test_rescale_keeps_e8m0_scales_bit_identical():
    x = js.ScaledArray(jnp.asarray(random_data(0, (4, 6), jnp.float16) * 2.0**9), jnp.float32(0.25))
    for rescale in RESCALE.values():
        check_e8m0_matches(rescale, [x])


def test_rescale_of_plain_array_inside_scalify_stays_plain():
    x = jnp.asarray(random_data(1, (3, 4), jnp.float32) * 2.0**20)
    for rescale in RESCALE.values():
        y = js.scalify(rescale)(x)
        assert not isinstance(y, js.ScaledArray)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_rescale_under_vmap_inside_scalify_uses_one_scale():
    x = js.ScaledArray(jnp.asarray(random_data(2, (3, 5), jnp.float32) * 2.0**12), jnp.float32(1))
    y = js.scalify(jax.vmap(ops.dynamic_rescale_max))(x)
    assert np.ndim(y.scale) == 0
    assert 1.0 <= statistic64(y.data, "max") < 2.0
    assert_same_value(y, x)


@pytest.mark.parametrize("norm", list(RESCALE))
def test_a_rescaled_scale_is_computed_once_for_its_readers(norm):
    # Derived from the data's statistic, the new scale was worked out again in every kernel
    # reading the rescaled data or its scale (3.5% of the 1-layer GPT's fp8_policy step).
    def rescaled_and_read_twice(x):
        y = RESCALE[norm](x * 3.0)
        return jnp.sin(y), jnp.exp(y).T

    x = js.scaled_array(jnp.asarray(random_data(3, (64, 64), jnp.float16)), 2.0)
    lines = [line for body in compiled_computations(js.scalify(rescaled_and_read_twice), x).values()
             for line in body]  # fmt: skip
    assert sum(" remainder(" in line for line in lines) == 1
    y = js.scalify(lambda x: RESCALE[norm](x * 3.0))(x)
    assert_same_value(y, js.scalify(lambda x: x * 3.0)(x))


@pytest.mark.parametrize(
    ("norm", "scale", "how"), covering(list(product(RESCALE, [2.0**-20, 1.0, 2.0**20])), HOW)
)
def test_a_rescaled_cast_is_guarded_from_the_rescale_s_largest_magnitude(norm, how, scale):
    # New float16 master weights are rescaled, saturated and cast: the cast's range guard
    # reads the largest magnitude the rescale took (multiplied and clipped as the data is)
    # instead of reducing the data again. Same bits as a guard that reduces it afresh.
    def rescaled(x):
        return saturate(RESCALE[norm](x * 1.0), jnp.float16)

    def cast(y):
        return y.astype(jnp.float16)

    x = built(how, jnp.asarray(heavy_tailed(5)), jnp.float32, scale)
    together = jax.jit(js.scalify(lambda x: cast(rescaled(x))))(x)
    apart = jax.jit(js.scalify(cast))(jax.jit(js.scalify(rescaled))(x))
    assert np.asarray(together.data).tobytes() == np.asarray(apart.data).tobytes()
    assert np.asarray(together.scale).tobytes() == np.asarray(apart.scale).tobytes()
    jaxpr = jax.make_jaxpr(js.scalify(lambda x: cast(rescaled(x))))(x)
    assert sum(e.primitive.name == "reduce_max" for e in all_eqns(jaxpr.jaxpr)) == 1


@pytest.mark.parametrize("special", [0.0, np.inf, np.nan])
def test_a_rescaled_cast_of_zero_or_non_finite_data_is_guarded_as_before(special):
    def rescaled_cast(x):
        return saturate(ops.dynamic_rescale_l2(x * 1.0), jnp.float16)

    values = np.full((64, 64), special, np.float32) if special == 0.0 else heavy_tailed(6)
    values.flat[7] = special
    x = js.as_scaled_array(jnp.asarray(values))
    together = jax.jit(js.scalify(lambda x: rescaled_cast(x).astype(jnp.float16)))(x)
    apart = jax.jit(js.scalify(lambda y: y.astype(jnp.float16)))(
        jax.jit(js.scalify(rescaled_cast))(x)
    )
    assert np.asarray(together.data).tobytes() == np.asarray(apart.data).tobytes()
    assert np.asarray(together.scale).tobytes() == np.asarray(apart.scale).tobytes()


NARROW = [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2]


@jax.jit
def _unit_relative_statistics(data):
    """The l1 and l2 statistics of ``data`` taken relative to its largest magnitude rounded
    down to a power of two, as every format needs them (float32 squares overflow above
    2^64): the reference a narrow format's direct statistic must match bit for bit."""
    magnitude = jnp.abs(data.astype(jnp.float32))
    unit = js.pow2_round(jnp.max(magnitude, initial=0))
    relative = magnitude / unit
    l1 = jnp.mean(relative) * unit
    l2 = jnp.sqrt(jnp.mean(jnp.square(relative))) * unit
    return l1, l2


@jax.jit
def _direct_statistics(data):
    return tuple(rescale_module._data_statistic(data, norm)[0] for norm in ("l1", "l2"))


@pytest.mark.parametrize("dtype", NARROW)
@given(exponent=st.integers(-40, 20), seed=st.integers(0, 2**31 - 1))
def test_a_narrow_format_s_statistic_needs_no_unit(dtype, exponent, seed):
    # float16 and float8 data square and sum in float32 without leaving its normal range, so
    # the statistic is taken in one pass, not after the largest magnitude's. Data at every
    # exponent the format holds (subnormals and the top included, some of it flushed or
    # saturated by the cast) gives the unit-relative statistic to the bit.
    values = heavy_tailed(seed % 1000, (64, 512)) * np.float32(2.0**exponent)
    info = ml_dtypes.finfo(dtype)
    data = jnp.asarray(np.clip(values, -float(info.max), float(info.max)).astype(dtype))
    direct, relative = _direct_statistics(data), _unit_relative_statistics(data)
    assert [np.float32(v).tobytes() for v in direct] == [np.float32(v).tobytes() for v in relative]


@pytest.mark.parametrize("special", [0.0, np.inf, np.nan])
def test_a_narrow_format_s_statistic_of_zero_or_non_finite_data_is_unchanged(special):
    values = np.zeros((64, 64), np.float32) if special == 0.0 else heavy_tailed(8, (64, 64))
    values.flat[3] = special
    data = jnp.asarray(values.astype(jnp.float16))
    direct, relative = _direct_statistics(data), _unit_relative_statistics(data)
    assert [np.float32(v).tobytes() for v in direct] == [np.float32(v).tobytes() for v in relative]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rescale_of_empty_data_keeps_it(dtype):
    x = js.ScaledArray(jnp.zeros((0, 3), dtype), jnp.float32(2.0**-10))
    for rescale in RESCALE.values():
        y = js.scalify(rescale)(x)
        assert y.data.shape == (0, 3) and y.dtype == dtype
        assert float(y.scale) == 2.0**-10


def _arithmetic(body: list[str]) -> list[str]:
    """The opcodes of a kernel's instructions that compute (not its inputs and reshapes)."""
    opcodes = [line.split("(")[0].split()[-1] for line in body]
    return [op for op in opcodes if op not in ("parameter", "constant", "bitcast")]


def _rescaled_together(norm: str, seed: int, shape, *, scalar: bool = False):
    """16 tensors of ``shape`` rescaled together: them, the scalified rescale and the
    arithmetic of each kernel of its compiled program (``scalar``: of one-element ones)."""
    keys = jax.random.split(jax.random.key(seed), 16)
    xs = [js.scaled_array(jax.random.normal(k, shape), 2.0**-3) for k in keys]
    rescaled = js.scalify(lambda xs: [RESCALE[norm](x) for x in xs])
    bodies = compiled_computations(rescaled, xs)
    pattern = r"= f32\[1?\]\S* fusion" if scalar else r"fusion\("
    kernels = [re.search(r"calls=(%[\w.\-]+)", line) for line in bodies["ENTRY"]
               if re.search(pattern, line)]  # fmt: skip
    return xs, rescaled, [_arithmetic(bodies[k.group(1)]) for k in kernels if k]


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_rescales_together_stack_their_largest_magnitudes_as_reduced(norm):
    # Stacked for their units, each tensor's largest magnitude went through a maximum with
    # 0 (jnp.max's initial) in a kernel of its own: 52 kernels in the 4-layer GPT's step.
    xs, rescaled, arithmetic = _rescaled_together(norm, 3, (64, 64))
    assert len(arithmetic) > 16 and ["maximum"] not in arithmetic
    for x, y in zip(xs, rescaled(xs), strict=True):
        assert_same_value(y, x)


# Tensors of the sizes a step rescales together (a GPT block's kernels and biases), one of
# them near its format's largest value, where a unit of 2^127 had a subnormal reciprocal.
TOGETHER_SHAPES = [(128, 384), (384,), (128, 512), (512, 128), (128,)]


def _together_inputs(how: str, dtype, scale: float) -> list[js.ScaledArray]:
    top = 1.5 * 2.0 ** (ml_dtypes.finfo(dtype).maxexp - 1)  # the last one's: the top binade
    largest = [2.0**-20, 2.0**-6, 1.0, 2.0**8, top]
    xs = []
    for i, (shape, high) in enumerate(zip(TOGETHER_SHAPES, largest, strict=True)):
        values = heavy_tailed(20 + i, shape)
        values = values / np.abs(values).max() * np.float32(high)
        # At the top, in_jit's power of two is not one: XLA's float32 exp2(127) is inexact.
        way = "scaled_array" if high == top and how == "in_jit" else how
        xs.append(built(way, jnp.asarray(values), dtype, 1.0 if high == top else scale))
    return xs


@pytest.mark.parametrize(
    ("dtype", "norm", "scale", "how"),
    covering(list(product(FLOAT_DTYPES, RESCALE)), list(product([2.0**-20, 1.0, 2.0**20], HOW))),
)
def test_rescales_together_give_each_rescale_s_bits(dtype, norm, scale, how):
    # The statistics of rescales together are worked out on vectors (units, reciprocals,
    # means, square roots): every tensor gets the bits of its rescale alone, the top binade
    # of float32 and bfloat16 included.
    xs = _together_inputs(how, dtype, scale)
    together = jax.jit(js.scalify(lambda xs: [RESCALE[norm](x) for x in xs]))(xs)
    for x, y in zip(xs, together, strict=True):
        alone = jitted_scalify(RESCALE[norm])(x)
        assert np.asarray(y.data).tobytes() == np.asarray(alone.data).tobytes()
        assert np.asarray(y.scale).tobytes() == np.asarray(alone.scale).tobytes()
        assert_same_value(y, x)
    top = np.abs(np.asarray(xs[-1].data, np.float64)).max() >= 2.0 ** (
        ml_dtypes.finfo(dtype).maxexp - 1
    )
    assert float(together[-1].scale) > float(xs[-1].scale) or not top  # moved off the top


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_rescales_together_finish_their_statistics_on_one_vector(norm):
    # Each tensor's mean, square root and unit used to follow its reduction in a scalar
    # kernel of its own wherever XLA:CPU could not fuse them into the reduction's.
    xs, rescaled, arithmetic = _rescaled_together(norm, 4, (128, 384), scalar=True)
    finishing = [ops for ops in arithmetic if "reduce" not in ops and "multiply" in ops]
    assert len(arithmetic) >= 16 and len(finishing) <= 2, finishing
    for x, y in zip(xs, rescaled(xs), strict=True):
        assert_same_value(y, x)


def test_float32_l2_rescales_together_write_no_magnitudes():
    # The sum of squares read |data| where the maximum did: abs, read by two reductions,
    # was a kernel of its own writing every magnitude, one per float32 master weight of a
    # step. Squares of the data are the same floats, and abs fuses into the maximum.
    xs, rescaled, arithmetic = _rescaled_together("l2", 5, (128, 384))
    assert len(arithmetic) >= 16 and ["abs"] not in arithmetic, arithmetic
    for x, y in zip(xs, rescaled(xs), strict=True):
        assert_same_value(y, x)


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_a_float16_rescale_reads_its_data_once(norm):
    # The statistic's reduction no longer waits for a reduction to the largest magnitude.
    x = js.scaled_array(jnp.asarray(heavy_tailed(9).astype(jnp.float16)), 2.0**-20)
    lines = [line for body in compiled_computations(js.scalify(RESCALE[norm]), x).values()
             for line in body]  # fmt: skip
    assert sum(" reduce(" in line for line in lines) == 1
    assert_same_value(jitted_scalify(RESCALE[norm])(x), x)


# --- identities outside scalify ----------------------------------------------------------


def _main_body_ops(fn, x) -> list[str]:
    """Names of the StableHLO operations in the body of ``jit(fn)``'s main function."""
    module = jax.jit(fn).lower(x).compiler_ir("stablehlo")
    main = next(op for op in module.body.operations if "main" in str(op.attributes["sym_name"]))
    return [op.operation.name for op in main.regions[0].blocks[0].operations]


@pytest.mark.parametrize("rescale", list(RESCALE.values()))
def test_rescale_outside_scalify_is_one_equation_and_no_operation(rescale):
    x = jnp.asarray(random_data(4, (2, 3), jnp.float16))
    jaxpr = jax.make_jaxpr(rescale)(x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dynamic_rescale"]
    assert _main_body_ops(rescale, x) == _main_body_ops(lambda x: x, x) == ["func.return"]


@pytest.mark.parametrize("fn", ALL_OPS)
def test_ops_are_identities_outside_scalify(fn):
    x = jnp.asarray(random_data(5, (3, 4), jnp.float32) * 2.0**30)
    w = jnp.asarray(random_data(6, (3, 4), jnp.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.vmap(fn)(x)), np.asarray(x))
    grad = jax.grad(lambda x: jnp.sum(fn(x) * w))(x)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(w))


def test_rescale_refuses_integer_arrays():
    with pytest.raises(TypeError, match="floating-point"):
        ops.dynamic_rescale_l2(jnp.arange(3))


# --- *_grad: the cotangent's representation is rebalanced, its value kept ------------------


def grad_of(fn):
    return lambda x, w: jax.grad(lambda x: jnp.sum(fn(x) * w))(x)


GRAD_OF = {norm: grad_of(fn) for norm, fn in RESCALE_GRAD.items()}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("norm", list(RESCALE_GRAD))
@given(data=st.data())
def test_grad_rescale_rebalances_the_cotangent(dtype, norm, data):
    w = data.draw(imbalanced(dtype))
    x = js.as_scaled_array(jnp.ones(w.shape, dtype))
    g = jitted_scalify(GRAD_OF[norm])(x, w)
    assert isinstance(g, js.ScaledArray) and g.dtype == w.dtype
    assert_pow2_scales(g)
    assert 1.0 <= statistic64(g.data, norm) < 2.0
    assert_same_value(g, w)  # the gradient of sum(x * w) is w


def test_grad_rescale_without_it_the_cotangent_stays_off():
    w = js.ScaledArray(jnp.full((4,), 2.0**12, jnp.float16), jnp.float32(2.0**-30))
    x = js.as_scaled_array(jnp.ones(4, jnp.float16))
    plain = js.scalify(grad_of(lambda x: x))(x, w)
    assert statistic64(plain.data, "l2") == 2.0**12
    rescaled = js.scalify(grad_of(ops.dynamic_rescale_l2_grad))(x, w)
    assert statistic64(rescaled.data, "l2") == 1.0 and float(rescaled.scale) == 2.0**-18


@pytest.mark.parametrize("norm", list(RESCALE_GRAD))
def test_grad_rescale_is_in_the_backward_pass_and_identity_forward(norm):
    x = jnp.ones((2, 3), jnp.float16)
    jaxpr = jax.make_jaxpr(grad_of(RESCALE_GRAD[norm]))(x, x)
    rescales = [e for e in jaxpr.eqns if e.primitive.name == "dynamic_rescale"]
    assert [e.params["norm"] for e in rescales] == [norm]
    xs = js.ScaledArray(jnp.full((2, 3), 2.0**10, jnp.float16), jnp.float32(2.0**-5))
    y = js.scalify(RESCALE_GRAD[norm])(xs)
    assert float(y.scale) == 2.0**-5
    np.testing.assert_array_equal(np.asarray(y.data), np.asarray(xs.data))
