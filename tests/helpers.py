"""Shared test tooling: hypothesis strategies for scaled inputs and float64 reference checks.

A rule test draws ScaledArray inputs (random data in a dtype, random power-of-two scale in
[2^-40, 2^40]), runs ``jit(scalify(fn))`` on them, runs ``fn`` on the represented values in
float64 (``jax.enable_x64``), and checks the result is within the data format's rounding of the
reference and that every output scale is an exact power of two.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js
from jax_scaled import _jax_internals
from jax_scaled.pow2.static import is_pow2

FLOAT_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
MIN_EXP, MAX_EXP = -40, 40


def eps(dtype) -> float:
    """Machine epsilon (spacing at 1) of a float dtype."""
    return float(ml_dtypes.finfo(jnp.dtype(dtype)).eps)


def value64(x: Any) -> np.ndarray:
    """The represented value of an array or ScaledArray, in float64 numpy (no overflow)."""
    if isinstance(x, js.ScaledArray):
        scale = np.asarray(x.scale, np.float64)
        for axis, block in enumerate(x.block_shape if scale.ndim else ()):
            scale = np.repeat(scale, block, axis)  # block scales onto the data grid
        return np.asarray(x.data, np.float64) * scale
    x = np.asarray(x)
    if x.dtype.kind == "V" or jnp.issubdtype(x.dtype, jnp.floating):
        return np.asarray(x, np.float64)
    return x


@st.composite
def scales(draw, min_exp: int = MIN_EXP, max_exp: int = MAX_EXP) -> float:
    """A random power of two 2^e, e in [min_exp, max_exp]."""
    return 2.0 ** draw(st.integers(min_exp, max_exp))


@st.composite
def shapes(draw, min_dims: int = 1, max_dims: int = 3, max_side: int = 5) -> tuple[int, ...]:
    """A small random shape."""
    ndim = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.integers(1, max_side)) for _ in range(ndim))


def random_data(seed: int, shape, dtype, *, low: float | None = None, high: float | None = None):
    """Standard-normal data (or uniform in [low, high]) in ``dtype``, as a numpy array."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return np.asarray(values, np.float32).astype(jnp.dtype(dtype))


def heavy_tailed(seed: int, shape=(128, 512)) -> np.ndarray:
    """Float32 Gaussian data with 16 outliers up to 2^12 times larger and 64 zeros: once its
    RMS is at 1, its largest datum lands far outside float16's guard band."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    x.flat[rng.integers(0, x.size, 16)] *= 2.0 ** rng.integers(1, 13, 16)
    x.flat[rng.integers(0, x.size, 64)] = 0.0
    return x.astype(np.float32)


def all_eqns(jaxpr) -> Any:
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _jax_internals.eqn_subjaxprs(eqn):
            yield from all_eqns(sub)


@st.composite
def scaled_arrays(
    draw,
    shape,
    dtype,
    *,
    min_exp: int = MIN_EXP,
    max_exp: int = MAX_EXP,
    low: float | None = None,
    high: float | None = None,
) -> js.ScaledArray:
    """A ScaledArray of ``shape`` and ``dtype`` with random data and a random pow2 scale.

    ``low``/``high`` draw uniform data instead of normal (for restricted domains: the
    represented value is ``data * scale``, so pass ``min_exp=max_exp=0`` to control it).
    """
    seed = draw(st.integers(0, 2**31 - 1))
    data = random_data(seed, shape, dtype, low=low, high=high)
    scale = np.float32(draw(scales(min_exp, max_exp)))
    # device_put, not jnp.asarray: the latter compiles a copy for every new shape
    return js.ScaledArray(jax.device_put(data), jax.device_put(scale))


def reference64(fn: Callable, *inputs: Any) -> Any:
    """``fn`` evaluated in float64 on the represented values of ``inputs``."""
    with jax.enable_x64(True):
        args = [_to64(x) for x in inputs]
        out = jax.jit(fn)(*args)
        return jax.tree.map(np.asarray, out)


def _to64(tree: Any) -> Any:
    def convert(x):
        if _is_key(x):
            return x
        value = np.asarray(value64(x))
        if value.dtype == np.float64:
            return jnp.asarray(value, jnp.float64)
        return jnp.asarray(x)

    return js.tree.tree_map(convert, tree)


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.prng_key)


def float32_values(tree: Any) -> Any:
    """The represented values of ``tree``'s floating leaves as float32 arrays (others as is)."""

    def convert(x):
        if _is_key(x):
            return x
        value = value64(x)
        return jnp.asarray(value, jnp.float32) if value.dtype == np.float64 else x

    return js.tree.tree_map(convert, tree)


