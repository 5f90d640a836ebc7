"""Every optax optimizer under scalify: float32 model invariance and float16 fidelity.

The optimizers are enumerated from ``dir(optax)`` (every function taking a ``learning_rate``
and returning a GradientTransformation), so a new optax optimizer is tested, or must be
excluded here with a reason. Each case runs two update steps in one ``jax.jit(js.scalify(...))``
with params, grads and optimizer state as ScaledArrays:

* float32: the new params and state match the plain step (relative error <= 1e-5);
* float16 data (params, grads and state), grads of magnitude 2^-20 and 2^+20 (raw float16
  flushes or overflows them): the updates, new params and state are within a few float16
  roundings of a float64 reference.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import reference64, relative_error

import jax_scaled as js

LR = 1e-2
FIDELITY_TOL = 4 * float(ml_dtypes.finfo(np.float16).eps)  # measured worst case: 1.6e-3
TINY, HUGE = 2.0**-20, 2.0**20

# Optimizers of dir(optax) that cannot run with only (grads, state, params) as inputs.
EXCLUDED = {
    # Its default zoom linesearch needs ``value``, ``grad`` and ``value_fn`` at every update:
    # run below as "lbfgs" without linesearch, and in test_value_based_optimizers with it.
    "lbfgs": "needs value_fn",
}

# Hyperparameters that float16 cannot hold (eps=1e-8 rounds to 0): a float16 program traced
# with them computes another function than its float64 reference, whatever the scaling. The
# fidelity test sets them to exact float16 values (2^-24 is float16's smallest subnormal).
FLOAT16_EXACT_HYPERPARAMETERS = {
    "eps": 2.0**-24,
    "eps_root": 0.0,
    "min_norm": 2.0**-20,
    "min_step_size": 2.0**-20,
}


def _takes_learning_rate(name: str) -> bool:
    fn = getattr(optax, name)
    if name.startswith("_") or inspect.isclass(fn) or not callable(fn):
        return False
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # typing aliases exported by optax
        return False
    returns = signature.return_annotation
    is_transformation = inspect.isclass(returns) and issubclass(
        returns, optax.GradientTransformation
    )
    return "learning_rate" in signature.parameters and is_transformation


ENUMERATED = sorted(name for name in dir(optax) if _takes_learning_rate(name))


def _optimizer(name: str, **overrides: Any) -> optax.GradientTransformation:
    """``optax.<name>(LR)``, with those ``overrides`` its signature accepts."""
    fn = getattr(optax, name)
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in overrides.items() if k in accepted}
    if name == "noisy_sgd":
        kwargs["key"] = jax.random.key(0)
    if name == "lbfgs":
        kwargs["linesearch"] = None
    return fn(LR, **kwargs)


def _clipped_adam_with_schedule(**overrides: Any) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, warmup_steps=1, decay_steps=10)
    adam = optax.adam(schedule, eps=overrides.get("eps", 1e-8))
    return optax.chain(optax.clip_by_global_norm(1.0), adam)


def _sm3_with_eps(**overrides: Any) -> optax.GradientTransformation:
    """optax.sm3 spelled out, to reach scale_by_sm3's eps (1e-8, not exposed by optax.sm3)."""
    eps = overrides.get("eps", 1e-8)
    return optax.chain(optax.scale_by_sm3(b1=0.9, eps=eps), optax.scale_by_learning_rate(LR))


CASES: dict[str, Callable[..., optax.GradientTransformation]] = {
    **{name: functools.partial(_optimizer, name) for name in ENUMERATED if name not in EXCLUDED},
    "lbfgs": functools.partial(_optimizer, "lbfgs"),
    "sgd_momentum": lambda **_: optax.sgd(LR, momentum=0.9),
    "sgd_nesterov": lambda **_: optax.sgd(LR, momentum=0.9, nesterov=True),
    "adafactor_factored": lambda **_: optax.adafactor(LR, min_dim_size_to_factor=4),
    "clip_adam_warmup_cosine": _clipped_adam_with_schedule,
    "sm3_eps": _sm3_with_eps,
}

