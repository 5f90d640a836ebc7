"""The FP8 recipes of ``js.dot_formats`` trained side by side: current, delayed and MX block
scaling against float32 and raw FP8, on a flax MLP and a flax CNN (whose convolution
gradients run as FP8 kernels), with inputs of magnitude 2^-20, 1 and 2^20.

Prints, per model and input magnitude, the final loss of each recipe and its step time
relative to float32 (FP8 is emulated on CPU: the ratio measures the casts, not FP8 GEMMs).

    python benchmarks/fp8_recipes.py --steps 300
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import jax_scaled as js


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=2.0**-100)(nn.Dense(512, use_bias=False)(x))
        return nn.Dense(10)(nn.gelu(h))


class Cnn(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(epsilon=2.0**-100)(nn.Conv(32, (3, 3), use_bias=False)(x))
        h = nn.Conv(32, (3, 3), strides=2)(nn.gelu(h))
        return nn.Dense(10)(nn.gelu(h).reshape(h.shape[0], -1))


PROBLEMS = {"mlp": (Mlp, (512, 256)), "cnn": (Cnn, (64, 16, 16, 3))}


def problem(name: str, exponent: int):
    model, shape = PROBLEMS[name]
    x = jax.random.normal(jax.random.key(0), shape) * 2.0**exponent
    labels = jax.random.randint(jax.random.key(1), (shape[0],), 0, 10)
    params = model().init(jax.random.key(2), x)

    def loss(params, x):
        logits = model().apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss, params, x


RECIPES = {
    "float32": lambda loss: loss,
    "fp8 none": lambda loss: js.dot_formats(loss, scaling="none"),
    "fp8 current": js.dot_formats,
    "fp8 delayed": lambda loss: js.dot_formats(loss, scaling="delayed"),
    "mxfp8 block": lambda loss: js.dot_formats(loss, block=js.nn.MXFP8),
}


def train(loss, params, x, steps: int) -> tuple[float, float]:
    """The final loss and the median step time of ``steps`` Adam steps."""
    optimizer = optax.adam(1e-3)
    delayed = isinstance(loss, js.dot_delayed.DelayedFormats)

    @jax.jit
    def step(params, opt_state, fp8_state, x):
        if delayed:
            grad = jax.value_and_grad(loss, argnums=(0, 1))
            value, (fp8_state, grads) = grad(fp8_state, params, x)
        else:
            value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, value

    state = (params, optimizer.init(params), loss.init(params, x) if delayed else {})
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        *state, value = jax.block_until_ready(step(*state, x))
        times.append(time.perf_counter() - start)
    return float(value), float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--exponents", default="-20,0,20")
    parser.add_argument("--models", default="mlp,cnn")
    args = parser.parse_args()
    print("| model | input magnitude | " + " | ".join(RECIPES) + " |")
    print("| --- | --- |" + " --- |" * len(RECIPES))
    for name in args.models.split(","):
        for exponent in map(int, args.exponents.split(",")):
            loss, params, x = problem(name, exponent)
            results = {r: train(make(loss), params, x, args.steps) for r, make in RECIPES.items()}
            base_time = results["float32"][1]
            cells = [f"{v:.3g} ({t / base_time:.2f}x)" for v, t in results.values()]
            print(f"| {name} | 2^{exponent} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
