"""Decode step time with one rank against two (tensor parallelism on CPU, gloo).

    python benchmarks/tensor_parallel.py [--sizes tiny,small] [--batches 1,16] [--steps 48]
                                         [--threads 2] [--dtype auto] [--rounds 2] [--tp-sizes 1,2]

For each model, batch size and round, in one process: an in-process engine (rank 0 is this process;
with TP=2 it starts rank 1) prefills ``batch`` random 32-token prompts, then the time of ``steps``
decode steps (``Engine.step``: schedule, forward, sample, detokenize) is taken. TP=1 runs ``threads``
torch threads; TP=2 splits them between its two ranks, so both use the same cores. The rounds
alternate TP=1 and TP=2 so a noisy host hits both alike. Prints ms per step and TP=2 / TP=1 as markdown.
``--tp-sizes 1`` runs one rank only, also against a checkout from before tensor parallelism
(``PYTHONPATH=that/checkout``): the single-rank path before and after.

With TP=2 it also adds up the time rank 0 spends in the step's collectives (the batch broadcast,
two all-reduces per layer and one for the embedding, the logits gather), waiting for rank 1 included.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as a served engine (engine_client.py)
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from models import make_model  # noqa: E402
from tidal.gpu.engine import Engine  # noqa: E402
from tidal.wire import AddRequest, EngineConfig, SamplingParams  # noqa: E402

PROMPT_LEN = 32


def decode_step_ms(model_dir: str, tp: int, batch: int, steps: int, threads: int, dtype: str) -> tuple[float, float]:
    """(ms per decode step, ms of it rank 0 spent in collectives)."""
    torch.set_num_threads(threads)  # a TP=2 run before left this process with its per-rank share
    # without the tensor-parallel field at TP=1, so the script also runs on a checkout from before it
    parallel = {"tensor_parallel_size": tp} if tp > 1 else {}
    engine = Engine(EngineConfig(model=model_dir, dtype=dtype, num_threads=threads, num_kv_blocks=batch * 8 + 8,
                                 **parallel))
    try:
        rng = random.Random(batch)
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(AddRequest(i, [rng.randrange(10, 8000) for _ in range(PROMPT_LEN)], params, 0, 0.0))
        for _ in range(4):  # the prefill, then a few decodes to settle
            engine.step()
            engine.take_report()
        in_collectives = _time_collectives(engine.runner.tp) if tp > 1 else [0.0]
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
            engine.take_report()
        elapsed = time.perf_counter() - start
        return elapsed / steps * 1e3, in_collectives[0] / steps * 1e3
    finally:
        if getattr(engine.runner, "tp", None) is not None:
            engine.runner.tp.close()


def _time_collectives(tp) -> list[float]:
    """Wrap rank 0's collectives (all-reduces, logits gather, batch broadcast) to add up their time."""
    total = [0.0]

    def timed(fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                total[0] += time.perf_counter() - start
        return call

    for name in ("all_reduce", "gather_vocab", "send_batch"):
        setattr(tp, name, timed(getattr(tp, name)))
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp-sizes", default="1,2")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    both = tp_sizes == [1, 2]
    print(f"threads {args.threads} in all (TP=2: {args.threads // 2} per rank), dtype {args.dtype}, "
          f"{args.steps} decode steps after a {PROMPT_LEN}-token prefill, {args.rounds} rounds alternating")
    header = ["model", "batch", *(f"TP={tp} ms/step" for tp in tp_sizes)]
    if 2 in tp_sizes:
        header.append("of which rank 0 in collectives")
    if both:
        header.append("TP=2 / TP=1 (best)")
    print("| " + " | ".join(header) + " |")
    print("|---|---:|" + "---|" * (len(header) - 2))
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model_dir = make_model(size, os.path.join(tmp, size))
            times: dict[tuple[int, int], list[float]] = {}
            waits: dict[int, list[float]] = {}
            for _ in range(args.rounds):
                for tp in tp_sizes:
                    for batch in batches:
                        ms, collective_ms = decode_step_ms(model_dir, tp, batch, args.steps, args.threads,
                                                           args.dtype)
                        times.setdefault((tp, batch), []).append(ms)
                        if tp > 1:
                            waits.setdefault(batch, []).append(collective_ms)
            for batch in batches:
                cells = [size, str(batch), *(_fmt(times[(tp, batch)]) for tp in tp_sizes)]
                if 2 in tp_sizes:
                    cells.append(_fmt(waits[batch]))
                if both:
                    cells.append(f"{min(times[(2, batch)]) / min(times[(1, batch)]):.2f}")
                print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
