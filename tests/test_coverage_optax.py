"""Every optax optimizer under scalify, as published: float32 invariance, float16 fidelity.

The optimizers are enumerated from ``dir(optax)`` and ``dir(optax.contrib)`` (every function
taking a ``learning_rate`` and returning a GradientTransformation), so a new optax optimizer
is tested, or must be excluded here with a reason. Each is built with its **default
hyperparameters** (optax's ``eps=1e-8`` included: float16 rounds it to 0 when JAX traces the
program, and scalify recovers it, see :mod:`jax_scaled.engine.constants`). Each case runs two
update steps from ``init`` in one ``jax.jit(js.scalify(...))`` with params, grads and
optimizer state as ScaledArrays:

* float32 data, grads at scales 1, 2^-20 and 2^+20: the new params, updates and state match
  the plain float32 program on the same values (relative error <= 1e-5);
* float16 data (params, grads and state), grads of magnitude 2^-20 and 2^+20 (raw float16
  flushes or overflows them): everything is finite and within a few float16 roundings of the
  float32 program on the true values;
* the same through :mod:`jax_scaled.optim` (float16 master weights and scaled state).
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
import optax.contrib
import pytest
from helpers import float32_values, reference64, relative_error, value64

import jax_scaled as js
from jax_scaled import optim

LR = 1e-2
INVARIANCE_TOL = 1e-5
FIDELITY_TOL = 4 * float(ml_dtypes.finfo(np.float16).eps)  # measured worst case: 1.5e-3
TINY, HUGE = 2.0**-20, 2.0**20

# Optimizers that take more than a learning rate: the required arguments, as their docs
# suggest. lbfgs's default zoom linesearch needs ``value``, ``grad`` and ``value_fn`` at every
# update: here without linesearch, in test_value_based_* with it.
REQUIRED_ARGS: dict[str, Callable[[], dict]] = {
    "noisy_sgd": lambda: {"key": jax.random.key(0)},
    "lbfgs": lambda: {"linesearch": None},
    "contrib.schedule_free": lambda: {"base_optimizer": optax.sgd(LR)},
}

# Optimizers tested elsewhere in this file, and why.
EXCLUDED = {
    "contrib.dpsgd": "takes per-example gradients: test_dpsgd_*",
    "contrib.momo": "needs the loss value: test_value_based_*",
    "contrib.momo_adam": "needs the loss value: test_value_based_*",
    "contrib.sophia": "needs the objective: test_value_based_*",
}

# Cases whose float16 error exceeds FIDELITY_TOL for a reason of their own, and the bound the
# issue sets for them (2e-2 of the float32 program).
LOOSER_FLOAT16_TOLERANCE = {
    # Five Newton-Schulz iterations of a quintic polynomial on the float16 update amplify
    # its rounding (measured 5.2e-3).
    "contrib.muon": 2e-2,
    # Its slow momentum (b3=0.9999) and fast one are float16 state; the second moment takes
    # the (1 - b2) = 0.001 share of g^2 in float16 (measured 6.4e-3).
    "contrib.simplified_ademamix": 2e-2,
}

# Cases whose state cannot be cast to float16 by hand: plain JAX already fails to trace them
# (MultiSteps' cond joins a float32 accumulator with the float16 one). They run through
# js.optim.scaled_state, which computes in float32 and stores in float16.
FLOAT16_STATE_NOT_CASTABLE = {"multi_steps_adam"}

# (case, grad scale) pairs left out of the float16 comparison, and why.
NOT_FLOAT16_COMPARABLE = {
    # The noise is drawn in the grads' dtype: float32 draws differ from float16 ones.
    "noisy_sgd": "random noise differs between dtypes",
    # Its memory holds differences of consecutive params (lr-sized, ~1e-9 at 2^-20): below the
    # resolution of float16 params. See test_lbfgs_float16_grads_with_float32_params.
    "lbfgs": "param differences below float16 params' resolution",
}

# Leaves computed from differences of parameter-sized values: rounded to float16 parameters'
# resolution (2^-11 of their magnitude) whatever the scaling, as the float32 program's are to
# float32's. Their error is measured against the parameters' magnitude; the leaves marked
# None depend on such differences nonlinearly (a product or a maximum with them) and are
# only checked to be finite.
PARAM_DIFFERENCE_LEAVES: dict[str, dict[str, str | None]] = {
    "contrib.cocob": {"updates": "params", "reward": None},
    "contrib.madgrad": {"updates": "params"},
    "contrib.scale_by_madgrad": {"updates": "params"},
    "contrib.schedule_free": {"updates": "params"},
    "contrib.schedule_free_adamw": {"updates": "params"},
    "contrib.schedule_free_sgd": {"updates": "params"},
    "contrib.prodigy": {"numerator_weighted": None},
}


def _takes_learning_rate(fn: Any) -> bool:
    if inspect.isclass(fn) or not callable(fn):
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


def _enumerate() -> dict[str, Callable]:
    found = {}
    for prefix, module in (("", optax), ("contrib.", optax.contrib)):
        for name in dir(module):
            fn = getattr(module, name)
            if not name.startswith("_") and _takes_learning_rate(fn):
                found[prefix + name] = fn
    return found


ENUMERATED = _enumerate()


def _optimizer(name: str) -> optax.GradientTransformation:
    """``<name>(LR)`` with default hyperparameters (and the arguments it requires)."""
    extra = REQUIRED_ARGS.get(name, dict)()
    return ENUMERATED[name](learning_rate=LR, **extra)


CASES: dict[str, Callable[[], optax.GradientTransformation]] = {
    **{name: functools.partial(_optimizer, name) for name in ENUMERATED if name not in EXCLUDED},
    "sgd_momentum": lambda: optax.sgd(LR, momentum=0.9),
    "sgd_nesterov": lambda: optax.sgd(LR, momentum=0.9, nesterov=True),
    "adafactor_factored": lambda: optax.adafactor(LR, min_dim_size_to_factor=4),
    "clip_adam_warmup_cosine": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adam(optax.warmup_cosine_decay_schedule(0.0, LR, warmup_steps=1, decay_steps=10)),
    ),
    "multi_steps_adam": lambda: optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
    "inject_hyperparams_adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=LR),
    "masked_decay_adam": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(1e-4), {"w": True}), optax.adam(LR)
    ),
}


def _params() -> dict[str, jax.Array]:
    """One (8, 4) matrix: small programs compile fast; global norms and factored second
    moments (adafactor) see a real tree leaf."""
    return {"w": jax.random.normal(jax.random.key(0), (8, 4))}


def _grads(seed: int) -> dict[str, jax.Array]:
    return {"w": jax.random.normal(jax.random.key(seed), (8, 4))}


def _scaled_grads(seed: int, scale: float, dtype) -> dict[str, js.ScaledArray]:
    """Standard-normal grads in ``dtype`` data, representing values of magnitude ``scale``."""
    return {k: js.ScaledArray(g.astype(dtype), jnp.float32(scale)) for k, g in _grads(seed).items()}


def _two_steps(opt: optax.GradientTransformation, apply_updates: Callable = optax.apply_updates):
    """Two updates: returns (new params, second updates, new state)."""

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return apply_updates(params, updates), updates, state

    def two_steps(params, state, grads1, grads2):
        params, _, state = step(params, state, grads1)
        return step(params, state, grads2)

    return two_steps


def _named_float_leaves(tree: Any) -> list[tuple[str, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=js.is_scaled_leaf)
    return [
        (jax.tree_util.keystr(path), x)
        for path, x in leaves
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]


def assert_outputs_close(name: str, actual: Any, expected: Any, tol: float) -> float:
    """Per-leaf normwise relative errors of (params, updates, state) <= ``tol``, every leaf
    finite; parameter-difference leaves (:data:`PARAM_DIFFERENCE_LEAVES`) measured against
    the parameters' magnitude, or only checked to be finite. Returns the worst error."""
    special = PARAM_DIFFERENCE_LEAVES.get(name, {})
    params_magnitude = max(np.max(np.abs(value64(p))) for _, p in _named_float_leaves(actual[0]))
    errors = {}
    for part, got_tree, want_tree in zip(("params", "updates", "state"), actual, expected):
        got_leaves, want_leaves = _named_float_leaves(got_tree), _named_float_leaves(want_tree)
        for (path, got), (_, want) in zip(got_leaves, want_leaves, strict=True):
            label = f"{part}{path}"
            assert np.all(np.isfinite(value64(got))), f"{label} is not finite"
            rule = next((r for key, r in special.items() if key in label), "own")
            if rule is None:
                continue
            error = relative_error(got, want)
            if rule == "params":
                error *= np.max(np.abs(np.asarray(want, np.float64))) / params_magnitude
            errors[label] = error
    worst = max(errors.values())
    assert worst <= tol, f"relative errors {errors} above {tol:.3g}"
    return worst