def reference32(fn: Callable, *inputs: Any) -> Any:
    """``fn`` evaluated (jitted) in float32 on the represented values of ``inputs``: the
    program a user would compare a float16 scalified one with. Unlike :func:`reference64`,
    random draws and float32 intermediates are those of the float32 program."""
    return jax.jit(fn)(*float32_values(inputs))


def expected_scale(x: js.ScaledArray, scale: float) -> float:
    """``scale``, or the smallest scale ``2^-126`` when ``x`` is one element that is zero at
    run time (scalify gives such a scalar the smallest scale: it carries no magnitude)."""
    if x.size == 1 and float(np.asarray(x.data, np.float64).reshape(())) == 0.0:
        return 2.0**-126
    return float(scale)


def assert_pow2_scales(tree: Any) -> None:
    """Every ScaledArray in ``tree`` has an exact power-of-two (or zero) scale."""
    for leaf in js.tree.tree_leaves(tree):
        if isinstance(leaf, js.ScaledArray):
            scale = np.asarray(leaf.scale, np.float64)
            assert np.all(is_pow2(scale) | (scale == 0)), f"scale {scale} not a power of 2"


def assert_close(
    actual: Any,
    expected: Any,
    dtype,
    *,
    ulps: float = 4.0,
    normwise: bool = False,
    atol: float = 0.0,
) -> None:
    """``actual`` within ``ulps`` roundings of ``dtype`` of the float64 ``expected``.

    Elementwise relative error by default; ``normwise`` compares against the largest
    reference magnitude instead (for sums and contractions, where cancellation makes
    elementwise relative error meaningless). Non-finite values must match exactly.
    """
    got, want = value64(actual), np.asarray(expected)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    want = want.astype(np.float64)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite, err_msg="non-finite pattern differs")
    np.testing.assert_array_equal(got[~finite], want[~finite])
    tol = ulps * eps(dtype)
    scale = np.max(np.abs(want[finite]), initial=0.0) if normwise else np.abs(want[finite])
    error = np.abs(got[finite] - want[finite])
    bound = tol * scale + atol
    worst = np.max(error - bound, initial=-1.0)
    assert worst <= 0, (
        f"error above {ulps} ulps of {jnp.dtype(dtype).name}: max |err|={np.max(error):.3g}, "
        f"got={got[finite].ravel()[:6]}, want={want[finite].ravel()[:6]}"
    )


def check_scaled(
    fn: Callable,
    inputs: Sequence[Any],
    dtype,
    *,
    ulps: float = 4.0,
    normwise: bool = False,
    atol: float = 0.0,
    expect_scaled: bool = True,
) -> Any:
    """Run ``jit(scalify(fn))`` on ``inputs`` and compare with the float64 reference.

    Returns the scalified output. ``expect_scaled`` asserts that every floating output
    is a ScaledArray with data in the program's dtype and a power-of-two scale.
    """
    out = jax.jit(js.scalify(fn))(*inputs)
    expected = reference64(fn, *inputs)
    assert_pow2_scales(out)
    out_leaves = js.tree.tree_leaves(out)
    for got, want in zip(out_leaves, jax.tree.leaves(expected), strict=True):
        if expect_scaled and jnp.issubdtype(np.asarray(want).dtype, jnp.floating):
            assert isinstance(got, js.ScaledArray), f"expected a ScaledArray, got {type(got)}"
        assert_close(got, want, dtype, ulps=ulps, normwise=normwise, atol=atol)
    return out


