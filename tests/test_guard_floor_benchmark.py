"""``benchmarks/guard_floor.py``: the plain float16 program with the range guard's work on the
outputs scalify guards, kept by XLA, and nothing else of scalify."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

pytest.importorskip("flax")

ms = load_benchmark("model_scale")
guard_floor = load_benchmark("guard_floor")
# Not the size of test_hlo_anatomy_benchmark's GPT: traced here first in the same worker, the
# equal scalified step carried this file's line into that test's HLO metadata, where it looks
# for its own line ("(scalify's own)").
TINY = dataclasses.replace(ms.SIZE, width=16, heads=2, context=8, batch_size=3, layers=1)
F16 = jnp.float16


def _matmuls(x, w):
    y = x @ w
    return jnp.sum(y.astype(jnp.float32)), y


def test_data_in_the_guard_band_comes_out_as_the_plain_program_s():
    x, w = jnp.ones((16, 64), F16), jnp.full((64, 8), 0.5, F16)  # products of 32
    floored = guard_floor.guard_floor(_matmuls)
    for got, want in zip(jax.jit(floored)(x, w), _matmuls(x, w), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert guard_floor.guard_counts(jax.make_jaxpr(floored)(x, w).jaxpr) == {"dot_general": 1}


def test_contractions_inside_jit_and_checkpoint_are_guarded_too():
    x, w = jnp.ones((16, 64), F16), jnp.full((64, 8), 0.5, F16)
    for wrap in (jax.jit, jax.checkpoint):
        floored = guard_floor.guard_floor(wrap(_matmuls))
        np.testing.assert_array_equal(np.asarray(floored(x, w)[1]), np.asarray(_matmuls(x, w)[1]))
        assert guard_floor.guard_counts(jax.make_jaxpr(floored)(x, w).jaxpr) == {"dot_general": 1}


def test_a_guard_that_moves_a_power_of_two_stays_in_the_compiled_program():
    x, w = jnp.full((16, 64), 2.0**10, F16), jnp.full((64, 8), 0.5, F16)  # products of 2^15
    floored = jax.jit(guard_floor.guard_floor(_matmuls))
    (total, y), (_, plain) = floored(x, w), _matmuls(x, w)
    ratio = np.asarray(plain, np.float64) / np.asarray(y, np.float64)
    assert np.all(ratio == ratio.flat[0]) and ratio.flat[0] > 1  # a power of two moved out
    assert np.log2(ratio.flat[0]).is_integer()
    assert float(total) == float(jnp.sum(y.astype(jnp.float32)))
    compiled = floored.lower(x, w).compile().as_text()
    assert "dynamic-slice" in compiled  # the factor's lookup by the binade, not folded away


@functools.cache
def _tiny(name: str):
    params = ms.init_params(TINY.model_config(ms.VOCAB), "unrolled", 0)
    runner = ms.build(name, TINY, "unrolled", params)
    traced = runner.step.trace(*runner.state, *ms.batch_of(TINY))
    return traced.jaxpr.jaxpr, ms.hlo_instructions(traced.lower().compile().as_text())


def _plain_count(jaxpr, primitive: str) -> int:
    return sum(
        e.primitive.name == primitive and e.outvars[0].aval.dtype == F16
        for j in ms.all_jaxprs(jaxpr)
        for e in j.eqns
    )


def test_the_floor_of_a_gpt_step_guards_its_contractions_sums_and_casts():
    plain, plain_hlo = _tiny("fp16")
    floor, floor_hlo = _tiny(ms.GUARD_FLOOR)
    _, scalified_hlo = _tiny("fp16_scalify")
    found = guard_floor.guard_counts(floor)
    assert found["dot_general"] == _plain_count(plain, "dot_general") > 0
    params = jax.tree.leaves(ms.init_params(TINY.model_config(ms.VOCAB), "unrolled", 0))
    assert found["cast"] == len(params)  # every float32 parameter cast to float16
    assert found["add_any"] > 0 and found["reduce_sum"] > 0
    assert found["sum"] == 2 * TINY.layers  # the residual joins, two a block
    assert plain_hlo < floor_hlo < scalified_hlo
    assert ms.plain_twin(ms.GUARD_FLOOR, ["fp16_scalify", ms.GUARD_FLOOR, "fp16"]) == "fp16"
