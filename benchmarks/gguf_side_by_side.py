"""tidal and llama.cpp's llama-server on the same GGUF files, one server at a time, the same client: tok/s, TPOT and
start-to-ready time.

    python benchmarks/gguf_side_by_side.py --llama-server PATH/llama-server \
        --pair q4_1=/tmp/anchors/gguf/smol-q4_1.gguf --pair q8_0=...q8_0.gguf --pair q4_0=...q4_0.gguf \
        --pair bf16=/tmp/anchors/gguf/smol-bf16.gguf:/tmp/anchors/models/smol \
        --tokenizer /tmp/anchors/models/smol [--rounds 2] [--rows 1:8,16:64] [--warm 16:16] [--out FILE.jsonl]

A pair is NAME=FILE (both servers serve FILE) or NAME=FILE:DIR (llama-server serves FILE, tidal the Hugging Face
directory DIR: its bf16 row). Each round serves every pair with both servers, which one goes first alternating
by round. A server is started in its own process group; its start-to-ready time is from the process start to
the first ``/health`` answering 200 (llama-server answers 503 while it loads), and ``first completion`` to the
end of a first one-token completion. Then unmeasured warm-up rows (``--warm``), then each row with ``tidal
bench`` (``--endpoint completions``, random prompts of exactly ``--input-len`` tokens cut with ``--tokenizer``,
``--output-len`` tokens each with ``ignore_eos``, temperature 0): the same prompts for both servers, no chat
template. ``--cold``: tidal is also started once per pair with an empty ``TIDAL_GGUF_CACHE`` (tokenizer
conversion, repacking: a first start), for its start-to-ready time only. Prints a table; appends JSON lines to
``--out``. On a shared host, read ratios within a round, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request


def wait_ready(url: str, proc: subprocess.Popen, started: float, limit: float = 900.0) -> tuple[float, float]:
    """(seconds to the first /health 200, seconds to the end of a first one-token completion)."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode} before it was ready")
        if time.monotonic() - started > limit:
            raise RuntimeError("server not ready in time")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                break
        except Exception:
            time.sleep(0.1)
    ready = time.monotonic() - started
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    while True:
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=60).read()
            return ready, time.monotonic() - started
        except Exception:
            if proc.poll() is not None or time.monotonic() - started > limit:
                raise
            time.sleep(0.1)


class Server:
    def __init__(self, command: list[str], env: dict[str, str], log_path: str) -> None:
        self.log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        self.log.close()


