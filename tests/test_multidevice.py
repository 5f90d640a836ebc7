"""Multi-device programs under scalify: shardings, shard_map and collectives on 8 CPU devices.

The root conftest.py asks XLA for 8 virtual CPU devices. Collectives run inside
``jax.shard_map`` on shards whose scales differ (each shard's value is multiplied by its own
power of two), against a float64 reference of the same program. Then the acceptance test of
the issue: a tiny transformer's scalified train step under ``jax.jit`` with ``NamedSharding``
(data x tensor parallel) and as a ``shard_map`` data-parallel step match one device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_pow2_scales, random_data, reference64, value64
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scaled as js
from jax_scaled.rules.higher_order.collectives import scaled_shardings

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices: XLA_FLAGS set by the root conftest.py"
)

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
SHARDS = MESH.shape["data"]
SHAPE = (16, 4)
RING = [(i, (i + 1) % SHARDS) for i in range(SHARDS)]

# name: (collective on a shard, in_spec of the input, out_spec, kind of result)
# kinds: "sum" rounds in the data format; "move" (data movement, max, min) is exact at
# power-of-two ratios; "mul" (by the non-power-of-two axis index) rounds once.
COLLECTIVES = {
    "psum": (lambda v: jax.lax.psum(v, "data"), P("data"), P(), "sum"),
    "psum_2d": (lambda v: jax.lax.psum(v, ("data", "model")), P("data", "model"), P(), "sum"),
    "pmean": (lambda v: jax.lax.pmean(v, "data"), P("data"), P(), "sum"),
    "psum_scatter": (
        lambda v: jax.lax.psum_scatter(v, "data", tiled=True),
        P("data"),
        P("data"),
        "sum",
    ),
    "pmax": (lambda v: jax.lax.pmax(v, "data"), P("data"), P(), "move"),
    "pmin": (lambda v: jax.lax.pmin(v, "data"), P("data"), P(), "move"),
    "all_gather": (
        lambda v: jax.lax.all_gather(v, "data", axis=1, tiled=True),
        P("data"),
        P("data"),
        "move",
    ),
    "ppermute": (lambda v: jax.lax.ppermute(v, "data", RING), P("data"), P("data"), "move"),
    "ppermute_partial": (  # shard 0 receives nothing: zeros
        lambda v: jax.lax.ppermute(v, "data", RING[:-1]),
        P("data"),
        P("data"),
        "move",
    ),
    "all_to_all": (
        lambda v: jax.lax.all_to_all(v, "data", 0, 0, tiled=True),
        P("data"),
        P("data"),
        "move",
    ),
    "axis_index": (
        lambda v: v * jax.lax.axis_index("data").astype(v.dtype),
        P("data"),
        P("data"),
        "mul",
    ),
}


@functools.cache
def on_shards(name: str, check_vma: bool = True):
    """The collective inside shard_map, on ``x`` times its shard's factor ``factors[i]``."""
    collective, in_spec, out_spec, _ = COLLECTIVES[name]

    def body(x, factors):
        return collective(x * factors[0].astype(x.dtype))

    return jax.shard_map(
        body, mesh=MESH, in_specs=(in_spec, P("data")), out_specs=out_spec, check_vma=check_vma
    )


@functools.cache
def scalified(name: str, check_vma: bool = True):
    return jax.jit(js.scalify(on_shards(name, check_vma)))


@st.composite
def shard_inputs(draw, dtype):
    """A ScaledArray at 2^-20 or 2^20 and per-shard factors 2^k, k in [-6, 6], not all equal."""
    exponent = draw(st.sampled_from([-20, 20]))
    data = random_data(draw(st.integers(0, 2**31 - 1)), SHAPE, dtype)
    shifts = draw(st.lists(st.integers(-6, 6), min_size=SHARDS, max_size=SHARDS, unique=True))
    x = js.ScaledArray(jnp.asarray(data), jnp.float32(2.0**exponent))
    return x, jnp.asarray(2.0 ** np.array(shifts), jnp.float32)


