"""Does tokenising long prompts delay other streams? (issue 9 item 6)

Starts ``tidal serve`` (tidal-tiny, steps of >= 20 ms), runs one normal 150-token stream and,
from 0.5 s on, sends ``--prompts`` concurrent /v1/completions requests whose prompt has
``--chars`` characters (longer than the 4096-token context: each ends in a 400 or, past the
tokenizer's queue, a 503). Prints the normal stream's longest and median gap between frames,
the statuses of the long requests and how long the last took to be answered.

    python benchmarks/tokenizer_isolation.py                       # 20 prompts of 1 MB
    python benchmarks/tokenizer_isolation.py --chars 250000       # tokenised, then refused
    PYTHONPATH=/other/checkout python benchmarks/tokenizer_isolation.py --no-path   # another version
    python benchmarks/tokenizer_isolation.py --gil     # does encode / encode_batch release the GIL?
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import httpx
import trio
from serving import serving

PROMPT = "The tide comes in and the tide goes out"


async def measure(url: str, prompts: int, chars: int) -> str:
    times: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    answered: list[float] = []
    long_prompt = (PROMPT + ". ") * (chars // (len(PROMPT) + 2) + 1)
    # encoded once: encoding 1 MB of JSON per request would stall this client's own event loop
    long_body = json.dumps({"prompt": long_prompt[:chars], "max_tokens": 4}).encode()
    limits = httpx.Limits(max_connections=prompts + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client, trio.open_nursery() as nursery:
        async def normal():
            body = {"prompt": PROMPT, "max_tokens": 150, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(trio.current_time())

        async def long(start: float):
            await trio.sleep(0.5)
            response = await client.post("/v1/completions", content=long_body,
                                         headers={"Content-Type": "application/json"})
            statuses[response.status_code] += 1
            answered.append(trio.current_time() - start)

        nursery.start_soon(normal)
        for _ in range(prompts):
            nursery.start_soon(long, trio.current_time() + 0.5)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return (f"{prompts} x {chars} characters: normal stream's longest gap {gaps[-1] * 1e3:.0f} ms "
            f"(median {gaps[len(gaps) // 2] * 1e3:.0f} ms, {len(times)} frames); long requests: "
            f"{dict(sorted(statuses.items()))}, last answered after {max(answered):.2f} s")


def gil() -> None:
    """Encode 1 MB in a thread while the main thread wakes every 1 ms; print its longest gap."""
    import threading

    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tidal

    tokenizer = Tokenizer.from_file(os.path.join(os.path.dirname(tidal.__file__), "assets", "tidal-tiny",
                                                 "tokenizer.json"))
    text = ((PROMPT + ". ") * 30000)[:1_000_000]
    for name, encode in (("encode", lambda: tokenizer.encode(text)),
                         ("encode_batch", lambda: tokenizer.encode_batch([text]))):
        worker = threading.Thread(target=encode)
        start = last = time.perf_counter()
        longest = 0.0
        worker.start()
        while worker.is_alive():
            time.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        print(f"{name}: {now - start:.2f} s for 1 MB; the main thread's longest gap {longest * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--chars", type=int, default=1_000_000)
    parser.add_argument("--no-path", action="store_true", help="import tidal from PYTHONPATH, not this checkout")
    parser.add_argument("--gil", action="store_true", help="only measure whether tokenizers releases the GIL")
    args = parser.parse_args()
    if args.gil:
        return gil()
    env = dict(os.environ)
    if not args.no_path:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    with serving("--min-step-time", "0.02", env=env) as url:
        print(trio.run(measure, url, args.prompts, args.chars))


if __name__ == "__main__":
    main()
