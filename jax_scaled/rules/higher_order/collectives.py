"""Scale rules for multi-device programs: shardings, ``shard_map`` and collectives.

A ScaledArray has one scalar scale per tensor. Across devices:

* Under ``jax.jit`` with shardings (``with_sharding_constraint``, ``device_put``), the data is
  placed as asked and the scale replicated: every device holds the same scale.
* Inside ``shard_map`` every device runs the body on its own shard, so each device may hold
  its own scale (a local ``set_scaling``, a scale received by ``ppermute``). A collective that
  combines shards first *agrees* on one scale: the largest of the shards' scales (``pmax`` of
  a scalar; shards whose data is all zero take no part), re-expresses every shard's data at
  it (exact: a power-of-two ratio), then communicates the data in its own dtype. The agreed
  scale is the same on every device.
* With ``check_vma=True`` (JAX's default) JAX types the mesh axes each value varies over; a
  scale typed invariant over a collective's axes is known equal everywhere and the agreement
  is skipped. Without that typing (``check_vma=False``) it is always done: one scalar
  all-reduce per collective.
* A ``shard_map`` output gets one replicated scale (spec ``P()``), agreed the same way over
  the manual axes, so that ``out_specs`` reassembles data shards that share a scale.

Output scales follow DESIGN's table: sums (``psum``, ``psum_scatter``) ``S * sqrt(N)`` with
``S`` the agreed scale and ``N`` the number of shards summed (the ``reduce_sum`` estimate);
``pmax``, ``pmin``, gathers and ``all_to_all`` keep ``S``; ``ppermute`` keeps each shard's own
scale (sent along with the data where it may differ). ``pmean`` is ``psum`` then a division.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_scaled import _jax_internals as jxi
from jax_scaled.array import ScaledArray, check_block_sharding
from jax_scaled.engine.facts import Slot, plain_slot
from jax_scaled.engine.interpreter import interpret_jaxpr
from jax_scaled.engine.registry import register_higher_order_rule, register_scale_rule
from jax_scaled.pow2.static import MIN_SCALE_EXPONENT
from jax_scaled.scales import make_scale, rescale, safe_ratio, scale_f32, sqrt_pow2

# ---------------------------------------------------------------------------------------
# Shardings of scaled values
# ---------------------------------------------------------------------------------------


def replicated_like(sharding: Any) -> Any:
    """The placement of a scale next to data placed by ``sharding``: replicated, same devices.

    A ``PartitionSpec`` gives ``P()``; a ``NamedSharding`` the replicated one on its mesh; a
    device, a memory space, ``None`` or a fully replicated sharding are returned unchanged.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> replicated_like(P("data", None))
        P()
    """
    if isinstance(sharding, PartitionSpec):
        return PartitionSpec()
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    if not isinstance(sharding, jax.sharding.Sharding) or sharding.is_fully_replicated:
        return sharding
    devices = np.array(sorted(sharding.device_set, key=lambda d: d.id))
    mesh = jax.sharding.Mesh(devices, ("devices",))
    return NamedSharding(mesh, PartitionSpec(), memory_kind=sharding.memory_kind)


def scaled_shardings(shardings: Any, values: Any) -> Any:
    """Shardings (or shard_map specs) for a pytree that holds ScaledArrays.

    ``shardings`` has the structure of ``values`` with ScaledArrays as leaves (it may be a
    prefix of it). Where ``values`` has a ScaledArray the result has a ScaledArray node
    ``(sharding, scale sharding)``: the data placed as asked; a 0-d scale replicated
    (``replicated_like(sharding)``), block scales sharded like the data (the same sharding:
    the scale has the data's rank), so that every shard holds the scales of its own blocks.
    A ``NamedSharding`` that would split a block is refused with a ``ValueError``
    (:func:`~jax_scaled.array.check_block_sharding`); for a ``PartitionSpec`` JAX refuses
    a scale whose grid does not divide among the devices, which is the same condition. Pass
    the result as ``in_shardings``/``out_shardings`` of ``jax.jit`` or as
    ``in_specs``/``out_specs`` of ``jax.shard_map``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> specs = scaled_shardings({"w": P("model")}, {"w": scaled_array([1.0, 2.0], 1.0)})
        >>> specs["w"].data, specs["w"].scale
        (P('model',), P())
        >>> blocks = ScaledArray(jnp.ones((4, 64)), jnp.ones((4, 2), jnp.float32))
        >>> scaled_shardings(P("model", None), blocks).scale
        P('model', None)
    """

    def pair(sharding, value):
        if not isinstance(value, ScaledArray):
            return sharding
        if np.ndim(value.scale) == 0:
            return ScaledArray.tree_unflatten(None, (sharding, replicated_like(sharding)))
        check_block_sharding(value, sharding)
        return ScaledArray.tree_unflatten(None, (sharding, sharding))

    def broadcast(sharding, subtree):
        return jax.tree.map(lambda v: pair(sharding, v), subtree, is_leaf=_is_scaled)

    is_leaf = lambda x: x is None or isinstance(x, PartitionSpec)  # noqa: E731
    return jax.tree.map(broadcast, shardings, values, is_leaf=is_leaf)


@register_scale_rule(jxi.sharding_constraint_p)
def sharding_constraint_rule(x: ScaledArray, *, sharding, **params) -> ScaledArray:
    """Data constrained to ``sharding``; the scale constrained to replicated on its mesh."""
    data = jxi.sharding_constraint_p.bind(x.data, sharding=sharding, **params)
    replicated = replicated_like(sharding)
    if not isinstance(replicated, NamedSharding):
        return ScaledArray(data, x.scale)
    scale_params = dict(params, layout=None, unconstrained_dims=frozenset())
    scale = jxi.sharding_constraint_p.bind(x.scale, sharding=replicated, **scale_params)
    return ScaledArray(data, scale)


if jxi.reshard_p is not None:

    @register_scale_rule(jxi.reshard_p)
    def reshard_rule(x: ScaledArray, **params) -> ScaledArray:
        """``jax.sharding.reshard`` (explicit sharding): data resharded; the 0-d scale is
        replicated by type already."""
        return ScaledArray(jxi.reshard_p.bind(x.data, **params), x.scale)


@register_scale_rule(jxi.device_put_p)
def device_put_rule(*xs, devices, srcs, copy_semantics) -> list:
    """Data put where asked; each scale put replicated on the same devices."""
    datas = [x.data if isinstance(x, ScaledArray) else x for x in xs]
    put = jxi.device_put_p.bind(*datas, devices=devices, srcs=srcs, copy_semantics=copy_semantics)
    scaled = [i for i, x in enumerate(xs) if isinstance(x, ScaledArray)]
    scales = jxi.device_put_p.bind(
        *[xs[i].scale for i in scaled],
        devices=tuple(replicated_like(devices[i]) for i in scaled),
        srcs=tuple(srcs[i] for i in scaled),
        copy_semantics=tuple(copy_semantics[i] for i in scaled),
    )
    for i, scale in zip(scaled, scales, strict=True):
        put[i] = ScaledArray(put[i], scale)
    return list(put)


# ---------------------------------------------------------------------------------------
# Agreeing on one scale across devices
# ---------------------------------------------------------------------------------------


def _as_axes(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _scale_may_differ(scale: jax.Array, axes: tuple) -> tuple:
    """The axes among ``axes`` over which ``scale`` may differ between devices.

    With JAX's varying-axes typing on (``check_vma``) these are the axes it is typed varying
    over; without it, all of them.
    """
    if not jxi.vma_checked():
        return axes
    varying = jxi.varying_axes(scale)
    return tuple(a for a in axes if a in varying)


def _agreed_scale(x: ScaledArray, axis_name: Any) -> jax.Array:
    """The float32 scale all devices along ``axis_name`` share: the largest of theirs.

    A shard whose data is all zero holds its value at any scale: it takes no part (it would
    otherwise impose a meaningless scale, such as that of a product with zero).
    """
    scale = scale_f32(x)
    differ = _scale_may_differ(scale, _as_axes(axis_name))
    if not differ:
        return scale
    smallest = np.float32(2.0**MIN_SCALE_EXPONENT)
    return lax.pmax(jnp.where(jnp.any(x.data != 0), scale, smallest), differ)


def _data_at(x: ScaledArray, scale: jax.Array) -> jax.Array:
    """``x``'s data re-expressed at the power-of-two ``scale`` (exact unless it underflows).

    The ratio is capped to a finite float32: only all-zero data can meet a larger one.
    """
    own = scale_f32(x)
    if own is scale:
        return x.data
    ratio = lax.min(safe_ratio(own, scale), np.float32(jnp.finfo(jnp.float32).max))
    return rescale(x.data, ratio)


def _with_agreed_scale(x: ScaledArray, axis_name: Any) -> ScaledArray:
    """``x`` at the scale all devices along ``axis_name`` agree on."""
    scale = _agreed_scale(x, axis_name)
    if scale is scale_f32(x):
        return x
    return ScaledArray(_data_at(x, scale), make_scale(scale, x))


def _axis_size(axes: tuple, primitive: str) -> int:
    if any(isinstance(a, int) for a in axes):
        raise NotImplementedError(
            f"scalify supports {primitive} over named mesh axes only, got axes {axes}."
        )
    return int(lax.axis_size(axes))


def _check_no_groups(primitive: str, axis_index_groups: Any) -> None:
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"scalify does not support {primitive} with axis_index_groups (pmap-only "
            "feature); use shard_map over a sub-mesh instead."
        )


# ---------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------


def _summed(x: ScaledArray, axes: tuple, count: int, bind: Callable) -> ScaledArray:
    """A sum over ``count`` shards: scale ``S * sqrt(count)``, data summed in its dtype."""
    scale = _agreed_scale(x, axes) * np.float32(sqrt_pow2(count))
    return ScaledArray(bind(_data_at(x, scale)), make_scale(scale, x))


@register_scale_rule(jxi.psum_p)
def psum_rule(x: ScaledArray, *, axes: tuple, axis_index_groups: Any) -> ScaledArray:
    """Agreed scale ``S`` (pmax of the shards' scales) times ``sqrt(N)``, N shards summed."""
    _check_no_groups("psum", axis_index_groups)
    bind = lambda d: jxi.psum_p.bind(d, axes=axes, axis_index_groups=None)  # noqa: E731
    return _summed(x, axes, _axis_size(axes, "psum"), bind)


if jxi.psum_invariant_p is not None:

    @register_scale_rule(jxi.psum_invariant_p)
    def psum_invariant_rule(x: ScaledArray, *, axes: tuple) -> ScaledArray:
        """``psum`` under ``check_vma``: scale ``S * sqrt(N)`` like :func:`psum_rule`."""
        bind = lambda d: jxi.psum_invariant_p.bind(d, axes=axes)  # noqa: E731
        return _summed(x, axes, _axis_size(axes, "psum"), bind)


@register_scale_rule(jxi.reduce_scatter_p)
def reduce_scatter_rule(x: ScaledArray, *, axis_name, axis_index_groups, **params) -> ScaledArray:
    """``psum_scatter``: scale ``S * sqrt(N)``, data reduce-scattered in its dtype."""
    _check_no_groups("psum_scatter", axis_index_groups)
    count = _axis_size(_as_axes(axis_name), "psum_scatter")
    bind = lambda d: jxi.reduce_scatter_p.bind(  # noqa: E731
        d, axis_name=axis_name, axis_index_groups=None, **params
    )
    return _summed(x, _as_axes(axis_name), count, bind)


def _on_agreed(primitive: jxi.Primitive, axis_param: str) -> Callable:
    """A rule that binds ``primitive`` on data brought to the agreed scale, keeping it."""

    def rule(x: ScaledArray, **params) -> ScaledArray:
        _check_no_groups(primitive.name, params.get("axis_index_groups"))
        x = _with_agreed_scale(x, params[axis_param])
        return ScaledArray(primitive.bind(x.data, **params), x.scale)

    rule.__name__ = f"{primitive.name}_rule"
    rule.__doc__ = f"Agreed scale S (pmax of the shards' scales); {primitive.name} of the data."
    return rule


register_scale_rule(jxi.pmax_p)(_on_agreed(jxi.pmax_p, "axes"))
register_scale_rule(jxi.pmin_p)(_on_agreed(jxi.pmin_p, "axes"))
register_scale_rule(jxi.all_gather_p)(_on_agreed(jxi.all_gather_p, "axis_name"))
register_scale_rule(jxi.all_to_all_p)(_on_agreed(jxi.all_to_all_p, "axis_name"))
if jxi.all_gather_invariant_p is not None:
    register_scale_rule(jxi.all_gather_invariant_p)(
        _on_agreed(jxi.all_gather_invariant_p, "axis_name")
    )


@register_scale_rule(jxi.ppermute_p)
def ppermute_rule(x: ScaledArray, *, axis_name, perm) -> ScaledArray:
    """Each device receives its source's data and scale (the scale only if it may differ).

    Devices no pair sends to receive zeros, here with scale 0 when scales travel.
    """
    data = jxi.ppermute_p.bind(x.data, axis_name=axis_name, perm=perm)
    if not _scale_may_differ(x.scale, _as_axes(axis_name)):
        return ScaledArray(data, x.scale)
    scale = jxi.ppermute_p.bind(scale_f32(x), axis_name=axis_name, perm=perm)
    return ScaledArray(data, make_scale(scale, x))


if jxi.pvary_p is not None:

    @register_scale_rule(jxi.pvary_p)
    def pvary_rule(x: ScaledArray, *, axes: tuple) -> ScaledArray:
        """Data typed varying over ``axes``; the scale keeps its type (invariant stays so).

        Axes the data already varies over (a per-device ``set_scaling`` of a replicated value
        makes it vary) are skipped.
        """
        missing = tuple(a for a in axes if a not in jxi.varying_axes(x.data))
        data = jxi.pvary_p.bind(x.data, axes=missing) if missing else x.data
        return ScaledArray(data, x.scale)


# ---------------------------------------------------------------------------------------
# shard_map
# ---------------------------------------------------------------------------------------


def _flatten_scaled(values: Sequence[Any], specs: Sequence[Any]) -> tuple[list, list]:
    """Arrays and specs with each ScaledArray split into data (its spec) and scale (``P()``)."""
    arrays, flat_specs = [], []
    for value, spec in zip(values, specs, strict=True):
        if isinstance(value, ScaledArray):
            arrays += [value.data, value.scale]
            flat_specs += [spec, replicated_like(spec)]
        else:
            arrays.append(value)
            flat_specs.append(spec)
    return arrays, flat_specs


def _unflatten_scaled(like: Sequence[Any], arrays: Sequence[Any]) -> list:
    """Inverse of :func:`_flatten_scaled` for values shaped like ``like``."""
    arrays, out = iter(arrays), []
    for value in like:
        if isinstance(value, ScaledArray):
            out.append(ScaledArray.tree_unflatten(None, (next(arrays), next(arrays))))
        else:
            out.append(next(arrays))
    return out


def _manual_axes(params: dict) -> tuple:
    mesh_axes = params["mesh"].axis_names
    return tuple(a for a in mesh_axes if a in params["newly_manual_axes"])


def _body_slot(value: Any, estimate: float | None) -> Slot:
    if isinstance(value, ScaledArray):
        return Slot(value)
    return dataclasses.replace(plain_slot(value), estimate=estimate)


@register_higher_order_rule(jxi.shard_map_p)
def _shard_map_rule(eqn: jxi.JaxprEqn, in_slots: list[Slot]) -> list[Slot]:
    """Re-bind ``shard_map`` through ``jax.shard_map`` on data and scales, keeping the specs.

    A scaled input's data gets its spec and its scale ``P()``. Every output is returned as a
    (data, scale) pair with specs ``(spec, P())`` (a plain output's scale is an unused 1,
    dropped by jit's dead-code elimination), its scale agreed over the manual axes.
    """
    params = eqn.params
    jaxpr = getattr(params["jaxpr"], "jaxpr", params["jaxpr"])  # a Jaxpr in JAX 0.10
    consts = getattr(params["jaxpr"], "consts", ())
    values = [s.value for s in in_slots]
    estimates = [s.estimate for s in in_slots]
    manual_axes = _manual_axes(params)
    scaled_outputs: list[list[bool]] = []

    def body(*arrays):
        inputs = _unflatten_scaled(values, arrays)
        slots = [_body_slot(v, e) for v, e in zip(inputs, estimates, strict=True)]
        outs = [s.value for s in interpret_jaxpr(jaxpr, consts, slots)]
        outs = [_with_agreed_scale(o, manual_axes) if _is_scaled(o) else o for o in outs]
        scaled_outputs.append([_is_scaled(o) for o in outs])
        return tuple(a for o in outs for a in _as_pair(o))

    body.__name__ = body.__qualname__ = getattr(jaxpr.debug_info, "func_name", "body")
    flat_values, flat_in_specs = _flatten_scaled(values, params["in_specs"])
    out_specs = [s for spec in params["out_specs"] for s in (spec, PartitionSpec())]
    flat_outs = jax.shard_map(
        body,
        mesh=params["mesh"],
        in_specs=tuple(flat_in_specs),
        out_specs=tuple(out_specs),
        axis_names=frozenset(params["newly_manual_axes"]),
        check_vma=params["check_vma"],
    )(*flat_values)
    pairs = zip(flat_outs[::2], flat_outs[1::2], scaled_outputs[-1], strict=True)
    return [_out_slot(data, scale, scaled) for data, scale, scaled in pairs]


def _is_scaled(value: Any) -> bool:
    return isinstance(value, ScaledArray)


def _as_pair(value: Any) -> tuple[jax.Array, jax.Array]:
    if isinstance(value, ScaledArray):
        return value.data, value.scale
    return value, np.ones((), np.float32)


def _out_slot(data: jax.Array, scale: jax.Array, scaled: bool) -> Slot:
    if scaled:
        return Slot(ScaledArray.tree_unflatten(None, (data, scale)))
    return plain_slot(data)


__all__ = ["replicated_like", "scaled_shardings"]
