"""Scale rules, one module per primitive family. Importing this package registers them all."""

from jax_scaled.rules import (  # noqa: F401
    block_contractions,
    block_layout,
    calls,
    casts,
    collectives,
    complex,
    control_flow,
    elementwise,
    factorizations,
    indexing,
    linalg,
    reductions,
    reductions_custom,
    shape,
    special,
    transcendental,
)
