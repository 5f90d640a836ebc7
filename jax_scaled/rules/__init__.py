"""Scale rules, one module per primitive family. Importing this package registers them all."""

from jax_scaled.rules import elementwise, linalg  # noqa: F401