# (case, grad scale) pairs left out of the float16 fidelity test, and why.
NOT_FLOAT16_COMPARABLE = {
    # The noise is drawn in the grads' dtype: float64 draws differ from float16 ones.
    ("noisy_sgd", TINY): "random noise differs between dtypes",
    ("noisy_sgd", HUGE): "random noise differs between dtypes",
    # Its internal eps (1e-8) is 0 in float16 (see FLOAT16_EXACT_HYPERPARAMETERS); "sm3_eps"
    # is the same chain with an exact eps.
    ("sm3", TINY): "internal eps below float16 range",
    # Its memory holds differences of consecutive params (lr-sized, ~1e-9 at 2^-20): below the
    # resolution of float16 params (10-20% error at any grad scale; a float64 reference keeps
    # them). See test_lbfgs_float16_grads_with_float32_params.
    ("lbfgs", TINY): "param differences below float16 params' resolution",
    ("lbfgs", HUGE): "param differences below float16 params' resolution",
}


def _params() -> dict[str, jax.Array]:
    """One (8, 4) matrix: small programs compile fast; global norms and factored second
    moments (adafactor) see a real tree leaf."""
    return {"w": jax.random.normal(jax.random.key(0), (8, 4))}


def _grads(seed: int) -> dict[str, jax.Array]:
    return {"w": jax.random.normal(jax.random.key(seed), (8, 4))}


def _two_steps(opt: optax.GradientTransformation) -> Callable:
    """Two updates: returns (new params, second updates, new state)."""

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), updates, state

    def two_steps(params, state, grads1, grads2):
        params, _, state = step(params, state, grads1)
        return step(params, state, grads2)

    return two_steps


