"""Numerics of block quantization: MX element formats x scale roundings x block layouts.

    python benchmarks/block_numerics.py                 # 512 x 512 operands, markdown table
    python benchmarks/block_numerics.py --size 256 --outliers 8 --seed 1

For every element format of ``js.formats`` (E4M3, E5M2, E2M3, E3M2, E2M1), scale rounding
(``floor``: OCP MX; ``rceil``: never saturates) and layout (one scale per tensor, per row,
blocks of 32 along the row, 128x128 tiles), on two kinds of ``size x size`` float32 data:

* **gaussian**: standard normal;
* **outliers**: standard normal with ``--outliers`` values (random positions) 2^10 times
  larger, as activations with a few outlier features;

it quantizes with :func:`jax_scaled.quantize` (E8M0 scales) and reports:

* **SQNR** (dB): ``10 log10(sum x^2 / sum (x - q)^2)`` over the tensor, in float64;
* **sat %**: share of elements saturated (``|x| / scale`` beyond the format's largest value,
  clipped to it);
* **ftz %**: share of non-zero elements quantized to zero;
* **matmul err**: relative Frobenius error of ``q(A) @ q(B)`` against ``A @ B`` in float64
  (``size^3``), ``A`` blocked along its rows and ``B`` along its columns, so that blocks lie
  along the contracting axis (per row: one scale per row of ``A`` and per column of ``B``);
* **bits**: storage per element counting the scales (8-bit E8M0 scales: 8.25 for MXFP8).

The per-tensor rows are the baseline that blocks must beat on outlier-heavy data.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_scaled as js
from jax_scaled.array import expand_scale
from jax_scaled.formats import element_bits

ROUNDINGS = ("floor", "rceil")
OUTLIER_FACTOR = 2.0**10


@dataclasses.dataclass(frozen=True)
class Layout:
    """A block layout: blocks of ``rows x cols`` for the left operand (``-1``: the whole
    axis, None: one scale per tensor); the right operand takes the transposed blocks."""

    name: str
    blocks: tuple[int, int] | None

    def lhs(self) -> tuple[int, int] | None:
        return self.blocks

    def rhs(self) -> tuple[int, int] | None:
        return None if self.blocks is None else self.blocks[::-1]


LAYOUTS = (
    Layout("per tensor", None),
    Layout("per row", (1, -1)),
    Layout("1x32", (1, 32)),
    Layout("128x128", (128, 128)),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512, help="M = N = K (default 512)")
    parser.add_argument("--outliers", type=int, default=32, help="outliers per operand")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return parser.parse_args()


def operands(kind: str, size: int, outliers: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two ``size x size`` float32 operands of the given kind."""
    rng = np.random.default_rng(seed)
    pair = []
    for _ in range(2):
        x = rng.standard_normal((size, size))
        if kind == "outliers":
            x.flat[rng.choice(x.size, outliers, replace=False)] *= OUTLIER_FACTOR
        pair.append(x.astype(np.float32))
    return pair[0], pair[1]


def quantized(x: np.ndarray, dtype, rounding: str, blocks) -> tuple[np.ndarray, np.ndarray]:
    """``(dequantized value, per-element scale)`` in float64."""
    q = js.quantize(
        x, dtype, block_shape=blocks, scale_rounding=rounding, scale_dtype=jnp.float8_e8m0fnu
    )
    scale = expand_scale(q.scale.astype(jnp.float32), x.shape)
    return np.asarray(q.to_array(jnp.float32), np.float64), np.asarray(scale, np.float64)


def statistics(x: np.ndarray, q: np.ndarray, scale: np.ndarray, dtype) -> dict[str, float]:
    x = x.astype(np.float64)
    noise = np.sum((x - q) ** 2)
    top = float(ml_dtypes.finfo(dtype).max)
    return {
        "sqnr": 10 * np.log10(np.sum(x**2) / noise) if noise else np.inf,
        "sat": 100 * np.mean(np.abs(x) / scale > top),
        "ftz": 100 * np.sum((q == 0) & (x != 0)) / max(np.count_nonzero(x), 1),
    }


def matmul_error(a: np.ndarray, b: np.ndarray, qa: np.ndarray, qb: np.ndarray) -> float:
    exact = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.linalg.norm(qa @ qb - exact) / np.linalg.norm(exact))


def bits_per_element(dtype, blocks, size: int) -> float:
    elements = size * size if blocks is None else np.prod([size if b == -1 else b for b in blocks])
    return element_bits(dtype) + element_bits(jnp.float8_e8m0fnu) / float(elements)


def row(fmt, rounding: str, layout: Layout, data: dict, size: int) -> list[str]:
    cells = [
        fmt.name,
        rounding,
        layout.name,
        f"{bits_per_element(fmt.element_dtype, layout.blocks, size):.2f}",
    ]
    for a, b in data.values():
        qa, scale = quantized(a, fmt.element_dtype, rounding, layout.lhs())
        qb, _ = quantized(b, fmt.element_dtype, rounding, layout.rhs())
        stats = statistics(a, qa, scale, fmt.element_dtype)
        cells += [f"{stats['sqnr']:.1f}", f"{stats['sat']:.3f}", f"{stats['ftz']:.2f}"]
        cells.append(f"{matmul_error(a, b, qa, qb):.2e}")
    return cells


def main() -> None:
    args = parse_args()
    data = {
        kind: operands(kind, args.size, args.outliers, args.seed)
        for kind in ("gaussian", "outliers")
    }
    print(
        f"jax {jax.__version__}, ml_dtypes {ml_dtypes.__version__}, "
        f"backend {jax.default_backend()}, size {args.size}, "
        f"outliers {args.outliers} x 2^10, seed {args.seed}\n"
    )
    stats = ["SQNR dB", "sat %", "ftz %", "matmul err"]
    header = ["format", "rounding", "layout", "bits"] + [f"{k} {s}" for k in data for s in stats]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for fmt in js.formats.MX_FORMATS:
        for rounding in ROUNDINGS:
            for layout in LAYOUTS:
                print("| " + " | ".join(row(fmt, rounding, layout, data, args.size)) + " |")


if __name__ == "__main__":
    main()
