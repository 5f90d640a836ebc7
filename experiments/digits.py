"""Train a small MLP on scikit-learn's digits in FP32, raw FP16 and scalified FP16.

The demo of ``make demo``::

    python -m experiments.digits                        # fp32, fp16, scaled-fp16
    python -m experiments.digits --modes fp32,scaled-fp16 --steps 500 --optimizer sgd

A *mode* says how a run represents its parameters, optimizer state and batches and how it
compiles the train step. ``fp32`` and ``fp16`` cast everything to that dtype and use
``jax.jit(train_step)``; ``scaled-fp16`` follows the jax_scaled user's view: parameters and
optimizer state become ScaledArrays with float16 data, batches go through
``js.as_scaled_array``, and the step is ``jax.jit(js.scalify(train_step))``. The model, loss
and optimizer code is the same plain JAX/optax code in every mode.

Reuse: :func:`run` takes a :class:`Config` and returns a :class:`Result`; new modes go in
:data:`MODES` (see :func:`register_mode`), and a larger experiment can pass its own dataset,
model and loss to :func:`train`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_scaled as js

# ---------------------------------------------------------------------------------------
# Configuration and results
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run. ``mode`` names an entry of :data:`MODES`."""

    mode: str = "fp32"
    steps: int = 1000
    batch_size: int = 64
    hidden: tuple[int, ...] = (128, 128)
    optimizer: str = "adam"  # "adam" or "sgd" (with momentum 0.9)
    learning_rate: float | None = None  # default: 1e-3 for adam, 0.05 for sgd
    adam_eps: float = 1e-8  # optax's default
    seed: int = 0
    test_fraction: float = 0.25
    warmup_steps: int = 10  # steps left out of the ms/step median (compilation, caches)


@dataclasses.dataclass(frozen=True)
class Result:
    """What a run reports. Losses and accuracies are computed in the mode's own precision."""

    mode: str
    train_loss: float  # mean cross-entropy over the whole training set after training
    test_accuracy: float  # fraction in [0, 1]
    ms_per_step: float  # median wall time of one step (batch conversion included), after warm-up
    first_step_s: float  # wall time of the first step: trace, lower, compile and run
    first_nonfinite_step: int | None  # first step whose training loss was inf or nan


# ---------------------------------------------------------------------------------------
# Modes: how state and batches are represented, and how the step is compiled
# ---------------------------------------------------------------------------------------


def _cast_floats(tree: Any, dtype) -> Any:
    def cast(x):
        is_float = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
        return jnp.asarray(x, dtype) if is_float else x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Mode:
    """A precision setting: data ``dtype``, scaled (jax_scaled) or raw."""

    name: str
    dtype: Any
    scaled: bool
    description: str

    def state(self, tree: Any) -> Any:
        """Parameters or optimizer state (created in float32) in this mode's representation."""
        if self.scaled:
            return js.tree.astype(js.as_scaled_array(tree), self.dtype)
        return _cast_floats(tree, self.dtype)

    def optimizer(self, opt: optax.GradientTransformation) -> optax.GradientTransformation:
        """``opt`` as this mode runs it: scaled modes store its state with
        ``js.optim.scaled_state`` (``dtype`` data, one scale per 32 elements)."""
        return js.optim.scaled_state(opt, self.dtype) if self.scaled else opt

    def optimizer_state(self, state: Any) -> Any:
        """The state of :meth:`optimizer`'s ``init`` in this mode's representation."""
        return state if self.scaled else _cast_floats(state, self.dtype)

    def batch(self, batch: Any) -> Any:
        """A batch already in ``dtype`` (see :meth:`cast_dataset`), ready for the step."""
        return js.as_scaled_array(batch) if self.scaled else batch

    def cast_dataset(self, arrays: Any) -> Any:
        """Host arrays cast once to the data dtype, so batching costs no conversion."""
        return jax.tree.map(lambda x: np.asarray(x, dtype=self.dtype), arrays)

    def compile(self, fn: Callable) -> Callable:
        return jax.jit(js.scalify(fn)) if self.scaled else jax.jit(fn)

    def to_float32(self, tree: Any) -> Any:
        return js.asarray(tree, jnp.float32)


MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> Mode:
    """Add ``mode`` to :data:`MODES` (by name) and return it."""
    MODES[mode.name] = mode
    return mode


