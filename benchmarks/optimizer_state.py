"""Optimizer state representations: how far float16 Adam state drifts from float32.

    python benchmarks/optimizer_state.py                     # (512, 64) weight, 10 updates
    python benchmarks/optimizer_state.py --shape 4096,16 --steps 50 --optimizer adafactor

On one weight, ``--steps`` updates of an optax optimizer (default hyperparameters but the
learning rate) with float16 gradients of two kinds, Gaussian (std ``1e-2``) and heavy-tailed
(Student-t with 1.5 degrees of freedom, times ``1e-4``), in three representations of the
state:

* **raw**: optax on the state cast once to float16 (``js.tree.astype(js.as_scaled_array(
  state), jnp.float16)``), one scale per tensor;
* **tensor**: ``js.optim.scaled_state(opt, block_size=None)``, one scale per tensor,
  re-centred at every step, float32 compute;
* **block32**: ``js.optim.scaled_state(opt)``, one scale per 32 elements.

Reported against float32 optax on the same (float16-rounded) gradients: the largest
``|w - w32|`` and the number of elements off by more than a tenth of one step's size.
docs/index.md ("Optimizer state") quotes its default run.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import jax_scaled as js

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3),
}

REPRESENTATIONS: dict[str, Callable[[optax.GradientTransformation], object]] = {
    "fp32": lambda opt: opt,
    "raw": lambda opt: opt,
    "tensor": lambda opt: js.optim.scaled_state(opt, block_size=None),
    "block32": lambda opt: js.optim.scaled_state(opt),
}


def gradients(kind: str, shape: tuple[int, ...], steps: int) -> list[jax.Array]:
    """``steps`` float32 gradients of ``kind``, rounded to float16 (what a float16 model
    produces), from a fixed key."""
    keys = jax.random.split(jax.random.key(1), steps)
    if kind == "gaussian":
        grads = [jax.random.normal(k, shape) * 1e-2 for k in keys]
    else:
        grads = [jax.random.t(k, 1.5, shape) * 1e-4 for k in keys]
    return [g.astype(jnp.float16).astype(jnp.float32) for g in grads]


def train(representation: str, optimizer: str, grads: list[jax.Array]) -> jax.Array:
    """The weight after one update per gradient, in ``representation``."""
    opt = REPRESENTATIONS[representation](OPTIMIZERS[optimizer]())
    weight = jax.random.normal(jax.random.key(0), grads[0].shape) * 0.05
    state = opt.init(weight)
    if representation == "fp32":
        update = jax.jit(opt.update)
    else:
        update = jax.jit(js.scalify(opt.update))
    if representation == "raw":
        with warnings.catch_warnings():  # the OptimizerStateWarning this benchmark measures
            warnings.simplefilter("ignore", js.tree.OptimizerStateWarning)
            state = js.tree.astype(js.as_scaled_array(state), jnp.float16)
    for g in grads:
        if representation != "fp32":
            g = js.tree.astype(js.as_scaled_array(g), jnp.float16)
        updates, state = update(g, state, weight)
        weight = weight + js.asarray(updates, jnp.float32)
    return weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="512,64", help="weight shape (comma separated)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    tolerance = 1e-4  # a tenth of adam(1e-3)'s largest step
    print(f"{args.optimizer}, weight {shape}, {args.steps} updates, float16 gradients")
    print("| gradients | representation | max abs(w - w32) | elements off by > 1e-4 |")
    print("| --- | --- | --- | --- |")
    for kind in ("gaussian", "student-t(1.5)"):
        grads = gradients(kind, shape, args.steps)
        reference = train("fp32", args.optimizer, grads)
        for representation in ("raw", "tensor", "block32"):
            error = jnp.abs(train(representation, args.optimizer, grads) - reference)
            off = int(jnp.sum(~(error <= tolerance)))
            print(f"| {kind} | {representation} | {float(jnp.max(error)):.2e} | {off} |")


if __name__ == "__main__":
    main()
