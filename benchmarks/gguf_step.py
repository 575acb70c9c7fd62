"""One batch-1 decode step of a GGUF file as tidal serves it, against its weight-read floor, and where it goes.

    python benchmarks/gguf_step.py FILE.gguf [FILE.gguf ...] [--hf-dir DIR] [--batches 1] [--steps 40]
                                   [--rounds 3] [--threads 2] [--profile]

Each file is loaded the way ``tidal serve --model FILE.gguf`` loads it (``--dtype auto``; Q8_0 / Q4_0 / Q4_1
linears native on the int kernels, against int8 activations; ``--exact-activations``: float ones, as a named
``--dtype`` runs them) and ``--hf-dir`` (a Hugging Face directory, e.g. the dequantized bf16 copy)
as ``--model DIR`` does. Rows are timed in rounds, interleaved, median reported. The floor is the bytes one
step reads in linear weights (integers, scales, offsets, the LM head) over the read bandwidth measured in
the same run (a sum over 1 GiB in 2 MiB pages, where the weights live). ``--profile``: the same step with the
decoder layers in Python (``TIDAL_CPU_STACK=0``: one op per kernel call, so torch.profiler sees each),
every operator's share of the step, per file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from decode_step import decode_batch, read_bandwidth, time_steps  # noqa: E402
from tidal import gguf_model  # noqa: E402
from tidal.gpu.cpu import huge_pages  # noqa: E402
from tidal.gpu.model import quantization  # noqa: E402
from tidal.gpu.model.attention import TorchPagedAttention  # noqa: E402
from tidal.gpu.model.layers import Linear  # noqa: E402
from tidal.gpu.model.loader import checkpoint_weight_dtype, load_model  # noqa: E402
from tidal.gpu.model.precision import resolve_precision  # noqa: E402

BLOCK_SIZE = 16


def load(source: str, stack: str, activation_bits: int = 8):
    model_dir = gguf_model.prepare(source) if source.endswith(".gguf") else source
    weight_dtype = None if source.endswith(".gguf") else checkpoint_weight_dtype(model_dir)
    precision = resolve_precision("auto", torch.device("cpu"), weight_dtype)
    os.environ["TIDAL_CPU_STACK"] = stack
    try:
        model, config = load_model(model_dir, precision.dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                                   linear_weights=precision.linear_weights, gguf_activation_bits=activation_bits)
    finally:
        os.environ.pop("TIDAL_CPU_STACK")
    quantized, dense = quantization.weight_bytes([m for m in model.modules() if isinstance(m, Linear)])
    return model, config, precision.dtype, quantized + dense


def step_fn(model, fb, caches):
    def step() -> None:  # what ModelRunner._forward runs for a decode batch
        if model.decode_logits(fb, caches) is None:
            model.compute_logits(model(fb, caches)[fb.logits_indices])
    return step


def caches_for(config, dtype, batch: int, context: int):
    shape = (batch * (context // BLOCK_SIZE + 1), BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    flat = huge_pages.zeros(shape, dtype, 2 * config.num_layers)
    for cache in flat:
        cache.copy_(torch.randn(shape))
    return list(zip(flat[::2], flat[1::2]))


def profile(label: str, model, config, dtype, context: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fb, caches = decode_batch(1, context, config.vocab_size), caches_for(config, dtype, 1, context)
    step = step_fn(model, fb, caches)
    wall = time_steps(step, steps, time.perf_counter)
    with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\n{label}, python layers, batch 1: step {wall * 1e3:.2f} ms (median, unprofiled); "
          f"per-op share of the profiled CPU time ({total / steps / 1e3:.2f} ms per step):\n")
    print("| op | calls per step | ms per step | share |")
    print("|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"| {e.key} | {e.count / steps:.0f} | {e.self_cpu_time_total / steps / 1e3:.3f} | "
              f"{e.self_cpu_time_total / total:.1%} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*")
    ap.add_argument("--hf-dir", action="append", default=[])
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--exact-activations", action="store_true",
                    help="GGUF integer linears against float activations (a named --dtype) instead of int8 ones")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(huge=True)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512_bf16", "amx_bf16")})
    print(f"host flags: {' '.join(flags)}; torch threads {args.threads}; read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(2 MiB pages); load average {os.getloadavg()[0]:.2f}\n")
    sources = args.files + args.hf_dir
    bits = 16 if args.exact_activations else 8
    models = {os.path.basename(s.rstrip("/")): load(s, "1", bits) for s in sources}
    print("| model | batch | step ms (median) | rounds | linear weight MB read | floor ms | step / floor | tok/s |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {label: [] for label in models}
        runs = {}
        for label, (model, config, dtype, _) in models.items():
            fb = decode_batch(batch, args.context, config.vocab_size)
            runs[label] = step_fn(model, fb, caches_for(config, dtype, batch, args.context))
        for _ in range(args.rounds):
            for label, step in runs.items():
                times[label].append(time_steps(step, args.steps, time.perf_counter))
        for label, (_, _, _, nbytes) in models.items():
            median, floor = statistics.median(times[label]), nbytes / bandwidth
            spread = ", ".join(f"{t * 1e3:.2f}" for t in times[label])
            print(f"| {label} | {batch} | {median * 1e3:.2f} | {spread} | {nbytes / 1e6:.1f} | {floor * 1e3:.2f} | "
                  f"{median / floor:.2f}x | {batch / median:.0f} |", flush=True)
        runs.clear()
    if args.profile:
        for source in sources:
            model, config, dtype, _ = load(source, "0", bits)
            profile(os.path.basename(source.rstrip("/")), model, config, dtype, args.context, args.steps)
    print(f"\nafter the run: read bandwidth {read_bandwidth(huge=True) / 1e9:.1f} GB/s, "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
