"""FP8 vs BF16 throughput of the scalified linear layer on an NVIDIA Hopper (or Ada) GPU.

    python benchmarks/fp8_linear.py                    # M = N = K = 8192
    python benchmarks/fp8_linear.py --size 2048 --iters 50
    python benchmarks/fp8_linear.py --size 256 --any-backend   # smoke test, e.g. on CPU

Without a GPU with FP8 tensor cores (compute capability >= 8.9) it prints why and exits 0,
unless ``--any-backend`` is given (then it runs everywhere; only the timings of a GPU mean
anything).

Variants (square problem ``x (n, n) @ w (n, n)``, compiled with ``jax.jit``):

* ``bf16``:               ``linear(x, w)`` on plain bfloat16 arrays (the BF16 GEMM);
* ``fp8 scalify``:        ``scalify(linear(..., x_dtype=e4m3, w_dtype=e4m3))`` on ScaledArrays
                          whose data is already float8_e4m3fn (pure FP8 GEMM, BF16 output);
* ``fp8 scalify +casts``: the same on bfloat16 ScaledArrays: the casts to FP8 are timed too.

and for a training step (``value_and_grad`` of ``sum(linear(x, w) * r)`` w.r.t. ``x`` and
``w``: three GEMMs), ``bf16`` against ``fp8 scalify`` with E5M2 gradients (bfloat16 data).

For each compiled program the script lists the GEMM kernels in XLA's optimised HLO (cuBLAS
custom calls, such as ``__cublas$lt$matmul$f8`` for the FP8 GEMM, and Triton GEMM fusions)
and checks the FP8 forward uses an FP8 GEMM (exit status 1 if not). Timings: ``--iters``
back-to-back calls, blocked once, best of ``--reps``; TFLOP/s = 2 n^3 per GEMM / time.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jax_scaled as js
from jax_scaled.nn.linear import linear

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_FORWARD = dict(x_dtype=E4M3, w_dtype=E4M3, preferred_element_type=jnp.bfloat16)
FP8_TRAINING = dict(FP8_FORWARD, grad_dtype=E5M2)
MIN_FP8_COMPUTE_CAPABILITY = 8.9  # Ada and Hopper


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=8192, help="M = N = K (default 8192)")
    parser.add_argument("--iters", type=int, default=20, help="calls per timing (default 20)")
    parser.add_argument("--reps", type=int, default=5, help="timings, best kept (default 5)")
    parser.add_argument("--no-training", action="store_true", help="forward pass only")
    parser.add_argument(
        "--any-backend", action="store_true", help="run even without an FP8-capable GPU"
    )
    return parser.parse_args()


def fp8_gpu_missing() -> str | None:
    """Why this machine cannot run FP8 GEMMs, or None if it can."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"no GPU (JAX backend: {device.platform})"
    capability = getattr(device, "compute_capability", None)
    if capability is None or float(capability) < MIN_FP8_COMPUTE_CAPABILITY:
        return f"{device.device_kind} (compute capability {capability}) has no FP8 tensor cores"
    return None


# ---------------------------------------------------------------------------------------
# Programs and inputs
# ---------------------------------------------------------------------------------------


def training_loss(x, w, r, **dtypes):
    return jnp.sum(linear(x, w, **dtypes).astype(jnp.float32) * r.astype(jnp.float32))


def training_step(**dtypes) -> Callable:
    return jax.value_and_grad(functools.partial(training_loss, **dtypes), argnums=(0, 1))


def gaussian_inputs(n: int, count: int) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(0), count)
    return [jax.random.normal(k, (n, n), jnp.float32).astype(jnp.bfloat16) for k in keys]


def scaled(arrays: list[jax.Array], dtype) -> list[js.ScaledArray]:
    """ScaledArrays of ``arrays`` (unit-RMS data) with their data cast to ``dtype``."""
    return [js.tree.astype(js.as_scaled_array(a), dtype) for a in arrays]


