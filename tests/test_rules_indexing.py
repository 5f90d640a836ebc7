"""Scale rules for indexing primitives: gather, dynamic_slice, scatter, max-pool derivatives.

Index arrays are plain int32 inputs. Reads must be bit exact; writes align operand and updates
to a common scale, so the smaller side rounds once relative to the larger values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FLOAT_DTYPES,
    check_e8m0_matches,
    check_named,
    eps,
    reference64,
    scaled_arrays,
    shapes,
    value64,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jax_scaled as js

few = settings(max_examples=max(3, settings.default.max_examples // 3))


def _indices(data, low: int, high: int, size: int) -> jax.Array:
    """``size`` random int32 indices in ``[low, high)`` (repeats allowed)."""
    drawn = data.draw(st.lists(st.integers(low, high - 1), min_size=size, max_size=size))
    return jnp.asarray(drawn, jnp.int32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_reads_bit_exact(dtype, data):
    shape = data.draw(shapes(min_dims=2))
    n, m = shape[0], shape[-1]
    x = data.draw(scaled_arrays(shape, dtype))
    rows = _indices(data, -n - 2, n + 2, 4)  # out of bounds: take's default NaN fill
    cols = _indices(data, 0, m, 3 * m).reshape(*([1] * (len(shape) - 1)), 3 * m)
    start = _indices(data, -1, n + 1, 1)[0]  # dynamic_slice clamps

    def fn(x, rows, cols, start):
        starts = (start,) + (start * 0,) * (x.ndim - 1)  # one int type, also under x64
        return {
            "take": jnp.take(x, rows, axis=0),
            "take_along_axis": jnp.take_along_axis(
                x, jnp.broadcast_to(cols, (*shape[:-1], 3 * m)), axis=-1
            ),
            "fancy": x[jnp.clip(rows, 0, n - 1), ..., 0],
            "dynamic_index": x[jnp.clip(start, 0, n - 1)],
            "lax.dynamic_slice": lax.dynamic_slice(x, starts, (1, *shape[1:])),
            "dynamic_slice_in_dim": lax.dynamic_slice_in_dim(x, start, 1, axis=0),
        }

    out = check_named(fn, [x, rows, cols, start], dtype, ulps=0)
    assert all(y.scale == x.scale for y in js.tree.tree_leaves(out))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_writes_align_operand_and_updates(dtype, data):
    n, m = data.draw(st.integers(2, 5)), data.draw(st.integers(1, 4))
    k = data.draw(st.integers(1, n))
    x = data.draw(scaled_arrays((n, m), dtype))
    u = data.draw(scaled_arrays((k, m), dtype))
    factor = data.draw(scaled_arrays((k, m), dtype, min_exp=0, max_exp=0, low=0.5, high=2.0))
    plain = data.draw(scaled_arrays((n, m), dtype, min_exp=0, max_exp=0)).data
    repeats = _indices(data, 0, n, k)
    unique = jnp.asarray(data.draw(st.permutations(range(n)))[:k], jnp.int32)
    start = _indices(data, 0, n - k + 1, 1)[0]
    fill = data.draw(st.sampled_from([3.0, -1e4, 0.0, 2.0**-30]))

    def fn(x, u, factor, plain, repeats, unique, start):
        return {
            "set": x.at[unique].set(u),
            "set_scalar": x.at[unique].set(1.5),
            "slice_set": x.at[:k].set(u),
            "add": x.at[repeats].add(u),
            "add_into_zeros": jnp.zeros_like(x).at[repeats].add(u),
            "subtract": x.at[repeats].subtract(u),  # scatter-sub
            "subtract_from_zeros": jnp.zeros_like(x).at[repeats].subtract(u),
            "min": x.at[repeats].min(u),
            "max": x.at[repeats].max(u),
            "multiply": x.at[repeats].multiply(factor),
            "dynamic_update_slice": lax.dynamic_update_slice(x, u, (start, start * 0)),
            "update_plain": lax.dynamic_update_slice(plain, u, (start, start * 0)),
            "take_fill": jnp.take(x, jnp.append(repeats, n), axis=0, mode="fill", fill_value=fill),
            "gather_transpose": jax.vjp(lambda p: jnp.take(p, repeats, axis=0), plain)[1](u)[0],
            "iota": x * jnp.arange(m, dtype=x.dtype),
        }

    # Operand and updates meet at the larger scale, so each output rounds relative to the
    # largest input (fill value included); sums of up to k + 1 terms round k + 1 times.
    inputs = [x, u, factor, plain, repeats, unique, start]
    largest = max([1.5, abs(fill)] + [np.max(np.abs(value64(v))) for v in (x, u, plain)])
    out = check_named(fn, inputs, dtype, ulps=k + 1, atol=(k + 1) * eps(dtype) * largest)
    assert out["add_into_zeros"].scale == u.scale  # a zero operand takes any scale
    assert out["subtract_from_zeros"].scale == u.scale
    assert out["subtract"].scale == max(x.scale, u.scale)  # sqrt(so^2 + su^2), rounded down
    assert out["gather_transpose"].scale == u.scale
    assert out["set"].scale == max(x.scale, u.scale)


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 1), "VALID")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@few
@given(data=st.data())
def test_max_pool_derivatives(dtype, data):
    """Derivatives of max pooling of a plain input with scaled (co)tangents."""
    n, m = data.draw(st.integers(2, 5)), data.draw(st.integers(2, 5))
    x = data.draw(scaled_arrays((n, m), dtype, min_exp=0, max_exp=0)).data
    tangent = data.draw(scaled_arrays((n, m), dtype))
    cotangent = data.draw(scaled_arrays((n - 1, m - 1), dtype))

    def fn(x, tangent, cotangent):
        return {
            "jvp": jax.jvp(_max_pool, (x,), (tangent,))[1],  # select_and_gather_add
            "vjp": jax.vjp(_max_pool, x)[1](cotangent)[0],  # select_and_scatter_add
        }

    # Overlapping windows sum up to 4 cotangents per element.
    out = check_named(fn, [x, tangent, cotangent], dtype, ulps=4, normwise=True)
    assert out["jvp"].scale == tangent.scale and out["vjp"].scale == cotangent.scale
    exact = reference64(lambda x, t: jax.jvp(_max_pool, (x,), (t,))[1], x, tangent)
    np.testing.assert_array_equal(value64(out["jvp"]), exact)  # moves tangents bit for bit


@few  # bit identity does not depend on the values drawn
@given(data=st.data())
def test_indexing_rules_e8m0_bit_identical(data):
    x = data.draw(scaled_arrays((4, 3), jnp.float16))
    u = data.draw(scaled_arrays((2, 3), jnp.float16))
    idx = jnp.array([3, 0, 3])

    def fn(x, u):
        gathered = jnp.take(x, idx, axis=0, mode="fill", fill_value=7.0)
        added = x.at[idx[:2]].add(u)
        subtracted = x.at[idx[1:]].subtract(u)
        return gathered, added, subtracted, lax.dynamic_update_slice(added, u, (1, 0))

    check_e8m0_matches(fn, [x, u])