def bench(url: str, args, conc: int, prompts: int) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    command = [sys.executable, "-m", "tidal", "bench", "--base-url", url, "--endpoint", "completions",
               "--num-prompts", str(prompts), "--concurrency", str(conc), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--ignore-eos", "--tokenizer", args.tokenizer, "--seed", "0",
               "--json", path, "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        print(done.stdout[-1500:], done.stderr[-1500:], file=sys.stderr)
        return None
    finally:
        os.remove(path)


def figure(report: dict, *names: str):
    """The first of ``names`` found in the report's aggregates (its JSON nests them by metric)."""
    for name in names:
        node = report
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    return None


def serve(args, side: str, name: str, gguf: str, hf_dir: str | None, port: int, env_extra: dict[str, str],
          rows: bool) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **env_extra)
    if side == "llama.cpp":
        command = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
                   "-np", str(args.slots), "-t", str(args.threads)]
    else:
        command = [sys.executable, "-m", "tidal", "serve", "--model", hf_dir or gguf, "--host", "127.0.0.1",
                   "--port", str(port)] + shlex.split(args.tidal_args)
    server = Server(command, env, os.path.join(args.logs, f"{side}-{name}.log"))
    records = []
    try:
        ready, first = wait_ready(url, server.proc, server.started)
        base = {"server": side, "pair": name, "file": os.path.basename(hf_dir or gguf),
                "cache": "cold" if "TIDAL_GGUF_CACHE" in env_extra else "warm", "ready_s": round(ready, 2),
                "first_completion_s": round(first, 2)}
        if not rows:
            return [dict(base, conc=None)]
        for row in filter(None, args.warm.split(",")):
            bench(url, args, *map(int, row.split(":")))
        for row in args.rows.split(","):
            conc, prompts = map(int, row.split(":"))
            report = bench(url, args, conc, prompts)
            if report is None:
                records.append(dict(base, conc=conc, error="bench failed"))
                continue
            records.append(dict(
                base, conc=conc, prompts=prompts,
                completed=figure(report, "completed", "summary.completed"),
                tok_s=figure(report, "output_throughput", "summary.output_throughput"),
                tpot_p50_ms=figure(report, "tpot_ms.p50", "summary.tpot_ms.p50", "tpot.p50", "summary.tpot.p50"),
                ttft_p50_ms=figure(report, "ttft_ms.p50", "summary.ttft_ms.p50", "ttft.p50", "summary.ttft.p50"),
                load_average=round(os.getloadavg()[0], 2)))
    finally:
        server.stop()
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pair", action="append", required=True, help="NAME=FILE or NAME=FILE:HF_DIR")
    ap.add_argument("--tokenizer", required=True, help="a directory with the model's tokenizer.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="1:8,16:64")
    ap.add_argument("--warm", default="16:16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--tidal-args", default="")
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--out", default="gguf_side_by_side.jsonl")
    ap.add_argument("--logs", default=tempfile.gettempdir())
    args = ap.parse_args()
    pairs = []
    for spec in args.pair:
        name, _, where = spec.partition("=")
        gguf, _, hf_dir = where.partition(":")
        pairs.append((name, gguf, hf_dir or None))
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512_bf16", "amx_bf16")})
    print(f"host flags: {' '.join(flags)}; {os.cpu_count()} cores; client: tidal bench --endpoint completions, "
          f"random {args.input_len}/{args.output_len}, ignore_eos", flush=True)
    records = []
    for round_ in range(1, args.rounds + 1):
        for name, gguf, hf_dir in pairs:
            sides = ["tidal", "llama.cpp"] if round_ % 2 else ["llama.cpp", "tidal"]
            for side in sides:
                for record in serve(args, side, name, gguf, hf_dir, args.port, {}, rows=True):
                    record["round"] = round_
                    records.append(record)
                    print(json.dumps(record), flush=True)
            if args.cold and round_ == 1 and hf_dir is None:
                with tempfile.TemporaryDirectory() as empty:
                    for record in serve(args, "tidal", name, gguf, None, args.port, {"TIDAL_GGUF_CACHE": empty},
                                        rows=False):
                        record["round"] = round_
                        records.append(record)
                        print(json.dumps(record), flush=True)
    with open(args.out, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print("\n| pair | conc | round | llama.cpp tok/s (TPOT p50 ms) | tidal tok/s (TPOT p50 ms) | tidal / llama.cpp |")
    print("|---|---:|---:|---|---|---:|")
    rows = {}
    for r in records:
        if r.get("conc") and r.get("tok_s"):
            rows.setdefault((r["pair"], r["conc"], r["round"]), {})[r["server"]] = r
    for (pair, conc, round_), sides in rows.items():
        llama, tidal = sides.get("llama.cpp"), sides.get("tidal")
        cell = lambda r: "-" if r is None else f"{r['tok_s']:.1f} ({r['tpot_p50_ms'] or 0:.2f})"  # noqa: E731
        ratio = f"{tidal['tok_s'] / llama['tok_s']:.2f}x" if llama and tidal else "-"
        print(f"| {pair} | {conc} | {round_} | {cell(llama)} | {cell(tidal)} | {ratio} |")
    print("\n| pair | server | cache | start to /health 200 s | start to first completion s |")
    print("|---|---|---|---:|---:|")
    seen = set()
    for r in records:
        key = (r["pair"], r["server"], r["cache"], r["round"])
        if key not in seen:
            seen.add(key)
            print(f"| {r['pair']} | {r['server']} | {r['cache']} | {r['ready_s']} | {r['first_completion_s']} |")


if __name__ == "__main__":
    main()
