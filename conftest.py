"""Names available to the docstring examples run by ``pytest --doctest-modules jax_scaled``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_scaled as js


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update({"jax": jax, "jnp": jnp, "np": np, "js": js})
    doctest_namespace.update({name: getattr(js, name) for name in js.__all__})
