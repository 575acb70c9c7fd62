"""Where a forward pass runs on a CPU: on the forward thread, or deferred on the step loop's own.

    python benchmarks/forward_passes.py [--model DIR] [--batches 1,16] [--rounds 8]
                                        [--output-len 96] [--threads 2]

In-process, real model: one ``Engine`` decodes ``batch`` greedy requests (128-token random prompts,
``output-len`` tokens each) with its passes on a ``ForwardThread`` and with ``DeferredPasses`` (the
CPU default), the two alternated ``rounds`` times so drift in the host's load hits both alike.
Prints the median wall and process CPU time per decode step of each, as markdown.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tidal.gpu.engine import DeferredPasses, Engine, ForwardThread
from tidal.wire import AddRequest, EngineConfig, SamplingParams


def decode_steps(engine: Engine, batch: int, output_len: int, first_id: int, rng: random.Random) -> tuple[float, float]:
    """Wall and CPU seconds per step over the decode steps of ``batch`` requests."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(AddRequest(first_id + i, [rng.randrange(10, 8000) for _ in range(128)], params, 0, 0.0))
    for _ in range(3):  # the prefill
        engine.step()
        engine.take_report()
    steps, start, cpu = 0, time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
        engine.take_report()
        steps += 1
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tidal-tiny")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model))
    ways = {"forward thread": ForwardThread(), "deferred": DeferredPasses()}
    rng = random.Random(0)
    decode_steps(engine, 1, 16, 0, rng)  # warm-up
    next_id = 100
    print(f"\n{args.model}, {torch.get_num_threads()} torch threads, {args.output_len} tokens, "
          f"{args.rounds} rounds alternated (median)\n")
    print("| batch | forward thread ms/step | deferred ms/step | ratio | CPU ms/step thread / deferred |")
    print("|---:|---:|---:|---:|---:|")
    for batch in map(int, args.batches.split(",")):
        results: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, passes in ways.items():
                engine._passes = passes
                results[way].append(decode_steps(engine, batch, args.output_len, next_id, rng))
                next_id += batch
        wall = {way: statistics.median(r[0] for r in rs) for way, rs in results.items()}
        cpu = {way: statistics.median(r[1] for r in rs) for way, rs in results.items()}
        t, d = wall["forward thread"], wall["deferred"]
        print(f"| {batch} | {t * 1e3:.3f} | {d * 1e3:.3f} | {d / t:.2f} | "
              f"{cpu['forward thread'] * 1e3:.3f} / {cpu['deferred'] * 1e3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
