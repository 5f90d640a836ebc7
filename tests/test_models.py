"""Model invariance (float32) and low-precision fidelity (float16) on real library code."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import reference64, value64

import jax_scaled as js

RTOL = 1e-5


def relative_error(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300)


def assert_tree_rel_close(actual, expected, rtol):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert relative_error(value64(a), e) <= rtol, (relative_error(value64(a), e), rtol)


def check_invariance(fn, *args):
    """asarray(jit(scalify(fn))(as_scaled_array(args))) == fn(args) in float32."""
    expected = jax.jit(fn)(*args)
    out = jax.jit(js.scalify(fn))(*js.as_scaled_array(args))
    assert_tree_rel_close(js.asarray(out), expected, RTOL)
    return out


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus,
    "tanh": jnp.tanh,
    "elu": jax.nn.elu,
    "leaky_relu": jax.nn.leaky_relu,
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "standardize": jax.nn.standardize,
}

NUMPY_FUNCTIONS = {
    "mean_var": lambda x: (jnp.mean(x, axis=-1), jnp.var(x, axis=0)),
    "matmul_einsum": lambda x: (x @ x.T, jnp.einsum("ij,kj->ik", x, x)),
    "where_clip": lambda x: (jnp.where(x > 0, x, 0.1 * x), jnp.clip(x, -0.5, 0.5)),
    "exp_log": lambda x: (jnp.exp(x), jnp.log(jnp.abs(x) + 1.0)),
    "max_sum": lambda x: (jnp.max(x, axis=1), jnp.sum(x**2)),
    "reshape_transpose_concat": lambda x: jnp.concatenate([x.reshape(-1), x.T.reshape(-1)]),
    "norm": lambda x: jnp.linalg.norm(x, axis=-1),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_invariance(name):
    x = jax.random.normal(jax.random.key(0), (4, 16), jnp.float32)
    check_invariance(ACTIVATIONS[name], x)


@pytest.mark.parametrize("name", sorted(NUMPY_FUNCTIONS))
def test_numpy_invariance(name):
    x = jax.random.normal(jax.random.key(1), (8, 6), jnp.float32)
    check_invariance(NUMPY_FUNCTIONS[name], x)


# -- a small MLP classifier ------------------------------------------------------------------


def init_mlp(key, sizes=(32, 64, 64, 10)):
    params = []
    for k, (n_in, n_out) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        w = jax.random.normal(k, (n_in, n_out), jnp.float32) / np.sqrt(n_in)
        params.append({"w": w, "b": jnp.zeros((n_out,), jnp.float32)})
    return params


def mlp_loss(params, x, labels):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, 10, dtype=log_probs.dtype) * log_probs, -1))


def sgd_step(params, x, labels):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, labels)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return params, loss


def mlp_batch(key, batch=16, features=32):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, features), jnp.float32)
    return x, jax.random.randint(ky, (batch,), 0, 10)


def test_mlp_sgd_step_invariance():
    params = init_mlp(jax.random.key(0))
    x, labels = mlp_batch(jax.random.key(1))
    new_params, loss = check_invariance(sgd_step, params, x, labels)
    assert all(isinstance(p, js.ScaledArray) for p in js.tree.tree_leaves(new_params))
    assert isinstance(loss, js.ScaledArray)


def test_optax_adam_step_invariance():
    opt = optax.adam(1e-2)
    params = init_mlp(jax.random.key(2))
    x, labels = mlp_batch(jax.random.key(3))

    def step(params, state, x, labels):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, labels)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    check_invariance(step, params, opt.init(params), x, labels)


def test_mlp_float16_fidelity_at_tiny_input_scale():
    """Inputs of magnitude 2^-20: raw float16 underflows, scalified float16 does not."""
    params = init_mlp(jax.random.key(4))
    x, labels = mlp_batch(jax.random.key(5))
    x_tiny = x * 2.0**-20
    grad_fn = jax.value_and_grad(mlp_loss)
    _, expected = reference64(grad_fn, params, x_tiny, labels)

    params16 = js.tree.astype(js.as_scaled_array(params), jnp.float16)
    x16 = js.as_scaled_array(x, scale=1.0).astype(jnp.float16)
    x16 = js.ScaledArray(x16.data, jnp.float32(2.0**-20))  # value x * 2^-20, data in float16
    _, scaled_grads = jax.jit(js.scalify(grad_fn))(params16, x16, labels)

    raw16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    _, raw_grads = jax.jit(grad_fn)(raw16, x_tiny.astype(jnp.float16), labels)

    want = expected[0]["w"]
    scaled_error = relative_error(value64(scaled_grads[0]["w"]), want)
    raw_error = relative_error(value64(raw_grads[0]["w"]), want)
    assert scaled_error < 2e-2, scaled_error  # a few float16 roundings through the MLP
    assert raw_error > 0.5, raw_error  # raw float16 gradients of the first layer are lost


def test_mlp_gradients_are_near_unit_scale():
    """Static estimates keep gradient data near 1 (the property that makes float16 work)."""
    params = init_mlp(jax.random.key(6))
    x, labels = mlp_batch(jax.random.key(7), batch=64)
    _, grads = jax.jit(js.scalify(jax.value_and_grad(mlp_loss)))(
        js.as_scaled_array(params), js.as_scaled_array(x), labels
    )
    for grad in js.tree.tree_leaves(grads):
        rms = float(jnp.sqrt(jnp.mean(jnp.square(grad.data))))
        assert 2.0**-4 <= rms <= 2.0**4, (rms, float(grad.scale))


def test_as_scaled_array_puts_data_near_unit_scale():
    w = jax.random.normal(jax.random.key(8), (256, 64)) * 0.01
    scaled_w = js.as_scaled_array(w)
    assert float(scaled_w.scale) == 2.0**-7
    np.testing.assert_array_equal(js.asarray(scaled_w), w)


def _nn_mlp_loss(params, x, labels):
    """An MLP built from js.nn (custom scale rules) and jax.nn (automatic propagation)."""
    h = x
    for i, layer in enumerate(params[:-1]):
        h = js.nn.layer_norm(h @ layer["w"] + layer["b"])
        h = js.nn.gelu(h) if i % 2 == 0 else jax.nn.silu(h)
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(js.nn.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)))


@pytest.mark.parametrize("loss_fn", [mlp_loss, _nn_mlp_loss], ids=["jax_nn", "js_nn"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_e8m0_scales_give_bit_identical_mlp_gradients(loss_fn, dtype):
    """E8M0 scales end to end: every scale stays E8M0 and the values match float32 scales."""
    params = init_mlp(jax.random.key(9))
    x, labels = mlp_batch(jax.random.key(10))
    grad_fn = jax.jit(js.scalify(jax.value_and_grad(loss_fn)))

    def scaled(tree, scale_dtype):
        return js.tree.astype(js.as_scaled_array(tree, scale_dtype=scale_dtype), dtype)

    loss32, grads32 = grad_fn(scaled(params, jnp.float32), scaled(x, jnp.float32), labels)
    with js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu):
        e8m0 = jnp.float8_e8m0fnu
        loss8, grads8 = grad_fn(scaled(params, e8m0), scaled(x, e8m0), labels)
    for a, b in zip(js.tree.tree_leaves((loss32, grads32)), js.tree.tree_leaves((loss8, grads8))):
        assert isinstance(b, js.ScaledArray) and b.scale.dtype == e8m0, b
        np.testing.assert_array_equal(value64(a), value64(b))
