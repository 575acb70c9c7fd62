"""One bf16 linear, oneDNN on prepacked weights against the AVX512-BF16 kernel, shape by shape.

    python benchmarks/linear_bf16.py [--shapes 1280x768,768x2048,8192x768] [--rows 1,4,16,128,512]
                                     [--threads 1] [--clock cpu]

Times ``y = x @ W.T`` for x [M, K] and W [N, K] (shapes given as NxK), both paths on the same
weight, and prints microseconds per call, the ratio, and the kernel's multiply-adds per second.
With ``--clock cpu`` (the default) and one thread the figures hold up on a busy host; the weights
are reused call after call, so they come from cache (decode_step.py measures the DRAM-bound step).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from tidal.gpu.model.layers import gemv_ops, pack_gemv_weight, pack_weight, packed_linear


def per_call(fn, macs: int, clock) -> float:
    """Seconds per call of ``fn``, over enough calls for ~0.2 G multiply-adds."""
    calls = max(5, int(2e8 / macs))
    for _ in range(3):
        fn()
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1280x768,768x768,4096x768,768x2048,8192x768,1024x14336")
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = ap.parse_args()
    ops = gemv_ops(torch.bfloat16, "cpu")
    if ops is None:
        raise SystemExit("the AVX512-BF16 kernel cannot run here (no avx512_bf16, or the kernels did not build)")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"torch threads {args.threads}; {args.clock} clock; load average {os.getloadavg()[0]:.2f}\n")
    print("| N x K | M | oneDNN us | kernel us | speedup | kernel GMAC/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weight = torch.randn(n, k).bfloat16()
        onednn, kernel = pack_weight(weight), pack_gemv_weight(weight)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            base = per_call(lambda x=x, w=onednn: packed_linear(x, w, None), n * k * m, clock)
            ours = per_call(lambda x=x, w=kernel, n=n: ops.linear_bf16(x, w, n, None), n * k * m, clock)
            print(f"| {n} x {k} | {m} | {base * 1e6:.1f} | {ours * 1e6:.1f} | {base / ours:.2f}x | "
                  f"{n * k * m / ours / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
