"""Random sampling on the CPU: the C++ inverse-CDF draw against torch's exponential race.

    python benchmarks/sampling.py [--rows 1,16,64,256] [--vocab 8192] [--threads 1]
                                  [--top-p 1.0] [--temperature 1.0]

Times ``Sampler.sample_tokens`` over [rows, vocab] float32 logits, both ways in one process (the race
is what runs without the kernels: ``_cpu_draw`` patched to None), alternating, and prints the median
CPU time per call (this thread's, so a busy host does not inflate it) and the ratio. Default settings
are those of a request that sends no sampling parameters (temperature 1, no top-p), e.g.
``vllm bench serve``'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tidal.gpu import sampler as sampler_module  # noqa: E402
from tidal.gpu.sampler import Sampler, SamplingBatch  # noqa: E402
from tidal.wire import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernel_draw = sampler_module._cpu_draw
    if kernel_draw(torch.zeros(1, 4)) is None:
        sys.exit("the C++ kernels are not available here")
    sampler = Sampler()
    print(f"torch threads {a.threads}; vocab {a.vocab}; temperature {a.temperature}; top_p {a.top_p}; "
          f"thread CPU time per call, median of {a.rounds}\n")
    print("| rows | exponential race us | C++ inverse CDF us | ratio |\n|---:|---:|---:|---:|")
    for rows in [int(r) for r in a.rows.split(",")]:
        logits = torch.randn(rows, a.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        params = [SamplingParams(max_tokens=16, temperature=a.temperature, top_p=a.top_p)] * rows
        batch = SamplingBatch(params, [[1]] * rows, [[1]] * rows, [None] * rows)
        times: dict[str, list[float]] = {"race": [], "kernel": []}
        for _ in range(a.rounds):
            for way in times:
                sampler_module._cpu_draw = kernel_draw if way == "kernel" else (lambda logits: None)
                scratch = logits.clone()
                start = time.thread_time()
                sampler.sample_tokens(scratch, batch)
                times[way].append(time.thread_time() - start)
        sampler_module._cpu_draw = kernel_draw
        race, kernel = (statistics.median(times[w]) * 1e6 for w in ("race", "kernel"))
        print(f"| {rows} | {race:.0f} | {kernel:.0f} | {race / kernel:.1f}x |")


if __name__ == "__main__":
    main()
