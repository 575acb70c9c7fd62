"""The engine's own work per step, with a forward pass of fixed length.

    python benchmarks/engine_overhead.py [--batches 1,16,64,256] [--step-ms 4.48]
                                         [--steps 200] [--runs 5] [--sampling greedy|random|stop]
                                         [--threads 1]

In-process, offline: the engine runs ``tidal-test`` with ``min_step_time`` = STEP (the forward
pass is a sleep of that length, the Llama-3-8B-on-H100 decode floor), so everything else a step
costs is the engine's own Python: scheduling, input preparation, sampling, appending tokens,
detokenizing, stop checks, the report. B requests decode together (prompts of 16 tokens, no
EOS); after a warm-up we time ``--steps`` steps driven exactly as the engine process drives
them (``Engine.step`` + ``take_report``) and print, per batch, the median over ``--runs`` runs
of the step time, the overhead not hidden behind the forward (step - STEP), and the engine's
CPU time per step (all its threads: on a busy host the wall figures stretch, the CPU does not;
a step can only reach STEP if its CPU, spread over the step loop and the forward thread, fits),
and the critical path: the step loop's time from a forward pass's end to the next launch, which
nothing overlaps. A bare sleep loop measured in the same run gives the host's wake-up floor.

``--sampling``: greedy (temperature 0), random (temperature 1, top_p 0.9, the API's usual
shape) or stop (greedy with a stop string that never matches, so every token's text is checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tidal.gpu.engine import PASSES, Engine
from tidal.gpu.process import tighten_timer_slack
from tidal.wire import AddRequest, EngineConfig, SamplingParams

WARMUP_STEPS = 20


class CriticalPath:
    """CPU time the step loop spends between a forward pass's end and the next one's launch (the
    abort window, the commit, the next schedule): the part of the overhead no overlap can hide.
    Thread CPU time, not wall time, so other processes on a busy host do not inflate it.
    Hooks the engine's own methods; engines without a forward thread have no such split."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        self.count = 0
        self.supported = hasattr(engine, "_launch")
        if not self.supported:
            return
        apply_aborts, launch = engine._apply_late_aborts, engine._launch
        started = [0.0]

        def timed_aborts():
            started[0] = time.thread_time()
            apply_aborts()

        def timed_launch():
            result = launch()
            if started[0]:
                self.seconds += time.thread_time() - started[0]
                self.count += 1
                started[0] = 0.0
            return result

        engine._apply_late_aborts, engine._launch = timed_aborts, timed_launch

    def take(self) -> float:
        mean = self.seconds / self.count if self.count else float("nan")
        self.seconds, self.count = 0.0, 0
        return mean


def sleep_floor(step: float, steps: int) -> float:
    """What a bare ``time.sleep(step)`` loop takes per iteration on this host right now."""
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(step)
    return (time.perf_counter() - start) / steps


def sampling_params(kind: str, max_tokens: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if kind == "random":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, ignore_eos=True)
    if kind == "stop":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=("\x00never",))
    raise ValueError(kind)


def time_steps(engine: Engine, batch: int, steps: int, kind: str, first_id: int,
               critical: CriticalPath | None = None) -> tuple[float, float, float]:
    """Wall seconds, engine CPU seconds (all threads) and critical-path seconds per step, over
    ``steps`` decode steps with ``batch`` running requests."""
    params = sampling_params(kind, WARMUP_STEPS + steps + 8)
    for i in range(batch):
        engine.add_request(AddRequest(first_id + i, [100 + (i + j) % 50 for j in range(16)], params, 0, 0.0))
    for _ in range(WARMUP_STEPS):  # the prefill and a few decodes
        engine.step()
        engine.take_report()
    assert len(engine.scheduler.running) == batch
    if critical:
        critical.take()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
        engine.take_report()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    path = critical.take() if critical else float("nan")
    engine.abort_all()
    engine.take_report()
    return elapsed / steps, cpu / steps, path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--step-ms", type=float, default=4.48)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "random", "stop"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the host is shared: 1 is steadiest)")
    ap.add_argument("--passes", choices=sorted(PASSES), help="where passes run (default: the engine's choice)")
    ap.add_argument("--default-timer-slack", action="store_true",
                    help="keep Linux's 50 us timer slack (the engine process tightens it; for comparison)")
    args = ap.parse_args()
    if not args.default_timer_slack:
        tighten_timer_slack()  # as the engine process does, before any thread starts
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    step = args.step_ms / 1000
    engine = Engine(EngineConfig(model="tidal-test", min_step_time=step, max_num_seqs=max(batches),
                                 max_num_batched_tokens=max(2048, 16 * max(batches)), num_kv_blocks=8192), passes=args.passes)
    critical = CriticalPath(engine)
    results: dict[int, list[tuple[float, float, float]]] = {b: [] for b in batches}
    floors = []
    next_id = 0
    for _ in range(args.runs):  # interleave the batches so drift in machine load hits all alike
        floors.append(sleep_floor(step, 50))
        for batch in batches:
            results[batch].append(time_steps(engine, batch, args.steps, args.sampling, next_id, critical))
            next_id += batch
    print(f"\ntidal-test, forward {args.step_ms} ms, {args.sampling} sampling, {args.steps} steps x "
          f"{args.runs} runs (median), torch threads {args.threads}, passes {args.passes or 'default'}, "
          f"timer slack {'default' if args.default_timer_slack else '1 ns'}\n")
    floor = statistics.median(floors)
    print(f"host floor: a bare time.sleep({args.step_ms} ms) loop takes {floor * 1e3:.2f} ms per iteration\n")
    print("| batch | step ms | overhead ms | steps/s | % of ideal | engine CPU ms/step | critical path CPU ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        t = statistics.median(r[0] for r in results[batch])
        cpu = statistics.median(r[1] for r in results[batch])
        path = statistics.median(r[2] for r in results[batch])
        print(f"| {batch} | {t * 1e3:.2f} | {(t - step) * 1e3:.2f} | {1 / t:.0f} | {step / t * 100:.0f}% "
              f"| {cpu * 1e3:.2f} | {'-' if path != path else f'{path * 1e3:.3f}'} |")
    print("\nper-run step ms: " + "; ".join(
        f"{b}: " + ", ".join(f"{r[0] * 1e3:.2f}" for r in results[b]) for b in batches), file=sys.stderr)


if __name__ == "__main__":
    main()
