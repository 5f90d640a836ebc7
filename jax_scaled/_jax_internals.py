"""The one door to JAX internals.

Every import of ``jax._src``, ``jax.extend`` or ``jax.core`` in jax_scaled lives here, so that
a JAX upgrade that moves an internal touches one file. Everything else imports from this module.
"""

from __future__ import annotations

import contextlib
import os

from jax._src import ad_checkpoint, source_info_util
from jax._src import core as _core
from jax._src import shard_map as _shard_map
from jax._src.lax import parallel as _parallel
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import lax as _lax_impl
from jax.extend import core as jex_core
from jax.extend.core import primitives as lax_primitives

Primitive = jex_core.Primitive
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar

jit_p = lax_primitives.jit_p
custom_jvp_call_p = lax_primitives.custom_jvp_call_p
custom_vjp_call_p = lax_primitives.custom_vjp_call_p
closed_call_p = lax_primitives.closed_call_p
split_p = getattr(_lax_impl, "split_p", None)

# Control flow and memory.
scan_p = lax_primitives.scan_p
while_p = lax_primitives.while_p
cond_p = lax_primitives.cond_p
remat_p = ad_checkpoint.remat_p
sharding_constraint_p = lax_primitives.sharding_constraint_p
device_put_p = lax_primitives.device_put_p

# Multi-device: shard_map and collectives (names as of JAX 0.10).
shard_map_p = _shard_map.shard_map_p
psum_p = _parallel.psum_p
pmax_p = _parallel.pmax_p
pmin_p = _parallel.pmin_p
all_gather_p = _parallel.all_gather_p
all_gather_invariant_p = getattr(_parallel, "all_gather_invariant_p", None)
psum_invariant_p = getattr(_parallel, "psum_invariant_p", None)
reduce_scatter_p = _parallel.reduce_scatter_p
ppermute_p = _parallel.ppermute_p
all_to_all_p = _parallel.all_to_all_p
pbroadcast_p = getattr(_parallel, "pbroadcast_p", None)
axis_index_p = _parallel.axis_index_p

# Helpers for writing higher-order primitives.
jaxpr_as_fun = _core.jaxpr_as_fun
NOT_MAPPED = getattr(batching, "not_mapped", None)  # None in recent JAX

# Frames inside jax_scaled are library frames: source locations point at the user's code.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "NOT_MAPPED",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "Var",
    "ad",
    "all_lax_primitives",
    "batching",
    "closed_call_p",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "eqn_source_line",
    "eqn_user_context",
    "is_unspecified_sharding",
    "jit_p",
    "jaxpr_as_fun",
    "scan_p",
    "while_p",
    "cond_p",
    "remat_p",
    "sharding_constraint_p",
    "device_put_p",
    "shard_map_p",
    "psum_p",
    "pmax_p",
    "pmin_p",
    "all_gather_p",
    "all_gather_invariant_p",
    "psum_invariant_p",
    "reduce_scatter_p",
    "ppermute_p",
    "all_to_all_p",
    "pbroadcast_p",
    "axis_index_p",
    "lax_primitives",
    "mlir",
    "split_p",
]


def eqn_source_line(eqn: JaxprEqn) -> str:
    """The user's source location of an equation, as ``file:line (function)``."""
    return source_info_util.summarize(eqn.source_info)


@contextlib.contextmanager
def eqn_user_context(eqn: JaxprEqn):
    """Context in which primitives re-bound for ``eqn`` keep its source info and name stack."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def eqn_bind_params(eqn: JaxprEqn) -> tuple[list, dict]:
    """``(subfuns, params)`` to re-bind ``eqn`` as is, like ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # JAX before 0.7 also returned sub-functions
        return params
    return [], params


def is_unspecified_sharding(sharding) -> bool:
    """True for JAX's "no sharding given" marker (``UNSPECIFIED``) and for None."""
    return sharding is None or type(sharding).__name__ == "UnspecifiedValue"


def all_lax_primitives() -> dict[str, Primitive]:
    """Every primitive JAX exposes in ``jax.extend.core.primitives``, by name."""
    found = {}
    for attr in dir(lax_primitives):
        value = getattr(lax_primitives, attr)
        if isinstance(value, Primitive):
            found[value.name] = value
    if split_p is not None:
        found.setdefault(split_p.name, split_p)
    return found
