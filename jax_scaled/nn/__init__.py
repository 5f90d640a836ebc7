"""Scale-aware neural-network building blocks: FP8-aware linear, activations, norms."""
