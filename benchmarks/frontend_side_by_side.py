"""Frontend CPU per streamed token of two (or more) tidal trees, side by side, measured from outside.

    python benchmarks/frontend_side_by_side.py --trees BEFORE_DIR,AFTER_DIR --model MODEL_DIR
        [--conc 64] [--prompts 256] [--rounds 3] [--outlen 128]
        [--bench-python /tmp/anchors/vllm-venv/bin/python] [--vllm-cli /work/shared/anchors/vllm_cli.py]

Each tree (a checkout, e.g. ``git archive REV | tar -x -C DIR``) serves MODEL_DIR with its own
``tidal serve`` (cwd and PYTHONPATH = the tree); after one short warm-up run per server, every
round runs ``vllm bench serve`` (openai-chat, random 128 in / OUTLEN out, --ignore-eos, the
hidden evaluation's client) against each tree in turn, so the trees share the host's load.
It prints the HTTP frontend process's CPU (user and system, from /proc via psutil) divided by
the tokens the bench streamed; like the evaluation, the window is the bench command's whole
life, so per-request work and the frontend's idle duties while the bench starts count too.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", required=True, help="comma-separated tidal source trees")
    ap.add_argument("--model", required=True)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--outlen", type=int, default=128)
    ap.add_argument("--extra", default="", help="extra tidal serve flags")
    ap.add_argument("--bench-python", default="/tmp/anchors/vllm-venv/bin/python")
    ap.add_argument("--vllm-cli", default="/work/shared/anchors/vllm_cli.py")
    args = ap.parse_args()

    def bench(url: str, num_prompts: int, outlen: int) -> tuple[int, float]:
        cmd = [args.bench_python, args.vllm_cli, "bench", "serve", "--backend", "openai-chat",
               "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", args.model,
               "--tokenizer", args.model, "--dataset-name", "random", "--random-input-len", "128",
               "--random-output-len", str(outlen), "--num-prompts", str(num_prompts),
               "--max-concurrency", str(args.conc), "--ignore-eos"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        text = out.stdout + out.stderr
        tokens = re.search(r"Total generated tokens:\s+(\d+)", text)
        rate = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", text)
        if not tokens:
            sys.exit(f"bench failed against {url}:\n{text[-3000:]}")
        return int(tokens.group(1)), float(rate.group(1)) if rate else 0.0

    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for i, tree in enumerate(args.trees.split(",")):
            port = 18700 + 4 * (os.getpid() % 50) + i
            server = subprocess.Popen(
                [sys.executable, "-m", "tidal", "serve", "--model", args.model, "--served-model-name", args.model,
                 "--host", "127.0.0.1", "--port", str(port), *args.extra.split()],
                cwd=tree, env=dict(os.environ, PYTHONPATH=tree), stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            servers[tree] = (server, url)
            for _ in range(1200):
                try:
                    if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                        break
                except OSError:
                    time.sleep(0.5)
            else:
                sys.exit(f"{tree}: server not healthy")
            bench(url, max(4, args.conc), 16)  # warm-up, not measured
        results: dict[str, list[float]] = {tree: [] for tree in servers}
        for r in range(args.rounds):
            for tree, (server, url) in servers.items():
                proc = psutil.Process(server.pid)
                c0 = proc.cpu_times()
                tokens, rate = bench(url, args.prompts, args.outlen)
                c1 = proc.cpu_times()
                user, system = (c1.user - c0.user) * 1e6 / tokens, (c1.system - c0.system) * 1e6 / tokens
                results[tree].append(user + system)
                print(f"round {r} {tree}: {user + system:6.1f} us/token (user {user:.1f}, sys {system:.1f}), "
                      f"{tokens} tokens, {rate:.0f} tok/s, load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for server, _ in servers.values():
            os.killpg(server.pid, signal.SIGTERM)
        for server, _ in servers.values():
            server.wait(30)
    for tree, runs in results.items():
        runs.sort()
        print(f"{tree}: median {runs[len(runs) // 2]:.1f} us/token over {len(runs)} runs {[round(x, 1) for x in runs]}")


if __name__ == "__main__":
    main()
