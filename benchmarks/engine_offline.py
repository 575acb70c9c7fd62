"""Offline engine throughput against Hugging Face ``generate`` on the same model and prompts.

    python benchmarks/engine_offline.py [--sizes tiny,small] [--batches 1,8,32]
                                        [--input-len 128] [--output-len 128] [--threads 2]
                                        [--dtype auto|float32|bfloat16]

For each model and batch size, in one process and one run: tidal's engine (in-process:
scheduler, paged KV cache, model, sampler, detokenizer, stop checks) generates
``output-len`` greedy tokens for ``batch`` random prompts of ``input-len`` tokens, then
HF ``generate(do_sample=False)`` does the same, in the dtype tidal resolved (``--dtype auto``:
bfloat16 on CPUs with native bf16, else float32). Prints tokens/s and the ratio as markdown.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from models import make_model  # noqa: E402
from tidal.gpu.engine import Engine  # noqa: E402
from tidal.wire import AddRequest, EngineConfig, SamplingParams  # noqa: E402


def make_prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 8000) for _ in range(length)] for _ in range(batch)]


def run_tidal(engine: Engine, prompts: list[list[int]], out_len: int, first_id: int) -> float:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(AddRequest(first_id + i, p, params, 0, 0.0))
    produced = 0
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        if report:
            produced += sum(len(o.token_ids) for o in report.outputs)
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * out_len, produced
    return elapsed


def run_hf(model, prompts: list[list[int]], out_len: int) -> float:
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=out_len,
                             min_new_tokens=out_len, pad_token_id=2)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + out_len
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tidal-bench-models"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    rows = []
    for size in args.sizes.split(","):
        model_dir = make_model(size, os.path.join(args.model_dir, size))
        batches = [int(b) for b in args.batches.split(",")]
        engine = Engine(EngineConfig(model=model_dir, dtype=args.dtype, max_num_seqs=max(batches),
                                     max_num_batched_tokens=max(2048, args.input_len * 8),
                                     kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False))
        dtype = engine.runner.dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        run_tidal(engine, make_prompts(2, 16, seed=99), 8, 10_000_000)  # warm-up
        run_hf(hf, make_prompts(2, 16, seed=99), 8)
        for batch in batches:
            prompts = make_prompts(batch, args.input_len, seed=batch)
            t_tidal = run_tidal(engine, prompts, args.output_len, batch * 1000)
            t_hf = run_hf(hf, prompts, args.output_len)
            tokens = batch * args.output_len
            rows.append((size, batch, tokens / t_tidal, tokens / t_hf))
            print(f"{size} batch {batch}: tidal {tokens / t_tidal:.0f} tok/s, HF {tokens / t_hf:.0f} tok/s",
                  file=sys.stderr, flush=True)
    print(f"\ninput {args.input_len} / output {args.output_len} tokens, greedy, {dtype}, "
          f"torch threads {args.threads}\n")
    print("| model | batch | tidal tok/s | HF generate tok/s | ratio |")
    print("|---|---:|---:|---:|---:|")
    for size, batch, a, b in rows:
        print(f"| {size} | {batch} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
