"""Overload benchmark: offer several times tidal's capacity, with the admission bound and without.

    python benchmarks/overload.py                      # 60 s of overload per configuration
    python benchmarks/overload.py --duration 20        # a quick run

For each queue bound (default: tidal's default, then ``inf``, i.e. no bound) it starts
``tidal serve``, offers ``--overload`` x capacity as Poisson arrivals of streaming requests for
``--duration`` seconds, waits ``--drain`` seconds for what is still in flight, and reports:

* TTFT p50/p99 of the admitted requests (arrival to first token, as the client sees it),
* p99 of the time to answer a refused request (the 503),
* completed requests per second during the overload window,
* peak RSS of the server (frontend + engine processes).

Capacity is measured once, on the first configuration, by a closed loop of ``--max-num-seqs``
clients; every configuration then gets the same offered rate and the same arrival times.
The default model is tidal-tiny with a fixed ``--min-step-time`` so that the engine's speed,
not the CPU the client shares with it, decides the capacity. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import psutil
import trio

PROMPT = "The tide comes in and the tide goes out"


@dataclass
class Outcome:
    sent: float
    status: int | None = None  # None: no answer before the benchmark gave up on it
    answered: float | None = None  # status line received
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RunResult:
    bound: str
    offered_rate: float
    duration: float
    outcomes: list[Outcome] = field(default_factory=list)
    peak_rss: int = 0
    idle_rss: int = 0
    end: float = 0.0  # when the benchmark hung up on what was left (run-relative)


# ------------------------------------------------------------------ the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``tidal serve`` subprocess."""

    def __init__(self, args: argparse.Namespace, bound: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tidal", "serve", "--port", str(self.port), "--model", args.model,
               "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
        if args.min_step_time:
            cmd += ["--min-step-time", str(args.min_step_time)]
        if args.engine_threads:
            cmd += ["--engine-threads", str(args.engine_threads)]
        if bound != "default":
            cmd += ["--max-queued-requests", bound]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tidal-overload-", suffix=".log", delete=False)
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tidal serve exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tidal serve did not become healthy: see {self.log.name}")

    def rss(self) -> int:
        """Frontend + engine resident memory, in bytes."""
        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:  # e.g. a connection the benchmark left half-read
            self.process.kill()
            self.process.wait()


# ------------------------------------------------------------------ the clients


def request_bytes(args: argparse.Namespace, port: int) -> bytes:
    """One streaming /v1/completions request, as raw HTTP/1.1 bytes (built once, sent many times)."""
    body = json.dumps({"model": args.served_model_name, "prompt": PROMPT, "max_tokens": args.max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def one_request(port: int, request: bytes, outcome: Outcome, start: float) -> None:
    """Send one request on its own connection and note when its status, first token and [DONE]
    arrive (run-relative times). A raw socket rather than an HTTP library: at hundreds of requests
    a second on a shared CPU, the load generator must not be what is measured."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        outcome.status = -1
        return
    async with stream:
        try:
            await stream.send_all(request)
            tail = b""
            while data := await stream.receive_some(1 << 16):
                now = trio.current_time() - start
                window = tail + data  # markers may straddle two reads
                if outcome.status is None:
                    outcome.status = int(window.split(b" ", 2)[1])
                    outcome.answered = now
                    if outcome.status != 200:
                        return
                if outcome.first_token is None and b'"choices":[{' in window:
                    outcome.first_token = now
                if b"data: [DONE]" in window:
                    outcome.finished = now
                    return
                tail = window[-16:]
        except (trio.BrokenResourceError, OSError, ValueError, IndexError):
            pass
        if outcome.status is None:
            outcome.status = -1


async def measure_capacity(server: Server, args: argparse.Namespace) -> float:
    """Completed requests/s of a closed loop of max-num-seqs clients (after a short warm-up)."""
    request = request_bytes(args, server.port)
    done: list[float] = []
    origin = trio.current_time()

    async def loop():
        while True:
            outcome = Outcome(sent=0.0)
            await one_request(server.port, request, outcome, origin)
            if outcome.finished is None:
                raise RuntimeError(f"request failed while measuring capacity (status {outcome.status})")
            done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for _ in range(args.max_num_seqs):
            nursery.start_soon(loop)
        await trio.sleep(args.warmup)
        start = trio.current_time()
        await trio.sleep(args.capacity_seconds)
        with trio.move_on_after(60):  # a slow machine: wait for enough completions to mean something
            while sum(1 for t in done if t >= start) < args.max_num_seqs:
                await trio.sleep(0.1)
        count = sum(1 for t in done if t >= start)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    if count == 0:
        raise RuntimeError("no request completed while measuring capacity")
    return count / elapsed


async def offer_load(server: Server, args: argparse.Namespace, bound: str, arrivals: list[float],
                     rate: float) -> RunResult:
    result = RunResult(bound, rate, args.duration)
    request = request_bytes(args, server.port)
    result.idle_rss = server.rss()

    async def sample_rss():
        while True:
            result.peak_rss = max(result.peak_rss, server.rss())
            await trio.sleep(0.25)

    async with trio.open_nursery() as outer:
        outer.start_soon(sample_rss)
        async with trio.open_nursery() as requests:
            start = trio.current_time()
            for at in arrivals:
                await trio.sleep_until(start + at)
                outcome = Outcome(sent=trio.current_time() - start)
                result.outcomes.append(outcome)
                requests.start_soon(one_request, server.port, request, outcome, start)
            # what is still queued gets --drain seconds, then the benchmark hangs up on it
            result.end = trio.current_time() - start + args.drain
            requests.cancel_scope.deadline = start + result.end
        outer.cancel_scope.cancel()
    return result


# ------------------------------------------------------------------ report


def pct(values: list[tuple[float, bool]], q: float) -> tuple[float, bool] | None:
    """The q-th percentile of (value, censored) pairs; censored values are lower bounds."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1)]


def fmt_s(value: tuple[float, bool] | None) -> str:
    if value is None:
        return "-"
    seconds, censored = value
    text = f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
    return "> " + text if censored else text


def summarize(r: RunResult) -> dict:
    """Admitted = not refused. An admitted request that never got a first token counts in the TTFT
    percentiles with its wait so far (a lower bound: shown as "> x")."""
    refused = [o for o in r.outcomes if o.status == 503]
    admitted = [o for o in r.outcomes if o.status in (200, None)]
    ttft = [(o.first_token - o.sent, False) if o.first_token is not None else (r.end - o.sent, True)
            for o in admitted]
    refusal = [(o.answered - o.sent, False) for o in refused]
    completed = [o for o in admitted if o.finished is not None and o.finished <= r.duration]
    return {
        "bound": r.bound,
        "offered": len(r.outcomes),
        "offered_rate": r.offered_rate,
        "admitted": len(admitted),
        "refused": len(refused),
        "other": sum(1 for o in r.outcomes if o.status not in (200, 503, None)),
        "never_scheduled": sum(1 for o in admitted if o.first_token is None),
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "refusal_p99": pct(refusal, 99),
        "completed_per_s": len(completed) / r.duration,
        "peak_rss_mib": r.peak_rss / 2**20,
        "idle_rss_mib": r.idle_rss / 2**20,
    }


def markdown(rows: list[dict], capacity: float, args: argparse.Namespace) -> str:
    lines = [
        f"Capacity (closed loop, {args.max_num_seqs} clients): {capacity:.1f} req/s; offered "
        f"{args.overload:g}x = {rows[0]['offered_rate']:.1f} req/s for {args.duration:g} s "
        f"({args.model}, --max-num-seqs {args.max_num_seqs}, max_tokens {args.max_tokens}"
        + (f", --min-step-time {args.min_step_time:g}" if args.min_step_time else "") + ").",
        "",
        "| --max-queued-requests | offered | admitted | 503 | TTFT p50 | TTFT p99 | 503 answer p99 "
        "| completed/s | never scheduled | peak RSS (idle) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        lines.append(
            f"| {s['bound']} | {s['offered']} | {s['admitted']} | {s['refused']} | {fmt_s(s['ttft_p50'])} "
            f"| {fmt_s(s['ttft_p99'])} | {fmt_s(s['refusal_p99'])} | {s['completed_per_s']:.1f} "
            f"| {s['never_scheduled']} | {s['peak_rss_mib']:.0f} MiB ({s['idle_rss_mib']:.0f}) |")
    lines += ["", "TTFT is over admitted (not refused) requests, arrival to first token. 'never scheduled': "
              f"admitted requests still without a token {args.drain:g} s after the last arrival, when the "
              "benchmark hung up; they count in the TTFT percentiles with their wait so far ('> x'). "
              "'completed/s': requests finished within the overload window, per second."]
    return "\n".join(lines)


async def run_all(args: argparse.Namespace) -> tuple[list[dict], float]:
    bounds = [b.strip() for b in args.bounds.split(",") if b.strip()]
    rows: list[dict] = []
    capacity = rate = None
    arrivals: list[float] = []
    for bound in bounds:
        default_label = "default (256)" if bound == "default" else bound
        print(f"starting tidal serve with --max-queued-requests {default_label} ...", file=sys.stderr)
        server = await trio.to_thread.run_sync(Server, args, bound)
        try:
            if capacity is None:
                capacity = args.capacity or await measure_capacity(server, args)
                rate = args.overload * capacity
                rng = random.Random(args.seed)
                t = rng.expovariate(rate)
                while t < args.duration:
                    arrivals.append(t)
                    t += rng.expovariate(rate)
                print(f"capacity ~{capacity:.1f} req/s; offering {rate:.1f} req/s", file=sys.stderr)
            result = await offer_load(server, args, default_label, arrivals, rate)
        finally:
            await trio.to_thread.run_sync(server.stop)
        summary = summarize(result)
        print(json.dumps(summary), file=sys.stderr)
        rows.append(summary)
    return rows, capacity


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0, help="Seconds of overload per configuration.")
    p.add_argument("--overload", type=float, default=4.0, help="Offered load as a multiple of capacity.")
    p.add_argument("--bounds", default="default,inf",
                   help="Comma-separated --max-queued-requests values to compare ('default' = tidal's default).")
    p.add_argument("--model", default="tidal-tiny")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--min-step-time", type=float, default=0.04,
                   help="Engine step floor (s); 0 to run the model at full speed.")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="torch threads in the engine (default 1: fastest for tidal-tiny on a CPU it shares "
                        "with the load generator; 0 = torch's default).")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--capacity", type=float, default=None, help="Skip the measurement: capacity in req/s.")
    p.add_argument("--capacity-seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--drain", type=float, default=10.0,
                   help="Seconds after the last arrival to let admitted requests finish.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.served_model_name is None:
        args.served_model_name = args.model if os.path.sep not in args.model else None
    rows, capacity = trio.run(run_all, args)
    print(markdown(rows, capacity, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
