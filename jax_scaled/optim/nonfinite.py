"""Skipping training steps whose gradients hold an ``inf`` or a ``NaN``.

One bad batch (an ``inf`` in the inputs, a ``log`` of a negative number) gives non-finite
gradients; an optimizer that applies them turns every parameter into ``NaN`` for the rest of
the run, silently. :func:`skip_nonfinite` is ``optax.apply_if_finite`` made to work with
scaled, narrow optimizer state: such a step leaves parameters and state unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jax_scaled.optim._storage import (
    SCALED_STATE_UPDATES,
    call_scaled,
    is_float,
    like_reference,
)


def skip_nonfinite(
    inner: optax.GradientTransformation, max_consecutive_errors: int = 5
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that a step with a non-finite gradient is skipped.

    The step's updates are zeros and the inner state is kept as it was, bit for bit (this is
    ``optax.apply_if_finite``). The state is an ``optax.ApplyIfFiniteState``:
    ``notfinite_count`` counts the consecutive skipped steps, ``last_finite`` says whether
    the last one was applied, ``total_notfinite`` counts all skipped steps. After more than
    ``max_consecutive_errors`` skipped steps in a row the update is applied anyway, so a run
    that has truly diverged still shows its ``NaN`` rather than freezing.

    Unlike bare ``apply_if_finite``, the inner update is made to return its state in the
    dtypes it was given (a float16 state stays float16, as with the README's cast state,
    where Adam's moments would otherwise come back float32): the skipped branch returns the
    old state, and both branches of the step must agree on dtypes.

    Works inside ``jax.jit(js.scalify(step))`` with ScaledArray parameters, gradients and
    state, on plain arrays, and outside ``scalify`` on ScaledArrays (it then applies
    ``scalify`` itself). With :func:`~jax_scaled.optim.scaled_state`, write
    ``scaled_state(skip_nonfinite(opt))``: the check runs inside scaled_state's update, on
    the state as loaded for computing, and the counters are stored beside the scaled state
    (``state.notfinite_count``). ``skip_nonfinite(scaled_state(opt))`` is refused with a
    ``ValueError``: ``apply_if_finite``'s ``lax.cond`` would carry the stored state itself,
    and a ``cond`` keeps one scale per tensor, losing the block scales that keep a second
    moment from flushing.

    Only the gradients are checked: a ``NaN`` loss with finite gradients is applied.

    Args:
        inner: any optax ``GradientTransformation`` (``optax.adam(1e-3)``, a chain, ...).
        max_consecutive_errors: how many non-finite steps in a row are skipped before the
            update is applied again.

    Returns:
        An optax ``GradientTransformationExtraArgs`` (extra arguments of ``update`` are passed
        to ``inner.update``).

    Example:
        >>> import optax
        >>> from jax_scaled.optim import scaled_state, skip_nonfinite
        >>> opt = scaled_state(skip_nonfinite(optax.adam(0.1)), jnp.float16)
        >>> def loss_fn(w, x):
        ...     return jnp.mean((x @ w - 1.0) ** 2)
        >>> @jax.jit
        ... @js.scalify
        ... def step(w, state, x):
        ...     loss, grads = jax.value_and_grad(loss_fn)(w, x)
        ...     updates, state = opt.update(grads, state, w)
        ...     return optax.apply_updates(w, updates), state, loss
        >>> w = js.as_scaled_array(jnp.ones((4, 1)))
        >>> state = opt.init(w)
        >>> x = jnp.ones((8, 4)).at[0, 0].set(jnp.inf)   # a bad batch
        >>> new_w, state, loss = step(w, state, js.as_scaled_array(x))
        >>> bool(jnp.isfinite(js.asarray(loss))), int(state.notfinite_count)
        (False, 1)
        >>> bool(jnp.array_equal(js.asarray(new_w), js.asarray(w)))   # step skipped
        True
        >>> new_w, state, loss = step(new_w, state, js.as_scaled_array(jnp.ones((8, 4))))
        >>> int(state.notfinite_count), int(state.total_notfinite)
        (0, 1)
    """
    if getattr(inner, "update", None) in SCALED_STATE_UPDATES:
        raise ValueError(
            "skip_nonfinite(scaled_state(opt)) would merge the stored state's block scales in "
            "apply_if_finite's lax.cond; write scaled_state(skip_nonfinite(opt)) instead."
        )
    guarded = optax.apply_if_finite(_keeping_state_dtypes(inner), max_consecutive_errors)

    def traced_update(grads, state, params, extra_args):
        return guarded.update(grads, state, params, **extra_args)

    def update(grads, state, params=None, **extra_args):
        # Outside scalify, ScaledArray gradients or state need the scale rules; updates come
        # back plain where the gradients were plain, as from scaled_state.
        updates, state = call_scaled(traced_update, grads, state, params, extra_args)
        return like_reference(grads, updates), state

    return optax.GradientTransformationExtraArgs(guarded.init, update)


def _keeping_state_dtypes(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` whose ``update`` casts each floating leaf of its new state back to the dtype
    of the state it was given (``apply_if_finite``'s ``lax.cond`` needs equal dtypes)."""
    inner = optax.with_extra_args_support(inner)

    def update(grads, state, params=None, **extra_args):
        updates, new_state = inner.update(grads, state, params, **extra_args)
        return updates, jax.tree.map(_cast_like, state, new_state)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _cast_like(old: Any, new: Any) -> Any:
    if is_float(old) and is_float(new) and new.dtype != old.dtype:
        return new.astype(old.dtype)
    return new
