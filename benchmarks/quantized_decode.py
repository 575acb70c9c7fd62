"""Decode step: the anchor model in bf16 against int8 and int4 weights (float or int8 activations), side by side.

    python benchmarks/quantized_decode.py [--model-dir DIR] [--size small] [--batches 1] [--steps 40]
                                          [--modes bf16,int8,int4,w8a8,w4a8]
                                          [--rounds 3] [--threads 2] [--clock wall|cpu]
                                          [--anchors ../shared/anchors]

Makes the anchor model with ``../shared/anchors/make_tiny_model.py DIR --size small`` (bf16 weights) unless
DIR holds one, loads it the way the engine does (``--dtype auto``: on a CPU without native bf16, float32
activations over bf16-stored linear weights; with native bf16, bf16) once per ``--modes`` row: as is
and with each ``--quantization`` (int8, int4: float activations; w8a8, w4a8: int8 activations), and times ``model.decode_logits`` (or ``model(batch)`` plus ``compute_logits`` where the stack has no head)
(a mode ``NAME:bf16-head``: that scheme with the LM head packed dense again from the checkpoint, as before every
scheme rounded it; ``NAME@G``: that scheme in groups of G inputs, as in quality.py)
for one decode token per sequence at ``--context`` cached tokens. Rows are repeated ``--rounds`` times,
interleaved, and the median is reported. The floor is the bytes the step reads in linear weights (integers,
scales, offsets; the dense LM head) over the host's read bandwidth, measured in the same run (a sum over a
1 GiB tensor in 2 MiB pages, where the weights live). The bf16 model runs its layers in one C++ call
(csrc/decoder_stack.cpp) where it can; a "bf16, python layers" row runs them as the quantized models do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from decode_step import decode_batch, read_bandwidth, time_steps  # noqa: E402
from quality import with_group  # noqa: E402
from tidal.gpu.cpu import huge_pages  # noqa: E402
from tidal.gpu.model import quantization  # noqa: E402
from tidal.gpu.model.attention import TorchPagedAttention  # noqa: E402
from tidal.gpu.model.layers import Linear, place_kernel_weights  # noqa: E402
from tidal.gpu.model.loader import checkpoint_weight_dtype, load_model  # noqa: E402
from tidal.gpu.model.precision import resolve_precision  # noqa: E402

BLOCK_SIZE = 16


def anchor_model(model_dir: str, size: str, anchors: str) -> str:
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        subprocess.run([sys.executable, os.path.join(anchors, "make_tiny_model.py"), model_dir, "--size", size],
                       check=True)
    return model_dir


def dense_head(model_dir: str, config, dtype: torch.dtype) -> Linear:
    """The checkpoint's LM head (the embedding table where they are tied) as a packed dense Linear."""
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    weight = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"].to(dtype)
    head = Linear.packed_from(weight)
    place_kernel_weights([head])
    return head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (with --threads 1 it shrugs off a busy machine)")
    ap.add_argument("--modes", default="bf16,int8,int4,w8a8,w4a8",
                    help="rows after bf16 (always first): --quantization names, or 'bf16, python layers'")
    ap.add_argument("--anchors", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "anchors"),
                    help="the directory of make_tiny_model.py (default: ../shared/anchors from the checkout)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    model_dir = anchor_model(args.model_dir or os.path.join(tempfile.gettempdir(), f"tidal-anchor-{args.size}"),
                             args.size, args.anchors)
    precision = resolve_precision("auto", torch.device("cpu"), checkpoint_weight_dtype(model_dir))
    bandwidth = read_bandwidth(huge=True)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split()
                    if f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")})
    print(f"host flags: {' '.join(flags)}; int kernel ISA {quantization.int_linear_ops('cpu').linear_int_isa()}; "
          f"torch threads {args.threads}; {args.clock} clock; read bandwidth {bandwidth / 1e9:.1f} GB/s (2 MiB pages); "
          f"{args.size} anchor model; dtype {str(precision.dtype).removeprefix('torch.')} ({precision.reason}); "
          f"load average {os.getloadavg()[0]:.2f}\n")

    models = {}
    rows = {"bf16": (None, "1"), "bf16, python layers": (None, "0"),
            **{name: (name, "1") for name in quantization.ON_THE_FLY},
            **{f"{name}:bf16-head": (name, "1") for name in quantization.ON_THE_FLY}}
    for label in ["bf16", *(m for m in args.modes.split(",") if m != "bf16")]:
        quantize, stack = rows[label] if label in rows else (with_group(label), "1")
        os.environ["TIDAL_CPU_STACK"] = stack
        model, config = load_model(model_dir, precision.dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                                   linear_weights=precision.linear_weights, quantize=quantize)
        if label.endswith(":bf16-head"):  # in place of the rounded one, so its bytes count once
            model._packed_lm_head = dense_head(model_dir, config, precision.dtype)
            if not config.tie_word_embeddings:
                model.lm_head = model._packed_lm_head
        quantized, dense = quantization.weight_bytes([m for m in model.modules() if isinstance(m, Linear)])
        models[label] = (model, quantized + dense)
    os.environ.pop("TIDAL_CPU_STACK")

    print("| weights | batch | step ms (median of rounds) | rounds | linear weight MB read | floor ms | "
          "step / floor | tok/s | vs bf16 |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        shape = (batch * (args.context // BLOCK_SIZE + 1), BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        flat = huge_pages.zeros(shape, precision.dtype, 2 * config.num_layers)
        for cache in flat:
            cache.copy_(torch.randn(shape))
        caches = list(zip(flat[::2], flat[1::2]))
        fb = decode_batch(batch, args.context, config.vocab_size)
        times: dict[str, list[float]] = {label: [] for label in models}
        for _ in range(args.rounds):
            for label, (model, _) in models.items():
                def step(model=model) -> None:
                    # what ModelRunner._forward runs for a decode batch: the stack's own head where it has one
                    if model.decode_logits(fb, caches) is None:
                        model.compute_logits(model(fb, caches)[fb.logits_indices])

                times[label].append(time_steps(step, args.steps, clock))
        base = statistics.median(times["bf16"])
        for label, (_, nbytes) in models.items():
            median = statistics.median(times[label])
            floor = nbytes / bandwidth
            spread = ", ".join(f"{t * 1e3:.2f}" for t in times[label])
            print(f"| {label} | {batch} | {median * 1e3:.2f} | {spread} | {nbytes / 1e6:.1f} | {floor * 1e3:.2f} | "
                  f"{median / floor:.2f}x | {batch / median:.0f} | {base / median:.2f}x |", flush=True)
    print(f"\nafter the run: read bandwidth {read_bandwidth(huge=True) / 1e9:.1f} GB/s, "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
