"""Where do scales drift? Record the data statistics of every scaled value scalify computes.

Static scale propagation keeps a tensor's *data* near unit magnitude only as long as the
unit-scaling estimates of the rules hold. When they do not (correlated sums, saturated
activations, weights far from their initial scale), the data drifts towards the edges of its
format: it overflows, or underflows into subnormals and zeros. :func:`record_scales` shows
where, equation by equation, forward and backward. Then:

* :func:`worst` and :func:`format_records` (a table, or the source annotated with bits);
* :func:`first_nonfinite`: the operation that produced a step's first ``inf`` or ``NaN``;
* :func:`plot`: a chart of values and data against the float16 / FP8 ranges (matplotlib);
* :func:`to_rows` and :func:`to_dataframe`: tabular export (pandas, the ``analysis`` extra);
* :func:`check_scaling`: check that a function (a new op, a ``custom_scale`` rule) keeps
  unit-scaled inputs and cotangents unit-scaled.

Example:
    >>> import jax, jax.numpy as jnp, jax_scaled as js
    >>> x = js.as_scaled_array(jnp.full((4, 64), 3.0, jnp.float16))
    >>> with js.diagnostics.record_scales() as records:
    ...     _ = js.scalify(lambda x: jnp.sum(x, axis=1) * x[:, 0])(x)
    >>> [(r.primitive, r.max_abs) for r in records if r.primitive in ("reduce_sum", "mul")]
    [('reduce_sum', 12.0), ('mul', 18.0)]
"""

from jax_scaled.diagnostics.check import ScalingEntry, ScalingReport, check_scaling
from jax_scaled.diagnostics.export import to_dataframe, to_rows
from jax_scaled.diagnostics.listing import format_records
from jax_scaled.diagnostics.plot import plot
from jax_scaled.engine.recording import (
    ScaleRecord,
    SourceLocation,
    first_nonfinite,
    is_recording,
    observe,
    record_scales,
    worst,
)

__all__ = [
    "ScaleRecord",
    "ScalingEntry",
    "ScalingReport",
    "SourceLocation",
    "check_scaling",
    "first_nonfinite",
    "format_records",
    "is_recording",
    "observe",
    "plot",
    "record_scales",
    "to_dataframe",
    "to_rows",
    "worst",
]
