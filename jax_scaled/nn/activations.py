"""Scale-aware activations (scalify paper, Appendix C.1).

Most activations are gated identities, ``f(x) = x * gate(x)`` with a bounded gate. Under
scalify, their rule keeps the input's scale and computes the data as
``d * gate(d * s)``: the gate is evaluated in float32 on the represented value (well defined
even where ``d * s`` overflows the data format), and nothing is re-split. Outside scalify each
function is its plain formula, with the same values as ``jax.nn``'s.

The backward pass is propagated automatically (see :mod:`jax_scaled.custom_scale`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jax_scaled.array import ScaledArray
from jax_scaled.custom_scale import custom_scale
from jax_scaled.dtypes import compute_dtype
from jax_scaled.scales import as_scaled, make_scale, round_scale, scale_f32

Gate = Callable[[jax.Array], jax.Array]


def _gated_rule(gate: Gate) -> Callable[[ScaledArray], ScaledArray]:
    """The App. C.1 rule for ``x * gate(x)``: same scale, data ``d * gate(d * s)``."""

    def rule(x: ScaledArray) -> ScaledArray:
        x = as_scaled(x)
        wide = x.data.astype(compute_dtype(x.dtype))
        value = wide * x.scale.astype(wide.dtype)
        return ScaledArray((wide * gate(value)).astype(x.dtype), x.scale)

    return rule


def _gated(gate: Gate) -> Callable[[jax.Array], jax.Array]:
    """``x * gate(x)`` with the App. C.1 rule on the forward pass and on the backward pass.

    The backward is ``ct * f'(x)`` with ``f' = gate + x gate'`` bounded: under scalify it
    keeps the cotangent's scale and evaluates ``f'`` in float32 on the represented value, so
    the ``x gate'(x)`` term, vanishing for large ``|x|``, is never given the input's scale.
    """

    def activation(x: jax.Array) -> jax.Array:
        wide = x.astype(compute_dtype(x.dtype))
        return (wide * gate(wide)).astype(x.dtype)

    forward = custom_scale(activation)
    forward.defscale(_gated_rule(gate))
    backward = custom_scale(functools.partial(_gated_backward_body, gate))
    backward.defscale(functools.partial(_gated_backward_rule, gate))

    @jax.custom_vjp
    def function(x: jax.Array) -> jax.Array:
        return forward(x)

    function.defvjp(lambda x: (forward(x), x), lambda x, ct: (backward(x, ct),))
    return function


def _derivative(gate: Gate, value: jax.Array) -> jax.Array:
    """``d/dx (x gate(x))`` elementwise, in float32; 0 where the value is not finite."""
    ones = jnp.ones_like(value)
    _, slope = jax.jvp(lambda v: v * gate(v), (value,), (ones,))
    return jnp.where(jnp.isfinite(slope), slope, 0)


def _gated_backward_body(gate: Gate, x: jax.Array, ct: jax.Array) -> jax.Array:
    wide = compute_dtype(ct.dtype)
    return (ct.astype(wide) * _derivative(gate, x.astype(wide))).astype(ct.dtype)


def _gated_backward_rule(gate: Gate, x: ScaledArray, ct: ScaledArray) -> ScaledArray:
    x, ct = as_scaled(x), as_scaled(ct)
    wide = compute_dtype(ct.dtype)
    value = x.data.astype(wide) * x.scale.astype(wide)
    data = ct.data.astype(wide) * _derivative(gate, value)
    return ScaledArray(data.astype(ct.dtype), ct.scale)


def _relu_body(x: jax.Array) -> jax.Array:
    return jnp.where(x > 0, x, jnp.zeros((), x.dtype))  # derivative 0 at 0, as jax.nn.relu


def _gelu_gate(x: jax.Array) -> jax.Array:
    return 0.5 * (1 + lax.erf(x * (1 / math.sqrt(2))))


def _gelu_tanh_gate(x: jax.Array) -> jax.Array:
    return 0.5 * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _elu_gate(x: jax.Array) -> jax.Array:
    negative = x < 0
    safe = jnp.where(negative, x, -1)  # expm1(x)/x, with no 0/0 where the gate is 1 anyway
    return jnp.where(negative, jnp.expm1(safe) / safe, 1)


_relu = custom_scale(_relu_body)
_relu.defscale(lambda x: ScaledArray(_relu_body(as_scaled(x).data), as_scaled(x).scale))
_gelu_exact = _gated(_gelu_gate)
_gelu_tanh = _gated(_gelu_tanh_gate)
_silu = _gated(jax.nn.sigmoid)
_elu = _gated(_elu_gate)


def relu(x: jax.Array) -> jax.Array:
    """Rectified linear unit ``max(x, 0)``; under scalify the scale is kept, data clipped.

    Example:
        >>> js.nn.relu(jnp.array([-1.0, 2.0])).tolist()
        [0.0, 2.0]
    """
    return _relu(x)


def silu(x: jax.Array) -> jax.Array:
    """SiLU ``x * sigmoid(x)``; under scalify the scale is kept.

    Example:
        >>> round(float(js.nn.silu(jnp.array(1.0))), 4)
        0.7311
    """
    return _silu(x)


def elu(x: jax.Array) -> jax.Array:
    """ELU with alpha 1: ``x`` for ``x > 0``, ``exp(x) - 1`` otherwise; scale kept.

    Example:
        >>> round(float(js.nn.elu(jnp.array(-1.0))), 4)
        -0.6321
    """
    return _elu(x)


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """GELU, tanh-approximated by default like ``jax.nn.gelu``; exact with ``approximate=False``.

    Example:
        >>> round(float(js.nn.gelu(jnp.array(1.0), approximate=False)), 4)
        0.8413
    """
    return _gelu_tanh(x) if approximate else _gelu_exact(x)


def swish(x: jax.Array) -> jax.Array:
    """Alias of :func:`silu`.

    Example:
        >>> round(float(js.nn.swish(jnp.array(1.0))), 4)
        0.7311
    """
    return silu(x)


def _leaky_relu_body(x: jax.Array, negative_slope: float) -> jax.Array:
    return jnp.where(x >= 0, x, negative_slope * x).astype(x.dtype)


_leaky_relu = custom_scale(_leaky_relu_body, static_argnums=(1,))


@_leaky_relu.defscale
def _leaky_relu_rule(x: ScaledArray, negative_slope: float) -> ScaledArray:
    x = as_scaled(x)
    return ScaledArray(_leaky_relu_body(x.data, negative_slope), x.scale)


def leaky_relu(x: jax.Array, negative_slope: float = 0.01) -> jax.Array:
    """Leaky ReLU: ``x`` for ``x >= 0``, ``negative_slope * x`` otherwise; scale kept.

    Example:
        >>> js.nn.leaky_relu(jnp.array([-2.0, 3.0]), 0.5).tolist()
        [-1.0, 3.0]
    """
    return _leaky_relu(x, float(negative_slope))


def _softplus_body(x: jax.Array) -> jax.Array:
    return jnp.logaddexp(x, 0).astype(x.dtype)


_softplus = custom_scale(_softplus_body)


@_softplus.defscale
def _softplus_rule(x: ScaledArray) -> ScaledArray:
    """softplus is ``log 2`` near 0 and ``x`` for large x: output scale ``max(s, 1)``."""
    x = as_scaled(x)
    s = scale_f32(x)
    wide = x.data.astype(compute_dtype(x.dtype))
    value = jnp.logaddexp(wide * s.astype(wide.dtype), 0)
    out_scale = round_scale(lax.max(s, jnp.float32(1)))
    data = (value / out_scale.astype(wide.dtype)).astype(x.dtype)
    return ScaledArray(data, make_scale(out_scale, x))


def softplus(x: jax.Array) -> jax.Array:
    """Softplus ``log(1 + exp(x))``; under scalify the output scale is ``max(s, 1)``.

    Example:
        >>> round(float(js.nn.softplus(jnp.array(0.0))), 4)
        0.6931
    """
    return _softplus(x)
