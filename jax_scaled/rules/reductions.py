"""Scale rules: reductions primitives."""
