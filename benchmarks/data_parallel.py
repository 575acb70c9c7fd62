"""Data parallelism: throughput of --data-parallel-size 2 against 1, and the router's cost per request.

    python benchmarks/data_parallel.py                   # tidal-tiny, c=64, 128 in / 128 out, 2 rounds
    python benchmarks/data_parallel.py --rounds 1 --num-prompts 64
    python benchmarks/data_parallel.py --min-step-time 0.05 --output-len 64   # a device-bound engine

Throughput: starts ``tidal serve`` with each data-parallel size in turn (DP=1, DP=2, DP=1, DP=2 ...:
alternating rounds so the shared machine's noise hits both alike) and drives it with ``tidal bench``
(chat, random prompts, ``--ignore-eos``). Engine threads are split the way the server splits them:
DP=1 gets torch's default (one per core), each of N replicas gets cores / N.

``--min-step-time S`` makes every engine step last at least S seconds, as when the engine waits on an
accelerator rather than computing on the CPU it shares with the frontend: it shows what replicas
buy once the CPU is not the bottleneck.

Routing cost: ``Router.route`` + ``release`` for 128-token prompts over 2 replicas with 64 requests
in flight (the prefix index warm), in-process, as microseconds per request.

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from tidal.engines.router import Router
from tidal.wire import EngineStats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from live_server import LiveServer  # noqa: E402


def bench_server(dp: int, args) -> dict:
    flags = ["--model", args.model, "--data-parallel-size", str(dp), "--num-kv-blocks", str(args.num_kv_blocks),
             "--log-level", "warning", "--min-step-time", str(args.min_step_time)]
    with LiveServer(*flags, start_timeout=300) as server, tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "tidal", "bench", "--base-url", server.url, "--endpoint", "chat",
               "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
               "--no-progress", "--json", out.name]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        with open(out.name) as f:
            return json.load(f)


def routing_cost(num_requests: int = 200_000, in_flight: int = 64, prompt_len: int = 128) -> float:
    router = Router(2, 16)
    for i in range(2):
        router.replica_up(i, 256, 4096, lambda: EngineStats(num_total_blocks=4096))
    rng = random.Random(0)
    prompts = [[rng.randrange(8192) for _ in range(prompt_len)] for _ in range(256)]
    open_ = []
    start = time.perf_counter()
    for n in range(num_requests):
        open_.append(router.route(prompts[n % 256]))
        if len(open_) > in_flight:
            d = open_.pop(0)
            router.release(d.index, d.generation)
    return (time.perf_counter() - start) / num_requests * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tidal-tiny")
    p.add_argument("--sizes", default="1,2", help="data-parallel sizes to compare (default 1,2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--min-step-time", type=float, default=0.0)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, list[dict]] = {dp: [] for dp in sizes}
    for _ in range(args.rounds):
        for dp in sizes:
            results[dp].append(bench_server(dp, args))
    print(f"{args.model}, chat, {args.input_len} in / {args.output_len} out, c={args.concurrency}, "
          f"{args.num_prompts} prompts, min step time {args.min_step_time} s, {os.cpu_count()} cores\n")
    print("| data-parallel size | output tok/s per round | TTFT p50 ms | TPOT mean ms |")
    print("|---:|---|---:|---:|")
    for dp in sizes:
        rounds = results[dp]
        tps = ", ".join(f"{r['output_throughput']:.0f}" for r in rounds)
        ttft = sum(r["ttft_ms"]["p50"] for r in rounds) / len(rounds)
        tpot = sum(r["tpot_ms"]["mean"] for r in rounds) / len(rounds)
        print(f"| {dp} | {tps} | {ttft:.0f} | {tpot:.1f} |")
    print(f"\nrouting cost: {routing_cost():.1f} us per request (Router.route + release, 128-token prompts, "
          "2 replicas, 64 in flight)")


if __name__ == "__main__":
    main()
