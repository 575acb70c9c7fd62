"""Engine steps per second when served: ``tidal-test`` at a fixed pass, B streams decoding together.

    python benchmarks/served_steps.py --trees BEFORE_DIR,AFTER_DIR [--batch 64] [--step-ms 4.48]
                                      [--rounds 2] [--window 4] [--stream-interval 1]

The in-process ``engine_overhead.py`` leaves out what the engine process adds around a step (the
pipe's reader and writer, the process loop). Here each tree (a checkout, cwd and PYTHONPATH =
the tree) runs ``tidal serve --model tidal-test --min-step-time STEP``; B streaming chat
completions (openai SDK, ``ignore_eos``, greedy unless ``--temperature``, long enough to outlast the window) run at once, and
once all B decode, the engine's step counter (``tidal:engine_steps_total`` on /metrics) is read at both
ends of a WINDOW-second span: steps/s against the ideal 1/STEP, and the engine process's CPU
per step (psutil) over that span. Trees alternate round by round so they share the host's load.
With ``--stream-interval`` N the frontend sends a chunk every N tokens: the client's and the
frontend's CPU per step shrink, the engine's does not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil
from openai import AsyncOpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def start_server(tree: str, port: int, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", "serve", "--model", "tidal-test", "--port", str(port),
         "--min-step-time", str(args.step_ms / 1000), "--max-num-seqs", str(max(args.batch, 8)),
         "--stream-interval", str(args.stream_interval), "--kv-cache-memory", str(args.kv_cache_gib)],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"{tree}: the server did not become ready")


def engine_process(server: subprocess.Popen) -> psutil.Process:
    children = psutil.Process(server.pid).children(recursive=True)
    return next(c for c in children if "tidal.gpu" in " ".join(c.cmdline()))


async def measure(port: int, engine: psutil.Process, args) -> tuple[float, float]:
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    # outlasts the ramp-up and the window, also when the client falls behind the streams
    tokens = min(4000, int((args.window + 20) / (args.step_ms / 1000)))  # tidal-test: 4096 tokens at most

    async def stream() -> None:
        chunks = await client.chat.completions.create(
            model="tidal-test", messages=[{"role": "user", "content": "Say something long."}],
            max_tokens=tokens, temperature=args.temperature, stream=True, extra_body={"ignore_eos": True})
        async for _ in chunks:
            pass

    tasks = [asyncio.create_task(stream()) for _ in range(args.batch)]
    ramp_deadline = time.monotonic() + 60
    while metric(port, "tidal:num_requests_running") < args.batch:
        if time.monotonic() > ramp_deadline:  # e.g. a KV cache too small for B long requests
            raise RuntimeError(f"fewer than {args.batch} requests running after 60 s")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # past the prefills
    first = metric(port, "tidal:engine_steps_total")
    while metric(port, "tidal:engine_steps_total") < first + 50:  # a first use may build a kernel first
        if time.monotonic() > ramp_deadline + 120:
            raise RuntimeError("the engine made no steps in 120 s")
        await asyncio.sleep(0.2)
    steps0, cpu0, t0 = metric(port, "tidal:engine_steps_total"), engine.cpu_times(), time.perf_counter()
    await asyncio.sleep(args.window)
    steps1, cpu1, t1 = metric(port, "tidal:engine_steps_total"), engine.cpu_times(), time.perf_counter()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    steps = steps1 - steps0
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return steps / (t1 - t0), cpu / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="comma-separated tidal source trees")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=4.48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window", type=float, default=4.0, help="seconds of steady decoding measured")
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="room for B requests of ~(WINDOW + 20) / STEP tokens")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, as engine_overhead.py; 1: the API's default (the CPU sampler's draw)")
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    results: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            port = free_port()
            server = start_server(tree, port, args)
            try:
                results[tree].append(asyncio.run(measure(port, engine_process(server), args)))
            finally:
                os.killpg(server.pid, signal.SIGTERM)
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
    ideal = 1000 / args.step_ms
    print(f"\ntidal-test served, forward {args.step_ms} ms (ideal {ideal:.0f} steps/s), batch {args.batch}, "
          f"temperature {args.temperature:g}, stream interval {args.stream_interval}, {args.window:.0f} s window, {args.rounds} rounds\n")
    print("| tree | steps/s per round | median | % of ideal | step ms | engine CPU ms/step |")
    print("|---|---|---:|---:|---:|---:|")
    for tree in trees:
        rates = [r[0] for r in results[tree]]
        rate = statistics.median(rates)
        cpu = statistics.median(r[1] for r in results[tree])
        print(f"| {tree} | {' / '.join(f'{r:.0f}' for r in rates)} | {rate:.0f} | {rate / ideal * 100:.0f}% "
              f"| {1000 / rate:.2f} | {cpu * 1e3:.2f} |")


if __name__ == "__main__":
    main()