def variants(n: int, training: bool) -> dict[str, tuple[Callable, list, int]]:
    """name -> (jitted function, its inputs, GEMMs per call)."""
    x, w, r = gaussian_inputs(n, 3)
    found = {
        "bf16": (jax.jit(linear), [x, w], 1),
        "fp8 scalify": (
            jax.jit(js.scalify(functools.partial(linear, **FP8_FORWARD))),
            scaled([x, w], E4M3),
            1,
        ),
        "fp8 scalify +casts": (
            jax.jit(js.scalify(functools.partial(linear, **FP8_FORWARD))),
            scaled([x, w], jnp.bfloat16),
            1,
        ),
    }
    if training:
        found["train bf16"] = (jax.jit(training_step()), [x, w, r], 3)
        found["train fp8 scalify"] = (
            jax.jit(js.scalify(training_step(**FP8_TRAINING))),
            scaled([x, w, r], jnp.bfloat16),
            3,
        )
    return found


# ---------------------------------------------------------------------------------------
# Optimised HLO: which GEMM kernels
# ---------------------------------------------------------------------------------------


def gemm_kernels(hlo_text: str) -> list[str]:
    """GEMM kernels of an optimised HLO module: cuBLAS calls, Triton/cuDNN GEMM fusions, dots."""
    kernels = [t for t in re.findall(r'custom_call_target="([^"]+)"', hlo_text) if "blas" in t]
    fusion_kinds = re.findall(r'"kind":"(__[^"]+)"', hlo_text)
    kernels += [k for k in fusion_kinds if any(g in k for g in ("gemm", "cudnn", "cublas"))]
    if not kernels:  # e.g. XLA CPU: plain dots, listed with their operand types
        kernels = [f"dot({', '.join(types)})" for types in dot_operand_types(hlo_text)]
    return kernels


def dot_operand_types(hlo_text: str) -> list[tuple[str, ...]]:
    """Element types of the operands of every ``dot`` instruction."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo_text))
    dots = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo_text)
    return [tuple(types.get(name, "?") for name in operands) for operands in dots]


def uses_fp8_gemm(hlo_text: str) -> bool:
    """An FP8 cuBLAS GEMM, or a dot kept on FP8 operands (e.g. in a Triton GEMM fusion)."""
    if any("f8" in kernel for kernel in gemm_kernels(hlo_text) if "blas" in kernel):
        return True
    return any(t.startswith("f8") for types in dot_operand_types(hlo_text) for t in types)


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


def best_time(fn: Callable, args: list, iters: int, reps: int) -> float:
    """Best over ``reps`` of the mean time of ``iters`` back-to-back calls (seconds)."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> int:
    args = parse_args()
    missing = fp8_gpu_missing()
    if missing is not None and not args.any_backend:
        print(f"Skipping the FP8 linear benchmark: {missing}. (--any-backend runs it anyway.)")
        return 0
    n = args.size
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, M = N = K = {n}")
    tflops, fp8_forward_ok = {}, True
    for name, (fn, inputs, gemms) in variants(n, not args.no_training).items():
        hlo = fn.lower(*inputs).compile().as_text()
        seconds = best_time(fn, inputs, args.iters, args.reps)
        tflops[name] = gemms * 2 * n**3 / seconds / 1e12
        print(
            f"{name:20s} {seconds * 1e3:9.3f} ms {tflops[name]:9.1f} TFLOP/s   GEMMs: "
            f"{', '.join(gemm_kernels(hlo)) or 'none found'}"
        )
        if name.startswith("fp8") and not uses_fp8_gemm(hlo):
            fp8_forward_ok = False
    print(
        f"FP8 / BF16 forward:        {tflops['fp8 scalify'] / tflops['bf16']:.2f}x "
        f"({tflops['fp8 scalify +casts'] / tflops['bf16']:.2f}x with the casts)"
    )
    if not args.no_training:
        ratio = tflops["train fp8 scalify"] / tflops["train bf16"]
        print(f"FP8 / BF16 training step:  {ratio:.2f}x")
    if missing is None and not fp8_forward_ok:
        print("FAILED: the scalified FP8 forward does not compile to an FP8 GEMM.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
