"""Scale rules, one module per primitive family. Importing this package registers them all."""

from jax_scaled.rules import (  # noqa: F401
    block_contractions,
    block_layout,
    casts,
    complex,
    elementwise,
    factorizations,
    higher_order,
    indexing,
    linalg,
    powers,
    reductions,
    reductions_custom,
    shape,
    special,
    transcendental,
)
