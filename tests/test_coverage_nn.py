"""jax.nn under scalify: float32 model invariance and float16 fidelity at scales 2^±20.

Invariance: values and gradients (of a weighted sum of the output) of the scalified function
on ``as_scaled_array`` inputs match the plain float32 function to 1e-5. Fidelity: float16
data at scale 2^-20 or 2^20 (where raw float16 underflows or overflows) gives results within a
few float16 roundings of float64 on the same represented values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_fidelity, check_model_invariance, random_data, weighted_sum_grad

import jax_scaled as js

SCALES = [2.0**-20, 2.0**20]
F16_TOL = 4e-3  # four float16 epsilons (normwise)
ATTENTION_SHAPE = (1, 4, 2, 8)  # batch, time, heads, head dim
MASK = jnp.asarray(np.random.default_rng(7).random((1, 2, 4, 4)) > 0.4).at[..., 0].set(True)


def one_hot_mix(x):
    """one_hot of scaled-derived indices, multiplied back into scaled values."""
    picked = jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=x.dtype) * x
    indices = jnp.round(x[:, 0]).astype(jnp.int32) + 3
    rounded = jax.nn.one_hot(indices, x.shape[-1], dtype=x.dtype)
    return picked + rounded


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "celu": jax.nn.celu,
    "leaky_relu": jax.nn.leaky_relu,
    "mish": jax.nn.mish,
    "glu": jax.nn.glu,
    "log_sigmoid": jax.nn.log_sigmoid,
    "softmax": jax.nn.softmax,
    "softmax_axis0": lambda x: jax.nn.softmax(x, axis=0),
    "log_softmax": jax.nn.log_softmax,
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1),
    "logsumexp_all": jax.nn.logsumexp,
    "standardize": jax.nn.standardize,
    "one_hot": one_hot_mix,
}

ATTENTION = {
    "plain": lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
    "causal": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    "mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=MASK),
}


def activation_input(dtype=jnp.float32):
    return jnp.asarray(random_data(0, (4, 8), dtype))


def attention_inputs(dtype=jnp.float32):
    return [jnp.asarray(random_data(seed, ATTENTION_SHAPE, dtype)) for seed in (1, 2, 3)]


def scaled(inputs, scale):
    return [js.scaled_array(x, scale) for x in inputs]


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_invariance(name):
    check_model_invariance(ACTIVATIONS[name], [activation_input()])


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_float16_fidelity(name, scale):
    x = scaled([activation_input(jnp.float16)], scale)
    check_fidelity(ACTIVATIONS[name], x, tol=F16_TOL)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_gradient_float16_fidelity(name, scale):
    """At |x| ~ 2^20 the ``x * f'(x)`` terms of silu, mish, gelu (tanh) and glu are exactly
    zero, at the input's scale; the range guard on gradient accumulation (``add_any``) and
    joins (``concatenate``) keeps the O(1) terms they are added to from underflowing."""
    x = scaled([activation_input(jnp.float16)], scale)
    check_fidelity(weighted_sum_grad(ACTIVATIONS[name], x), x, tol=F16_TOL)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_gradient_float16_fidelity_with_guarded_sums(name, scale):
    """``ScalifyConfig(guard_sums=True)`` also guards ``add`` and ``sub``: every gradient
    still passes."""
    x = scaled([activation_input(jnp.float16)], scale)
    config = js.ScalifyConfig(guard_sums=True)
    check_fidelity(weighted_sum_grad(ACTIVATIONS[name], x), x, tol=F16_TOL, config=config)


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_invariance(name):
    check_model_invariance(ATTENTION[name], attention_inputs())


@pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="XLA:CPU has no float16 x float16 -> float32 dot_general (plain JAX fails too)",
)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_float16_fidelity(name, scale):
    check_fidelity(ATTENTION[name], scaled(attention_inputs(jnp.float16), scale), tol=F16_TOL)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_attention_bfloat16_fidelity(name, scale):
    """bfloat16 runs on every backend; at 2^±20 it checks the rules, not the format's range."""
    inputs = scaled(attention_inputs(jnp.bfloat16), scale)
    check_fidelity(ATTENTION[name], inputs, tol=4 * 2.0**-8)
