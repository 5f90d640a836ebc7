"""The one door to JAX internals.

Every import of ``jax._src``, ``jax.extend`` or ``jax.core`` in jax_scaled lives here, so that
a JAX upgrade that moves an internal touches one file. Everything else imports from this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Sequence

import jax
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
    "all_lax_primitives",
    "define_primitive",
    "eqn_subjaxprs",
    "is_kernel_call",
    "map_jaxpr_params",
    "retrace_closed_jaxpr",
    "with_weak_type",
    "zero_tangent",
    "closed_call_p",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "eqn_source_line",
    "eqn_lax_origin",
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
    "split_p",
]


def current_trace() -> object:
    """The trace that primitives bound now are staged into (or evaluated by)."""
    return _core.trace_ctx.trace


def eqn_source_line(eqn: JaxprEqn) -> str:
    """The user's source location of an equation, as ``file:line (function)``."""
    return source_info_util.summarize(eqn.source_info)


_LAX_DIR = os.path.dirname(os.path.abspath(_lax_impl.__file__)) + os.sep


def eqn_lax_origin(eqn: JaxprEqn) -> str | None:
    """The name of the innermost ``jax.lax`` function in the traceback that ``eqn`` records,
    or None: ``"slice"`` for the slice of ``x[:, :2]``, and also for the ``pad`` of its
    transpose, which keeps the forward equation's source.

    Example:
        >>> closed = jax.make_jaxpr(lambda x: jax.lax.slice(x, (0,), (2,)))(jnp.ones(4))
        >>> eqn_lax_origin(closed.jaxpr.eqns[0])
        'slice'
    """
    traceback = eqn.source_info.traceback
    frames = traceback.frames if traceback is not None else ()
    return next((f.function_name for f in frames if f.file_name.startswith(_LAX_DIR)), None)


# Frames a warning skips to reach the user's line: JAX's, this package's and the standard
# library's (contextlib, functools) that JAX's tracing passes through.
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, contextlib)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in the caller of this function that names the
    first frame outside JAX, jax_scaled and the standard library: the user's line, however
    deep in ``jit`` or ``grad`` tracing the warning is raised.

    Example:
        >>> user_stacklevel() >= 1
        True
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def eqn_name_stack(eqn: JaxprEqn) -> str:
    """The full name stack of ``eqn`` where it is being interpreted (e.g. ``transpose(jvp(f))``
    for an equation of a backward pass)."""
    return str(source_info_util.current_name_stack() + eqn.source_info.name_stack)


def eqn_module_path(eqn: JaxprEqn) -> str:
    """The flax module path of ``eqn`` (``"GPT/Block_0/qkv"``): its own name stack without
    the transforms' wrappers (``jvp(``, ``transpose(``, ``vmap(``)."""
    return _TRANSFORM_WRAPPER.sub("", str(eqn.source_info.name_stack)).replace(")", "")


_TRANSFORM_WRAPPER = re.compile(r"\w+\(")


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


def is_kernel_call(primitive: Primitive) -> bool:
    """True for a Pallas kernel call (``pallas_call``), whose body is a kernel, not a program
    (identified by name: importing Pallas to compare the primitive costs import time)."""
    return primitive.name == "pallas_call"


def with_weak_type(x):
    """``x``, same dtype and values, typed weakly (as arrays built from Python scalars are)."""
    return _lax_impl._convert_element_type(x, x.dtype, weak_type=True)


# =======================================================================================
# Defining primitives: jax_scaled's scaling primitives, identities (or elementwise maps)
# outside scalify, with their scale rules registered separately.
# =======================================================================================

Batcher = Callable[..., tuple]


