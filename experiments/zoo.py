"""A training zoo: realistic flax models x optax optimizers (default hyperparameters) x precisions.

Four models on scikit-learn's digits (1797 8x8 images, bundled, no download), each with
weights of realistic size (512x512, 256x256, 128x512):

* ``cnn``: Conv 16 3x3, Conv 32 3x3 stride 2, Dense 512, Dense 10 (relu) on 8x8x1 images;
* ``mlp``: Dense 512, LayerNorm, gelu, Dense 512, LayerNorm, gelu, Dense 10 on 64 pixels;
* ``gru``: ``nn.RNN(nn.GRUCell(256))`` over the 8 rows (8 pixels each), Dense 10 on the last;
* ``transformer``: a 2-layer pre-LayerNorm encoder (width 128, 4 heads, MLP 512, gelu) over
  the 8 rows as tokens, mean-pooled, Dense 10.

Eight optimizers, optax defaults but the learning rate (:data:`OPTIMIZERS`), and six modes
(:data:`MODES`):

* ``fp32``: the reference;
* ``readme``: the README's quickstart: ScaledArray parameters of float32 data (master
  weights), :func:`jax_scaled.optim.scaled_state` state (float16, a scale per 32 elements),
  float16 ScaledArray inputs, ``jax.jit(js.scalify(step))``;
* ``fp16_params``: the same with float16 parameters too (everything in float16);
* ``raw_fp16_state``: ``fp16_params`` with plain optax on a state cast once to float16
  ScaledArrays (known to fail: a per-tensor float16 second moment flushes);
* ``fp8``: ``readme`` with :func:`jax_scaled.dot_formats`: E4M3 forward, E5M2 backward, the
  classifier head kept 16-bit as in Table 3's ``fp8_policy_scalify``; float32 master
  weights, as FP8 training recipes keep them;
* ``mxfp8``: the same with ``block=js.nn.MXFP8``.

Every cell of a model starts from the same float32 initialisation and sees the same batches;
:func:`run_cell` trains one and :func:`verdict` compares it with the ``fp32`` cell
(``benchmarks/training_zoo.py`` runs the grid).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.stats

import jax_scaled as js
from experiments.digits import batch_indices, load_digits_dataset

NUM_CLASSES = 10
Batch = dict[str, Any]

# ---------------------------------------------------------------------------------------
# Models (plain flax linen: nothing jax_scaled-specific in them)
# ---------------------------------------------------------------------------------------


class CNN(nn.Module):
    """Two convolutions and two dense layers on ``[batch, 8, 8, 1]`` images."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=(2, 2))(x))
        x = nn.relu(nn.Dense(512)(x.reshape(x.shape[0], -1)))
        return nn.Dense(NUM_CLASSES)(x)


class MLP(nn.Module):
    """Dense, LayerNorm and gelu twice, then a linear head, on ``[batch, 64]`` pixels."""

    width: int = 512

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = nn.gelu(nn.LayerNorm()(nn.Dense(self.width)(x)))
        return nn.Dense(NUM_CLASSES)(x)


class GRU(nn.Module):
    """A GRU over the rows of ``[batch, 8, 8]`` images; the head reads its last output."""

    features: int = 256

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.RNN(nn.GRUCell(self.features))(x)
        return nn.Dense(NUM_CLASSES)(h[:, -1])


class EncoderBlock(nn.Module):
    """A pre-LayerNorm transformer encoder block (self-attention, gelu MLP)."""

    heads: int = 4
    mlp_width: int = 512

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(self.mlp_width)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class Transformer(nn.Module):
    """Rows of ``[batch, 8, 8]`` images as tokens: embedding, encoder blocks, mean pool, head."""

    width: int = 128
    layers: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pos = self.param("pos", nn.initializers.normal(0.02), x.shape[1:2] + (self.width,))
        x = nn.Dense(self.width)(x) + pos
        for _ in range(self.layers):
            x = EncoderBlock()(x)
        return nn.Dense(NUM_CLASSES)(nn.LayerNorm()(jnp.mean(x, axis=1)))


@dataclasses.dataclass(frozen=True)
class Model:
    """A flax module and the shape of one example it reads (digits pixels reshaped)."""

    module: nn.Module
    example_shape: tuple[int, ...]


