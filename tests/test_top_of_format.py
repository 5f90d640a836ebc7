"""Pointwise rules on data at the top of its format, as js.quantize makes it (the OCP MX rule:
a block's largest value maps near the format's largest).

Every rule is compared with a float64 reference on the same (quantized) values, within the
format's rounding at a scale that puts each block's largest result at most a few binades
below the top of the format, and must not produce a NaN or an infinity the float32 program
does not have (E4M3 has no infinity: an overflowing cast is NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_pow2_scales, reference64, value64
from hypothesis import assume, given
from hypothesis import strategies as st

import jax_scaled as js
from jax_scaled.scales.guard import centre_exponent

SHAPE = (64, 512)
# name: (quantize's format argument, extra quantize keyword arguments)
FORMATS = {
    "e4m3": (jnp.float8_e4m3fn, {}),
    "e5m2": (jnp.float8_e5m2, {}),
    "mx_e4m3": (js.formats.MXFP8_E4M3, {"axis": -1}),
    "mx_e5m2": (js.formats.MXFP8_E5M2, {"axis": -1}),
    "mx_e2m3": (js.formats.MXFP6_E2M3, {"axis": -1}),
    "e4m3_rows": (jnp.float8_e4m3fn, {"block_shape": (1, -1)}),
    "f16": (jnp.float16, {}),
    "f16_blocks": (jnp.float16, {"block_shape": (1, 32)}),
}
# Binades below the top of the format where a rule may put a block's largest result: the
# range guard's target is 2 to 3 binades below the top of 8-bit formats.
HEADROOM = 4


def _ops(c: float) -> dict[str, tuple[Callable, bool]]:
    """name: (function of (t, u), additive); ``c`` a constant of the data's magnitude."""
    return {
        "t+t": (lambda t, u: t + t, True),
        "t+u": (lambda t, u: t + u, True),
        "t-u": (lambda t, u: t - u, True),
        "t+c": (lambda t, u: t + c, True),
        "t*3": (lambda t, u: t * 3.0, False),
        "t*0.7": (lambda t, u: t * 0.7, False),
        "t*u": (lambda t, u: t * u, False),
        "t/u": (lambda t, u: t / u, False),
        "t/0.3": (lambda t, u: t / 0.3, False),
        "-t": (lambda t, u: -t, False),
        "max(t,u)": (lambda t, u: jnp.maximum(t, u), True),
        "min(t,c)": (lambda t, u: jnp.minimum(t, c), True),
        "clip": (lambda t, u: jnp.clip(t, -c, c), True),
        "lax.clamp": (lambda t, u: jax.lax.clamp(jnp.asarray(-c, t.dtype), t, u), True),
        "where": (lambda t, u: jnp.where(t > 0, t, 2.5 * t), True),
        "where0": (lambda t, u: jnp.where(t > u, t, 0.0), True),
        "relu": (lambda t, u: jax.nn.relu(t), True),
        "square": (lambda t, u: jnp.square(t), False),
        "t**3": (lambda t, u: t**3, False),
        "t*t*t": (lambda t, u: t * t * t, False),
    }


OPS = list(_ops(1.0))


def _quantize(x: np.ndarray, name: str) -> js.ScaledArray:
    fmt, kwargs = FORMATS[name]
    return js.quantize(jnp.asarray(x), fmt, **kwargs)


def _inputs(seed: int, exponent: int, heavy: bool) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian ``t`` (heavy-tailed: times a lognormal) and ``u`` away from zero, at 2^exponent."""
    rng = np.random.default_rng(seed)
    t = rng.standard_normal(SHAPE)
    if heavy:
        t *= np.exp(2.0 * rng.standard_normal(SHAPE))
    g = rng.standard_normal(SHAPE)
    u = np.sign(g) * (0.25 + np.abs(g))
    return (t * 2.0**exponent).astype(np.float32), (u * 2.0**exponent).astype(np.float32)


def _blocks(q: js.ScaledArray) -> tuple[int, ...]:
    return q.block_shape if np.ndim(q.scale) else q.shape


def _block_max(values: np.ndarray, blocks: tuple[int, ...]) -> np.ndarray:
    """The largest finite magnitude of every block, repeated onto the elements."""
    grid = [n // b for n, b in zip(values.shape, blocks, strict=True)]
    tiled = np.where(np.isfinite(values), np.abs(values), 0.0).reshape(
        grid[0], blocks[0], grid[1], blocks[1]
    )
    largest = tiled.max(axis=(1, 3), keepdims=True)
    return np.broadcast_to(largest, tiled.shape).reshape(values.shape)


def _top(name: str) -> float:
    """Where quantize puts a block's largest value: the top of 8-bit and narrower formats,
    the range guard's centre (2^3 for float16) of wider ones, which keep headroom."""
    fmt, _ = FORMATS[name]
    element = fmt.element_dtype if isinstance(fmt, js.formats.BlockFormat) else fmt
    if ml_dtypes.finfo(element).bits <= 8:
        return float(ml_dtypes.finfo(element).max)
    return 2.0 ** (centre_exponent(element) + 1)