def check_collective(name: str, dtype, x, factors, check_vma: bool = True):
    out = scalified(name, check_vma)(x, factors)
    assert isinstance(out, js.ScaledArray) and out.dtype == dtype
    assert_pow2_scales(out)
    expected = reference64(on_shards(name, check_vma), x, factors)
    kind = COLLECTIVES[name][3]
    if kind == "sum":  # sums round in the data format: normwise
        assert_close(out, expected, dtype, ulps=4, normwise=True)
    elif dtype == jnp.float32:  # power-of-two alignment is exact in float32
        assert_close(out, expected, dtype, ulps=0 if kind == "move" else 1)
    else:  # float16: aligning shards to the largest scale rounds once more
        assert_close(out, expected, dtype, ulps=1 if kind == "move" else 2, normwise=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("name", sorted(COLLECTIVES))
@given(data=st.data())
def test_collective_on_shards_with_different_scales(name, dtype, data):
    check_collective(name, dtype, *data.draw(shard_inputs(dtype)))


@pytest.mark.parametrize("name", ["psum", "all_gather", "ppermute_partial"])
@given(data=st.data())
def test_collective_without_vma_checks(name, data):
    check_collective(name, jnp.float16, *data.draw(shard_inputs(jnp.float16)), check_vma=False)


@pytest.mark.parametrize("name", ["psum", "ppermute", "all_to_all"])
def test_e8m0_scales_give_the_same_bits(name):
    x = js.ScaledArray(jnp.asarray(random_data(5, SHAPE, jnp.float16)), jnp.float32(2.0**-20))
    factors = jnp.asarray([0.5, 8.0, 1.0, 2.0], jnp.float32)
    out32 = scalified(name)(x, factors)
    with js.ScalifyConfig(scale_dtype=jnp.float8_e8m0fnu):
        x8 = js.ScaledArray(x.data, x.scale.astype(jnp.float8_e8m0fnu))
        out8 = jax.jit(js.scalify(on_shards(name)))(x8, factors)
    assert out8.scale.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(value64(out8), value64(out32))


def test_float16_values_beyond_float16_range_stay_finite():
    """Values near 2^26 are beyond float16 (max 65504): the plain program gives inf."""
    x = js.ScaledArray(jnp.ones(SHAPE, jnp.float16), jnp.float32(2.0**20))
    factors = jnp.asarray([2.0**6, 1.0, 0.5, 2.0], jnp.float32)
    plain = on_shards("psum")(x.to_array(), factors.astype(jnp.float16))
    out = scalified("psum")(x, factors)
    assert not np.all(np.isfinite(plain))
    np.testing.assert_array_equal(value64(out), np.full((4, 4), 2.0**20 * 67.5))


def test_shards_hold_their_own_scales():
    """Inside shard_map each shard's scale is its own (the premise of the tests above).

    Without vma checks: get_data_and_scale's scale output is typed invariant (it is 1 outside
    scalify), so check_vma=True would insert a pvary that rejects the varying scale.
    """

    def body(x, factors):
        return js.get_data_and_scale(x * factors[0].astype(x.dtype))[1][None]

    fn = jax.shard_map(
        body, mesh=MESH, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False
    )
    x = js.ScaledArray(jnp.ones(SHAPE, jnp.float16), jnp.float32(2.0**-20))
    factors = jnp.asarray([2.0**-3, 1.0, 2.0**5, 4.0], jnp.float32)
    scales = jax.jit(js.scalify(fn))(x, factors)
    np.testing.assert_array_equal(scales, 2.0**-20 * np.asarray(factors))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_scalify_inside_shard_map(check_vma):
    """``shard_map(scalify(f))``: ScaledArray specs from scaled_shardings, psum on shards."""
    x = js.ScaledArray(jnp.asarray(random_data(3, SHAPE, jnp.float16)), jnp.float32(2.0**20))
    factors = jnp.asarray([2.0, 1.0, 4.0, 8.0], jnp.float32)
    out_like = js.ScaledArray(jnp.zeros((4, 4), jnp.float16), jnp.float32(1))

    def body(x, factors):
        return jax.lax.psum(x * factors[0].astype(x.dtype), "data")

    def sharded(fn, in_spec, out_spec):
        return jax.shard_map(
            fn, mesh=MESH, in_specs=(in_spec, P("data")), out_specs=out_spec, check_vma=check_vma
        )

    scaled_specs = scaled_shardings(P("data"), x), scaled_shardings(P(), out_like)
    out = jax.jit(sharded(js.scalify(body), *scaled_specs))(x, factors)
    assert isinstance(out, js.ScaledArray) and out.dtype == jnp.float16
    assert_close(out, reference64(sharded(body, P("data"), P()), x, factors), jnp.float16, ulps=4,
                 normwise=True)  # fmt: skip


def test_unsupported_collective_raises_a_clear_error():
    def body(x):
        return jax.lax.pbroadcast(x, ("data",), source=0)

    fn = jax.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(NotImplementedError, match="pbroadcast"):
        jax.make_jaxpr(js.scalify(fn))(scaled_input())


def test_plain_shard_map_is_forwarded():
    fn = on_shards("psum")
    x, factors = jnp.ones(SHAPE), jnp.ones(SHARDS)
    assert str(jax.make_jaxpr(js.scalify(fn))(x, factors)) == str(jax.make_jaxpr(fn)(x, factors))


# --- shardings outside shard_map -------------------------------------------------------------


def scaled_input(dtype=jnp.float32) -> js.ScaledArray:
    return js.as_scaled_array(jnp.asarray(random_data(0, SHAPE, dtype)) * 2.0**-20)


def test_sharding_constraint_shards_data_and_replicates_scale():
    sharding = NamedSharding(MESH, P("data", "model"))

    def fn(x):
        return jax.lax.with_sharding_constraint(x * 2.0, sharding)

    x = scaled_input()
    out = jax.jit(js.scalify(fn))(x)
    assert out.data.sharding.is_equivalent_to(sharding, 2)
    assert out.scale.sharding.is_fully_replicated
    np.testing.assert_array_equal(js.asarray(out), fn(x.to_array()))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_device_put_places_data_like_the_plain_program(jit):
    """Eagerly the data lands where asked; under jit (Auto axes) where plain JAX puts it."""
    sharding = NamedSharding(MESH, P(None, "model"))

    def fn(x, y):
        return jax.device_put((x, y), sharding)

    run = jax.jit if jit else lambda f: f
    x = scaled_input(jnp.float16)
    out, plain = run(js.scalify(fn))(x, jnp.ones(SHAPE))
    expected = run(fn)(x.to_array(), jnp.ones(SHAPE))[0].sharding
    assert expected.is_equivalent_to(sharding, 2) or jit
    assert out.data.sharding.is_equivalent_to(expected, 2)
    assert plain.sharding.is_equivalent_to(expected, 2)
    assert out.scale.sharding.is_fully_replicated
    np.testing.assert_array_equal(value64(out), value64(x))


def test_device_put_to_one_device_moves_data_and_scale():
    device = jax.devices()[3]
    out = js.scalify(lambda x: jax.device_put(x, device))(scaled_input())
    assert out.data.devices() == {device} and out.scale.devices() == {device}


def test_scaled_shardings_pairs_data_and_replicated_scale():
    values = {"w": scaled_input(), "step": jnp.int32(0)}
    sharding = NamedSharding(MESH, P("data"))
    found = scaled_shardings({"w": sharding, "step": sharding}, values)
    assert found["w"].data is sharding and found["step"] is sharding
    assert found["w"].scale.is_fully_replicated and found["w"].scale.mesh == MESH
    broadcast = scaled_shardings(sharding, values)  # a prefix is broadcast
    assert jax.tree.structure(broadcast) == jax.tree.structure(found)
    assert jax.tree.leaves(broadcast) == jax.tree.leaves(found)


def test_explicit_axes_mesh_keeps_sharding_types():
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # JAX's default: Explicit axes

    def fn(x, w):
        h = jax.nn.relu(x @ w)
        return jnp.sum(h * 2.0, axis=1), jax.sharding.reshard(h, P("data", None))

    x = js.as_scaled_array(jnp.asarray(random_data(1, (8, 16), jnp.float32)))
    w = js.as_scaled_array(jnp.asarray(random_data(2, (16, 4), jnp.float32)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, scaled_shardings(P("data", None), x))
        w = jax.device_put(w, scaled_shardings(P(None, "model"), w))
        expected = jax.jit(fn)(x.to_array(), w.to_array())
        out = jax.jit(js.scalify(fn))(x, w)
    for got, want in zip(out, expected, strict=True):
        assert jax.typeof(got.data).sharding.spec == jax.typeof(want).sharding.spec
        np.testing.assert_allclose(js.asarray(got), want, rtol=1e-5, atol=1e-6)


# --- acceptance: a tiny transformer, sharded -------------------------------------------------

VOCAB, WIDTH, HEADS, HIDDEN, LENGTH, BATCH = 32, 16, 2, 32, 8, 8
TENSOR_PARALLEL = {
    "embed": P(), "ln1": P(), "ln2": P(),
    "qkv": P(None, "model"), "out": P("model", None),
    "w1": P(None, "model"), "w2": P("model", None),
}  # fmt: skip


def init_transformer(key) -> dict:
    keys = jax.random.split(key, 5)

    def normal(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)

    return {
        "embed": normal(keys[0], (VOCAB, WIDTH), 1),
        "ln1": jnp.ones(WIDTH),
        "ln2": jnp.ones(WIDTH),
        "qkv": normal(keys[1], (WIDTH, 3 * WIDTH), WIDTH),
        "out": normal(keys[2], (WIDTH, WIDTH), WIDTH),
        "w1": normal(keys[3], (WIDTH, HIDDEN), WIDTH),
        "w2": normal(keys[4], (HIDDEN, WIDTH), HIDDEN),
    }


def layer_norm(x, gain):
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5) * gain


def constrain(x, spec, sharded: bool):
    return jax.lax.with_sharding_constraint(x, NamedSharding(MESH, spec)) if sharded else x


def attention(params, x):
    heads = lambda t: t.reshape(*t.shape[:2], HEADS, WIDTH // HEADS)  # noqa: E731
    q, k, v = map(heads, jnp.split(x @ params["qkv"], 3, axis=-1))
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(WIDTH // HEADS)
    logits = jnp.where(jnp.tril(jnp.ones((LENGTH, LENGTH), bool)), logits, -1e9)
    mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v)
    return mixed.reshape(x.shape) @ params["out"]


def transformer_loss(params, tokens, targets, sharded=False):
    h = params["embed"][tokens]
    h = h + attention(params, layer_norm(h, params["ln1"]))
    hidden = jax.nn.gelu(layer_norm(h, params["ln2"]) @ params["w1"])
    h = h + constrain(hidden, P("data", None, "model"), sharded) @ params["w2"]
    logits = constrain(h, P("data", None, None), sharded) @ params["embed"].T
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, VOCAB) * log_probs, -1))


