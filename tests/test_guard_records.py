"""What a range guard took, read again instead of recomputed: a guarded float16 output's
largest magnitude serves the guard of its next narrowing (a cast to float8, a power), and a
division by one leaves its operand as it is."""

from itertools import product

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HOW, all_eqns, built, covering, heavy_tailed

import jax_scaled as js
from jax_scaled.nn.cast_contraction import current_scale

EXTREMES = [2.0**-20, 2.0**20]
CONSUMERS = {
    "cast to E4M3": lambda y: y.astype(jnp.float8_e4m3fn),
    "cast to E5M2": lambda y: y.astype(jnp.float8_e5m2),
    "square": jnp.square,
}


def _guarded_product(x, w):
    return x @ w  # a float16 contraction: its output is range-guarded


def _reductions(fn, *args) -> int:
    """``reduce_max`` equations of ``fn`` scalified."""
    jaxpr = jax.make_jaxpr(js.scalify(fn))(*args).jaxpr
    return sum(e.primitive.name == "reduce_max" for e in all_eqns(jaxpr))


def _bytes(y: js.ScaledArray) -> tuple[bytes, bytes]:
    return np.asarray(y.data).tobytes(), np.asarray(y.scale).tobytes()


@pytest.mark.parametrize(
    ("consumer", "scale", "how"), covering(list(product(CONSUMERS, [2.0**-20, 1.0, 2.0**20])), HOW)
)
def test_a_guarded_output_s_next_guard_reads_its_largest_magnitude(consumer, how, scale):
    # Same bits as a guard that reduces the float16 data afresh, with one reduction fewer.
    read = CONSUMERS[consumer]
    x = built(how, jnp.asarray(heavy_tailed(1, (256, 128))), jnp.float16, scale)
    w = js.as_scaled_array(jnp.asarray(heavy_tailed(2, (128, 128)) / 16, jnp.float16))
    together = jax.jit(js.scalify(lambda x, w: read(_guarded_product(x, w))))(x, w)
    apart = jax.jit(js.scalify(read))(jax.jit(js.scalify(_guarded_product))(x, w))
    assert _bytes(together) == _bytes(apart)
    together = _reductions(lambda x, w: read(_guarded_product(x, w)), x, w)
    assert together == _reductions(_guarded_product, x, w)


@pytest.mark.parametrize("special", [0.0, np.inf, np.nan])
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_a_guarded_output_of_zero_or_non_finite_data_is_read_as_before(consumer, special):
    read = CONSUMERS[consumer]
    values = np.zeros((256, 128), np.float32) if special == 0.0 else heavy_tailed(3, (256, 128))
    values[5] = special  # a whole row of the product
    x = js.as_scaled_array(jnp.asarray(values, jnp.float16))
    w = js.as_scaled_array(jnp.asarray(heavy_tailed(4, (128, 128)) / 16, jnp.float16))
    together = jax.jit(js.scalify(lambda x, w: read(_guarded_product(x, w))))(x, w)
    apart = jax.jit(js.scalify(read))(jax.jit(js.scalify(_guarded_product))(x, w))
    assert _bytes(together) == _bytes(apart)


def test_a_division_by_a_scaled_operand_s_current_scale_is_its_operand():
    # Under scalify an operand's current scaling (js.dot_formats' "current" recipe) is the
    # constant 1: the division by it leaves the operand, and its guard record, as they are.
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)

    def divided(x):
        return x / current_scale(x, e4m3)

    x = js.scaled_array(jnp.asarray(heavy_tailed(5, (4, 8))), 2.0**-20)
    jaxpr = jax.make_jaxpr(js.scalify(divided))(x)
    assert not any(e.primitive.name == "div" for e in all_eqns(jaxpr.jaxpr))
    assert _bytes(jax.jit(js.scalify(divided))(x)) == _bytes(x)


