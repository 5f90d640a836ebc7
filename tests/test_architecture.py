"""The package's structure (issues 18 and 26): layers imported only downwards, no import
cycle, no private name imported across modules, a small interpreter, primitive knowledge only
in the registry's records, and the worked example of docs/architecture.md."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, reference64

import jax_scaled as js
from jax_scaled import _jax_internals as jxi
from jax_scaled.engine.registry import Property, record

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_scaled"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """``(imported module, names, line)`` for every jax_scaled import of ``module``, at any
    depth (function-level and ``TYPE_CHECKING`` imports included)."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_scaled"):
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            named = [a.name for a in node.names if a.name.startswith("jax_scaled")]
            found += [(name, [], node.lineno) for name in named]
    return found


def _dependencies(module: str) -> set[str]:
    """The jax_scaled modules ``module`` imports explicitly (``from jax_scaled import x``
    counts as importing the module ``jax_scaled.x`` when there is one)."""
    found = set()
    for target, names, _ in _imports(module):
        submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        found.update(submodules or [target])
    found.discard(module)
    return found


def test_no_import_cycle():
    graph = {m: _dependencies(m) for m in MODULES if m != "jax_scaled"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dependency in sorted(graph.get(module, ())):
            if dependency == "jax_scaled":
                continue  # the package's public re-exports: never imported by its modules
            if state.get(dependency) == 1:
                cycle = stack[stack.index(dependency) :] + [dependency]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if state.get(dependency) is None:
                visit(dependency)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module)


def test_package_modules_do_not_import_the_package():
    """Modules import what they use from its module, never from ``jax_scaled`` itself
    (whose ``__init__`` imports them all)."""
    offenders = [
        f"{m}:{line}"
        for m in MODULES
        if m != "jax_scaled"
        for target, names, line in _imports(m)
        if target == "jax_scaled" and any(f"jax_scaled.{n}" not in MODULES for n in names)
    ]
    assert not offenders, offenders


# The package's layers, lowest first: a module may import from its own layer and those below,
# never from a layer above (docs/architecture.md draws them). Modules not named here are the
# user-facing layer on top (scalify's API, quantize, nn, ops, optim, diagnostics, tree).
LAYERS = (
    ("base", ("_jax_internals", "dtypes", "any_scale", "formats", "context", "memo")),
    ("power-of-two arithmetic", ("pow2",)),
    ("ScaledArray and config", ("array", "construction", "config")),
    ("scale math on ScaledArrays", ("scales",)),
    ("engine", ("engine",)),
    ("rules", ("rules",)),
)


def _layer(module: str) -> int:
    """Index of ``module``'s layer in :data:`LAYERS` (the user-facing layer: ``len(LAYERS)``)."""
    name = module.removeprefix("jax_scaled.")
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    return len(LAYERS)


def _layer_name(index: int) -> str:
    return LAYERS[index][0] if index < len(LAYERS) else "user-facing"


def test_no_import_goes_up_a_layer():
    """E.g. the engine imports no user-facing op: it reads ``js.quantize``'s tracing flag
    from the per-call context, not from ``jax_scaled.quantize``."""
    offenders = [
        f"{m} ({_layer_name(_layer(m))}) imports {d} ({_layer_name(_layer(d))})"
        for m in MODULES
        if m != "jax_scaled"
        for d in _dependencies(m)
        if d != "jax_scaled" and _layer(d) > _layer(m)
    ]
    assert not offenders, offenders


def test_every_layer_has_modules():
    """A renamed folder must not leave its layer silently empty (and the test vacuous)."""
    counts = collections.Counter(_layer(m) for m in MODULES)
    assert all(counts[i] > 0 for i in range(len(LAYERS) + 1)), counts


def _defining_module(module: str, name: str) -> str | None:
    """The module of ``module``'s package tree that defines ``name`` at top level."""
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        targets = []
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if name in targets:
            return module
    return None


def test_no_private_name_is_imported_from_another_module():
    offenders = []
    for module in MODULES:
        for target, names, line in _imports(module):
            for name in names:
                if name.startswith("_") and target in MODULES and _defining_module(target, name):
                    offenders.append(f"{module}:{line} imports {target}.{name}")
    assert not offenders, offenders


def test_the_interpreter_is_small():
    assert len(MODULES["jax_scaled.engine.interpreter"].read_text().splitlines()) < 300


def _string_collections(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Set | ast.List | ast.Tuple):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = node.keys
        else:
            continue
        strings = [e.value for e in elements if isinstance(e, ast.Constant)]
        if len(strings) >= 2 and all(isinstance(s, str) for s in strings):
            yield node.lineno, strings


# A documentation table of the generator of docs/operators.md: which primitives can never
# carry floating-point data (so never a ScaledArray), reviewed by hand against JAX's dtype
# rules. The interpreter does not read it.
NAME_TABLES_ALLOWED = {"jax_scaled.coverage"}


def test_no_name_keyed_primitive_sets_outside_the_registry():
    names = set(jxi.all_lax_primitives())
    offenders = []
    for module, path in MODULES.items():
        if module in NAME_TABLES_ALLOWED:
            continue
        for line, strings in _string_collections(ast.parse(path.read_text())):
            if sum(s in names for s in strings) >= 2:
                offenders.append(f"{module}:{line} {strings}")
    assert not offenders, offenders


# --- the worked example of docs/architecture.md ------------------------------------------


def _architecture_example() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Adding a primitive's rule: one file") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def softsign_p():
    namespace: dict = {"__name__": "docs_architecture_example"}
    exec(compile(_architecture_example(), "docs/architecture.md", "exec"), namespace)
    return namespace["softsign_p"]


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**20])
def test_architecture_example_rule(softsign_p, scale):
    data = jax.random.normal(jax.random.key(0), (16,)).astype(jnp.float16)
    x = js.ScaledArray(data, jnp.float32(scale))
    fn = softsign_p.bind
    out = jax.jit(js.scalify(fn))(x)
    assert isinstance(out, js.ScaledArray) and float(out.scale) == min(scale, 1.0)
    assert_close(out, reference64(fn, x), jnp.float16, ulps=2)


def test_architecture_example_record(softsign_p):
    found = record(softsign_p)
    assert found.has(Property.FOLDS_SCALARS) and found.rule is not None
    # Outside scalify the primitive is itself; under scalify plain operands pass untouched.
    plain = np.asarray(js.scalify(softsign_p.bind)(jnp.array([1.0, -3.0])))
    np.testing.assert_allclose(plain, [0.5, -0.75])
