"""The sum of a request's hops against the TTFT its client measured, one request at a time (c=1).

    python benchmarks/hops_vs_client_ttft.py [--requests 20] [--model tidal-tiny]

One ``tidal serve --otlp-traces-endpoint`` with a local OTLP/HTTP receiver (tests/test_tracing.py's).
A raw-socket client on one keep-alive connection stamps ``time.monotonic()`` just before it sends each
request and just after it reads the first content frame; the server's span gives its first byte read,
its first frame written and the hops between. Both sides read the same clock (CLOCK_MONOTONIC, one
host), so the table splits the client's TTFT into the server's hops and what lies outside them: the
kernel's delivery of the request and of the frame, and the client's own wake-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from live_server import LiveServer  # noqa: E402
from test_tracing import Collector, span_attributes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--model", default="tidal-tiny")
    args = ap.parse_args()
    collector = Collector()
    rows = []
    with LiveServer("--model", args.model, "--otlp-traces-endpoint", collector.url, "--no-ui") as server:
        sock = socket.create_connection(("127.0.0.1", server.port))
        for i in range(args.requests):
            trace_id = os.urandom(16)
            body = json.dumps({"messages": [{"role": "user", "content": f"Tell me a story {i}"}],
                               "max_tokens": 8, "stream": True}).encode()
            request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"traceparent: 00-" + trace_id.hex().encode() + b"-" + os.urandom(8).hex().encode() +
                       b"-01\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            data = b""
            sent = time.monotonic()
            sock.sendall(request)
            first = None
            while b"data: [DONE]" not in data:
                data += sock.recv(1 << 16)
                if first is None and b'"content":"' in data.split(b"data: ", 2)[-1] if b"data: " in data else False:
                    first = time.monotonic()
            root, hops = collector.trace(trace_id)
            a = span_attributes(root)
            received = root.start_time_unix_nano
            to_first = [h for h in hops if h.name != "stream"]
            hop_sum = (to_first[-1].end_time_unix_nano - received) / 1e6
            client = (first - sent) * 1e3
            rows.append((client, hop_sum, a["tidal.time_to_first_token_s"] * 1e3))
        sock.close()
    collector.stop()
    clients, sums, ttfts = zip(*rows)
    gaps = [c - s for c, s, _ in rows]
    print(f"\n{args.model}, c=1, {args.requests} streamed chat requests of 8 tokens, one keep-alive connection\n")
    print("| | mean ms | p50 ms | min ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for label, values in (("client TTFT (send -> first content frame read)", clients),
                          ("sum of the server's hops to the first frame", sums),
                          ("client TTFT - sum of hops", gaps)):
        print(f"| {label} | {statistics.mean(values):.2f} | {statistics.median(values):.2f} | {min(values):.2f} | "
              f"{max(values):.2f} |")
    assert all(abs(s - t) < 1e-3 for s, t in zip(sums, ttfts))  # the hops add up to the span's own TTFT


if __name__ == "__main__":
    main()