MODELS: dict[str, Model] = {
    "cnn": Model(CNN(), (8, 8, 1)),
    "mlp": Model(MLP(), (64,)),
    "gru": Model(GRU(), (8, 8)),
    "transformer": Model(Transformer(), (8, 8)),
}

# ---------------------------------------------------------------------------------------
# Data and initialisation
# ---------------------------------------------------------------------------------------


@functools.cache
def load_task(model: str, seed: int = 0) -> tuple[Batch, Batch]:
    """``(train, test)`` digits (standardised, one-hot labels) shaped for ``model``.

    Example:
        >>> train, test = load_task("gru")
        >>> train["x"].shape, test["y"].shape
        ((1347, 8, 8), (450, 10))
    """
    data = load_digits_dataset(seed=seed)
    shape = MODELS[model].example_shape

    def shaped(split: dict[str, np.ndarray]) -> Batch:
        return {"x": split["x"].reshape(-1, *shape), "y": split["y"]}

    return shaped(data.train), shaped(data.test)


# Relative size of a jitter: half a float16 ulp, the rounding error of one float16 cast.
JITTER = 2.0**-11


@functools.cache
def init_params(model: str, seed: int = 0, jitter: int = 0) -> Any:
    """Float32 parameters of ``model`` from ``seed`` (the same for every mode).

    ``jitter`` > 0 multiplies every weight by ``1 + JITTER * r``, ``r`` drawn from
    ``{-1, 0, 1}`` with key ``jitter``: a perturbation the size of one float16 rounding, to
    measure how much a model's result moves under numerics alone (float32 included).

    Example:
        >>> a, b = init_params("mlp"), init_params("mlp", jitter=1)
        >>> w, v = a["Dense_0"]["kernel"], b["Dense_0"]["kernel"]
        >>> round(float(jnp.max(jnp.abs(v / w - 1))) / JITTER, 3)
        1.0
    """
    x = jnp.zeros((1, *MODELS[model].example_shape), jnp.float32)
    params = MODELS[model].module.init(jax.random.key(seed), x)["params"]
    if jitter == 0:
        return params
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(jitter), len(leaves))
    signs = [jax.random.randint(k, leaf.shape, -1, 2) for k, leaf in zip(keys, leaves)]
    jittered = [leaf * (1 + JITTER * s) for leaf, s in zip(leaves, signs)]
    return jax.tree.unflatten(treedef, jittered)


def loss_fn(model: str) -> Callable[[Any, Batch], jax.Array]:
    """``(params, batch) -> mean softmax cross-entropy`` of ``model``, in the params' dtype."""
    module = MODELS[model].module

    def loss(params: Any, batch: Batch) -> jax.Array:
        logits = module.apply({"params": params}, batch["x"])
        return jnp.mean(optax.softmax_cross_entropy(logits, batch["y"]))

    return loss


def logits_fn(model: str) -> Callable[[Any, Batch], jax.Array]:
    """``(params, batch) -> logits`` of ``model``."""
    module = MODELS[model].module
    return lambda params, batch: module.apply({"params": params}, batch["x"])


# ---------------------------------------------------------------------------------------
# Optimizers: optax defaults, one learning rate each
# ---------------------------------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "lion": lambda: optax.lion(1e-4),  # Lion's sign updates want a ~10x smaller rate than Adam
    "sgd": lambda: optax.sgd(0.05, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2),  # relative steps (multiply_by_parameter_scale)
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "lamb": lambda: optax.lamb(1e-3),
}

# ---------------------------------------------------------------------------------------
# Modes: how parameters, state and inputs are stored and the step is compiled
# ---------------------------------------------------------------------------------------

F16 = jnp.float16


def _head(site: js.ContractionSite) -> bool:
    """The classifier head (a ``[features, 10]`` kernel): kept in 16 bits, as FP8 recipes and
    experiments/table3.py's ``fp8_policy_scalify`` keep a model's output layer."""
    return len(site.rhs.shape) == 2 and site.rhs.shape[-1] == NUM_CLASSES