def _float_leaves(tree: Any) -> list:
    return [x for x in js.tree.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def _assert_close_leaves(actual: Any, expected: Any, tol: float) -> float:
    """Per-leaf normwise relative error of the floating leaves, all <= tol; returns the worst."""
    errors = [
        relative_error(got, want)
        for got, want in zip(_float_leaves(actual), _float_leaves(expected), strict=True)
    ]
    assert max(errors) <= tol, f"relative errors {np.round(errors, 8)} above {tol:.3g}"
    return max(errors)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_invariance(name):
    opt = CASES[name]()
    params = _params()
    inputs = (params, opt.init(params), _grads(1), _grads(2))
    expected = jax.jit(_two_steps(opt))(*inputs)
    scaled = jax.jit(js.scalify(_two_steps(opt)))(*js.as_scaled_array(inputs))
    assert all(isinstance(p, js.ScaledArray) for p in js.tree.tree_leaves(scaled[0]))
    new_params, _, state = js.asarray(scaled)
    _assert_close_leaves((new_params, state), (expected[0], expected[2]), 1e-5)


@functools.cache
def _float16_case(name: str) -> tuple[Callable, Callable, tuple]:
    """(two_steps, its jit(scalify), float16 scaled params and state): built once per case,
    so that both grad scales share one compilation (scales are data)."""
    opt = CASES[name](**FLOAT16_EXACT_HYPERPARAMETERS)
    params = _params()
    params16 = js.tree.astype(js.as_scaled_array(params), jnp.float16)
    state16 = js.tree.astype(js.as_scaled_array(opt.init(params)), jnp.float16)
    two_steps = _two_steps(opt)
    return two_steps, jax.jit(js.scalify(two_steps)), (params16, state16)


def _float16_grads(seed: int, scale: float) -> dict[str, js.ScaledArray]:
    """Standard-normal grads in float16 data, representing values of magnitude ``scale``."""
    return {
        k: js.ScaledArray(g.astype(jnp.float16), jnp.float32(scale))
        for k, g in _grads(seed).items()
    }


def _fidelity_params() -> list:
    params = []
    for name in sorted(CASES):
        for scale in (TINY, HUGE):
            if (name, scale) in NOT_FLOAT16_COMPARABLE:
                continue
            params.append(pytest.param(name, scale, id=f"{name}-2^{int(np.log2(scale))}"))
    return params


@pytest.mark.parametrize("name, scale", _fidelity_params())
def test_float16_fidelity_at_extreme_grad_scales(name, scale):
    two_steps, scalified, (params16, state16) = _float16_case(name)
    inputs = (params16, state16, _float16_grads(1, scale), _float16_grads(2, scale))
    out = scalified(*inputs)
    assert all(x.dtype == jnp.float16 for x in _float_leaves(out[:2]))
    _assert_close_leaves(out, reference64(two_steps, *inputs), FIDELITY_TOL)


def test_lbfgs_float16_grads_with_float32_params():
    """float32 params (resolving lbfgs's param differences), float16 grads and state.

    lbfgs's preconditioning scan multiplies its carry by the all-zero (unused) memory
    entries; a zero factor now gives its product the smallest scale, so the scale no longer
    grows ~2^7 per iteration to float32 overflow, as it did when zeros took scale 1."""
    two_steps, _, _ = _float16_case("lbfgs")
    state16 = js.tree.astype(js.as_scaled_array(CASES["lbfgs"]().init(_params())), jnp.float16)
    inputs = (js.as_scaled_array(_params()), state16, *[_float16_grads(s, HUGE) for s in (1, 2)])
    out = jax.jit(js.scalify(two_steps))(*inputs)
    _assert_close_leaves(out, reference64(two_steps, *inputs), FIDELITY_TOL)


def test_raw_float16_adam_fails_at_extreme_grad_scales():
    """The setting above is not trivial: raw float16 loses adam's updates at both scales."""
    opt = optax.adam(LR, eps=2.0**-24)
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), _params())
    state16 = js.tree.astype(opt.init(params16), jnp.float16)
    raw_step = jax.jit(_two_steps(opt))
    for scale in (TINY, HUGE):
        grads = [_float16_grads(seed, scale) for seed in (1, 2)]
        _, updates, _ = raw_step(params16, state16, *js.asarray(grads))
        expected = reference64(_two_steps(opt), params16, state16, *grads)[1]
        errors = jax.tree.leaves(jax.tree.map(relative_error, updates, expected))
        assert min(errors) > 0.1, errors


# --- optimizers that need the loss: polyak_sgd (value) and lbfgs with its linesearch ---------


def _loss(params: dict[str, jax.Array]) -> jax.Array:
    """A smooth convex loss with uneven curvature: two steps do not reach its minimum (where
    the values and grads compared would be rounding noise)."""
    curvature = jnp.linspace(0.5, 4.0, 32).reshape(8, 4)
    w = params["w"]
    return jnp.sum(curvature * jnp.square(w - 0.5)) + 0.1 * jnp.sum(w**4)


VALUE_BASED = {
    "polyak_sgd": lambda: optax.polyak_sgd(max_learning_rate=LR),
    "lbfgs_zoom_linesearch": lambda: optax.lbfgs(),
}


@pytest.mark.parametrize("name", sorted(VALUE_BASED))
def test_value_based_optimizers_float32_invariance(name):
    opt = VALUE_BASED[name]()

    def two_steps(params, state):
        for _ in range(2):
            value, grads = jax.value_and_grad(_loss)(params)
            extra = dict(value=value, grad=grads, value_fn=_loss)
            updates, state = optax.with_extra_args_support(opt).update(
                grads, state, params, **extra
            )
            params = optax.apply_updates(params, updates)
        return params, state

    params = _params()
    expected = jax.jit(two_steps)(params, opt.init(params))
    scaled = jax.jit(js.scalify(two_steps))(*js.as_scaled_array((params, opt.init(params))))
    _assert_close_leaves(js.asarray(scaled), expected, 1e-5)