# --- float32: invariance, at unit and extreme grad scales ---------------------------------------


@functools.cache
def _scalified(name: str) -> tuple[Callable, Callable]:
    """(two_steps, its jit(scalify)), built once per case: every dtype and grad scale of a
    case shares it (one compilation per dtype; scales are data)."""
    two_steps = _two_steps(CASES[name]())
    return two_steps, jax.jit(js.scalify(two_steps))


@pytest.mark.parametrize("scale", [1.0, TINY, HUGE], ids=["2^0", "2^-20", "2^20"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_invariance(name, scale):
    two_steps, scalified = _scalified(name)
    params = js.as_scaled_array(_params())
    state = js.as_scaled_array(CASES[name]().init(_params()))
    grads = [_scaled_grads(seed, scale, jnp.float32) for seed in (1, 2)]
    out = scalified(params, state, *grads)
    assert all(isinstance(p, js.ScaledArray) for p in js.tree.tree_leaves(out[0]))
    expected = jax.jit(two_steps)(*float32_values((params, state, *grads)))
    assert_outputs_close(name, out, expected, INVARIANCE_TOL)


# --- float16: fidelity at extreme grad scales -------------------------------------------------


def _fidelity_params(skip: set = frozenset()) -> list:
    return [
        pytest.param(name, scale, id=f"{name}-2^{int(np.log2(scale))}")
        for name in sorted(CASES)
        if name not in NOT_FLOAT16_COMPARABLE and name not in skip
        for scale in (TINY, HUGE)
    ]


@pytest.mark.parametrize("name, scale", _fidelity_params(FLOAT16_STATE_NOT_CASTABLE))
def test_float16_fidelity_at_extreme_grad_scales(name, scale):
    two_steps, scalified = _scalified(name)
    params16 = js.tree.astype(js.as_scaled_array(_params()), jnp.float16)
    state16 = js.tree.astype(js.as_scaled_array(CASES[name]().init(_params())), jnp.float16)
    grads = [_scaled_grads(seed, scale, jnp.float16) for seed in (1, 2)]
    out = scalified(params16, state16, *grads)
    assert all(x.dtype == jnp.float16 for _, x in _named_float_leaves(out[:2]))
    expected = jax.jit(two_steps)(*float32_values((params16, state16, *grads)))
    assert_outputs_close(name, out, expected, LOOSER_FLOAT16_TOLERANCE.get(name, FIDELITY_TOL))


@pytest.mark.parametrize("name", sorted(NOT_FLOAT16_COMPARABLE))
def test_float16_not_comparable_cases_stay_finite(name):
    _, scalified = _scalified(name)
    params16 = js.tree.astype(js.as_scaled_array(_params()), jnp.float16)
    state16 = js.tree.astype(js.as_scaled_array(CASES[name]().init(_params())), jnp.float16)
    for scale in (TINY, HUGE):
        out = scalified(params16, state16, *[_scaled_grads(s, scale, jnp.float16) for s in (1, 2)])
        assert all(np.all(np.isfinite(value64(x))) for _, x in _named_float_leaves(out))


# --- float16 through js.optim: scaled state and master weights --------------------------------


@functools.cache
def _optim_scalified(name: str) -> Callable:
    opt = optim.scaled_state(CASES[name](), jnp.float16)
    return jax.jit(js.scalify(_two_steps(opt, optim.apply_updates))), opt


@pytest.mark.parametrize("name, scale", _fidelity_params())
def test_js_optim_float16_fidelity_at_extreme_grad_scales(name, scale):
    scalified, opt = _optim_scalified(name)
    params16 = optim.as_master(_params(), jnp.float16)
    grads = [_scaled_grads(seed, scale, jnp.float16) for seed in (1, 2)]
    out = scalified(params16, opt.init(_params()), *grads)
    assert all(x.dtype == jnp.float16 for _, x in _named_float_leaves(out[0]))
    plain_two_steps, _ = _scalified(name)  # plain optax, compiled once for every test
    params32 = float32_values(params16)
    init = CASES[name]().init(params32)
    expected = jax.jit(plain_two_steps)(params32, init, *float32_values(grads))
    assert_outputs_close(name, out, expected, LOOSER_FLOAT16_TOLERANCE.get(name, FIDELITY_TOL))


# --- the setting is not trivial, and lbfgs with float32 params --------------------------------


def test_raw_float16_adam_fails_at_extreme_grad_scales():
    """Raw float16 loses adam's updates at both scales (and its eps is 0 there)."""
    opt = optax.adam(LR)
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), _params())
    state16 = js.tree.astype(opt.init(params16), jnp.float16)
    raw_step = jax.jit(_two_steps(opt))
    for scale in (TINY, HUGE):
        grads = [_scaled_grads(seed, scale, jnp.float16) for seed in (1, 2)]
        _, updates, _ = raw_step(params16, state16, *js.asarray(grads))
        expected = reference64(_two_steps(opt), params16, state16, *grads)[1]
        errors = jax.tree.leaves(jax.tree.map(relative_error, updates, expected))
        assert min(errors) > 0.1, errors