def test_a_scalar_divided_by_ones_takes_their_shape():
    def divided(x):
        return x / np.ones(3, np.float32)

    x = js.scaled_array(jnp.float32(1.5), 4.0)
    y = js.scalify(divided)(x)
    assert y.shape == (3,) and js.asarray(y).tolist() == [6.0, 6.0, 6.0]


LAYOUTS = {
    "reshape": lambda y: jnp.reshape(y, (128, 256)),
    "transpose": lambda y: y.T,
    "broadcast": lambda y: jnp.broadcast_to(y, (2, 256, 128)),
    "expand_dims then squeeze": lambda y: jnp.squeeze(y[None], 0),
    "rev": lambda y: jax.lax.rev(y, (0,)),  # jnp.flip: a jit of its own, a trace the record
    # does not reach
    "tile": lambda y: jnp.tile(y, (2, 1)),
    "sum of one term": lambda y: jnp.sum(y[:, None], axis=1),
}


@pytest.mark.parametrize(
    ("layout", "consumer", "how", "scale"),
    covering(list(product(LAYOUTS, ["cast to E4M3", "square"])), list(product(HOW, EXTREMES))),
)
def test_a_guard_record_holds_through_data_movement(layout, consumer, how, scale):
    # A layout op keeps every magnitude: the next guard reads the product's record.
    read, move = CONSUMERS[consumer], LAYOUTS[layout]
    x = built(how, jnp.asarray(heavy_tailed(6, (256, 128))), jnp.float16, scale)
    w = js.as_scaled_array(jnp.asarray(heavy_tailed(7, (128, 128)) / 16, jnp.float16))

    def together(x, w):
        return read(move(_guarded_product(x, w)))

    apart = jax.jit(js.scalify(lambda y: read(move(y))))(
        jax.jit(js.scalify(_guarded_product))(x, w)
    )
    assert _bytes(jax.jit(js.scalify(together))(x, w)) == _bytes(apart)
    assert _reductions(together, x, w) == _reductions(_guarded_product, x, w)


@pytest.mark.parametrize(
    ("layout", "scale", "how"),
    covering(list(product(["reshape", "transpose", "broadcast"], EXTREMES)), HOW),
)
def test_a_float32_rescale_s_record_holds_through_data_movement(layout, how, scale):
    # A dynamic rescale records the largest magnitude of its float32 output; a cast of the
    # moved data to float16 reads it (float32 data at scales far from 1).
    move = LAYOUTS[layout]
    x = built(how, jnp.asarray(heavy_tailed(9, (256, 128))), jnp.float32, scale)

    def together(x):
        return move(js.ops.dynamic_rescale_l2(x)).astype(jnp.float16)

    apart = jax.jit(js.scalify(lambda y: move(y).astype(jnp.float16)))(
        jax.jit(js.scalify(js.ops.dynamic_rescale_l2))(x)
    )
    assert _bytes(jax.jit(js.scalify(together))(x)) == _bytes(apart)
    assert _reductions(together, x) == _reductions(js.ops.dynamic_rescale_l2, x)


@pytest.mark.parametrize("consumer", ["cast to E4M3", "square"])
def test_a_slice_without_the_largest_datum_is_guarded_afresh(consumer):
    # A slice drops magnitudes: its guard must not read the whole product's record.
    read = CONSUMERS[consumer]
    values = heavy_tailed(8, (256, 128)) / 64
    values[0, 0] = 2.0**12  # the largest product lands in row 0, which the slice drops
    x = js.as_scaled_array(jnp.asarray(values, jnp.float16))
    w = js.as_scaled_array(jnp.eye(128, dtype=jnp.float16))
    together = jax.jit(js.scalify(lambda x, w: read(_guarded_product(x, w)[1:])))(x, w)
    apart = jax.jit(js.scalify(lambda y: read(y[1:])))(jax.jit(js.scalify(_guarded_product))(x, w))
    assert _bytes(together) == _bytes(apart)
