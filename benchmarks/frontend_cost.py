"""Frontend CPU per streamed token, and the largest batch the frontend serves without coalescing.

    python benchmarks/frontend_cost.py [--batches 1,8,32,64,128,256] [--step-ms 4.48]
                                       [--output-len 256] [--endpoint completions|chat]

Starts ``tidal serve --model tidal-test --min-step-time STEP``: the engine's forward pass
costs nothing and every step lasts exactly STEP, so the frontend is the only real work.
For each batch B, ``tidal bench`` (a separate process) keeps B streams in flight; we read the
frontend process's CPU time (user+sys, /proc) and the server's counters before and after.

Per batch it prints: generated tokens, frontend CPU us per token, frames per token
(1.0 = every token its own SSE frame; less = the mailbox merged tokens because the handler
was behind), engine steps/s against the ideal 1/STEP, and whether any tokens were coalesced.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from live_server import LiveServer  # noqa: E402


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--step-ms", type=float, default=4.48)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="requests per stream slot")
    ap.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    ap.add_argument("--extra", default="", help="extra tidal serve flags")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    serve_args = ["--model", "tidal-test", "--min-step-time", str(args.step_ms / 1000),
                  "--max-num-seqs", str(max(batches)), "--num-kv-blocks", "8192", *args.extra.split()]
    rows = []
    with LiveServer(*serve_args) as server:
        front = psutil.Process(server.process.pid)
        for batch in batches:
            m0 = server.metrics()
            c0 = cpu_seconds(front)
            t0 = time.monotonic()
            bench = [sys.executable, "-m", "tidal", "bench", "--base-url", server.url, "--endpoint", args.endpoint,
                     "--num-prompts", str(batch * args.rounds), "--concurrency", str(batch), "--input-len", "32",
                     "--output-len", str(args.output_len), "--ignore-eos", "--no-progress"]
            out = subprocess.run(bench, capture_output=True, text=True)
            wall = time.monotonic() - t0
            c1 = cpu_seconds(front)
            m1 = server.metrics()
            if out.returncode != 0:
                print(out.stdout, out.stderr, file=sys.stderr)
                raise SystemExit("bench failed")
            tokens = m1["tidal:generation_tokens_total"] - m0["tidal:generation_tokens_total"]
            merged = m1["tidal:stream_coalesced_chunks_total"] - m0["tidal:stream_coalesced_chunks_total"]
            steps = m1["tidal:engine_steps_total"] - m0["tidal:engine_steps_total"]
            cpu_us = 1e6 * (c1 - c0) / tokens
            frames = (tokens - merged) / tokens
            step_rate = steps / wall
            ideal = 1000 / args.step_ms
            rows.append((batch, int(tokens), cpu_us, frames, step_rate, ideal, tokens / wall, merged == 0))
            print(f"batch {batch}: {cpu_us:.1f} us/token, frames/token {frames:.3f}, steps/s {step_rate:.0f}",
                  file=sys.stderr, flush=True)
    print(f"\ntidal-test model, fixed engine step {args.step_ms} ms, {args.endpoint}, "
          f"{args.output_len} tokens per stream\n")
    print("| batch | tokens | frontend CPU us/token | frames/token | tok/s | engine steps/s (ideal) | no coalescing |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for batch, tokens, cpu_us, frames, rate, ideal, tps, clean in rows:
        print(f"| {batch} | {tokens} | {cpu_us:.1f} | {frames:.3f} | {tps:.0f} | {rate:.0f} ({ideal:.0f}) | "
              f"{'yes' if clean else 'no'} |")


if __name__ == "__main__":
    main()
