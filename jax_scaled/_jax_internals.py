"""The one door to JAX internals.

Every import of ``jax._src``, ``jax.extend`` or ``jax.core`` in jax_scaled lives here, so that
a JAX upgrade that moves an internal touches one file. Everything else imports from this module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from collections.abc import Callable, Sequence

from jax._src import ad_checkpoint, source_info_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import pjit as _pjit
from jax._src import shard_map as _shard_map
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_impl
from jax._src.lax import linalg as _lax_linalg
from jax._src.lax import parallel as _parallel
from jax.extend import core as jex_core
from jax.extend.core import primitives as lax_primitives

Primitive = jex_core.Primitive
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
Tracer = _core.Tracer
ShapedArray = _core.ShapedArray

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
linear_solve_p = lax_primitives.linear_solve_p  # lax.custom_linear_solve
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
reshard_p = getattr(_pjit, "reshard_p", None)  # jax.sharding.reshard
pvary_p = getattr(_core, "pvary_p", None)  # jax.lax.pcast(..., to="varying")

optimization_barrier_p = _lax_impl.optimization_barrier_p

# Householder QR primitives that jax.lax.linalg does not export (they appear in programs
# through jnp.linalg.qr(mode="raw"), jax.scipy.linalg.qr_multiply, slogdet(method="qr")).
geqrf_p = getattr(_lax_linalg, "geqrf_p", None)
geqp3_p = getattr(_lax_linalg, "geqp3_p", None)

# Random sampling with a float operand (jax.random.gamma's shape parameter).
random_gamma_p = getattr(lax_primitives, "random_gamma_p", None)

# Contractions without a public primitive object.
ragged_dot_general_p = getattr(_lax_impl, "ragged_dot_general_p", None)  # lax.ragged_dot_general
scaled_dot_p = getattr(importlib.import_module("jax._src.lax.scaled_dot"), "scaled_dot_p", None)

# Helpers for writing higher-order primitives.
jaxpr_as_fun = _core.jaxpr_as_fun
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr  # constvars -> leading invars
NOT_MAPPED = getattr(batching, "not_mapped", None)  # None in recent JAX

# Frames inside jax_scaled are library frames: source locations point at the user's code.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "ClosedJaxpr",
    "ShapedArray",
    "Tracer",
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
    "optimization_barrier_p",
    "geqrf_p",
    "geqp3_p",
    "convert_constvars_jaxpr",
    "scan_p",
    "while_p",
    "cond_p",
    "remat_p",
    "linear_solve_p",
    "ragged_dot_general_p",
    "random_gamma_p",
    "scaled_dot_p",
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
    "pvary_p",
    "reshard_p",
    "manual_axis_kwargs",
    "current_trace",
    "varying_axes",
    "vma_checked",
    "lax_primitives",
    "mlir",
    "split_p",
]


def current_trace() -> object:
    """The trace that primitives bound now are staged into (or evaluated by)."""
    return _core.trace_ctx.trace


def eqn_source_line(eqn: JaxprEqn) -> str:
    """The user's source location of an equation, as ``file:line (function)``."""
    return source_info_util.summarize(eqn.source_info)


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """The full name stack of ``eqn`` where it is being interpreted (e.g. ``transpose(jvp(f))``
    for an equation of a backward pass)."""
    return str(source_info_util.current_name_stack() + eqn.source_info.name_stack)


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


def manual_axis_kwargs(x) -> dict:
    """``jax.ShapeDtypeStruct`` keywords keeping how ``x`` varies over manual mesh axes.

    Empty outside ``shard_map``; inside, the manual axis type and the (abstract-mesh)
    sharding it is defined against.
    """
    aval = _core.typeof(x)
    manual_type = getattr(aval, "manual_axis_type", None)
    if manual_type is None or manual_type.empty:
        return {}
    return {"manual_axis_type": manual_type, "sharding": aval.sharding}


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty without check_vma)."""
    aval = _core.typeof(x)
    manual_type = getattr(aval, "manual_axis_type", None)  # JAX >= 0.9
    if manual_type is not None:
        return frozenset(manual_type.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def vma_checked() -> bool:
    """True while tracing a ``shard_map`` body with ``check_vma=True`` (varying axes typed)."""
    return bool(_config._check_vma.value)


def is_unspecified_sharding(sharding) -> bool:
    """True for JAX's "no sharding given" marker (``UNSPECIFIED``) and for None."""
    return sharding is None or type(sharding).__name__ == "UnspecifiedValue"