@dataclasses.dataclass(frozen=True)
class Mode:
    """A precision: ``state`` is ``"plain"`` (float32 arrays), ``"scaled"``
    (:func:`jax_scaled.optim.scaled_state`) or ``"raw"`` (plain optax, state cast once);
    ``formats`` are :func:`jax_scaled.dot_formats` arguments (None: no format policy)."""

    name: str
    state: str
    formats: dict[str, Any] | None = None
    master: bool = False  # float32 parameter data (master weights), as FP8 recipes keep them

    @property
    def scaled(self) -> bool:
        return self.state != "plain"

    def optimizer(self, opt: optax.GradientTransformation) -> optax.GradientTransformation:
        """The transformation the step runs."""
        return js.optim.scaled_state(opt) if self.state == "scaled" else opt

    def init_state(self, opt: optax.GradientTransformation, params: Any) -> Any:
        """Optimizer state of :meth:`optimizer` from float32 ``params``."""
        state = opt.init(params)
        return _fp16(state) if self.state == "raw" else state

    def inputs(self, tree: Any) -> Any:
        """A batch (float32) as the step takes it."""
        return _fp16(tree) if self.scaled else tree

    def parameters(self, tree: Any) -> Any:
        """Float32 parameters as the step takes them: float16 ScaledArrays, or with
        ``master`` ScaledArrays of float32 data (the README's default)."""
        return js.as_scaled_array(tree) if self.master else self.inputs(tree)

    def loss(self, loss: Callable) -> Callable:
        """``loss`` under this mode's format policy."""
        return js.dot_formats(loss, **self.formats) if self.formats else loss

    def compile(self, fn: Callable) -> Callable:
        return jax.jit(js.scalify(fn)) if self.scaled else jax.jit(fn)


def _fp16(tree: Any) -> Any:
    """Float16 ScaledArrays (README recipe); integer leaves (step counts) stay as they are."""
    return js.tree.astype(js.as_scaled_array(tree), F16)


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
_FP8 = {"lhs": E4M3, "rhs": E4M3, "grad": E5M2, "exclude": _head}
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("fp32", "plain"),
        Mode("readme", "scaled", master=True),
        Mode("fp16_params", "scaled"),
        Mode("raw_fp16_state", "raw"),
        Mode("fp8", "scaled", _FP8, master=True),
        Mode("mxfp8", "scaled", {"block": js.nn.MXFP8, "exclude": _head}, master=True),
    )
}

# ---------------------------------------------------------------------------------------
# One cell: train, evaluate, compare with fp32
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CellResult:
    """One trained cell. ``losses``: every step's training loss (inf/nan kept)."""

    model: str
    optimizer: str
    mode: str
    steps: int
    losses: list[float]
    test_accuracy: float  # fraction in [0, 1], from logits in the mode's own precision
    test_loss: float
    wall_s: float

    @property
    def finite(self) -> bool:
        """Every step's loss finite."""
        return all(math.isfinite(x) for x in self.losses)

    @property
    def first_nonfinite_step(self) -> int | None:
        return next((i for i, x in enumerate(self.losses) if not math.isfinite(x)), None)


