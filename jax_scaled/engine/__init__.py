"""The engine: how ``scalify`` walks a jaxpr and hands each equation to its scale rule.

* :mod:`~jax_scaled.engine.interpreter`: the jaxpr walk and ``scalify`` itself;
* :mod:`~jax_scaled.engine.tracing`: tracing on pytree arguments and the per-equation
  evaluation loop (shared with ``dot_formats``);
* :mod:`~jax_scaled.engine.registry`: one record per primitive (its rule and properties);
* :mod:`~jax_scaled.engine.facts`, :mod:`~jax_scaled.engine.estimates`: static facts and
  magnitude estimates of plain values;
* :mod:`~jax_scaled.engine.promotion`: plain operands made ScaledArrays, exactly;
* :mod:`~jax_scaled.engine.constants`: literals that a narrow trace rounded away;
* :mod:`~jax_scaled.engine.block_dispatch`: block-scaled operands meeting per-tensor rules;
* :mod:`~jax_scaled.engine.recording`: scales recorded for diagnostics;
* :mod:`~jax_scaled.engine.peephole`, :mod:`~jax_scaled.engine.fusion`: rewrites that keep
  the compiled program lean.

It sits above the scale math (:mod:`jax_scaled.pow2`, :mod:`jax_scaled.scales`) and below
the rules and every user-facing op; ``tests/test_architecture.py`` checks the order.
"""
