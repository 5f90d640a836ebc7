"""Rules of primitives that carry sub-programs: calls, control flow, collectives.

They interpret their sub-jaxprs with the engine's interpreter and bind the results again
through JAX's public API. Importing this package registers them.
"""

from jax_scaled.rules.higher_order import calls, collectives, control_flow  # noqa: F401
