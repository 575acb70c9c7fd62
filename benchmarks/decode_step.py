"""One decode step of the model alone (forward + logits), against the host's weight-read floor.

    python benchmarks/decode_step.py [--sizes small] [--batches 1,16] [--dtypes float32,bfloat16]
                                     [--context 128] [--steps 30] [--threads 2] [--linears onednn,gemv]
                                     [--layers stack] [--pages 2m] [--rounds 1] [--profile]

Loads the benchmark model (``benchmarks/models.py``) the way the engine does, builds a decode
batch of B sequences with ``--context`` tokens already cached, and times ``model(batch)`` plus
``compute_logits`` (no scheduler, sampler or detokenizer). The floor is the bytes of weights one
step reads over the host's read bandwidth, measured in the same run by summing a 1 GiB tensor.
``--linears`` compares bf16 linears side by side in one process, one model loaded per choice: ``onednn``
(oneDNN on prepacked weights, the path before the kernel; ``TIDAL_CPU_GEMV=0``) and ``gemv`` (the
AVX512-BF16 kernel of csrc/linear_bf16.cpp, the default where the CPU has it); float32 ``MKL`` (plain
float32 weights) and ``avx2`` (linear weights stored in bf16, csrc/linear_avx2.cpp: the default for a bf16
checkpoint on a CPU without native bf16). ``--layers stack,python`` compares the decoder layers run in one C++ call (csrc/decoder_stack.cpp, the default
where every linear is a tidal kernel) with the Python layers (``TIDAL_CPU_STACK=0``). ``--pages 2m,4k`` compares the packed weights and the KV cache in 2 MiB pages (tidal/gpu/cpu/huge_pages.py, the
default) with torch's 4 KiB pages (``TIDAL_CPU_HUGE_PAGES=0``); the bandwidth is read both ways too, and the
table gives the step against both floors. ``--rounds`` repeats
every row, interleaved, so a noisy host shows as spread, not as a difference.
``--profile`` prints torch.profiler's top operators for the last configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from models import make_model  # noqa: E402
from tidal.gpu.cpu import huge_pages
from tidal.gpu.model import layers# noqa: E402
from tidal.gpu.model.attention import TorchPagedAttention# noqa: E402
from tidal.gpu.forward_batch import ForwardBatch  # noqa: E402
from tidal.gpu.model.loader import iter_safetensors, load_model# noqa: E402

BLOCK_SIZE = 16


def read_bandwidth(gib: float = 1.0, repeats: int = 5, huge: bool = False) -> float:
    """Bytes/s of the fastest of ``repeats`` sums over a ``gib`` GiB float32 tensor (``huge``: in 2 MiB
    pages, where tidal keeps the weights, instead of torch's 4 KiB pages)."""
    nbytes = int(gib * (1 << 30))
    data = huge_pages.huge_page_bytes(nbytes).view(torch.float32).fill_(1) if huge else torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def decode_batch(batch: int, context: int, vocab: int) -> ForwardBatch:
    """B sequences at position ``context`` (their first ``context`` tokens cached), one new token each."""
    blocks_per_seq = context // BLOCK_SIZE + 1
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32).reshape(batch, blocks_per_seq)
    slots = tables[:, -1].to(torch.int64) * BLOCK_SIZE + context % BLOCK_SIZE
    return ForwardBatch(
        input_ids=torch.randint(10, vocab, (batch,)),
        positions=torch.full((batch,), context, dtype=torch.int64),
        slot_mapping=slots,
        num_decodes=batch,
        decode_block_tables=tables,
        decode_seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        decode_max_seq_len=context + 1,
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens_tensor=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        logits_indices=torch.arange(batch),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--linears", default="onednn,gemv",
                    help="the linear kernels to compare: bf16 onednn,gemv; float32 MKL,avx2 (bf16-stored weights)")
    ap.add_argument("--layers", default="stack",
                    help="stack,python: the layers in one C++ call and/or from Python (gemv and avx2 linears)")
    ap.add_argument("--pages", default="2m",
                    help="2m,4k: weights and KV cache in 2 MiB pages (the default) and/or torch's 4 KiB pages")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (with --threads 1 it shrugs off a busy machine)")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tidal-bench-models"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    bandwidth, huge_bandwidth = read_bandwidth(), read_bandwidth(huge=True)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512f", "avx512_bf16",
                                                                           "amx_bf16")})
    print(f"host flags: {' '.join(flags)}; torch threads {args.threads}; {args.clock} clock; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s ({huge_bandwidth / 1e9:.1f} from 2 MiB pages); context {args.context}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| model | dtype | linears | batch | step ms | weight MB | floor ms | step / floor | step / floor in "
          "2 MiB pages | tok/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        model_dir = make_model(size, os.path.join(args.model_dir, size))
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            models = {}  # linears -> model
            # each dtype's own choices of --linears (one run can give MKL,avx2 and onednn,gemv side by side)
            kinds = ("onednn", "gemv") if dtype == torch.bfloat16 else ("MKL", "avx2")
            for linears in [name for name in args.linears.split(",") if name in kinds] or [kinds[0]]:
                layers.USE_GEMV = linears in ("gemv", "avx2")
                choices = [(layer_choice, pages) for layer_choice in
                           (args.layers.split(",") if layers.USE_GEMV else ["python"])
                           for pages in args.pages.split(",")]
                for choice, pages in choices:
                    os.environ["TIDAL_CPU_STACK"] = "0" if choice == "python" else "1"
                    os.environ["TIDAL_CPU_HUGE_PAGES"] = "1" if pages == "2m" else "0"
                    model, config = load_model(model_dir, dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                                               linear_weights=torch.bfloat16 if linears == "avx2" else None)
                    if linears == "gemv" and not any(getattr(m, "gemv_packed", None) is not None
                                                     for m in model.modules()):
                        print(f"({size}: no AVX512-BF16 kernel on this CPU, gemv row skipped)")
                        break
                    label = ", ".join([linears] + ([choice] if "," in args.layers else [])
                                      + ([pages] if "," in args.pages else []))
                    models[label] = (model, pages)
                os.environ.pop("TIDAL_CPU_HUGE_PAGES")
            # weights a decode step reads: all but the embedding table (one row each), unless tied
            weights = sum(t.numel() for n, t in iter_safetensors(model_dir)
                          if n != "model.embed_tokens.weight" or config.tie_word_embeddings)
            for batch in (int(b) for b in args.batches.split(",")):
                num_blocks = batch * (args.context // BLOCK_SIZE + 1)
                shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
                caches = {}  # pages -> each layer's (k, v), in the pages the engine would give them
                for pages in args.pages.split(","):
                    os.environ["TIDAL_CPU_HUGE_PAGES"] = "1" if pages == "2m" else "0"
                    flat = huge_pages.zeros(shape, dtype, 2 * config.num_layers)
                    for cache in flat:
                        cache.copy_(torch.randn(shape))
                    caches[pages] = list(zip(flat[::2], flat[1::2]))
                os.environ.pop("TIDAL_CPU_HUGE_PAGES")
                fb = decode_batch(batch, args.context, config.vocab_size)
                for _ in range(args.rounds):
                    for linears, (model, pages) in models.items():
                        weight_bytes = weights * (2 if linears.startswith("avx2") else dtype.itemsize)  # bf16 linears
                        def step(model=model, fb=fb, caches=caches[pages]) -> None:
                            hidden = model(fb, caches)
                            model.compute_logits(hidden[fb.logits_indices])

                        median = time_steps(step, args.steps, clock)
                        floor = weight_bytes / bandwidth
                        print(f"| {size} | {dtype_name} | {linears} | {batch} | {median * 1e3:.2f} | "
                              f"{weight_bytes / 1e6:.0f} | {floor * 1e3:.2f} | {median / floor:.2f}x | "
                              f"{median * huge_bandwidth / weight_bytes:.2f}x | {batch / median:.0f} |", flush=True)
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                        for _ in range(10):
                            step()
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"\nafter the run: read bandwidth {read_bandwidth() / 1e9:.1f} GB/s ({read_bandwidth(huge=True) / 1e9:.1f} "
          f"from 2 MiB pages), load average {os.getloadavg()[0]:.2f}")


def time_steps(step, steps: int, clock) -> float:
    """Median seconds of ``steps`` calls of ``step`` after three warm-up calls."""
    with torch.inference_mode():
        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            start = clock()
            step()
            times.append(clock() - start)
    times.sort()
    return times[len(times) // 2]


if __name__ == "__main__":
    main()