register_mode(Mode("fp32", jnp.float32, False, "plain float32, jax.jit(step)"))
register_mode(Mode("fp16", jnp.float16, False, "raw float16 params/state/inputs, no scaling"))
register_mode(Mode("bf16", jnp.bfloat16, False, "raw bfloat16 params/state/inputs"))
register_mode(
    Mode("scaled-fp16", jnp.float16, True, "jax.jit(js.scalify(step)), float16, optim.scaled_state")
)
register_mode(Mode("scaled-fp32", jnp.float32, True, "jax.jit(js.scalify(step)), float32 data"))

DEFAULT_MODES = ("fp32", "fp16", "scaled-fp16")


# ---------------------------------------------------------------------------------------
# Data, model, loss
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Float32 features and one-hot float32 labels, as host (numpy) arrays."""

    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray]

    @property
    def num_features(self) -> int:
        return self.train["x"].shape[1]

    @property
    def num_classes(self) -> int:
        return self.train["y"].shape[1]


@functools.cache
def load_digits_dataset(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, no download), standardized.

    Features are standardized with the training set's mean and standard deviation (constant
    pixels are only centred); the split is stratified and fixed by ``seed``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32), y, test_size=test_fraction, random_state=seed, stratify=y
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    num_classes = int(y.max()) + 1

    def split(xs, ys):
        one_hot = np.eye(num_classes, dtype=np.float32)[ys]
        return {"x": ((xs - mean) / std).astype(np.float32), "y": one_hot}

    return Dataset(train=split(x_train, y_train), test=split(x_test, y_test))


def init_mlp(key: jax.Array, sizes: Sequence[int]) -> list[dict[str, jax.Array]]:
    """He-normal weights and zero biases in float32, one dict per layer."""
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(k, (n_in, n_out), jnp.float32) * np.sqrt(2.0 / n_in)
        params.append({"w": w, "b": jnp.zeros((n_out,), jnp.float32)})
    return params


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """Logits of a ReLU MLP."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def cross_entropy(logits: jax.Array, one_hot: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with one-hot labels."""
    return -jnp.mean(jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1))


def loss_fn(params, batch):
    return cross_entropy(mlp(params, batch["x"]), batch["y"])


def evaluate(params, batch):
    """``(loss, logits)`` on a whole batch."""
    logits = mlp(params, batch["x"])
    return cross_entropy(logits, batch["y"]), logits


def make_optimizer(config: Config) -> optax.GradientTransformation:
    if config.optimizer == "adam":
        return optax.adam(config.learning_rate or 1e-3, eps=config.adam_eps)
    if config.optimizer == "sgd":
        return optax.sgd(config.learning_rate or 0.05, momentum=0.9)
    raise ValueError(f"unknown optimizer {config.optimizer!r} (use 'adam' or 'sgd')")


def make_train_step(opt: optax.GradientTransformation, loss: Callable = loss_fn) -> Callable:
    """The plain-JAX train step every mode compiles (its own way)."""

    def train_step(params, opt_state, batch):
        loss_value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_value

    return train_step


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


