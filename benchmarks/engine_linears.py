"""The whole engine in-process with each bf16 linear path: oneDNN (prepacked) against the AVX512-BF16 kernel;
or, with ``--paths MKL,avx2``, float32 on plain weights against float32 on bf16-stored weights (the AVX2
kernel, engaged as a server would be by ``TIDAL_CPU_GEMV=avx2``, set while that engine is built).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_linears.py [--size small] [--batch 16]
                                                                [--input-len 128] [--output-len 128] [--rounds 2]
                                                                [--paths onednn,gemv]

One engine per path in one process (``layers.USE_GEMV`` read as each model is packed), alternating
rounds of ``batch`` random prompts decoded greedily to ``output-len`` tokens (the loop of
engine_offline.py). Prints wall time and the process's CPU time per generated token: on a busy host
the CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from engine_offline import make_prompts, run_tidal  # noqa: E402
from models import make_model  # noqa: E402
from tidal.gpu.model import layers# noqa: E402
from tidal.gpu.engine import Engine  # noqa: E402
from tidal.wire import EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tidal-bench-models"))
    ap.add_argument("--paths", default="onednn,gemv", help="bf16: onednn, gemv; float32: MKL, avx2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_model(args.size, os.path.join(args.model_dir, args.size))
    engines = {}
    for name in args.paths.split(","):
        layers.USE_GEMV = name in ("gemv", "avx2")
        os.environ["TIDAL_CPU_GEMV"] = "avx2" if name == "avx2" else "1"  # read as the engine resolves its dtype
        engines[name] = Engine(EngineConfig(model=model_dir, dtype="float32" if name in ("MKL", "avx2") else "bfloat16",
                                            max_num_seqs=args.batch,
                                            max_num_batched_tokens=max(2048, args.input_len * 8),
                                            kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False))
        print(f"{name}: {engines[name].runner.dtype_reason}")
        run_tidal(engines[name], make_prompts(2, 16, seed=99), 8, 10_000_000)  # warm-up
    tokens = args.batch * args.output_len
    print(f"{args.size}, batch {args.batch}, {args.input_len} in / {args.output_len} out, "
          f"{args.threads} threads\n")
    print("| round | linears | wall s | tok/s | CPU ms per token | load average |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for i, (name, engine) in enumerate(engines.items()):
            cpu, wall = time.process_time(), time.perf_counter()
            prompts = make_prompts(args.batch, args.input_len, seed=r)
            run_tidal(engine, prompts, args.output_len, (2 * r + i + 1) * 100_000)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"| {r} | {name} | {wall:.2f} | {tokens / wall:.0f} | {cpu / tokens * 1e3:.2f} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
