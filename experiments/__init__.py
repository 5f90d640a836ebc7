"""Experiments for jax_scaled: small, reproducible training runs comparing precisions.

Run the demo with ``python -m experiments`` (or ``make demo``).
"""