def define_primitive(
    name: str,
    impl: Callable,
    *,
    multiple_results: bool = False,
    abstract_eval: Callable | None = None,
    straight_through: bool = False,
    jvp: Callable | None = None,
    batcher: Batcher | None = None,
    batched_operands: int = 1,
) -> Primitive:
    """A primitive computing ``impl(*operands, **params)``: evaluation, abstract evaluation
    (``jax.eval_shape`` of ``impl``), lowering (``impl`` traced into MLIR), differentiation and
    batching.

    Args:
        name: the primitive's name.
        impl: the computation, a function of arrays and keyword parameters.
        multiple_results: ``impl`` returns a list.
        abstract_eval: the output avals from the input avals and parameters (default:
            ``jax.eval_shape`` of ``impl``, which traces it).
        straight_through: the tangent (and cotangent) of the output is that of the first
            operand, cast to the output's dtype (and back): for identities and roundings.
            The primitive is then linear in its first operand for ``jax.linear_transpose``
            and ``jax.grad``; the other operands get no cotangent.
        jvp: the JVP rule ``(primals, tangents, **params) -> (out, tangent)``, for a primitive
            that is not straight-through (None: not differentiable).
        batcher: the batching rule ``(args, dims, **params) -> (out, dims)``; default: the
            primitive maps its first ``batched_operands`` operands elementwise, which must
            share their batch axis, and refuses a batched later operand.
        batched_operands: how many leading operands the default batcher maps.

    Returns:
        The primitive.

    Example:
        >>> double_p = define_primitive("double", lambda x: 2 * x, straight_through=False)
        >>> float(jax.jit(lambda x: double_p.bind(x))(1.5))
        3.0
    """
    primitive = Primitive(name)
    primitive.multiple_results = multiple_results
    primitive.def_impl(impl)
    primitive.def_abstract_eval(
        abstract_eval or functools.partial(_abstract_eval, impl, multiple_results)
    )
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results))
    if straight_through:
        ad.primitive_jvps[primitive] = functools.partial(_straight_through_jvp, primitive)
        ad.primitive_transposes[primitive] = _straight_through_transpose
    elif jvp is not None:
        ad.primitive_jvps[primitive] = jvp
    default = functools.partial(_map_leading, primitive, batched_operands)
    batching.primitive_batchers[primitive] = batcher or default
    return primitive


def zero_tangent(x) -> object:
    """The symbolic zero tangent of a value shaped like ``x`` (a JVP rule's output)."""
    return ad.Zero(ShapedArray(x.shape, x.dtype).to_tangent_aval())


def _abstract_eval(impl: Callable, multiple_results: bool, *avals, **params):
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    out = jax.eval_shape(functools.partial(impl, **params), *structs)
    shaped = [ShapedArray(o.shape, o.dtype) for o in (out if multiple_results else [out])]
    return shaped if multiple_results else shaped[0]


def _straight_through_jvp(primitive: Primitive, primals, tangents, **params):
    out = primitive.bind(*primals, **params)
    tangent = tangents[0]
    if type(tangent) is ad.Zero:
        return out, zero_tangent(out)
    return out, _lax_impl.convert_element_type(tangent, out.dtype)


def _straight_through_transpose(cotangent, x, *others, **params):
    if type(cotangent) is ad.Zero:
        return (ad.Zero(x.aval.to_tangent_aval()), *[None] * len(others))
    return (_lax_impl.convert_element_type(cotangent, x.aval.dtype), *[None] * len(others))


def _map_leading(primitive: Primitive, count: int, args, dims, **params):
    mapped = [d for d in dims[:count] if d is not NOT_MAPPED]
    if any(d is not NOT_MAPPED for d in dims[count:]) or len(set(mapped)) > 1:
        raise NotImplementedError(
            f"{primitive.name} under vmap maps its first {count} operand(s) along one axis; "
            "it got a batched scale or parameter, or operands batched along different axes. "
            "Keep one scale for the whole batch, or apply it per example outside vmap."
        )
    dim = mapped[0] if mapped else NOT_MAPPED
    out = primitive.bind(*args, **params)
    return out, ([dim] * len(out) if primitive.multiple_results else dim)
