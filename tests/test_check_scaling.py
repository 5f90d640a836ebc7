"""js.diagnostics.check_scaling: unit-normal data in; data RMS (bits) of outputs and gradients."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js

BATCH = 64
HEAD_DIM = 64


def _features(width):
    return (jnp.zeros((BATCH, width)),)


def _softmax_cross_entropy(width):
    labels = jax.nn.one_hot(jnp.arange(BATCH) % width, width, dtype=jnp.float16)

    def softmax_cross_entropy(logits):  # one-hot labels are data, not checked
        return js.nn.softmax_cross_entropy(logits, labels)

    return softmax_cross_entropy, _features(width)


def _attention(seq, **kwargs):
    q = jnp.zeros((2, seq, 4, HEAD_DIM))
    return functools.partial(js.nn.dot_product_attention, **kwargs), (q, q, q)


# name -> width -> (function, example arguments). "width": the normalised or softmaxed axis,
# the attention sequence, the linear layer's input and output features.
ON_FEATURES = ("relu", "gelu", "silu", "swish", "elu", "leaky_relu", "softplus")
ON_FEATURES += ("layer_norm", "rms_norm", "softmax", "log_softmax")


def _on_features(name, *parameter_shapes):
    fn = getattr(js.nn, name)
    return lambda w: (fn, (*_features(w), *[jnp.zeros(s(w)) for s in parameter_shapes]))


def _vector(width):
    return (width,)


CASES = {name: _on_features(name) for name in ON_FEATURES}
CASES["layer_norm(weight, bias)"] = _on_features("layer_norm", _vector, _vector)
CASES["rms_norm(weight)"] = _on_features("rms_norm", _vector)
CASES["softmax_cross_entropy"] = _softmax_cross_entropy
CASES["dot_product_attention"] = _attention
CASES["dot_product_attention(is_causal)"] = lambda seq: _attention(seq, is_causal=True)
CASES["linear"] = _on_features("linear", lambda w: (w, w), _vector)

WIDTHS = (64, 1024)
# The softmax-family and normalisation estimates depend on the width (log N, 1/N, sqrt N):
# also check a wide axis (attention at sequence 4096 is left out: 0.5 GB of logits).
WIDE = ("softmax", "log_softmax", "layer_norm", "rms_norm", "softmax_cross_entropy")


def _params():
    for name in CASES:
        for width in WIDTHS + ((4096,) if name in WIDE else ()):
            yield pytest.param(name, width, id=f"{name}-{width}")


@pytest.mark.parametrize("name, width", list(_params()))
def test_nn_functions_stay_within_two_bits_forward_and_backward(name, width):
    fn, args = CASES[name](width)
    report = js.diagnostics.check_scaling(fn, *args, dtype=jnp.float16, tolerance_bits=2.0)
    assert {e.backward for e in report.entries} == {False, True}
    assert report.ok, str(report)


def _wrong_matmul():
    @js.custom_scale
    def matmul(a, b):
        return a @ b

    @matmul.defscale
    def forgets_sqrt_k(a, b):
        return js.ScaledArray(a.data @ b.data, a.scale * b.scale)

    return matmul


@pytest.mark.parametrize("k", [64, 256, 4096])
def test_a_rule_that_forgets_sqrt_k_is_flagged_by_log2_sqrt_k(k):
    a, b = jnp.zeros((32, k)), jnp.zeros((k, 16))
    report = js.diagnostics.check_scaling(_wrong_matmul(), a, b)
    out = report.entry("out")
    assert not report.ok and report.failures == (out,)
    assert abs(out.rms_bits - math.log2(math.sqrt(k))) < 0.5
    assert "FAILED (1 of 3)" in str(report) and "off unit scale" in str(report)


def test_the_automatic_matmul_rule_passes():
    report = js.diagnostics.check_scaling(jnp.matmul, jnp.zeros((32, 256)), jnp.zeros((256, 16)))
    assert report.ok and [e.name for e in report.entries] == ["out", "grad a", "grad b"]
    assert all(abs(e.rms_bits) < 0.5 for e in report.entries)


def test_shape_dtype_structs_pytrees_and_fixed_integer_arguments():
    def embed_and_project(params, tokens):
        return params["table"][tokens] @ params["w"]

    params = {"table": jax.ShapeDtypeStruct((100, 32), jnp.float32), "w": jnp.zeros((32, 8))}
    tokens = jnp.arange(48) % 100
    report = js.diagnostics.check_scaling(embed_and_project, params, tokens)
    names = [e.name for e in report.entries]
    assert names == ["out", "grad params['table']", "grad params['w']"]
    assert report.entry("out").dtype == "float16" and report.entry("out").shape == (48, 8)


def test_a_non_floating_shape_dtype_struct_is_refused():
    with pytest.raises(ValueError, match="concrete array"):
        js.diagnostics.check_scaling(
            lambda x, i: x[i], jnp.zeros(8), jax.ShapeDtypeStruct((4,), jnp.int32)
        )


def test_seed_dtype_and_plain_outputs():
    same = [js.diagnostics.check_scaling(jnp.tanh, jnp.zeros(256), seed=3) for _ in range(2)]
    other = js.diagnostics.check_scaling(jnp.tanh, jnp.zeros(256), seed=4)
    assert same[0].entries == same[1].entries != other.entries
    wide = js.diagnostics.check_scaling(jnp.tanh, jnp.zeros(256, jnp.float32), dtype=None)
    assert wide.dtype == "float32" and wide.entry("out").dtype == "float32"
    bf16 = js.diagnostics.check_scaling(js.nn.relu, jnp.zeros((16, 64)), dtype=jnp.bfloat16)
    assert bf16.ok and bf16.dtype == "bfloat16" and bf16.entry("grad x").dtype == "bfloat16"


def test_entries_are_the_data_statistics():
    def double(x):
        return 4.0 * x

    report = js.diagnostics.check_scaling(double, jnp.zeros(4096), tolerance_bits=0.25)
    out, grad = report.entry("out"), report.entry("grad x")
    assert out.scaled and out.scale == 4.0 and grad.scale == 4.0
    assert abs(out.rms_bits) < 0.1 and abs(out.value_rms_bits - 2.0) < 0.1
    np.testing.assert_allclose(out.data_rms, grad.data_rms, rtol=0.1)
    assert report.ok and "ok" in str(report).splitlines()[0]


def test_the_report_lists_the_recorded_values_that_drift():
    def l1_norm(x):  # correlated terms: the sum grows as N, the rule's estimate as sqrt(N)
        return jnp.sum(jnp.abs(x), axis=-1)

    assert js.diagnostics.check_scaling(l1_norm, jnp.zeros((8, 1024))).records == ()
    report = js.diagnostics.check_scaling(l1_norm, jnp.zeros((8, 1024)), record=True)
    assert not report.ok and report.entry("out").rms_bits > 4  # 0.8 * sqrt(1024) = 2^4.7
    assert all(isinstance(r, js.diagnostics.ScaleRecord) for r in report.records)
    listed = str(report).split("intermediates beyond the tolerance")[1]
    assert "fwd reduce_sum +4.7 bits" in listed
