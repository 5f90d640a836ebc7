"""Flax layers under scalify: linen modules and nnx modules (through nnx.split / nnx.merge).

Each case is a function ``apply(params, x) -> (y, aux)``; the test runs its forward pass and
the gradient of a fixed random weighting of ``y`` (w.r.t. the params, and ``x`` when it is a
float) in one ``jax.jit(js.scalify(...))``, with params and input as ScaledArrays:

* float32: everything matches the plain function (relative error <= 1e-5);
* float16 data (Dense, Conv, LayerNorm), inputs of magnitude 2^-20 and 2^+20: within a few
  float16 roundings of a float64 reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import reference64, relative_error

import jax_scaled as js

RTOL = 1e-5
FIDELITY_TOL = 2 * float(ml_dtypes.finfo(np.float16).eps)  # measured worst case: 5.3e-4
Apply = Callable[[Any, jax.Array], tuple[jax.Array, Any]]


def _normal(seed: int, *shape: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _float_leaves(tree: Any) -> list:
    return [x for x in js.tree.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _assert_close_leaves(actual: Any, expected: Any, tol: float) -> None:
    """Per-leaf normwise relative errors <= ``tol``. A leaf whose reference is below 1e-3 of
    the largest leaf (a key-bias gradient of attention: zero up to rounding) is measured
    against the largest leaf instead of its own rounding noise."""
    pairs = list(zip(_float_leaves(actual), _float_leaves(expected), strict=True))
    magnitudes = [float(np.max(np.abs(np.asarray(want, np.float64)))) for _, want in pairs]
    largest = max(magnitudes)
    errors = [
        relative_error(got, want) * (m / largest if m < 1e-3 * largest else 1.0)
        for (got, want), m in zip(pairs, magnitudes, strict=True)
    ]
    assert errors and max(errors) <= tol, f"relative errors {np.round(errors, 8)} above {tol}"


def forward_and_grad(apply: Apply, params: Any, x: jax.Array) -> Callable:
    """``(params, x) -> (y, aux, grads)``: ``grads`` of ``sum(y * w)`` for a fixed random
    ``w``, w.r.t. ``params`` (and ``x`` when it is a float array)."""
    y_shape = jax.eval_shape(apply, params, x)[0].shape
    weights = np.random.default_rng(0).standard_normal(y_shape).astype(np.float16)  # exact
    argnums = (0, 1) if jnp.issubdtype(x.dtype, jnp.floating) else 0

    def weighted_sum(params, x):
        y, aux = apply(params, x)
        return jnp.sum(y * weights.astype(y.dtype)), (y, aux)

    def fn(params, x):
        grads, (y, aux) = jax.grad(weighted_sum, argnums, has_aux=True)(params, x)
        return y, aux, grads

    return fn


def check_invariance(apply: Apply, params: Any, x: jax.Array) -> None:
    """float32: forward and gradient under scalify equal the plain ones."""
    fn = forward_and_grad(apply, params, x)
    expected = jax.jit(fn)(params, x)
    scaled = jax.jit(js.scalify(fn))(*js.as_scaled_array((params, x)))
    assert all(isinstance(v, js.ScaledArray) for v in _float_leaves(scaled[0]))
    _assert_close_leaves(js.asarray(scaled), expected, RTOL)


# --- linen ------------------------------------------------------------------------------------


def _linen(module: nn.Module, x: jax.Array, **call_kwargs: Any) -> tuple[Apply, Any, jax.Array]:
    """A linen module as ``apply(variables, x) -> (y, None)``, with its initial variables."""
    variables = module.init(jax.random.key(1), x, **call_kwargs)

    def apply(variables, x):
        return module.apply(variables, x, **call_kwargs), None

    return apply, variables, x


def _linen_batch_norm_train() -> tuple[Apply, Any, jax.Array]:
    module = nn.BatchNorm(use_running_average=False, momentum=0.5)
    x = 3.0 + _normal(2, 6, 5)
    variables = module.init(jax.random.key(1), x)

    def apply(variables, x):
        y, updates = module.apply(variables, x, mutable=["batch_stats"])
        return y, updates["batch_stats"]

    return apply, variables, x


def _linen_batch_norm_eval() -> tuple[Apply, Any, jax.Array]:
    x = 3.0 + _normal(2, 6, 5)
    train = nn.BatchNorm(use_running_average=False, momentum=0.5)
    variables = train.init(jax.random.key(1), x)
    _, stats = train.apply(variables, x, mutable=["batch_stats"])
    variables = {**variables, **stats}  # running statistics away from their initial (0, 1)
    return _linen(nn.BatchNorm(use_running_average=True), x)[0], variables, x


def _linen_dropout() -> tuple[Apply, Any, jax.Array]:
    module = nn.Dropout(0.5, deterministic=False)

    def apply(variables, x):
        return module.apply(variables, x, rngs={"dropout": jax.random.key(5)}), None

    return apply, {}, _normal(0, 4, 8)


class _Block(nn.Module):
    """Dense + gelu, with the (carry, x) -> (carry, y) signature nn.scan expects."""

    @nn.compact
    def __call__(self, carry: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return nn.gelu(nn.Dense(carry.shape[-1])(carry)), None


class _ScannedStack(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        stack = nn.scan(
            _Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        return stack()(x, None)[0]


class _RematBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.remat(_Block)()(x, None)[0]


def _causal_attention_linen() -> tuple[Apply, Any, jax.Array]:
    x = _normal(3, 2, 5, 8)
    mask = nn.make_causal_mask(jnp.ones((2, 5)))
    module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)
    return _linen(module, x, mask=mask)


LINEN_CASES: dict[str, Callable[[], tuple[Apply, Any, jax.Array]]] = {
    "Dense": lambda: _linen(nn.Dense(16), _normal(0, 4, 8)),
    "DenseGeneral": lambda: _linen(nn.DenseGeneral((2, 3), axis=-1), _normal(0, 4, 8)),
    "Conv": lambda: _linen(nn.Conv(4, (3, 3)), _normal(0, 2, 6, 6, 3)),
    "ConvTranspose": lambda: _linen(nn.ConvTranspose(4, (3, 3)), _normal(0, 2, 5, 5, 3)),
    "Embed": lambda: _linen(nn.Embed(10, 8), jnp.array([0, 3, 9, 3])),
    "LayerNorm": lambda: _linen(nn.LayerNorm(), 1.0 + _normal(0, 4, 16)),
    "RMSNorm": lambda: _linen(nn.RMSNorm(), _normal(0, 4, 16)),
    "BatchNorm_train": _linen_batch_norm_train,
    "BatchNorm_eval": _linen_batch_norm_eval,
    "GroupNorm": lambda: _linen(nn.GroupNorm(num_groups=2), _normal(0, 2, 4, 4, 8)),
    "MultiHeadDotProductAttention_causal": _causal_attention_linen,
    "Dropout": _linen_dropout,
    "scan": lambda: _linen(_ScannedStack(), _normal(0, 4, 8)),
    "remat": lambda: _linen(_RematBlock(), _normal(0, 4, 8)),
}


@pytest.mark.parametrize("name", list(LINEN_CASES))
def test_linen_invariance(name):
    check_invariance(*LINEN_CASES[name]())


@functools.cache
def _float16_case(name: str) -> tuple[Callable, Callable, Any, jax.Array]:
    """(forward_and_grad, its jit(scalify), float16 params, float16 input data), built once
    per layer: both input scales share one compilation (scales are data)."""
    apply, params, x = LINEN_CASES[name]()
    fn = forward_and_grad(apply, params, x)
    params16 = js.tree.astype(js.as_scaled_array(params), jnp.float16)
    return fn, jax.jit(js.scalify(fn)), params16, x.astype(jnp.float16)


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20], ids=["2^-20", "2^20"])
@pytest.mark.parametrize("name", ["Dense", "Conv", "LayerNorm"])
def test_linen_float16_fidelity_at_extreme_input_scales(name, scale):
    fn, scalified, params16, data16 = _float16_case(name)
    x16 = js.ScaledArray(data16, jnp.float32(scale))
    out = scalified(params16, x16)
    assert all(v.dtype == jnp.float16 for v in _float_leaves(out))
    _assert_close_leaves(out, reference64(fn, params16, x16), FIDELITY_TOL)


# --- nnx: a function of the params state, the graph definition and other state closed over ---


def _nnx(module: nnx.Module, x: jax.Array, call: Callable | None = None):
    """An nnx module as ``apply(params, x) -> (y, new non-param state)`` via split/merge."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    call = call or (lambda model, x: model(x))

    def apply(params, x):
        model = nnx.merge(graphdef, params, jax.tree.map(jnp.asarray, rest))  # copies, here
        y = call(model, x)
        return y, nnx.split(model, nnx.Param, ...)[2]

    return apply, params, x