def check_named(
    fn: Callable, inputs: Sequence[Any], dtype, tolerances: dict | None = None, **tolerance
) -> dict:
    """Like :func:`check_scaled` for a function returning a dict; names the failing key.

    ``tolerances`` maps each key to its own :func:`assert_close` tolerance; without it every
    key gets ``tolerance``. Every floating output must be a ScaledArray of ``dtype``.
    """
    out = jax.jit(js.scalify(fn))(*inputs)
    expected = reference64(fn, *inputs)
    assert_pow2_scales(out)
    for name, want in expected.items():
        name_tolerance = tolerance if tolerances is None else tolerances[name]
        got_leaves = js.tree.tree_leaves(out[name])
        for got, want_leaf in zip(got_leaves, jax.tree.leaves(want), strict=True):
            if jnp.issubdtype(np.asarray(want_leaf).dtype, jnp.floating):
                assert isinstance(got, js.ScaledArray) and got.dtype == dtype, (name, got)
            try:
                assert_close(got, want_leaf, dtype, **name_tolerance)
            except AssertionError as error:
                raise AssertionError(f"output {name!r}: {error}") from error
    return out


def with_e8m0_scales(tree: Any) -> Any:
    """The same scaled inputs with their scales stored as float8_e8m0fnu."""
    return js.as_scaled_array(tree, scale_dtype=jnp.float8_e8m0fnu)


def check_e8m0_matches(fn: Callable, inputs: Sequence[Any]) -> None:
    """``scalify(fn)`` with E8M0 scales gives bit-identical values to float32 scales."""
    out32 = jax.jit(js.scalify(fn))(*inputs)
    with js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu):
        out8 = jax.jit(js.scalify(fn))(*with_e8m0_scales(list(inputs)))
    for a, b in zip(js.tree.tree_leaves(out32), js.tree.tree_leaves(out8), strict=True):
        if isinstance(b, js.ScaledArray):
            assert b.scale.dtype == jnp.float8_e8m0fnu, b.scale.dtype
        np.testing.assert_array_equal(value64(a), value64(b))


# --- whole-function checks: model invariance and low-precision fidelity ----------------------


def relative_error(actual: Any, expected: Any) -> float:
    """``max|actual - expected| / max|expected|`` in float64 (normwise), over finite entries.

    Returns ``inf`` when the two differ in where they are non-finite (or in those values).
    """
    got, want = value64(actual).astype(np.float64), np.asarray(expected, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(
        got[~finite], want[~finite]
    ):
        return float("inf")
    error = np.max(np.abs(got[finite] - want[finite]), initial=0.0)
    return float(error / max(np.max(np.abs(want[finite]), initial=0.0), 1e-300))


def weighted_sum_grad(fn: Callable, inputs: Sequence[Any], seed: int = 1234) -> Callable:
    """The gradient, w.r.t. every input, of ``sum(fn(*inputs) * w)`` for a fixed random ``w``.

    The same function object is returned for the same ``fn``, input shapes and dtypes, so
    that jit caches are shared between calls (e.g. the same test at two scales).
    """
    return _weighted_sum_grad(fn, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in inputs), seed)


@functools.cache
def _weighted_sum_grad(fn: Callable, avals: tuple, seed: int) -> Callable:
    out = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals])
    weights = jnp.asarray(random_data(seed, out.shape, out.dtype))
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) * weights), argnums=tuple(range(len(avals))))


@functools.cache
def scalified_jit(fn: Callable, config: js.ScalifyConfig | None = None) -> Callable:
    """``jax.jit(js.scalify(fn, config=config))``, one per ``fn`` and ``config`` (compiled
    once per input signature: a ``with ScalifyConfig(...)`` block around a later call would
    not change it, so pass the config here)."""
    return jax.jit(js.scalify(fn, config=config))


def check_model_invariance(fn: Callable, inputs: Sequence[Any], *, rtol: float = 1e-5) -> None:
    """float32: ``asarray(scalify(f)(as_scaled_array(x)))`` matches ``f(x)`` for ``fn`` and for
    the gradient of a weighted sum of its output (see :func:`weighted_sum_grad`)."""
    for f in (fn, weighted_sum_grad(fn, inputs)):
        expected = jax.jit(f)(*inputs)
        actual = js.asarray(scalified_jit(f)(*js.as_scaled_array(list(inputs))))
        for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            error = relative_error(got, want)
            assert error <= rtol, f"{'value' if f is fn else 'gradient'} error {error:.3g}"


