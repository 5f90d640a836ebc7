"""Scale rules: indexing primitives."""