def _assert_within_rounding(got, want, magnitude, dtype, top, blocks) -> None:
    """|got - want| within one rounding of ``dtype`` plus its smallest subnormal at a scale
    putting each block's largest ``magnitude`` :data:`HEADROOM` binades below ``top``."""
    info = ml_dtypes.finfo(dtype)
    scale = _block_max(magnitude, blocks) / top * 2.0**HEADROOM
    bound = float(info.eps) * np.abs(want) + float(info.smallest_subnormal) * scale
    finite = np.isfinite(want)
    excess = np.abs(got - want) - bound
    worst = np.unravel_index(np.argmax(np.where(finite, excess, -np.inf)), got.shape)
    assert not np.any(excess[finite] > 0), (
        f"{np.sum(excess[finite] > 0)} values beyond {dtype.name}'s rounding; worst at "
        f"{worst}: got {got[worst]:.6g}, want {want[worst]:.6g}, bound {bound[worst]:.3g}"
    )


def check_top_of_format(name: str, op: str, seed: int, exponent: int, heavy: bool) -> None:
    t, u = _inputs(seed, exponent, heavy)
    fn, additive = _ops(0.5 * 2.0**exponent)[op]
    qt, qu = _quantize(t, name), _quantize(u, name)
    out = jax.jit(js.scalify(fn))(qt, qu)
    assert isinstance(out, js.ScaledArray) and out.dtype == qt.dtype
    assert_pow2_scales(out)
    got = value64(out)
    want = np.asarray(reference64(fn, qt, qu), np.float64)
    plain = np.asarray(jax.jit(fn)(*(jnp.asarray(value64(q), jnp.float32) for q in (qt, qu))))
    nonfinite = ~np.isfinite(got) & np.isfinite(plain)
    assert not nonfinite.any(), f"{nonfinite.mean():.2%} NaN/inf the float32 program has not"
    magnitude = np.abs(want)
    if additive:  # a sum's scale is its operands'
        magnitude = np.maximum(magnitude, np.maximum(np.abs(value64(qt)), np.abs(value64(qu))))
    _assert_within_rounding(got, want, magnitude, jnp.dtype(qt.dtype), _top(name), _blocks(qt))
    if op == "relu":  # relu never needs a new scale: exact, each block's scale kept
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(
            np.asarray(out.scale, np.float32), np.asarray(qt.scale, np.float32)
        )


@pytest.mark.parametrize("name", list(FORMATS))
@given(
    op=st.sampled_from(OPS),
    seed=st.integers(0, 2**16),
    exponent=st.integers(-20, 20),
    heavy=st.booleans(),
)
def test_pointwise_rules_at_the_top_of_the_format(name, op, seed, exponent, heavy):
    # Not yet: a full-size fill meeting 16-bit blocks takes their largest scale (the check
    # that it holds only zeros would cost per-tensor float16 programs a reduction).
    assume(not (name == "f16_blocks" and op == "where0"))
    check_top_of_format(name, op, seed, exponent, heavy)


@pytest.mark.parametrize("op", ["t+t", "t*u", "relu", "where0"])
@pytest.mark.parametrize("name", ["mx_e4m3", "e4m3", "mx_e5m2"])
def test_heavy_tailed_small_values(name, op):
    """Blocks whose scales lie many binades apart (the reported relu: one block's scale
    raised to the largest, its subnormals rounded)."""
    check_top_of_format(name, op, seed=3, exponent=-20, heavy=True)


def test_reported_example_has_no_nan():
    x = jax.random.normal(jax.random.key(0), (64, 128))
    for q in [js.quantize(x, js.formats.MXFP8_E4M3, axis=-1), js.quantize(x, jnp.float8_e4m3fn)]:
        for f in [lambda t: t + t, lambda t: t * 3.0, jax.nn.relu]:
            out = js.asarray(jax.jit(js.scalify(f))(q), jnp.float32)
            assert not jnp.isnan(out).any()


def test_float16_quantize_keeps_headroom():
    """float16 blocks map their largest value to [8, 16): sums and products stay finite."""
    q = js.quantize(jnp.array([[3.0, -1.0e4, 0.5, 1.0e-3]]), jnp.float16)
    assert 8.0 <= float(jnp.max(jnp.abs(q.data.astype(jnp.float32)))) < 16.0
    assert float(q.scale) == 2.0**13 / 8.0
