"""A nanoGPT-style decoder-only transformer in flax linen, with its numerics as a setting.

Pre-LayerNorm blocks (causal multi-head attention, GELU MLP), learned position embeddings,
tied or untied input/output embeddings, initialised as nanoGPT does (normal(0.02), residual
projections scaled by ``1/sqrt(2 * layers)``). Every matmul with a weight goes through
:func:`dense`, i.e. :func:`jax_scaled.nn.linear`; :class:`Numerics` chooses whether these
run in FP8 (E4M3 activations and weights forward, E5M2 gradients backward) and whether the
LayerNorm inputs get a dynamic rescale of their gradient (the scalify paper's "LayerNorm bwd"
rescaling, Algorithm 5). Outside scalify both are plain casts / identities, so the same
module is the float32 baseline, the raw float16 model and the scalified models.

The model computes in the dtype of the parameters it is given: cast them first
(``js.tree.astype``) to run, e.g., float32 master weights in float16.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_scaled as js

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model size. ``width`` must be a multiple of ``heads``."""

    vocab_size: int
    context: int = 128
    width: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    scan_layers: bool = False  # the blocks under nn.scan (parameters stacked on axis 0)


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the model's matmuls and LayerNorms run (a static, hashable setting).

    ``fp8_matmuls``: the weight matmuls of the transformer blocks cast activations and
    weights to E4M3 on the forward pass and the output gradient to E5M2 on the backward
    pass. ``fp8_head``: the output projection (logits) does too; off by default, as in FP8
    training practice (Transformer Engine and torchao keep the output layer in 16 bits):
    E5M2's two mantissa bits on the logits gradient alone shrink every weight gradient's
    norm by 3% on average and the embedding's by 10%, in this model.
    ``rescale_layernorm_grad``: every LayerNorm input passes through
    :func:`jax_scaled.ops.dynamic_rescale_l2_grad`. ``block``: a block-scaled recipe
    (:class:`jax_scaled.nn.BlockRecipe`, e.g. ``js.nn.MXFP8``) for the same weight matmuls,
    instead of ``fp8_matmuls``' per-tensor casts (the head follows ``fp8_head`` too).
    """

    fp8_matmuls: bool = False
    rescale_layernorm_grad: bool = False
    fp8_head: bool = False
    block: Any = None


def dense(x: jax.Array, w: jax.Array, b: jax.Array | None, numerics: Numerics) -> jax.Array:
    """``x @ w + b`` through :func:`jax_scaled.nn.linear`, in FP8 when ``numerics`` says so.

    Example:
        >>> x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.5)
        >>> dense(x, w, None, Numerics(fp8_matmuls=True)).tolist()[0]
        [2.0, 2.0, 2.0]
    """
    if numerics.block is not None:
        return js.nn.linear(x, w, b, block=numerics.block)
    if numerics.fp8_matmuls:
        return js.nn.linear(x, w, b, x_dtype=E4M3, w_dtype=E4M3, grad_dtype=E5M2)
    return js.nn.linear(x, w, b)


class Dense(nn.Module):
    """A linear layer (kernel ``normal(init_std)``, zero bias) applied with :func:`dense`."""

    features: int
    numerics: Numerics
    init_std: float = 0.02
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.normal(self.init_std)
        w = self.param("kernel", init, (x.shape[-1], self.features), jnp.float32)
        b = None
        if self.use_bias:
            b = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        return dense(x, w, b, self.numerics)


class LayerNorm(nn.Module):
    """:func:`jax_scaled.nn.layer_norm` with a learned scale and bias; optionally rescales the
    gradient of its input (scalify paper, Algorithm 5)."""

    numerics: Numerics
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), jnp.float32)
        if self.numerics.rescale_layernorm_grad:
            x = js.ops.dynamic_rescale_l2_grad(x)
        return js.nn.layer_norm(x, scale, bias, eps=self.eps)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with fused QKV and an output projection."""

    config: GPTConfig
    numerics: Numerics

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        batch, length, width = x.shape
        qkv = Dense(3 * width, self.numerics, name="qkv")(x)
        qkv = qkv.reshape(batch, length, 3, cfg.heads, width // cfg.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        y = js.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, length, width)
        return Dense(width, self.numerics, _residual_std(cfg), name="proj")(y)


class MLP(nn.Module):
    """``Dense(mlp_ratio * width) -> GELU -> Dense(width)``."""

    config: GPTConfig
    numerics: Numerics

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = js.nn.gelu(Dense(cfg.mlp_ratio * cfg.width, self.numerics, name="fc")(x))
        return Dense(cfg.width, self.numerics, _residual_std(cfg), name="proj")(h)


def _residual_std(cfg: GPTConfig) -> float:
    return 0.02 / math.sqrt(2 * cfg.layers)


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    config: GPTConfig
    numerics: Numerics

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + CausalSelfAttention(self.config, self.numerics, name="attn")(
            LayerNorm(self.numerics, name="ln1")(x)
        )
        return x + MLP(self.config, self.numerics, name="mlp")(
            LayerNorm(self.numerics, name="ln2")(x)
        )


class ScannedBlock(nn.Module):
    """:class:`Block` as a ``(carry, x) -> (carry, y)`` body for ``nn.scan``."""

    config: GPTConfig
    numerics: Numerics

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return Block(self.config, self.numerics, name="block")(x), None


class GPT(nn.Module):
    """Token ids ``[batch, length]`` (``length <= context``) to logits ``[batch, length, vocab]``.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=11, context=8, width=16, layers=1, heads=2))
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens)["params"]
        >>> model.apply({"params": params}, tokens).shape
        (2, 8, 11)
    """

    config: GPTConfig
    numerics: Numerics = Numerics()

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        init = nn.initializers.normal(0.02)
        wte = self.param("wte", init, (cfg.vocab_size, cfg.width), jnp.float32)
        wpe = self.param("wpe", init, (cfg.context, cfg.width), jnp.float32)
        x = jnp.take(wte, tokens, axis=0) + wpe[: tokens.shape[1]]
        if cfg.scan_layers:
            blocks = nn.scan(ScannedBlock, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=cfg.layers)  # fmt: skip
            x, _ = blocks(cfg, self.numerics, name="blocks")(x, None)
        else:
            for i in range(cfg.layers):
                x = Block(cfg, self.numerics, name=f"block{i}")(x)
        x = LayerNorm(self.numerics, name="ln_f")(x)
        head_numerics = self.numerics
        if not head_numerics.fp8_head:
            head_numerics = dataclasses.replace(head_numerics, fp8_matmuls=False, block=None)
        if cfg.tie_embeddings:
            return dense(x, wte.T, None, head_numerics)
        return Dense(cfg.vocab_size, head_numerics, use_bias=False, name="head")(x)


def init_params(config: GPTConfig, seed: int) -> dict[str, Any]:
    """Float32 parameters of :class:`GPT` for ``config``, from ``seed``."""
    tokens = jnp.zeros((1, config.context), jnp.int32)
    return GPT(config).init(jax.random.key(seed), tokens)["params"]


def count_params(params: Any) -> int:
    """Number of parameters (elements of all leaves)."""
    return sum(int(x.size) for x in js.tree.tree_leaves(params))


def next_char_loss(model: GPT, params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of next-character prediction, computed in ``params``' dtype."""
    logits = model.apply({"params": params}, inputs)
    labels = jax.nn.one_hot(targets, model.config.vocab_size, dtype=logits.dtype)
    return jnp.mean(js.nn.softmax_cross_entropy(logits, labels))