def test_lbfgs_float16_grads_with_float32_params():
    """float32 params (resolving lbfgs's param differences), float16 grads and state.

    lbfgs's preconditioning scan multiplies its carry by the all-zero (unused) memory
    entries; a zero factor gives its product the smallest scale, so the scale does not grow
    ~2^7 per iteration to float32 overflow, as it did when zeros took scale 1."""
    two_steps, scalified = _scalified("lbfgs")
    state16 = js.tree.astype(js.as_scaled_array(CASES["lbfgs"]().init(_params())), jnp.float16)
    params = js.as_scaled_array(_params())
    for scale in (TINY, HUGE):
        grads = [_scaled_grads(s, scale, jnp.float16) for s in (1, 2)]
        out = scalified(params, state16, *grads)
        expected = jax.jit(two_steps)(*float32_values((params, state16, *grads)))
        assert_outputs_close("lbfgs", out, expected, FIDELITY_TOL)


# --- dpsgd: per-example gradients --------------------------------------------------------------


def test_dpsgd_float32_invariance_and_float16_fidelity():
    """Per-example grads of shape (batch, 4); noise_multiplier 0 (the noise is drawn in the
    grads' dtype, so float16 and float32 draws would differ)."""
    opt = optax.contrib.dpsgd(LR, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
    params = {"w": jax.random.normal(jax.random.key(0), (4,))}
    two_steps = _two_steps(opt)
    scalified = jax.jit(js.scalify(two_steps))
    for dtype, scales, tol in ((jnp.float32, (1.0, TINY, HUGE), INVARIANCE_TOL),
                               (jnp.float16, (TINY, HUGE), FIDELITY_TOL)):  # fmt: skip
        for scale in scales:
            inputs = js.tree.astype(js.as_scaled_array((params, opt.init(params))), dtype)
            grads = [_scaled_grads(seed, scale, dtype) for seed in (1, 2)]
            out = scalified(*inputs, *grads)
            expected = jax.jit(two_steps)(*float32_values((*inputs, *grads)))
            assert_outputs_close("contrib.dpsgd", out, expected, tol)


# --- optimizers that need the loss: polyak_sgd, momo, sophia, lbfgs with its linesearch -------


def _loss(params: dict[str, jax.Array]) -> jax.Array:
    """A smooth convex loss with uneven curvature: two steps do not reach its minimum (where
    the values and grads compared would be rounding noise)."""
    curvature = jnp.linspace(0.5, 4.0, 32).reshape(8, 4).astype(params["w"].dtype)
    w = params["w"]
    return jnp.sum(curvature * jnp.square(w - 0.5)) + 0.1 * jnp.sum(w**4)


# name: (optimizer, the extra arguments its update takes)
VALUE_BASED = {
    "polyak_sgd": (lambda: optax.polyak_sgd(max_learning_rate=LR), ("value",)),
    "lbfgs_zoom_linesearch": (lambda: optax.lbfgs(), ("value", "grad", "value_fn")),
    "contrib.momo": (lambda: optax.contrib.momo(LR), ("value",)),
    "contrib.momo_adam": (lambda: optax.contrib.momo_adam(LR), ("value",)),
    "contrib.sophia": (lambda: optax.contrib.sophia(LR), ("obj_fn",)),
}


def _value_based_steps(name: str) -> tuple[optax.GradientTransformation, Callable]:
    make, extra_names = VALUE_BASED[name]
    opt = make()

    def two_steps(params, state):
        for _ in range(2):
            value, grads = jax.value_and_grad(_loss)(params)
            extras = dict(value=value, grad=grads, value_fn=_loss, obj_fn=_loss)
            extra = {k: extras[k] for k in extra_names}
            updates, state = optax.with_extra_args_support(opt).update(
                grads, state, params, **extra
            )
            params = optax.apply_updates(params, updates)
        return params, state

    return opt, two_steps


@pytest.mark.parametrize("name", sorted(VALUE_BASED))
def test_value_based_optimizers_float32_invariance(name):
    opt, two_steps = _value_based_steps(name)
    params = _params()
    expected = jax.jit(two_steps)(params, opt.init(params))
    scaled = jax.jit(js.scalify(two_steps))(*js.as_scaled_array((params, opt.init(params))))
    got, want = _named_float_leaves(js.asarray(scaled)), _named_float_leaves(expected)
    for (path, g), (_, w) in zip(got, want, strict=True):
        assert relative_error(g, w) <= INVARIANCE_TOL, path