def _nnx_batch_norm(train: bool):
    x = 3.0 + _normal(2, 6, 5)
    model = nnx.BatchNorm(5, momentum=0.5, rngs=nnx.Rngs(0))
    model(x)  # running statistics away from their initial (0, 1)
    model.use_running_average = not train
    return _nnx(model, x)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.gelu(self.linear(x))


def _nnx_scanned_stack():
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key):
        return _NnxBlock(nnx.Rngs(key))

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(block, x):
        return block(x)

    return _nnx(create(jax.random.split(jax.random.key(0), 3)), _normal(0, 4, 8), forward)


def _nnx_remat():
    forward = nnx.remat(lambda model, x: model(x))
    return _nnx(_NnxBlock(nnx.Rngs(0)), _normal(0, 4, 8), forward)


def _nnx_causal_attention():
    x = _normal(3, 2, 5, 8)
    mask = nnx.make_causal_mask(jnp.ones((2, 5)))
    model = nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=nnx.Rngs(0))
    return _nnx(model, x, lambda model, x: model(x, mask=mask))


RNGS = nnx.Rngs(0)
NNX_CASES: dict[str, Callable[[], tuple[Apply, Any, jax.Array]]] = {
    "Linear": lambda: _nnx(nnx.Linear(8, 16, rngs=RNGS), _normal(0, 4, 8)),
    "LinearGeneral": lambda: _nnx(nnx.LinearGeneral(8, (2, 3), rngs=RNGS), _normal(0, 4, 8)),
    "Conv": lambda: _nnx(nnx.Conv(3, 4, (3, 3), rngs=RNGS), _normal(0, 2, 6, 6, 3)),
    "ConvTranspose": lambda: _nnx(
        nnx.ConvTranspose(3, 4, (3, 3), rngs=RNGS), _normal(0, 2, 5, 5, 3)
    ),
    "Embed": lambda: _nnx(nnx.Embed(10, 8, rngs=RNGS), jnp.array([0, 3, 9, 3])),
    "LayerNorm": lambda: _nnx(nnx.LayerNorm(16, rngs=RNGS), 1.0 + _normal(0, 4, 16)),
    "RMSNorm": lambda: _nnx(nnx.RMSNorm(16, rngs=RNGS), _normal(0, 4, 16)),
    "BatchNorm_train": lambda: _nnx_batch_norm(train=True),
    "BatchNorm_eval": lambda: _nnx_batch_norm(train=False),
    "GroupNorm": lambda: _nnx(nnx.GroupNorm(8, num_groups=2, rngs=RNGS), _normal(0, 2, 4, 4, 8)),
    "MultiHeadAttention_causal": _nnx_causal_attention,
    "Dropout": lambda: _nnx(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=5)), _normal(0, 4, 8)),
    "scan": _nnx_scanned_stack,
    "remat": _nnx_remat,
}


@pytest.mark.parametrize("name", list(NNX_CASES))
def test_nnx_invariance(name):
    check_invariance(*NNX_CASES[name]())
