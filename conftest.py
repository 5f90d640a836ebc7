"""Names available to the docstring examples run by ``pytest --doctest-modules jax_scaled``."""

import os

# Eight virtual CPU devices for the multi-device tests; set before JAX initialises a backend.
_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_scaled as js  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update({"jax": jax, "jnp": jnp, "np": np, "js": js})
    doctest_namespace.update({name: getattr(js, name) for name in js.__all__})
