"""Frontend CPU per streamed token with request timelines and tracing: before them, tracing off, tracing on.

    python benchmarks/frontend_tracing.py [--base-ref REF] [--batch 64] [--rounds 3] [--output-len 256]

Starts three ``tidal serve --model tidal-test --min-step-time 4.48 ms`` servers: the tree at
``--base-ref`` (a tree from before request timelines: no timeline, no hop histograms; checked out in a temporary git
worktree), this tree without tracing, and this tree with ``--otlp-traces-endpoint`` pointing at a
local OTLP/HTTP receiver in this process (it reads each POST and answers 200). The engine's pass costs
nothing and every step lasts exactly STEP, so the frontend is the only real work. In each round, each
server serves the same ``tidal bench`` load (B streams in flight), in turn, so host noise spreads over
all three; the frontend process's CPU time (user+sys) per generated token is the figure.
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
from live_server import LiveServer, free_port  # noqa: E402


class Sink(http.server.BaseHTTPRequestHandler):
    spans_bytes = 0

    def do_POST(self):
        Sink.spans_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-ref", default=None, help="git ref of a tree from before request timelines, e.g. 35f6bba (omit: skip it)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=4.48)
    args = ap.parse_args()
    port = free_port()
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", port), Sink)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    flags = ["--model", "tidal-test", "--min-step-time", str(args.step_ms / 1000), "--max-num-seqs",
             str(args.batch), "--num-kv-blocks", "8192", "--no-ui"]
    servers = {}
    base_dir = None
    if args.base_ref:
        base_dir = tempfile.mkdtemp(prefix="tidal-base-")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", base_dir, args.base_ref], check=True,
                       capture_output=True)
        servers["before (" + args.base_ref + ")"] = LiveServer(*flags, env={"PYTHONPATH": base_dir}, start_timeout=900)
    servers["tracing off"] = LiveServer(*flags, env={"PYTHONPATH": ROOT}, start_timeout=900)
    servers["tracing on"] = LiveServer(*flags, "--otlp-traces-endpoint", f"http://127.0.0.1:{port}/v1/traces",
                                       env={"PYTHONPATH": ROOT}, start_timeout=900)
    results: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for server in servers.values():
            server.start()
        for r in range(args.rounds):
            for name, server in servers.items():
                front = psutil.Process(server.process.pid)
                m0, c0 = server.metrics(), cpu_seconds(front)
                bench = [sys.executable, "-m", "tidal", "bench", "--base-url", server.url, "--endpoint", "completions",
                         "--num-prompts", str(args.batch * 2), "--concurrency", str(args.batch), "--input-len", "32",
                         "--output-len", str(args.output_len), "--ignore-eos", "--no-progress"]
                out = subprocess.run(bench, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
                if out.returncode != 0:
                    raise SystemExit(f"bench failed: {out.stderr}")
                time.sleep(1.0)  # the last requests' handlers end; spans leave on the export thread
                c1, m1 = cpu_seconds(front), server.metrics()
                tokens = m1["tidal:generation_tokens_total"] - m0["tidal:generation_tokens_total"]
                results[name].append(1e6 * (c1 - c0) / tokens)
                print(f"round {r + 1} {name}: {results[name][-1]:.1f} us/token", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
        if base_dir is not None:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], capture_output=True)
    reference = statistics.median(results["tracing off"])
    print(f"\ntidal-test, step {args.step_ms} ms, {args.batch} streams x {args.output_len} tokens, "
          f"{args.rounds} rounds (median of rounds; each round: {args.batch * 2} requests)\n")
    print("| server | frontend CPU us/token (median) | rounds | vs tracing off |")
    print("|---|---:|---|---:|")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {median / reference - 1:+.1%} |")
    print(f"\nspans posted to the local collector: {Sink.spans_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
