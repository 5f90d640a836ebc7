"""Test session set-up (XLA flags, a compilation cache), and the names available to the
docstring examples run by ``pytest --doctest-modules jax_scaled``."""

import os
import shutil
import tempfile

# Set before JAX initialises a backend. Eight virtual CPU devices for the multi-device tests.
# LLVM at -O0 for the CPU kernels: the suite's programs are small, so XLA's compile is most of
# its time, and LLVM's passes about 40% of that (a tiny GPT's scalified FP8 step: 4.2 s at
# -O0, 6 to 8 s at -O2). The optimised HLO, what the structure tests count, is the same at
# any level. The kernels' results can differ from -O2's in the last bit (LLVM's choice of
# instructions, fused multiply-adds among them), so a bit-for-bit test compares values that
# any kernel rounds alike, as it must anyway: XLA fuses one HLO differently in two programs.
_TEST_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
for _flag in _TEST_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax_scaled as js  # noqa: E402

# One persistent compilation cache per test session, shared by its xdist workers (they
# inherit the variable from the controller) and removed at its end: tests compile the same
# programs (float64 references, plain twins of a model); the rule, user-value and Table 3
# tests take a fifth less time with it. Every program is cached, not only those compiling
# for a second or more (JAX's default): at -O0 most compile faster, and the rule, Table 3
# and dot-format tests took 6% less time again (85 s against 90 s, interleaved runs).
_CACHE_VARIABLE = "JAX_SCALED_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jax_scaled_tests_xla_")
    if cache := os.environ.get(_CACHE_VARIABLE):
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and (cache := os.environ.pop(_CACHE_VARIABLE, None)):
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace.update({"jax": jax, "jnp": jnp, "np": np, "js": js})
    doctest_namespace.update({name: getattr(js, name) for name in js.__all__})
