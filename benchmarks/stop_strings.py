"""What long stop strings cost the engine, and everyone else.

1. In process: the time and memory to set up one request's stop matching (the detokenizer
   of a request), for stop strings that share no prefix, then the slowest step of streaming
   text that keeps matching the first one (median and p99 of a step).
2. End to end: a normal stream (120 tokens, steps of >= 20 ms) while 8 requests with
   16 stop strings of 4096 characters arrive; its longest gap between frames.

    python benchmarks/stop_strings.py                # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/stop_strings.py --no-path

The second form measures another checkout (e.g. before this change) with the same script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serving import serving

PROMPT = "The tide comes in and the tide goes out"


def distinct_stops(count: int, length: int, head: str = "") -> list[str]:
    rng = random.Random(0)
    return [(head + f"\x00{i:02d}" + "".join(rng.choice("ab") for _ in range(length)))[:length] for i in range(count)]


def setup_cost(count: int, length: int) -> str:
    from tokenizers import Tokenizer

    import tidal
    from tidal.gpu.detokenizer import IncrementalDetokenizer

    tokenizer = Tokenizer.from_file(os.path.join(os.path.dirname(tidal.__file__), "assets", "tidal-tiny",
                                                 "tokenizer.json"))
    stops = tuple(distinct_stops(count, length))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    detokenizer = IncrementalDetokenizer(tokenizer, [], stops, True)
    setup = time.perf_counter() - start
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    # stream the first stop string but its last character: every step extends the held text
    ids = tokenizer.encode(stops[0][:-1], add_special_tokens=False).ids[:2000]
    steps = []
    for token_id in ids:
        start = time.perf_counter()
        detokenizer.append(token_id)
        steps.append(time.perf_counter() - start)
    steps.sort()
    return (f"| {count} x {length} | {setup * 1e3:.1f} ms | {grew:.0f} MB | {steps[len(steps) // 2] * 1e6:.1f} us "
            f"/ {steps[len(steps) * 99 // 100] * 1e6:.1f} us ({len(ids)} tokens) |")


def neighbour_gap(heavy: int) -> str:
    with serving("--min-step-time", "0.02") as url:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        output = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        stops = distinct_stops(16, 4096, head=output)
        return _measure(url, heavy, stops)


def _measure(url: str, heavy: int, stops: list[str]) -> str:
    import trio

    async def main() -> str:
        times: list[float] = []
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=url, timeout=120) as client, trio.open_nursery() as nursery:
            async def neighbour():
                body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            times.append(trio.current_time())

            async def one_heavy(i):
                await trio.sleep(0.3 + 0.05 * i)
                body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stops}
                statuses.append((await client.post("/v1/completions", json=body)).status_code)

            nursery.start_soon(neighbour)
            for i in range(heavy):
                nursery.start_soon(one_heavy, i)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return (f"{heavy} requests with 16 x 4096-character stop strings: neighbour's longest gap "
                f"{max(gaps) * 1e3:.0f} ms (median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms), statuses "
                f"{json.dumps(sorted(set(statuses)))}")

    return trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-path", action="store_true", help="import tidal from PYTHONPATH, not this checkout")
    parser.add_argument("--heavy", type=int, default=8)
    args = parser.parse_args()
    if not args.no_path:
        root = str(Path(__file__).resolve().parents[1])
        sys.path.insert(0, root)
        os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    print("| stop strings | setup | memory | step median / p99 |")
    print("|---|---|---|---|")
    for count, length in ((16, 4096), (1, 40000)):
        # each in a fresh process, so peak memory is that of this case alone
        print(subprocess.run([sys.executable, __file__, "--no-path", "--setup", str(count), str(length)],
                             capture_output=True, text=True, check=True).stdout.strip())
    print(neighbour_gap(args.heavy))


if __name__ == "__main__":
    if "--setup" in sys.argv:
        i = sys.argv.index("--setup")
        if "--no-path" not in sys.argv:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        print(setup_cost(int(sys.argv[i + 1]), int(sys.argv[i + 2])))
    else:
        main()
