"""Every ScaledArray a user can build is safe: traced non-power-of-two scales, zeros with a
nominal scale, values beyond a format's range (DESIGN.md, invariant 6)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_scaled as js
from tests.helpers import HOW, built, reference64, residual_loss, value64

FLOAT16_EPS = float(jnp.finfo(jnp.float16).eps)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("scale", [3.0, 448.0 / 3, 1e-7, 5e6])
def test_traced_scale_that_is_not_a_power_of_two_is_normalised(scale):
    data = jax.random.normal(jax.random.key(1), (256, 128))
    fn = jax.jit(lambda d, s: js.asarray(js.scalify(lambda t: t * t + t)(js.ScaledArray(d, s))))
    got = fn(data / scale, np.float32(scale))
    value = np.asarray(data / scale, np.float64) * np.float32(scale)
    assert relative_error(got, value * value + value) < 4 * float(jnp.finfo(jnp.float32).eps)


def test_traced_power_of_two_scale_keeps_the_data_bit_identical():
    data = jax.random.normal(jax.random.key(2), (64, 512)).astype(jnp.float16)
    built = jax.jit(lambda d, s: js.ScaledArray(d, s))(data, np.float32(2.0**-20))
    np.testing.assert_array_equal(np.asarray(built.data), np.asarray(data))
    assert float(built.scale) == 2.0**-20


def test_traced_scale_of_delayed_scaling_does_not_overflow_e4m3():
    x = jax.random.normal(jax.random.key(3), (64, 512)) * 7.0

    @jax.jit
    def port(x):  # as code ported from delayed-scaling libraries writes it
        scale = jnp.max(jnp.abs(x)) / 448.0
        q = js.ScaledArray((x / scale).astype(jnp.float8_e4m3fn), scale)
        return js.asarray(q, jnp.float32), q.scale

    got, scale = port(x)
    assert np.all(np.isfinite(got))
    assert np.frexp(float(scale))[0] == 0.5
    assert relative_error(got, x) <= float(jnp.finfo(jnp.float8_e4m3fn).eps)


def test_concrete_scale_that_is_not_a_power_of_two_raises():
    with pytest.raises(ValueError, match="power of two"):
        js.ScaledArray(jnp.ones(4), jnp.float32(3.0))


@pytest.mark.parametrize("build", ["eager", "jit"])
def test_zero_with_a_nominal_scale_takes_the_smallest_scale(build):
    make = lambda d: js.scaled_array(d, 2.0**-20)  # noqa: E731
    if build == "jit":
        make = jax.jit(make)
    assert float(make(jnp.zeros((4, 8), jnp.float16)).scale) == 2.0**-126
    assert float(make(jnp.ones((4, 8), jnp.float16)).scale) == 2.0**-20


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.Dense(256)(x))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_model_put_at_one_scale_has_the_reference_gradient(scale):
    """Every leaf built as scaled_array(float16 data, scale), zero biases included."""
    model = TwoDense()
    x = jax.random.normal(jax.random.key(1), (32, 64))
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    at_scale = lambda a: js.scaled_array(a.astype(jnp.float16), scale)  # noqa: E731
    params_s, x_s = jax.tree.map(at_scale, params), at_scale(x)
    grads = jax.jit(js.scalify(jax.grad(loss)))(params_s, x_s)
    want = reference64(jax.grad(loss), params_s, x_s)
    got = jax.tree.map(value64, grads, is_leaf=lambda v: isinstance(v, js.ScaledArray))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.all(np.isfinite(g))
        assert relative_error(g, w) < 16 * FLOAT16_EPS


@pytest.mark.parametrize("value", [1e20, 1e-20, 3e38, 1e-37])
def test_as_scaled_array_then_float16_keeps_values_beyond_float16(value):
    x = js.tree.astype(js.as_scaled_array(jnp.full((4, 1024), value)), jnp.float16)
    assert relative_error(js.asarray(x, jnp.float32), np.full((4, 1024), value)) <= FLOAT16_EPS


@pytest.mark.parametrize("value", [1e5, 1e-9])
@pytest.mark.parametrize("under_jit", [False, True])
def test_tree_astype_recentres_data_that_does_not_fit(value, under_jit):
    x = js.scaled_array(jnp.full((64,), value), 1.0)
    cast = lambda t: js.tree.astype(t, jnp.float16)  # noqa: E731
    y = jax.jit(cast)(x) if under_jit else cast(x)
    assert y.dtype == jnp.float16
    assert relative_error(js.asarray(y, jnp.float32), np.full(64, value)) <= FLOAT16_EPS


def test_tree_astype_keeps_data_that_fits_bit_identical():
    x = js.as_scaled_array(jax.random.normal(jax.random.key(0), (64, 512)) * 2.0**-20)
    y = js.tree.astype(x, jnp.float16)
    np.testing.assert_array_equal(np.asarray(y.data), np.asarray(x.data.astype(jnp.float16)))
    assert float(y.scale) == float(x.scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_cube_keeps_a_scale_beyond_float32_in_its_data(dtype):
    """gelu's cube at inputs near 2^43: the scale's cube 2^129 would be inf (and its zeros
    NaN); the value 2^129 * 0.01^3 is well inside float32."""
    data = jnp.asarray([0.01, -0.02, 0.0, 0.015], dtype)
    x = js.ScaledArray(data, jnp.float32(2.0**43))
    got = js.scalify(lambda t: t**3)(x)
    want = reference64(lambda t: t**3, x)
    assert np.all(np.isfinite(value64(got)))
    assert relative_error(value64(got), want) <= 4 * float(jnp.finfo(dtype).eps)


@pytest.mark.parametrize("under_jit", [False, True])
def test_a_closed_over_mask_takes_the_other_operands_scale(under_jit):
    """An attention mask of 0 and -inf built outside the function, at float16 2^-20: it is
    the same at any scale, so the data stays at unit scale (not flushed towards subnormals
    by an assumed scale of 1)."""
    mask = jnp.where(jnp.arange(512) % 3 == 0, 0.0, -jnp.inf).astype(jnp.float16)
    data = jax.random.normal(jax.random.key(4), (64, 512)).astype(jnp.float16)
    fn = js.scalify(lambda x: x + mask)
    fn = jax.jit(fn) if under_jit else fn
    x = js.scaled_array(data, 2.0**-20)
    got, want = value64(fn(x)), value64(x) + np.asarray(mask, np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    kept = np.isfinite(want)
    assert relative_error(got[kept], want[kept]) <= FLOAT16_EPS


# --- a residual stack, its inputs built every way the API allows ---------------------------


def build_float16(route: str, values: jax.Array, scale: float):
    """``values * scale`` as float16 data, built the way ``route`` names."""
    if route == "quantize":
        return js.quantize(values * scale, jnp.float16)
    if route == "scaled_array":
        return js.scaled_array(values.astype(jnp.float16), scale)
    if route == "as_scaled_array":
        return js.tree.astype(js.as_scaled_array(values * scale), jnp.float16)

    @jax.jit
    def split_in_jit(v):  # a scale computed inside jit: the power of two nearest the rms
        s = 2.0 ** jnp.round(jnp.log2(jnp.sqrt(jnp.mean(v * v))))
        return js.ScaledArray((v / s).astype(jnp.float16), s)

    return split_in_jit(values * scale)


def residual_errors(activation, weights, x) -> list[float]:
    """Normwise errors of the loss and its gradients against float64."""
    grad = jax.value_and_grad(functools.partial(residual_loss, activation=activation), (0, 1))
    got = jax.jit(js.scalify(grad))(weights, x)
    want = reference64(grad, weights, x)
    leaves = js.tree.tree_leaves(got)
    return [relative_error(value64(g), w) for g, w in zip(leaves, jax.tree.leaves(want))]


def check_residual_stack(route: str, weight_std: float, scale: float, activation) -> None:
    """The stream at ``scale``, three blocks of 128x128 weights of ``weight_std`` at scale 1:
    the loss and every gradient finite and within one float16 rounding per operation on the
    longest path (8 per block: mean, centring, variance, rsqrt, product, matmul, gelu, sum)."""
    keys = jax.random.split(jax.random.key(2), 4)
    weights = [jax.random.normal(k, (128, 128)) * weight_std for k in keys[1:]]
    x = jax.random.normal(keys[0], (256, 128))
    inputs = [build_float16(route, w, 1.0) for w in weights], build_float16(route, x, scale)
    errors = residual_errors(activation, *inputs)
    assert np.max(errors) <= 8 * len(weights) * FLOAT16_EPS, errors  # NaN fails too


GELUS = {"jax.nn.gelu": jax.nn.gelu, "js.nn.gelu": js.nn.gelu}


@pytest.mark.parametrize("gelu", sorted(GELUS))
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("route", ["quantize", "as_scaled_array", "scale_in_jit"])
def test_residual_stack_built_by_each_route_is_within_float16_rounding(route, scale, gelu):
    check_residual_stack(route, 1 / np.sqrt(128), scale, GELUS[gelu])


@pytest.mark.parametrize("gelu", sorted(GELUS))
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("weight_std", [2.0**-6, 2.0**-4, 2.0**-2])
def test_residual_stack_of_explicitly_scaled_weights_is_within_float16_rounding(
    weight_std, scale, gelu
):
    """``scaled_array(w, 1.0)`` keeps the initialiser's standard deviation in the data, so the
    stack's data lands anywhere in the guard band. With standard deviation 2^-4 the variance's
    data sat at its bottom and ``rsqrt(v) / v`` (the layer norm's gradient) at 2^15: the
    product after it overflowed into NaN, until quotients were range-guarded."""
    check_residual_stack("scaled_array", weight_std, scale, GELUS[gelu])


# --- clips and bounds far from the data: library code as published ---------------------

CLIPS = {
    "jnp.clip": lambda x: jnp.clip(x, -1.0, 1.0),
    "jnp.clip, int bounds": lambda x: jnp.clip(x, -5, 5),  # were traced scalars: scale 4
    "jnp.minimum": lambda x: jnp.minimum(x, 1.0),
    "jax.nn.relu6": jax.nn.relu6,
    "jax.nn.hard_tanh": jax.nn.hard_tanh,
    "optax.clip": lambda x: optax.clip(1.0).update(x, optax.EmptyState())[0],
    "where with an int fill": lambda x: jnp.where(x < -1, -1, x),  # the int cast in a jit
}


def _float16(how: str, values: jax.Array, scale: float) -> js.ScaledArray:
    """:func:`built`, but ``as_scaled_array`` of the float32 values then cast to float16 (the
    README's way): float16 values of 2^20 would be infinite before they have a scale."""
    if how == "as_scaled_array":
        return js.tree.astype(js.as_scaled_array(values * scale), jnp.float16)
    return built(how, values, jnp.float16, scale)


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("how", HOW)
def test_a_clip_keeps_the_values_it_does_not_clip_exactly(clip, scale, how):
    """At 2^-20 no element reaches the bound of 1, and the bound's scale (2^-7 for float16
    data) took every element's low bits, and flushed the smallest ones; at 2^20 every
    element is beyond it. Either way the output is one operand's values, exactly."""
    x = _float16(how, jax.random.normal(jax.random.key(4), (64, 512)), scale)
    got = js.scalify(CLIPS[clip])(x)
    np.testing.assert_array_equal(value64(got), reference64(CLIPS[clip], x))


@pytest.mark.parametrize("how", HOW)
def test_a_hand_written_clipping_factor_keeps_its_value(how):
    """``min(1, c / norm)`` for a norm of 2^28: the factor 2^-28 was aligned to the scale of
    the constant 1 (2^-7), a float16 subnormal with 3 of its 11 bits, and the clipped
    tensor was 13% off."""
    x = _float16(how, jax.random.normal(jax.random.key(5), (50_000,)), 2.0**20)

    def clipped(x):
        return x * jnp.minimum(1.0, 1.0 / jnp.linalg.norm(x))

    got, want = value64(js.scalify(clipped)(x)), reference64(clipped, x)
    # three float16 roundings: the norm, its reciprocal, the product
    assert relative_error(got, want) <= 3 * FLOAT16_EPS


BOUNDED = {
    "lax.clamp": lambda x: jax.lax.clamp(jnp.asarray(1e-3, x.dtype), x, jnp.asarray(2e-3, x.dtype)),
    "jnp.clip": lambda x: jnp.clip(x, 1e-3, 2e-3),
}


@pytest.mark.parametrize("bound", sorted(BOUNDED))
@pytest.mark.parametrize("how", HOW)
def test_a_bound_far_below_the_data_that_is_picked_everywhere_keeps_its_value(bound, how):
    """Positive data at 2^20 clipped to [1e-3, 2e-3] is 2e-3 everywhere: at the data's scale
    that bound is 2^-29 of float16 data, zero, and lax.clamp returned zeros."""
    values = jnp.abs(jax.random.normal(jax.random.key(6), (64, 512))) + 0.5
    x = _float16(how, values, 2.0**20)
    got, want = value64(js.scalify(BOUNDED[bound])(x)), reference64(BOUNDED[bound], x)
    assert relative_error(got, want) <= FLOAT16_EPS  # the bound's own float16 rounding


# --- a division differentiated: the denominator's gradient is a negative power ---------------


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("how", HOW)
def test_the_gradient_of_a_division_by_a_spread_denominator_is_finite(scale, how):
    """``jax.grad`` of ``x / y`` with respect to ``y`` is ``-x * y**-2``, an ``integer_pow``
    of exponent -2. Of a denominator whose float16 data spans 2^-10 to 2^2, that power's data
    reached 2^20 and overflowed, unguarded: the gradient held infinities at every scale."""
    keys = jax.random.split(jax.random.key(7))
    y = _float16(how, jnp.exp2(jax.random.uniform(keys[0], (64, 512), minval=-10, maxval=2)), scale)
    x = _float16(how, jax.random.normal(keys[1], (64, 512)), 1.0)
    grad = jax.grad(lambda y, x: jnp.sum(x / y))
    got, want = value64(js.scalify(grad)(y, x)), reference64(grad, y, x)
    assert relative_error(got, want) <= 2 * FLOAT16_EPS  # the power's rounding, the product's


@pytest.mark.parametrize("how", HOW)
def test_the_gradient_of_soft_sign_is_finite(how):
    """``jax.nn.soft_sign`` is ``x / (|x| + 1)``: at 2^10 the denominator's data spans 2^-10
    to 2^2, and its gradient held infinities (see above). Within two float16 roundings of
    the float64 gradient on the same values."""
    x = _float16(how, jax.random.normal(jax.random.key(8), (64, 512)), 2.0**10)
    grad = jax.grad(lambda x: jnp.sum(jax.nn.soft_sign(x)))
    got, want = value64(js.scalify(grad)(x)), reference64(grad, x)
    assert relative_error(got, want) <= 2 * FLOAT16_EPS


# --- a transcendental of an elementwise expression: its value, not its float16 data ----------

EXPRESSIONS = {
    "jax.nn.gelu": jax.nn.gelu,  # tanh(c * (x + 0.044715 * x**3))
    "jax.nn.gelu, exact": functools.partial(jax.nn.gelu, approximate=False),
    "a Gaussian kernel": lambda x: jnp.exp(-x * x),
}


def _assert_large_elements_within(got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    """Relative ``tolerance`` on the elements within 2^-10 of the largest magnitude (float16
    holds them to full precision at the output's scale, whatever that is); an all-zero
    ``want`` (a Gaussian of inputs around 2^20) must come out all zero."""
    if not np.any(want):
        np.testing.assert_array_equal(got, 0)
        return
    large = np.abs(want) >= np.max(np.abs(want)) * 2.0**-10
    assert np.max(np.abs(got - want)[large] / np.abs(want)[large]) <= tolerance


@pytest.mark.parametrize("expression", sorted(EXPRESSIONS))
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**10, 2.0**20])
@pytest.mark.parametrize("how", HOW)
def test_a_transcendental_of_an_expression_reads_its_value(expression, scale, how):
    """At 2^10 gelu's ``x + 0.044715 * x**3`` spans more binades than one float16 scale holds,
    so its moderate elements were zero, and tanh of them 0 where it is 1: gelu of 7.64 was
    3.82, and exp(-x * x) of 2.33 was 0.0067 where it is 0.0043. Each element within one
    float16 rounding of its float64 value."""
    fn = EXPRESSIONS[expression]
    x = _float16(how, jax.random.normal(jax.random.key(9), (64, 512)), scale)
    got, want = value64(js.scalify(fn)(x)), reference64(fn, x)
    _assert_large_elements_within(got, want, FLOAT16_EPS)


@pytest.mark.parametrize("expression", sorted(EXPRESSIONS))
@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
@pytest.mark.parametrize("how", HOW)
def test_the_gradient_of_a_transcendental_of_an_expression_is_right(expression, scale, how):
    """gelu's gradient at 2^20 was 10^9 times too large (its tanh was 0 where it is 1, and
    ``1 - tanh**2`` was 1 where it is 0). Within four float16 roundings (normwise, as the
    coverage suites); a zero gradient (the Gaussian's at 2^20) exactly."""
    fn = EXPRESSIONS[expression]
    x = _float16(how, jax.random.normal(jax.random.key(9), (64, 512)), scale)
    grad = jax.grad(lambda x: jnp.sum(fn(x)))
    got, want = value64(js.scalify(grad)(x)), reference64(grad, x)
    if not np.any(want):
        np.testing.assert_array_equal(got, 0)
    else:
        assert relative_error(got, want) <= 4 * FLOAT16_EPS
