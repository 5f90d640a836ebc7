"""Orbax checkpoints of ScaledArray parameters and scaled optimizer state.

Each case saves mid-training, restores into an abstract target of the state, checks data,
scales and dtypes bit for bit, and checks that training continues exactly as a run that was
never interrupted. The README's "Checkpoints" block runs here too.
"""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_scaled as js

ocp = pytest.importorskip("orbax.checkpoint")

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def loss_fn(params, x):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - 1.0) ** 2)


def make_step(opt):
    @jax.jit
    @js.scalify
    def step(params, opt_state, x):
        grads = jax.grad(loss_fn)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def run(step, state, x, n):
    for _ in range(n):
        state = step(*state, x)
    return state


def plain_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (8, 64)) / 3, "w2": jax.random.normal(k2, (64, 4)) / 8}


def batch():
    return js.as_scaled_array(jax.random.normal(jax.random.key(1), (16, 8)))


def assert_identical(got, want):
    """Same containers (ScaledArray nodes included) and leaves equal bit for bit."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def save_restore(path, state, checkpointer=ocp.StandardCheckpointer, target="shape_dtype"):
    if target == "shape_dtype":
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    elif target == "eval_shape":
        target = jax.eval_shape(lambda: state)
    with checkpointer() as ckptr:
        ckptr.save(path, state)
    with checkpointer() as ckptr:
        return ckptr.restore(path, target)


def check_resumes(path, step, state, x, **restore_options):
    """Save after 2 steps; the restored state equals it and 2 more steps match exactly."""
    state = run(step, state, x, 2)
    restored = save_restore(path, state, **restore_options)
    assert_identical(restored, state)
    assert_identical(run(step, restored, x, 2), run(step, state, x, 2))
    return restored


@pytest.mark.parametrize("target", ["shape_dtype", "eval_shape"])
def test_float16_params_and_per_tensor_state_resume_exactly(tmp_path, target):
    opt = optax.adam(1e-2)
    params = js.tree.astype(js.as_scaled_array(plain_params()), jnp.float16)
    with warnings.catch_warnings():  # one scale per tensor: the documented warning
        warnings.simplefilter("ignore", js.tree.OptimizerStateWarning)
        opt_state = js.tree.astype(js.as_scaled_array(opt.init(params)), jnp.float16)
    state = check_resumes(
        tmp_path / "ckpt", make_step(opt), (params, opt_state), batch(), target=target
    )
    mu = state[1][0].mu["w1"]
    assert isinstance(mu, js.ScaledArray) and mu.data.dtype == jnp.float16


@pytest.mark.parametrize("checkpointer", [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer])
def test_block_scaled_e8m0_state_resumes_exactly(tmp_path, checkpointer):
    opt = js.optim.scaled_state(optax.adam(1e-2), scale_dtype=jnp.float8_e8m0fnu)
    opt_state, params = opt.init(plain_params()), js.as_scaled_array(plain_params())
    state = check_resumes(
        tmp_path / "ckpt", make_step(opt), (params, opt_state), batch(), checkpointer=checkpointer
    )
    nu = state[1][0].nu["w1"]
    assert (nu.data.dtype, nu.scale.dtype, nu.scale.shape) == (
        jnp.float16,
        jnp.float8_e8m0fnu,
        (8, 2),
    )


@pytest.mark.parametrize("checkpointer", [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer])
def test_flat_state_resumes_exactly(tmp_path, checkpointer):
    opt = js.optim.scaled_state(optax.adam(1e-2), flat=True)
    opt_state, params = opt.init(plain_params()), js.as_scaled_array(plain_params())
    state = check_resumes(
        tmp_path / "ckpt", make_step(opt), (params, opt_state), batch(), checkpointer=checkpointer
    )
    assert isinstance(state[1], js.optim.FlatState)
    assert state[1].tree[0].mu["w1"] == opt_state.tree[0].mu["w1"]  # where each leaf lives
    assert state[1].expanded()[0].nu["w1"].data.dtype == jnp.float16


@pytest.mark.parametrize("checkpointer", [ocp.StandardCheckpointer, ocp.PyTreeCheckpointer])
def test_mxfp8_value_keeps_its_dtypes_and_block_scales(tmp_path, checkpointer):
    x = js.quantize(jax.random.normal(jax.random.key(2), (4, 64)), js.formats.MXFP8_E4M3, axis=-1)
    restored = save_restore(tmp_path / "ckpt", {"x": x}, checkpointer)["x"]
    assert (restored.data.dtype, restored.scale.dtype) == (jnp.float8_e4m3fn, jnp.float8_e8m0fnu)
    assert_identical(restored, x)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: XLA_FLAGS in conftest.py")
def test_sharded_block_scaled_state_restores_its_shards(tmp_path):
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("x", None))
    opt = js.optim.scaled_state(optax.adam(1e-2), scale_dtype=jnp.float8_e8m0fnu)
    params = js.as_scaled_array(plain_params())
    params = jax.device_put(params, js.scaled_shardings({"w1": rows, "w2": rows}, params))
    state = (params, opt.init(params))
    restored = check_resumes(tmp_path / "ckpt", make_step(opt), state, batch())
    for got, want in zip(
        jax.tree.leaves(restored), jax.tree.leaves(run(make_step(opt), state, batch(), 2))
    ):
        assert got.sharding == want.sharding
        shards = [(s.device, s.index, np.asarray(s.data).tobytes()) for s in got.addressable_shards]
        assert shards == [
            (s.device, s.index, np.asarray(s.data).tobytes()) for s in want.addressable_shards
        ]
    assert restored[0]["w1"].data.sharding.spec == P("x", None)


def test_restore_without_target_needs_rebuild_like(tmp_path):
    opt = js.optim.scaled_state(optax.adam(1e-2))
    step, x = make_step(opt), batch()
    state = run(step, (js.as_scaled_array(plain_params()), opt.init(plain_params())), x, 2)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        raw = ckptr.restore(tmp_path / "ckpt")
    assert isinstance(raw[0]["w1"], list)  # orbax's plain containers: [data, scale]
    with pytest.raises(TypeError):
        step(*raw, x)
    rebuilt = js.tree.rebuild_like(raw, jax.eval_shape(lambda: state))
    assert_identical(rebuilt, state)
    assert_identical(run(step, rebuilt, x, 2), run(step, state, x, 2))


def test_rebuild_like_names_the_leaf_that_does_not_match():
    target = {"w": js.as_scaled_array(jnp.ones((2, 3))), "count": jnp.zeros((), jnp.int32)}
    with pytest.raises(TypeError, match=r"restored tree has no leaf at \['w'\]\[1\]: restore "):
        js.tree.rebuild_like({"w": [jnp.ones((2, 3))], "count": jnp.int32(0)}, target)
    with pytest.raises(TypeError, match=r"leaf \['w'\]\[0\] has shape \(3, 2\) float32"):
        js.tree.rebuild_like({"w": [jnp.ones((3, 2)), jnp.ones(())], "count": jnp.int32(0)}, target)
    with pytest.raises(TypeError, match=r"leaf \['count'\] has shape \(\) float32"):
        js.tree.rebuild_like(
            {"w": [jnp.ones((2, 3)), jnp.ones(())], "count": jnp.float32(1)}, target
        )


def test_rebuild_like_keeps_namedtuple_fields_by_name():
    # optax states are namedtuples whose fields are not in sorted order; orbax gives a dict.
    target = optax.ApplyIfFiniteState(
        jnp.int32(0), jnp.bool_(True), jnp.int32(0), {"mu": js.as_scaled_array(jnp.ones(2))}
    )
    raw = {
        "notfinite_count": jnp.int32(3),
        "last_finite": jnp.bool_(False),
        "total_notfinite": jnp.int32(5),
        "inner_state": {"mu": [jnp.ones(2), jnp.ones(())]},
    }
    rebuilt = js.tree.rebuild_like(raw, target)
    assert (int(rebuilt.notfinite_count), int(rebuilt.total_notfinite)) == (3, 5)
    assert isinstance(rebuilt.inner_state["mu"], js.ScaledArray)


def test_readme_checkpoints_block_resumes_exactly(tmp_path):
    text = README.read_text()
    namespace: dict = {}
    for section in ("Quickstart", "Checkpoints"):
        code = re.search(rf"## {section}\n.*?```python\n(.*?)```", text, re.S).group(1)
        if section == "Checkpoints":
            want = namespace["train_step"](
                namespace["params"], namespace["opt_state"], namespace["batch"]
            )
        exec(compile(code, str(README), "exec"), namespace)
    assert_identical((namespace["params"], namespace["opt_state"]), want[:2])
