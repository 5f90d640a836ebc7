"""Trace, lowering and XLA compile time of the Table 3 GPT's train step, per configuration.

    python benchmarks/table3_compile.py                                   # 1 layer
    python benchmarks/table3_compile.py --layers 4 --configs fp8_scalify,mxfp8_scalify

The train step of ``experiments/table3.py`` (the full size: width 128, batch 16 x context
128) with ``--layers`` transformer layers, built as the table builds it, traced, lowered and
compiled once per configuration (fresh: nothing cached). Besides the times it counts the
jaxpr equations of the traced step and the ``convert`` operations of its StableHLO that touch
E8M0 (``f8E8M0FNU``), which XLA:CPU expands into long integer code: block-scaled steps should
have them only where block scales are made and read.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
import time
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments import gpt, table3  # noqa: E402

E8M0_CONVERT = re.compile(r"stablehlo\.convert .*f8E8M0FNU")


def measure(name: str, layers: int, vocab_size: int = 96) -> dict[str, float]:
    """Seconds to trace, lower and compile ``name``'s step; sizes of what each produced."""
    config = dataclasses.replace(table3.SIZES["full"], layers=layers)
    params = gpt.init_params(config.model_config(vocab_size), config.seed)
    tokens = np.zeros((config.batch_size, config.context), np.int32)
    runner = table3.build(table3.PRECISIONS[name], config, params, vocab_size)
    start = time.perf_counter()
    traced = runner.step.trace(*runner.state, tokens, tokens)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    compiled_at = time.perf_counter()
    return {
        "trace": traced_at - start,
        "lower": lowered_at - traced_at,
        "compile": compiled_at - lowered_at,
        "eqns": len(traced.jaxpr.jaxpr.eqns),
        "e8m0_converts": len(E8M0_CONVERT.findall(lowered.as_text())),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--configs", default="fp8_scalify,mxfp8_scalify,fp8_block128_scalify")
    args = parser.parse_args(argv)
    print(f"Table 3 GPT train step, {args.layers} layer(s), width 128, batch 16 x context 128")
    print("| config | trace s | lower s | compile s | jaxpr eqns | E8M0 converts |")
    print("|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        m = measure(name.strip(), args.layers)
        print(
            f"| `{name}` | {m['trace']:.1f} | {m['lower']:.1f} | {m['compile']:.1f} "
            f"| {m['eqns']} | {m['e8m0_converts']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