def make_step(loss: Callable, opt: optax.GradientTransformation) -> Callable:
    """The plain train step ``(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def to_float(x: Any) -> float:
    """A (possibly scaled) scalar as a Python float."""
    return float(js.asarray(x, jnp.float32))


def run_cell(
    model: str,
    optimizer: str,
    mode: str,
    steps: int,
    *,
    batch_size: int = 64,
    seed: int = 0,
    jitter: int = 0,
) -> CellResult:
    """Train ``model`` with ``optimizer`` in ``mode`` for ``steps`` batches, then evaluate.

    Every mode starts from :func:`init_params` and sees the batches of
    :func:`experiments.digits.batch_indices` for ``seed``, so cells differ only in numerics
    (``jitter``: see :func:`init_params`).

    Example:
        >>> r = run_cell("mlp", "adam", "readme", steps=3)
        >>> r.finite, len(r.losses), 0.0 <= r.test_accuracy <= 1.0
        (True, 3, True)
    """
    start, m = time.perf_counter(), MODES[mode]
    train, test = load_task(model, seed)
    opt = m.optimizer(OPTIMIZERS[optimizer]())
    params = init_params(model, seed, jitter)
    opt_state, params = m.init_state(opt, params), m.parameters(params)
    step = m.compile(make_step(m.loss(loss_fn(model)), opt))
    losses = []
    for idx in batch_indices(len(train["x"]), batch_size, steps, seed):
        batch = m.inputs({k: v[idx] for k, v in train.items()})
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(value)
    accuracy, test_loss = evaluate(model, m, params, test)
    return CellResult(model, optimizer, mode, steps, [to_float(x) for x in losses],
                      accuracy, test_loss, time.perf_counter() - start)  # fmt: skip


def evaluate(model: str, mode: Mode, params: Any, test: Batch) -> tuple[float, float]:
    """``(accuracy, loss)`` on the whole test set, with the mode's numerics."""
    logits = mode.compile(mode.loss(logits_fn(model)))(params, mode.inputs(test))
    logits = np.asarray(js.asarray(logits, jnp.float32))
    labels = np.argmax(test["y"], axis=-1)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    loss = float(-np.mean(log_probs[np.arange(len(labels)), labels]))
    return float(np.mean(np.argmax(logits, axis=-1) == labels)), loss


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A cell against the fp32 cell of the same model and optimizer."""

    accuracy_delta_pp: float  # test accuracy minus fp32's, percentage points
    finite: bool
    passed: bool
    allowance_pp: float = 0.0  # ensembles: the one-sided confidence bound of the delta's noise


def verdict(result: CellResult, reference: CellResult, tolerance_pp: float = 1.0) -> Verdict:
    """Pass: every step's loss finite, and a test accuracy at most ``tolerance_pp`` below
    fp32's (a better one passes: low precision is not asked to match float32's noise) or a
    test loss within 1% of fp32's.

    Example:
        >>> ref = CellResult("mlp", "adam", "fp32", 1, [2.3], 0.95, 0.2, 1.0)
        >>> v = verdict(dataclasses.replace(ref, mode="readme", test_accuracy=0.945), ref)
        >>> round(v.accuracy_delta_pp, 2), v.finite, v.passed
        (-0.5, True, True)
    """
    delta = 100 * (result.test_accuracy - reference.test_accuracy)
    close_loss = result.test_loss <= 1.01 * reference.test_loss
    passed = result.finite and (delta >= -tolerance_pp or close_loss)
    return Verdict(delta, result.finite, passed)


def ensemble_verdict(
    runs: Sequence[CellResult],
    reference_runs: Sequence[CellResult],
    tolerance_pp: float = 1.0,
    confidence: float = 0.95,
) -> Verdict:
    """:func:`verdict` for several runs of a cell and of its fp32 reference (jitters of the
    initialisation, see :func:`init_params`): a non-inferiority test of the mean accuracies
    with margin ``tolerance_pp``. It fails when the data show, at ``confidence`` (one-sided,
    Welch's t), that the cell is more than ``tolerance_pp`` below fp32; or when a run is not
    finite. A mean test loss within 1% of fp32's passes, as in :func:`verdict`.

    Example:
        >>> ref = [CellResult("mlp", "adam", "fp32", 1, [2.3], a, 0.2, 1.0) for a in (0.90, 0.94)]
        >>> low = [dataclasses.replace(r, mode="readme", test_accuracy=a - 0.02) for r, a
        ...        in zip(ref, (0.90, 0.94))]
        >>> v = ensemble_verdict(low, ref)
        >>> round(v.accuracy_delta_pp, 2), v.passed, v.allowance_pp > 1
        (-2.0, True, True)
    """
    accuracy = np.array([100 * r.test_accuracy for r in runs])
    reference = np.array([100 * r.test_accuracy for r in reference_runs])
    delta = float(accuracy.mean() - reference.mean())
    var_a, var_r = accuracy.var(ddof=1) / len(accuracy), reference.var(ddof=1) / len(reference)
    se = math.sqrt(var_a + var_r)
    allowance = 0.0
    if se > 0:
        df = (var_a + var_r) ** 2 / (
            var_a**2 / (len(accuracy) - 1) + var_r**2 / (len(reference) - 1)
        )
        allowance = float(scipy.stats.t.ppf(confidence, df) * se)
    finite = all(r.finite for r in runs)
    mean_loss = np.mean([r.test_loss for r in runs])
    close_loss = mean_loss <= 1.01 * np.mean([r.test_loss for r in reference_runs])
    passed = finite and (delta >= -tolerance_pp - allowance or bool(close_loss))
    return Verdict(delta, finite, passed, allowance)
