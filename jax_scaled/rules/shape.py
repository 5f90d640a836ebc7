"""Scale rules: shape primitives."""
