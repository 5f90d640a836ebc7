"""docs/operators.md is current, and the statuses it gives are true of scalify's behaviour."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import jax_scaled as js
from jax_scaled import coverage
from jax_scaled._jax_internals import all_lax_primitives

ROOT = Path(__file__).resolve().parent.parent


def test_committed_doc_matches_generator():
    documented = re.search(r"of JAX (\S+) \(", coverage.DOC_PATH.read_text())
    if documented is None or documented.group(1) != jax.__version__:
        pytest.skip(f"docs/operators.md is not for JAX {jax.__version__}: {coverage.REGENERATE}")
    # A fresh process: the document lists what `import jax_scaled` registers, nothing that
    # other tests may have registered in this one.
    check = subprocess.run(
        [sys.executable, "-m", "jax_scaled.coverage", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, (
        f"docs/operators.md is stale. Regenerate it: {coverage.REGENERATE}\n{check.stderr}"
    )


def test_check_mode_detects_a_stale_document(tmp_path, capsys):
    doc = tmp_path / "operators.md"
    assert coverage.main(["--output", str(doc)]) == 0
    assert coverage.main(["--check", "--output", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("| `dot_general` | rule", "| `dot_general` | none"))
    assert coverage.main(["--check", "--output", str(doc)]) == 1
    assert coverage.REGENERATE in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    ["scan", "while", "cond", "remat2", "shard_map", "psum", "reduce_scatter", "tile",
     "scatter-sub", "random_wrap", "pvary", "optimization_barrier"],
)  # fmt: skip
def test_document_lists_primitives_missing_from_jax_extend(name):
    rows = [line for line in coverage.generate().splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, rows


def test_every_classified_primitive_exists_and_has_no_rule():
    installed = all_lax_primitives()
    stale = sorted(set(coverage.NEVER_FLOAT_OPERANDS) - set(installed))
    assert not stale, f"not primitives of JAX {jax.__version__}: {stale}"
    ruled = sorted(set(coverage.NEVER_FLOAT_OPERANDS) & set(js.registered_primitives()))
    assert not ruled, f"classified as never-float but given a scale rule: {ruled}"


# Forwarded primitives, a public function binding each, and an operand dtype it accepts.
FORWARDED_SAMPLES = {
    "and": (lambda x: lax.bitwise_and(x, x), jnp.int32),
    "or": (lambda x: lax.bitwise_or(x, x), jnp.int32),
    "xor": (lambda x: lax.bitwise_xor(x, x), jnp.int32),
    "not": (lax.bitwise_not, jnp.int32),
    "shift_left": (lambda x: lax.shift_left(x, x), jnp.int32),
    "shift_right_arithmetic": (lambda x: lax.shift_right_arithmetic(x, x), jnp.int32),
    "shift_right_logical": (lambda x: lax.shift_right_logical(x, x), jnp.int32),
    "population_count": (lax.population_count, jnp.int32),
    "clz": (lax.clz, jnp.int32),
    "mulhi": (lambda x: lax.mulhi(x, x), jnp.int32),
    "reduce_and": (lambda x: lax.reduce_and(x, (0,)), jnp.int32),
    "reduce_or": (lambda x: lax.reduce_or(x, (0,)), jnp.int32),
    "reduce_xor": (lambda x: lax.reduce_xor(x, (0,)), jnp.int32),
    "real": (lax.real, jnp.complex64),
    "imag": (lax.imag, jnp.complex64),
}


@pytest.mark.parametrize("name", sorted(FORWARDED_SAMPLES))
def test_forwarded_primitives_refuse_floating_point_operands(name):
    fn, accepted = FORWARDED_SAMPLES[name]
    assert coverage.primitive_status(name, {}, {})[0] == coverage.FORWARDED
    jaxpr = jax.make_jaxpr(fn)(jnp.ones((3,), accepted))
    assert name in {eqn.primitive.name for eqn in jaxpr.eqns}
    for dtype in (jnp.float32, jnp.float16):
        with pytest.raises(TypeError):
            jax.eval_shape(fn, jax.ShapeDtypeStruct((3,), dtype))


def test_forwarded_primitives_run_untouched_next_to_scaled_values():
    def fn(x, key):
        noise = jax.random.uniform(key, x.shape)  # random_bits, shift_right_logical, or
        ramp = lax.iota(jnp.float32, x.shape[0])
        mask = lax.bitwise_and(lax.iota(jnp.int32, x.shape[0]), 1) == 0
        return jnp.where(mask, x * noise, x + ramp)

    x = np.linspace(-1.0, 1.0, 8, dtype=np.float32) * 2.0**-12
    key = jax.random.PRNGKey(3)
    expected = fn(jnp.asarray(x), key)
    out = jax.jit(js.scalify(fn))(js.as_scaled_array(jnp.asarray(x)), key)
    assert isinstance(out, js.ScaledArray)
    np.testing.assert_allclose(np.asarray(js.asarray(out)), np.asarray(expected), rtol=1e-6)


# Unary float primitives and a public function binding each on operands in its domain
# (x is drawn in [0.25, 0.75]).
UNARY_SAMPLES = {
    "acos": lax.acos,
    "acosh": lambda x: lax.acosh(x + 1.0),
    "asin": lax.asin,
    "asinh": lax.asinh,
    "atanh": lax.atanh,
    "bessel_i0e": lax.bessel_i0e,
    "bessel_i1e": lax.bessel_i1e,
    "digamma": lax.digamma,
    "lgamma": lax.lgamma,
    "erf": lax.erf,
    "sin": lax.sin,
    "tanh": lax.tanh,
}


@pytest.mark.parametrize("name", sorted(UNARY_SAMPLES))
def test_documented_status_is_what_scalify_does(name):
    """A "rule" primitive computes the plain result; a "not supported" one raises, naming it."""
    status = {c.name: c.status for c in coverage.lax_coverage()}[name]
    fn = UNARY_SAMPLES[name]
    x = np.random.default_rng(0).uniform(0.25, 0.75, (6,)).astype(np.float32)
    scaled = js.as_scaled_array(jnp.asarray(x))
    if status == coverage.NOT_SUPPORTED:
        with pytest.raises(NotImplementedError, match=f"'{name}'"):
            js.scalify(fn)(scaled)
    else:
        assert status == coverage.RULE
        out = js.asarray(jax.jit(js.scalify(fn))(scaled))
        np.testing.assert_allclose(np.asarray(out), np.asarray(fn(x)), rtol=2e-6, atol=1e-7)


def test_rules_defined_outside_any_module_do_not_break_the_document():
    # A rule written in exec'd code (a notebook cell, a docs example) has no __module__.
    orphan_p = Primitive("orphan_rule_test")
    rule = eval("lambda x: x", {})  # noqa: S307 - a function whose __module__ is None
    assert rule.__module__ is None
    js.register_scale_rule(orphan_p)(rule)
    assert "orphan_rule_test" not in coverage.generate()


def test_readme_and_docs_give_the_generated_rule_count():
    """One number of primitives with a rule: the one docs/operators.md counts."""
    count = re.search(r"^\| rule \| (\d+) \|$", coverage.DOC_PATH.read_text(), re.M).group(1)
    places = [(ROOT / "README.md", "Scale rules for {} primitives"),
              (ROOT / "docs" / "index.md", "Rules exist for {} primitives")]  # fmt: skip
    for path, sentence in places:
        assert sentence.format(count) in path.read_text(), (
            f"{path.name}: write '{sentence.format(count)}' (the count of docs/operators.md)"
        )