def batch_indices(num_examples: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """``(steps, batch_size)`` example indices: reshuffled epochs, last partial batch dropped."""
    rng = np.random.default_rng(seed)
    per_epoch = num_examples // batch_size
    epochs = -(-steps // per_epoch)
    perms = [rng.permutation(num_examples)[: per_epoch * batch_size] for _ in range(epochs)]
    return np.concatenate(perms).reshape(-1, batch_size)[:steps]


def train(
    config: Config,
    dataset: Dataset,
    params: Any,
    loss: Callable = loss_fn,
    evaluate_fn: Callable = evaluate,
) -> Result:
    """Train ``params`` (float32 pytree) on ``dataset`` under ``config``; evaluate at the end."""
    mode = MODES[config.mode]
    opt = mode.optimizer(make_optimizer(config))
    opt_state = mode.optimizer_state(opt.init(params))
    step = mode.compile(make_train_step(opt, loss))
    params = mode.state(params)

    train_data, test_data = mode.cast_dataset(dataset.train), mode.cast_dataset(dataset.test)
    indices = batch_indices(len(train_data["x"]), config.batch_size, config.steps, config.seed)
    times, losses = [], []
    for idx in indices:
        batch = {k: v[idx] for k, v in train_data.items()}
        start = time.perf_counter()
        params, opt_state, loss_value = step(params, opt_state, mode.batch(batch))
        jax.block_until_ready((params, opt_state, loss_value))
        times.append(time.perf_counter() - start)
        losses.append(loss_value)

    losses = np.array([float(mode.to_float32(x)) for x in losses])
    nonfinite = np.flatnonzero(~np.isfinite(losses))
    evaluate_step = mode.compile(evaluate_fn)
    train_loss, _ = evaluate_step(params, mode.batch(train_data))
    _, logits = evaluate_step(params, mode.batch(test_data))
    predictions = np.argmax(np.asarray(mode.to_float32(logits)), axis=-1)
    accuracy = float(np.mean(predictions == np.argmax(dataset.test["y"], axis=-1)))
    timed = times[config.warmup_steps :] or times
    return Result(
        mode=config.mode,
        train_loss=float(mode.to_float32(train_loss)),
        test_accuracy=accuracy,
        ms_per_step=1e3 * statistics.median(timed),
        first_step_s=times[0] if times else float("nan"),
        first_nonfinite_step=int(nonfinite[0]) if nonfinite.size else None,
    )


def run(config: Config) -> Result:
    """Train the digits MLP (64-hidden...-10) under ``config``."""
    dataset = load_digits_dataset(config.test_fraction, config.seed)
    sizes = (dataset.num_features, *config.hidden, dataset.num_classes)
    params = init_mlp(jax.random.PRNGKey(config.seed), sizes)
    return train(config, dataset, params)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------


def format_table(results: Sequence[Result]) -> str:
    header = ("mode", "final train loss", "test accuracy", "ms/step", "first step s", "notes")
    rows = [header]
    for r in results:
        step = r.first_nonfinite_step
        note = "" if step is None else f"loss inf/nan from step {step}"
        rows.append(
            (
                r.mode,
                f"{r.train_loss:.4f}",
                f"{100 * r.test_accuracy:.2f}%",
                f"{r.ms_per_step:.2f}",
                f"{r.first_step_s:.2f}",
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def accuracy_differences(results: Sequence[Result], reference: str = "fp32") -> dict[str, float]:
    """Test accuracy of each scaled mode minus ``reference``'s, in percentage points."""
    by_mode = {r.mode: r for r in results}
    if reference not in by_mode:
        return {}
    ref = by_mode[reference].test_accuracy
    return {
        r.mode: 100 * (r.test_accuracy - ref)
        for r in results
        if MODES[r.mode].scaled and r.mode != reference
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="python -m experiments.digits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="train steps per mode")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated modes, from: {', '.join(MODES)}",
    )
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default=defaults.optimizer)
    parser.add_argument("--lr", type=float, default=None, help="learning rate")
    parser.add_argument(
        "--adam-eps", type=float, default=defaults.adam_eps, help="Adam epsilon (see Config)"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--check",
        type=float,
        default=None,
        metavar="PP",
        help="exit with status 1 if a scaled mode's test accuracy is more than PP percentage "
        "points below fp32's",
    )
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = jax.devices()[0]
    print(
        f"digits MLP 64-128-128-10, {args.optimizer}, {args.steps} steps of batch "
        f"{args.batch_size}, seed {args.seed}; jax {jax.__version__} on {cpu.platform}"
    )
    results = []
    for name in args.modes:
        config = Config(
            mode=name,
            steps=args.steps,
            batch_size=args.batch_size,
            optimizer=args.optimizer,
            learning_rate=args.lr,
            adam_eps=args.adam_eps,
            seed=args.seed,
        )
        start = time.perf_counter()
        results.append(run(config))
        print(f"  {name:<12} {MODES[name].description} ({time.perf_counter() - start:.1f} s)")
    print()
    print(format_table(results))
    status = 0
    for mode, diff in accuracy_differences(results).items():
        verdict = ""
        if args.check is not None:
            ok = diff >= -args.check
            status |= not ok
            verdict = f" ({'within' if ok else 'NOT within'} {args.check} pp)"
        print(f"\n{mode} test accuracy - fp32 test accuracy: {diff:+.2f} pp{verdict}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