def all_lax_primitives() -> dict[str, Primitive]:
    """Every primitive of JAX's lax and random layers, by name.

    The union of ``jax.extend.core.primitives``, of the primitives defined in the modules of
    the ``jax._src.lax`` and ``jax._src.random`` packages (collectives, ``tile``,
    ``scatter-sub``, ``random_wrap``, ... which jax.extend does not list) and of those this
    module names (``remat``, ``shard_map``).
    """
    found = {}
    for module in [lax_primitives, *_modules_under("jax._src.lax", "jax._src.random")]:
        for attr in sorted(dir(module)):
            value = getattr(module, attr, None)
            if isinstance(value, Primitive):
                found.setdefault(value.name, value)
    named = [split_p, remat_p, shard_map_p, all_gather_invariant_p, psum_invariant_p]
    named.append(getattr(_core, "pvary_p", None))  # jax.lax.pvary
    for value in [*named, reduce_scatter_p, pbroadcast_p, reshard_p]:
        if value is not None:
            found.setdefault(value.name, value)
    return found


def _modules_under(*packages: str) -> list:
    """The modules of ``packages`` and of all their sub-packages (imported if needed)."""
    modules = []
    for name in packages:
        package = importlib.import_module(name)
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            modules.append(importlib.import_module(info.name))
    return modules


# =======================================================================================
# Jaxpr rewriting (jax_scaled.dot_policy): re-trace a closed jaxpr through an evaluator,
# list and map the jaxpr-valued parameters of an equation.
# =======================================================================================

JaxprEvaluator = Callable[[Jaxpr, Sequence, Sequence], list]


def retrace_closed_jaxpr(closed: ClosedJaxpr, evaluate: JaxprEvaluator) -> ClosedJaxpr:
    """The closed jaxpr of ``evaluate(closed.jaxpr, closed.consts, args)``, traced on the
    input avals of ``closed`` (same arity, dtypes, weak types and shardings)."""

    def body(*args):
        return evaluate(closed.jaxpr, closed.consts, args)

    fun = _lu.wrap_init(body, debug_info=closed.jaxpr.debug_info)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(fun, closed.in_avals)
    return ClosedJaxpr(jaxpr, consts)


def eqn_subjaxprs(eqn: JaxprEqn) -> list[Jaxpr]:
    """The jaxprs among ``eqn``'s parameters (a jit's body, a scan's, cond's branches, ...)."""
    return list(_core.jaxprs_in_params(eqn.params))


def map_jaxpr_params(eqn: JaxprEqn, transform: Callable[[ClosedJaxpr], ClosedJaxpr]) -> JaxprEqn:
    """``eqn`` with every jaxpr in its parameters replaced by ``transform`` of it.

    Closed jaxprs, open ones (``remat``'s: their transform must have no constants), tuples
    and named tuples of them (``cond``'s branches, ``custom_linear_solve``'s jaxprs), and the
    forward of a ``custom_vjp_call`` (a thunk tracing it on demand). ``transform`` must keep
    the input and output avals.
    """
    params = {name: _map_param(name, value, transform) for name, value in eqn.params.items()}
    return eqn.replace(params=params)


def _map_param(name: str, value, transform: Callable[[ClosedJaxpr], ClosedJaxpr]):
    if isinstance(value, ClosedJaxpr):
        return transform(value)
    if isinstance(value, Jaxpr):
        closed = transform(ClosedJaxpr(value, ()))
        if closed.consts:
            raise NotImplementedError("a transformed open jaxpr captured constants")
        return closed.jaxpr
    if isinstance(value, tuple) and any(isinstance(v, Jaxpr | ClosedJaxpr) for v in value):
        mapped = [_map_param(name, v, transform) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)
    if name == "fwd_jaxpr_thunk":  # custom_vjp_call: (zeros) -> (jaxpr, consts) of its fwd
        return _map_fwd_thunk(value, transform)
    return value


def _map_fwd_thunk(thunk, transform: Callable[[ClosedJaxpr], ClosedJaxpr]):
    def fwd_jaxpr(*zeros):
        closed = transform(ClosedJaxpr(*thunk.call_wrapped(*zeros)))
        return closed.jaxpr, closed.consts

    return _lu.wrap_init(fwd_jaxpr, debug_info=thunk.debug_info)


def with_weak_type(x):
    """``x``, same dtype and values, typed weakly (as arrays built from Python scalars are)."""
    return _lax_impl._convert_element_type(x, x.dtype, weak_type=True)
