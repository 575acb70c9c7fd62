"""One float32 linear on a CPU without native bf16: MKL and oneDNN on float32 weights against the AVX2 kernel
on bf16-stored weights (csrc/linear_avx2.cpp), shape by shape.

    python benchmarks/linear_avx2.py [--shapes 768x1280,768x768,768x4096,2048x768,768x8192] [--rows 1,4,16]
                                     [--threads 1] [--clock cpu] [--hot]

Shapes are K x N (in x out features; the small model's qkv, o, gate_up, down and LM head by default).
Times ``y = x @ W.T`` for x [M, K] float32 and W [N, K]: ``F.linear`` (MKL) and oneDNN's linear on its
prepacked float32 weight, and the kernel on the same weight rounded to bf16 (exact for a bf16 checkpoint).
Prints microseconds per call and the weight bytes read per second (float32: 4 bytes a weight, kernel: 2).

By default each path cycles through enough copies of its weight (>= 256 MB) that every call reads it from
memory, as a decode step over a whole model does; ``--hot`` reuses one copy (from cache). The kernel runs
only on a CPU with AVX2+FMA; on one with AVX512 MKL and oneDNN use it, so to see what they do on an
AVX2-only CPU run with ``MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F

from tidal.gpu.model.layers import avx2_linear_ops, pack_avx2_weight

COLD_BYTES = 256 << 20


def per_call(fn, weights: list, clock, calls: int) -> float:
    """Seconds per call of ``fn(weight)``, cycling through ``weights``."""
    cycle = itertools.cycle(weights)
    for _ in range(len(weights) + 2):
        fn(next(cycle))
    start = clock()
    for _ in range(calls):
        fn(next(cycle))
    return (clock() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="768x1280,768x768,768x4096,2048x768,768x8192", help="K x N, comma-separated")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    ap.add_argument("--hot", action="store_true", help="reuse one weight (from cache) instead of cycling copies")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    ops = avx2_linear_ops("cpu")
    if ops is None:
        raise SystemExit("the AVX2 kernel cannot run here (no AVX2+FMA, TIDAL_CPU_GEMV=0, or the kernels did not build)")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"torch threads {args.threads}; {args.clock} clock; {'hot (cached) weights' if args.hot else 'weights from memory'}; "
          f"load average {os.getloadavg()[0]:.2f}; MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')} "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}\n")
    print("| K x N | M | MKL fp32 us | oneDNN fp32 us | kernel bf16-w us | vs MKL | vs oneDNN | MKL GB/s | oneDNN GB/s | kernel GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        copies = 1 if args.hot else max(1, COLD_BYTES // (n * k * 4))
        weights = [torch.randn(n, k).bfloat16().float() for _ in range(copies)]  # bf16 values, as a bf16 checkpoint
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        kernel = [pack_avx2_weight(w.bfloat16()) for w in weights]
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k)
            mkl_s = per_call(lambda w, x=x: F.linear(x, w), weights, clock, args.calls)
            dnn_s = per_call(lambda w, x=x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), onednn,
                             clock, args.calls)
            ours_s = per_call(lambda w, x=x, n=n: ops.linear_avx2(x, w, n, None), kernel, clock, args.calls)
            fp32_bytes, bf16_bytes = n * k * 4, n * k * 2
            print(f"| {k} x {n} | {m} | {mkl_s * 1e6:.1f} | {dnn_s * 1e6:.1f} | {ours_s * 1e6:.1f} | "
                  f"{mkl_s / ours_s:.2f}x | {dnn_s / ours_s:.2f}x | {fp32_bytes / mkl_s / 1e9:.1f} | "
                  f"{fp32_bytes / dnn_s / 1e9:.1f} | {bf16_bytes / ours_s / 1e9:.1f} |", flush=True)
        del weights, onednn, kernel


if __name__ == "__main__":
    main()
