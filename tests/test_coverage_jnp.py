"""jax.numpy under scalify: float32 model invariance and float16 fidelity at scales 2^±20.

Each case is a function of one or two float arrays. Invariance: values and gradients (of a
weighted sum of the output) of the scalified function on ``as_scaled_array`` inputs match
the plain float32 function to 1e-5. Fidelity: float16 data at scale 2^-20 or 2^20 (where raw
float16 underflows or overflows) gives results within a few float16 roundings of float64 on
the same represented values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_fidelity, check_model_invariance, random_data
from jax import lax

import jax_scaled as js

SCALES = [2.0**-20, 2.0**20]
F16_TOL = 4e-3  # four float16 epsilons (normwise)
X = (4, 8)
INDEX = jnp.array([0, 2, 2, 7])


def sorted_by_argsort(x):
    return jnp.take_along_axis(x, jnp.argsort(x, axis=-1), axis=-1)


def picked_by_argmax_argmin(x):
    top = jnp.take_along_axis(x, jnp.argmax(x, axis=-1, keepdims=True), axis=-1)
    bottom = jnp.take_along_axis(x, jnp.argmin(x, axis=0, keepdims=True), axis=0)
    return top + bottom[:, :4].T


def sort_two_operands(x, y):
    keys, values = lax.sort((x, y), dimension=1, num_keys=1)
    return keys * 2 + values


def top_k_values_and_indices(x):
    values, indices = lax.top_k(x, 3)
    return values + jnp.take_along_axis(x, indices, axis=-1)


def scatter_updates(x):
    return x.at[1:3, 2].set(x[0, :2]).at[INDEX].add(x[1]).at[0, 0].set(0.25)


def inverse_trigonometric(x):
    bounded = jnp.tanh(x) * 0.9
    return jnp.arcsin(bounded) + jnp.arctanh(bounded) + jnp.arccos(bounded) + jnp.arcsinh(x)


def gamma_functions(x):
    positive = jnp.abs(x) + 0.25
    return jax.scipy.special.gammaln(positive) + jax.scipy.special.digamma(positive)


def factorizations(x, y):
    """eigh, qr, cholesky and triangular solves, sign-ambiguous factors multiplied back."""
    spd = x @ x.T + 4 * jnp.eye(x.shape[0], dtype=x.dtype)
    values, vectors = jnp.linalg.eigh(spd)
    q, r = jnp.linalg.qr(x)
    lower = jnp.linalg.cholesky(spd)
    solved = jax.scipy.linalg.solve_triangular(lower, y, lower=True)
    return (vectors * values) @ vectors.T + q @ r + lower + solved


def masked_softmax_with_finfo_min(x):
    """flax-style masking: a huge finite fill, then softmax."""
    return jax.nn.softmax(jnp.where(x > -0.5, x, jnp.finfo(x.dtype).min), axis=-1)


# name -> (function, input shapes)
CASES = {
    # statistics
    "mean": (lambda x: jnp.mean(x, axis=0), [X]),
    "mean_all": (jnp.mean, [X]),
    "var": (lambda x: jnp.var(x, axis=-1), [X]),
    "std": (lambda x: jnp.std(x, axis=0, ddof=1), [X]),
    "median": (lambda x: jnp.median(x, axis=-1), [X]),
    "median_all": (jnp.median, [X]),
    # norms
    "norm_vector_2": (lambda x: jnp.linalg.norm(x, axis=-1), [X]),
    "norm_vector_1": (lambda x: jnp.linalg.norm(x, ord=1, axis=0), [X]),
    "norm_vector_inf": (lambda x: jnp.linalg.norm(x, ord=jnp.inf, axis=-1), [X]),
    # float16 raises to 1/3 rounded to 0.33325: 3.4e-3 from float64 for sums of cubes ~2^±60
    "norm_vector_3": (lambda x: jnp.linalg.norm(x, ord=3, axis=-1), [X]),
    "norm_matrix_fro": (jnp.linalg.norm, [X]),
    "norm_matrix_1": (lambda x: jnp.linalg.norm(x, ord=1), [X]),
    "norm_matrix_inf": (lambda x: jnp.linalg.norm(x, ord=jnp.inf), [X]),
    "norm_matrix_2": (lambda x: jnp.linalg.norm(x, ord=2), [X]),
    "norm_matrix_nuc": (lambda x: jnp.linalg.norm(x, ord="nuc"), [X]),
    # cumulative
    "cumsum": (lambda x: jnp.cumsum(x, axis=1), [X]),
    "cumsum_reverse": (lambda x: lax.cumsum(x, axis=0, reverse=True), [X]),
    "cumprod": (lambda x: jnp.cumprod(x, axis=1), [(4, 2)]),
    "cummax": (lambda x: lax.cummax(x, axis=1), [X]),
    "cummin_reverse": (lambda x: lax.cummin(x, axis=0, reverse=True), [X]),
    "cumlogsumexp": (lambda x: lax.cumlogsumexp(x, axis=1), [X]),
    # order
    "sort": (lambda x: jnp.sort(x, axis=-1), [X]),
    "sort_axis0": (lambda x: jnp.sort(x, axis=0), [X]),
    "argsort": (sorted_by_argsort, [X]),
    "argmax_argmin": (picked_by_argmax_argmin, [X]),
    "sort_two_operands": (sort_two_operands, [X, X]),
    "top_k": (top_k_values_and_indices, [X]),
    # indexing
    "take": (lambda x: jnp.take(x, INDEX, axis=1), [X]),
    "take_fill": (lambda x: jnp.take(x, INDEX + 2, axis=1, mode="fill", fill_value=0.0), [X]),
    "take_along_axis": (lambda x: jnp.take_along_axis(x, jnp.argsort(-x, axis=0), axis=0), [X]),
    "at_set_add": (scatter_updates, [X]),
    "at_add_tensor": (lambda x, y: x.at[INDEX].add(y[:4]), [X, X]),
    # padding and joining
    "pad_zero": (lambda x: jnp.pad(x, 1), [X]),
    "pad_constant": (lambda x: jnp.pad(x, ((1, 0), (0, 2)), constant_values=0.5), [X]),
    "pad_edge": (lambda x: jnp.pad(x, 2, mode="edge"), [X]),
    "pad_reflect": (lambda x: jnp.pad(x, 2, mode="reflect"), [X]),
    "pad_wrap": (lambda x: jnp.pad(x, 2, mode="wrap"), [X]),
    "concatenate": (lambda x, y: jnp.concatenate([x, y, x], axis=0), [X, X]),
    "stack": (lambda x, y: jnp.stack([x, y], axis=1), [X, X]),
    "split": (lambda x: jnp.split(x, 2, axis=1)[1] * jnp.split(x, [3], axis=1)[0][:, :1], [X]),
    "unstack": (lambda x: jnp.unstack(x)[1] - jnp.unstack(x, axis=1)[2][:1], [X]),
    # contractions
    "matmul": (jnp.matmul, [X, (8, 3)]),
    "matmul_vector": (jnp.matmul, [X, (8,)]),
    "matmul_batched": (jnp.matmul, [(2, 4, 8), (2, 8, 3)]),
    "einsum": (lambda x, y: jnp.einsum("ij,kj->ik", x, y), [X, (3, 8)]),
    "einsum_batched": (lambda x, y: jnp.einsum("bij,bjk->bki", x, y), [(2, 4, 8), (2, 8, 3)]),
    "tensordot": (lambda x, y: jnp.tensordot(x, y, axes=([0], [0])), [X, (4, 3)]),
    "tensordot_2": (lambda x, y: jnp.tensordot(x, y, axes=2), [(2, 4, 8), X]),
    "factorizations": (factorizations, [(4, 4), (4, 4)]),
    # selections
    "where_literal": (lambda x: jnp.where(x > 0, x, 0.0), [X]),
    "where_leaky": (lambda x: jnp.where(x > 0, x, 0.1 * x), [X]),
    "where_tensors": (lambda x, y: jnp.where(x > y, x, y), [X, X]),
    "where_finfo_min_softmax": (masked_softmax_with_finfo_min, [X]),
    "clip": (lambda x: jnp.clip(x, -0.5, 0.5), [X]),
    "clip_tensor_bound": (lambda x, y: jnp.clip(x, max=jnp.abs(y)), [X, X]),
    "nan_to_num": (lambda x: jnp.nan_to_num(jnp.log(x)), [X]),
    "nan_to_num_inf": (
        lambda x: jnp.nan_to_num(jnp.where(x > 1, jnp.inf, x), posinf=100.0),
        [X],
    ),
    # remainders: the issue-17 case, and one whose operands have different scales
    "remainder_abs_plus_one": (lambda x, y: jnp.remainder(x, jnp.abs(y) + 1.0), [X, X]),
    "fmod_small_by_large": (lambda x, y: jnp.fmod(x * 2.0**-30, y), [X, X]),
    # beyond the list: lookups and special functions
    "searchsorted": (lambda x, y: jnp.searchsorted(jnp.sort(x[0]), y[0]) * x[1], [X, X]),
    "interp": (lambda x, y: jnp.interp(y[0], jnp.sort(x[0]), x[1]), [X, X]),
    "inverse_trigonometric": (inverse_trigonometric, [X]),
    "gamma_functions": (gamma_functions, [X]),
}

# XLA:CPU's LAPACK has no float16 SVD or other factorization: plain JAX fails there too.
NEEDS_FLOAT16_LAPACK = {"norm_matrix_2", "norm_matrix_nuc", "factorizations"}


def inputs_for(name, dtype=jnp.float32):
    _, shapes = CASES[name]
    return [jnp.asarray(random_data(seed, shape, dtype)) for seed, shape in enumerate(shapes)]


# Programs whose float16 version differs from their float64 version by a dtype-dependent
# constant, so that no float64 reference exists: jnp.interp treats segments shorter than
# spacing(finfo(dtype).eps) (2^-20 in float16) as empty, and the segments at 2^-20 are.
DTYPE_DEPENDENT = {("interp", 2.0**-20)}


def fidelity_marks(name: str, scale: float) -> list:
    marks = []
    if name in NEEDS_FLOAT16_LAPACK:
        reason = "XLA:CPU has no float16 LAPACK (plain JAX fails)"
        marks.append(pytest.mark.skipif(jax.default_backend() == "cpu", reason=reason))
    if (name, scale) in DTYPE_DEPENDENT:
        marks.append(pytest.mark.skip(reason="dtype-dependent program: no float64 reference"))
    return marks


def fidelity_cases() -> list:
    return [
        pytest.param(name, scale, marks=fidelity_marks(name, scale))
        for name in sorted(CASES)
        for scale in SCALES
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_invariance(name):
    check_model_invariance(CASES[name][0], inputs_for(name))


@pytest.mark.parametrize(("name", "scale"), fidelity_cases())
def test_float16_fidelity(name, scale):
    inputs = [js.scaled_array(x, scale) for x in inputs_for(name, jnp.float16)]
    check_fidelity(CASES[name][0], inputs, tol=F16_TOL)


def test_finfo_min_fill_keeps_the_other_operand_exact():
    """A flax-style ``finfo.min`` mask fill does not flush the masked tensor (float32)."""
    x = js.scaled_array(jnp.asarray(random_data(0, X, jnp.float32)), 2.0**-30)
    masked = jax.jit(js.scalify(lambda x: jnp.where(x > 0, x, jnp.finfo(x.dtype).min)))(x)
    expected = np.where(x.to_array() > 0, x.to_array(), np.finfo(np.float32).min)
    np.testing.assert_array_equal(js.asarray(masked), expected)


def test_raw_float16_fails_where_scalified_float16_does_not():
    """The fidelity cases are meaningful: raw float16 loses these values entirely."""
    x = jnp.asarray(random_data(0, X, jnp.float16))
    tiny = js.scaled_array(x, 2.0**-20)
    raw = jnp.var(tiny.to_array(), axis=-1)  # squares of ~2^-20 underflow float16
    assert np.all(np.asarray(raw) == 0)
    check_fidelity(lambda x: jnp.var(x, axis=-1), [tiny], tol=F16_TOL)