def sgd(params, grads):
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)


def train_step(params, tokens, targets, sharded=False):
    loss, grads = jax.value_and_grad(transformer_loss)(params, tokens, targets, sharded)
    return sgd(params, grads), loss


def data_parallel_step(params, tokens, targets, check_vma: bool):
    """A shard_map step: local gradients, summed over the data axis, then SGD."""

    def local_step(params, tokens, targets):
        loss, grads = jax.value_and_grad(transformer_loss)(params, tokens, targets)
        if not check_vma:  # local gradients: sum them explicitly
            grads, loss = jax.lax.psum((grads, loss), "data")
        else:  # gradients of replicated params arrive summed (JAX inserts the psum)
            loss = jax.lax.psum(loss, "data")
        grads = jax.tree.map(lambda g: g / SHARDS, grads)
        return sgd(params, grads), loss / SHARDS

    specs = (P(), P("data"), P("data"))
    return jax.shard_map(
        local_step,
        mesh=MESH,
        in_specs=specs,
        out_specs=(P(), P()),
        axis_names={"data"},
        check_vma=check_vma,
    )(params, tokens, targets)


@pytest.fixture(scope="module")
def transformer():
    """Parameters, a batch, and the plain single-device step's result."""
    params = init_transformer(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, VOCAB)
    batch = (tokens[:, :-1], tokens[:, 1:])
    return params, batch, jax.jit(train_step)(params, *batch)


