"""The engine's whole step in-process, at one request at a time, for one or more tidal trees side by side.

    python benchmarks/engine_step.py --trees A,B [--model DIR] [--quantization int4] [--rounds 8]
                                     [--requests 20] [--prompt-len 128] [--output-len 128] [--temperature 1.0]

Each round starts one process per tree, in turn (so the host's drift hits every tree alike), with that tree first
on PYTHONPATH: an ``Engine`` on ``--model`` runs ``--requests`` requests one after another (random prompts, sampled
at ``--temperature``: ``vllm bench serve`` sends none, so 1), timing every ``step()`` with its ``take_report()``.
A process reports the median decode step and the wall per generated token, prefill included. Printed as
markdown: per tree the median over the rounds and every round's value. No frontend, pipe or client: what the
step loop itself costs (docs/performance.md, "Seventh session on the Zen 4 host").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def child(args: argparse.Namespace) -> None:
    from tidal.gpu.engine import Engine
    from tidal.wire import AddRequest, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=args.model, quantization=args.quantization))
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    rng = random.Random(0)

    def run(first_id: int, count: int) -> list[float]:
        steps = []
        for request_id in range(first_id, first_id + count):
            prompt = [rng.randrange(10, 8000) for _ in range(args.prompt_len)]
            engine.add_request(AddRequest(request_id, prompt, params, 0, time.time()))
            while engine.has_work():
                started = time.perf_counter()
                engine.step()
                engine.take_report()
                steps.append(time.perf_counter() - started)
        return steps

    run(0, 3)  # warm-up: kernels, buffers, caches
    steps = run(3, args.requests)
    print(json.dumps({"step_median_us": statistics.median(steps) * 1e6,
                      "per_token_us": sum(steps) / (args.requests * args.output_len) * 1e6}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="comma-separated tidal source trees (default: this one)")
    ap.add_argument("--model", default="tidal-tiny")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    trees = args.trees.split(",")
    flags = ["--model", args.model, "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
             "--output-len", str(args.output_len), "--temperature", str(args.temperature)]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    results: dict[str, list[dict]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *flags], env=env, cwd=tree,
                                 capture_output=True, text=True, check=True).stdout
            results[tree].append(json.loads(out.strip().splitlines()[-1]))
    print(f"model {args.model}, --quantization {args.quantization}, {args.requests} requests of {args.prompt_len} + "
          f"{args.output_len} tokens at temperature {args.temperature}, {args.rounds} rounds\n")
    print("| tree | step median us (median of rounds) | per token us | every round's step median |")
    print("|---|---:|---:|---|")
    for tree, rounds in results.items():
        steps = [r["step_median_us"] for r in rounds]
        tokens = [r["per_token_us"] for r in rounds]
        print(f"| {tree} | {statistics.median(steps):.0f} | {statistics.median(tokens):.0f} | "
              f"{', '.join(f'{s:.0f}' for s in steps)} |")


if __name__ == "__main__":
    main()