def check_fidelity(
    fn: Callable,
    inputs: Sequence[js.ScaledArray],
    *,
    tol: float,
    config: js.ScalifyConfig | None = None,
) -> None:
    """``jit(scalify(fn))`` on scaled (narrow) inputs is within ``tol`` (normwise) of ``fn`` in
    float64 on the represented values, and its outputs keep the inputs' data dtype."""
    out = scalified_jit(fn, config)(*inputs)
    expected = reference64(fn, *inputs)
    assert_pow2_scales(out)
    for got, want in zip(js.tree.tree_leaves(out), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(np.asarray(want).dtype, jnp.floating):
            assert got.dtype == inputs[0].dtype, (got.dtype, inputs[0].dtype)
        error = relative_error(got, want)
        assert error <= tol, f"error {error:.3g} above {tol:.3g}"


def assert_static_or_guarded_scale(out: js.ScaledArray, static_scale: float) -> None:
    """``out`` has the rule's static ``static_scale``, unless its data at that scale lies
    outside the range guard's band (:class:`jax_scaled.ScalifyConfig`), in which case the
    guard must have brought it into the band."""
    from jax_scaled.scales.guard import guard_band

    if float(out.scale) == static_scale:
        return
    band = guard_band(out.dtype)
    assert band is not None, (float(out.scale), static_scale)
    low, high, _ = band
    unguarded = float(np.max(np.abs(value64(out)))) / static_scale
    assert not 2.0**low <= unguarded < 2.0**high, (unguarded, band)
    largest = float(np.max(np.abs(np.asarray(out.data, np.float64))))
    assert 2.0**low <= largest <= 2.0**high, (largest, band)


def compiled_computations(fn: Callable, *args: Any) -> dict[str, list[str]]:
    """The instruction lines of each computation of ``jit(fn)(*args)``'s optimised HLO, keyed
    by name (the entry computation as ``"ENTRY"``), stripped, ``ROOT`` markers removed."""
    computations, current = {}, None
    for line in jax.jit(fn).lower(*args).compile().as_text().splitlines():
        if line.endswith("{") and " = " not in line.split("{")[0]:
            current = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
            computations[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            computations[current].append(line.strip().removeprefix("ROOT "))
    return computations


def load_benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package); it is
    registered in ``sys.modules`` first, where its dataclasses look their module up."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def residual_loss(weights: Sequence[Any], x: Any, activation: Callable = jax.nn.gelu) -> Any:
    """A residual stack as transformers write it, ``h + activation(layer_norm(h) @ w)`` per
    block, then a loss."""
    h = x
    for w in weights:
        normed = (h - jnp.mean(h, -1, keepdims=True)) * lax.rsqrt(jnp.var(h, -1, keepdims=True))
        h = h + activation(normed @ w)
    return jnp.mean(h**2)


HOW = ("as_scaled_array", "scaled_array", "quantize", "in_jit")  # the ways of :func:`built`


def covering(primary: Sequence[Any], secondary: Sequence[Any]) -> list[tuple]:
    """Test cases pairing every ``primary`` case with the ``secondary`` cases in turn, so
    that each of both appears at least once, not their product (each a tuple or one value).
    For same-bits checks of an optimization, where each way of building an input needs to
    meet the optimized path, not every case of it.

    Example:
        >>> covering(["a", "b", "c"], [(1, "x"), (2, "y")])
        [('a', 1, 'x'), ('b', 2, 'y'), ('c', 1, 'x')]
    """

    def as_tuple(case: Any) -> tuple:
        return case if isinstance(case, tuple) else (case,)

    count = max(len(primary), len(secondary))
    return [
        as_tuple(primary[i % len(primary)]) + as_tuple(secondary[i % len(secondary)])
        for i in range(count)
    ]


def built(how: str, values: jax.Array, dtype, scale: float):
    """``values * scale`` as a ScaledArray of ``dtype`` data, built the way ``how`` names."""
    if how == "as_scaled_array":
        return js.as_scaled_array((values * scale).astype(dtype))
    if how == "scaled_array":
        return js.scaled_array(values.astype(dtype), np.float32(scale))
    if how == "quantize":
        return js.quantize(values * scale, dtype)

    return _built_in_jit(values, dtype, np.float32(scale))


@functools.partial(jax.jit, static_argnums=1)
def _built_in_jit(values: jax.Array, dtype, scale: jax.Array) -> js.ScaledArray:
    """A power-of-two scale computed inside jit, the data divided by it (compiled once per
    shape and dtype, however many scales a test draws)."""
    power = jnp.exp2(jnp.floor(jnp.log2(jnp.max(jnp.abs(values)))))
    return js.scaled_array((values / power).astype(dtype), power * scale)
