"""Every use of JAX internals (``jax._src``, ``jax.core``, ``jax.extend``) lives in
``jax_scaled/_jax_internals.py``: a JAX upgrade that moves one touches one file."""

from __future__ import annotations

import ast
import pathlib

import pytest

import jax_scaled

PACKAGE = pathlib.Path(jax_scaled.__file__).parent
INTERNAL = ("jax._src", "jax.core", "jax.extend")


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a chain of attribute accesses on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def internal_uses(source: str) -> list[str]:
    """The internal modules that ``source`` imports or reaches through ``jax.<internal>``.

    Example:
        >>> internal_uses("import jax\\nx = jax.core.Tracer\\nfrom jax._src import core")
        ['jax.core.Tracer', 'jax._src']
    """
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.startswith(INTERNAL))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(INTERNAL):
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and _dotted(node).startswith(INTERNAL):
            found.append(_dotted(node))  # the whole chain; its inner links are not visited
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_internal_uses_finds_imports_and_attribute_chains():
    source = "import jax.extend.core\nfrom jax._src import core\ny = jax.core.ShapedArray\n"
    source += "z = jax.numpy.ones"
    assert internal_uses(source) == ["jax.extend.core", "jax._src", "jax.core.ShapedArray"]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_jax_internals.py"),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_jax_internals_outside_the_one_module(path: pathlib.Path):
    assert internal_uses(path.read_text()) == [], f"{path}: use jax_scaled._jax_internals"
