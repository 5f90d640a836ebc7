"""Optax with scaled low-precision optimizer state and scaled master weights.

Two independent pieces:

* :func:`scaled_state` wraps any optax ``GradientTransformation`` so that its state lives as
  ScaledArrays with float16 (or bfloat16, float8) data, re-centred on unit scale at every
  step: half the memory of a float32 state, without the underflow of a raw float16 one.
* :func:`as_master` and :func:`apply_updates` keep the parameters themselves as FP16 (or
  FP8) ScaledArrays between steps ("master weights"), the update being applied with scale
  propagation inside the scalified step.

A whole FP16 training step: parameters, gradients and Adam state all scaled float16.

Example:
    >>> import optax
    >>> from jax_scaled import optim
    >>> def loss_fn(params, x, y):
    ...     return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
    >>> opt = optim.scaled_state(optax.adam(0.1), jnp.float16)
    >>> @jax.jit
    ... @js.scalify
    ... def train_step(params, opt_state, x, y):
    ...     loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    ...     updates, opt_state = opt.update(grads, opt_state, params)
    ...     return optim.apply_updates(params, updates), opt_state, loss
    >>> x = jax.random.normal(jax.random.key(0), (32, 4))
    >>> y = x @ jnp.arange(1.0, 5.0)[:, None]
    >>> params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    >>> opt_state = opt.init(params)              # float32 params in, scaled float16 state out
    >>> params = optim.as_master(params, jnp.float16)   # FP16 master weights
    >>> for _ in range(100):
    ...     params, opt_state, loss = train_step(params, opt_state, x, y)
    >>> params["w"].dtype, opt_state[0].mu["w"].dtype, bool(js.asarray(loss) < 0.05)
    (dtype('float16'), dtype('float16'), True)

Plain optax also runs on a state cast once (``js.tree.astype(js.as_scaled_array(opt.init(
params)), jnp.float16)``, as in the README), but the state then only keeps the dtypes optax's
arithmetic gives it: with float32 gradients Adam's first moment comes back float32 after one
step, and nothing re-centres the data.
:func:`scaled_state` computes in float32 data, stores in ``dtype`` and rescales.
"""

from jax_scaled.optim.flat import FlatState
from jax_scaled.optim.master import apply_updates, as_master
from jax_scaled.optim.nonfinite import skip_nonfinite
from jax_scaled.optim.state import scaled_state, state_bytes

__all__ = [
    "FlatState",
    "apply_updates",
    "as_master",
    "scaled_state",
    "skip_nonfinite",
    "state_bytes",
]
