"""Test configuration: deterministic, CI-sized hypothesis runs."""

import os

from hypothesis import HealthCheck, settings

# The ci profile (default) keeps `make test` within CI's 20 minutes on 2 cores: most
# hypothesis examples draw a new shape, so each costs two compilations (the scalified program
# and its float64 reference), about 0.5 s: a third of the suite's time. With 6 examples CI
# took 21 minutes, install included. HYPOTHESIS_PROFILE=thorough runs 200 examples per test.
settings.register_profile(
    "ci",
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
