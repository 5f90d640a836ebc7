"""Scale rules: transcendental primitives."""