def assert_same_step(got, expected, rtol=1e-5):
    for name, want in expected[0].items():
        assert isinstance(got[0][name], js.ScaledArray), name
        want = np.asarray(want, np.float64)
        error = np.max(np.abs(value64(got[0][name]) - want)) / np.max(np.abs(want))
        assert error <= rtol, (name, error)
    np.testing.assert_allclose(value64(got[1]), expected[1], rtol=rtol)


def test_transformer_step_under_jit_with_named_shardings(transformer):
    params, batch, expected = transformer
    params = js.as_scaled_array(params)
    param_shardings = {k: NamedSharding(MESH, spec) for k, spec in TENSOR_PARALLEL.items()}
    in_shardings = (scaled_shardings(param_shardings, params), NamedSharding(MESH, P("data")))
    step = jax.jit(
        js.scalify(functools.partial(train_step, sharded=True)),
        in_shardings=(in_shardings[0], in_shardings[1], in_shardings[1]),
    )
    compiled = step.lower(params, *batch).compile()
    assert_same_step(compiled(params, *batch), expected)
    # The shardings survive: inputs as given, updated parameters sharded like the inputs.
    compiled_params = compiled.input_shardings[0][0]
    out_params = compiled.output_shardings[0]
    for name, sharding in param_shardings.items():
        for found in (compiled_params[name], out_params[name]):
            assert found.data.is_equivalent_to(sharding, 2), (name, found.data)
            assert found.scale.is_fully_replicated, (name, found.scale)
    assert compiled.input_shardings[0][1].is_equivalent_to(in_shardings[1], 2)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_transformer_data_parallel_shard_map_step(transformer, check_vma):
    params, batch, expected = transformer
    step = functools.partial(data_parallel_step, check_vma=check_vma)
    got = jax.jit(js.scalify(step))(js.as_scaled_array(params), *batch)
    assert_same_step(got, expected)
