"""LoRA adapters on a served model: throughput through adapters against the base model, adapter load time, and
a smoke check that the served adapter says what transformers + peft with it merged says.

    python benchmarks/lora.py --model /path/to/hf-model-dir [--rounds 2] [--output-len 64]
    python benchmarks/lora.py --model /path/to/hf-model-dir --in-process [--rounds 5] [--steps 20] [--batch 16]

Makes four rank-16 adapters of the model offline with peft (random A and B), then:

1. smoke (``--dtype float32`` server): greedy tokens through adapter 0 equal transformers + peft merged, float32;
2. throughput (a ``--dtype auto`` server with ``--max-loras 4``): 16 concurrent streams spread over the 4
   adapters against 16 base-model streams, and one stream through adapter 0 against one base stream, the two
   sides alternating in the same server, ``--rounds`` times each; tok/s = completion tokens / wall time;
3. load time: ``POST /v1/load_lora_adapter`` of a fifth rank-16 adapter (every replica reads and checks it)
   and the engine's read alone (``read_adapter``, in this process).

``--in-process`` times the model's decode step alone instead (forward + logits, the one-call decoder stack, the
dtype the server's ``--dtype auto`` picks): ``--batch`` rows over the 4 adapters (row i through adapter i % 4)
against the same rows through the base model, and one row through adapter 0 against one base row, the sides
alternating ``--rounds`` times; the median step of each and their ratio. No server, scheduler or sampler: the
kernel's share of a step, for iterating on csrc/lora.cpp.

Prints one line per figure. On a loaded host only the ratios of sides measured alternately mean anything.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def make_adapter(model_dir: str, out_dir: str, seed: int, r: int = 16) -> str:
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapted = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(adapted.named_parameters()):
            if ".lora_" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(out_dir)
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen([sys.executable, "-m", "tidal", "serve", "--port", str(self.port), "--no-ui",
                                         *flags], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log.name).read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def complete(url: str, model: str, max_tokens: int, **fields) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
    answer.raise_for_status()
    return answer.json()


def tok_per_s(url: str, models: list[str], max_tokens: int) -> float:
    """len(models) concurrent requests, one per entry; completion tokens over the wall time."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        answers = list(pool.map(lambda m: complete(url, m, max_tokens), models))
    wall = time.perf_counter() - start
    return sum(a["usage"]["completion_tokens"] for a in answers) / wall


def smoke(model_dir: str, adapter: str) -> None:
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    server = Server("--model", model_dir, "--dtype", "float32", "--enable-lora", "--lora-modules", f"a0={adapter}",
                    "--max-lora-rank", "16")
    try:
        answer = complete(server.url, "a0", 16, return_tokens_as_token_ids=True, logprobs=0)
        served = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
        base = complete(server.url, model_dir, 16)["choices"][0]["text"]
    finally:
        server.stop()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    merged = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                            adapter).merge_and_unload().eval()
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():  # greedy through EOS, as the server's ignore_eos does (generate stops at the model's EOS)
        ids = prompt
        for _ in range(16):
            ids = torch.cat([ids, merged(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        reference = ids[0, prompt.shape[1]:]
    print(f"smoke: adapter a0 greedy tokens {'EQUAL' if served == reference.tolist() else 'DIFFER'} "
          f"transformers+peft merged (float32); through a0: {tokenizer.decode(served)!r}; base: {base!r}")


def in_process(model_dir: str, adapters: list[str], rounds: int, steps: int, batch: int) -> None:
    """The decode step alone, base rows against adapter rows, alternating (module docstring)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from decode_step import BLOCK_SIZE, decode_batch

    from tidal.gpu.cpu import huge_pages
    from tidal.gpu.model.attention import TorchPagedAttention
    from tidal.gpu.model.config import ModelConfig
    from tidal.gpu.model.loader import checkpoint_weight_dtype, load_model
    from tidal.gpu.model.lora import LoraSlots, read_adapter
    from tidal.gpu.model.precision import resolve_precision

    precision = resolve_precision("auto", torch.device("cpu"), checkpoint_weight_dtype(model_dir))
    model, config = load_model(model_dir, precision.dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                               linear_weights=precision.linear_weights)
    slots = LoraSlots(model, 4, 16)
    slots.place({i: read_adapter(f"a{i}", path, ModelConfig.from_dir(model_dir), 16)
                 for i, path in enumerate(adapters[:4])})
    context = 128
    shape = (batch * (context // BLOCK_SIZE + 1), BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    flat = huge_pages.zeros(shape, precision.dtype, 2 * config.num_layers)
    for cache in flat:
        cache.copy_(torch.randn(shape))
    caches = list(zip(flat[::2], flat[1::2]))
    sides = {}
    for rows in (batch, 1):
        base = decode_batch(rows, context, config.vocab_size)
        adapted = dataclasses.replace(base, lora=slots.rows([(slots.slot_of[i % 4], 1) for i in range(rows)], rows))
        sides[rows] = {"base": base, "lora": adapted}
    times: dict[tuple[int, str], list[float]] = {(rows, side): [] for rows in sides for side in ("base", "lora")}

    def step(fb) -> float:
        start = time.perf_counter()
        model.compute_logits(model(fb, caches)[fb.logits_indices])
        return time.perf_counter() - start

    with torch.inference_mode():
        for rows, pair in sides.items():  # warm-up
            for fb in pair.values():
                for _ in range(3):
                    step(fb)
        for _ in range(rounds):  # step by step, the sides alternating: a burst of load hits both
            for rows, pair in sides.items():
                for _ in range(steps):
                    for side, fb in pair.items():
                        times[rows, side].append(step(fb))
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512_bf16", "amx_bf16")})
    print(f"in-process decode step, {precision.dtype}, {torch.get_num_threads()} threads, host {' '.join(flags)}, "
          f"load average {os.getloadavg()[0]:.2f}")
    for rows in sides:
        base, lora = (statistics.median(times[rows, side]) for side in ("base", "lora"))
        fastest = {side: min(times[rows, side]) for side in ("base", "lora")}
        print(f"{rows} rows: median step base {base * 1e3:.2f} ms, through {min(rows, 4)} adapter(s) "
              f"{lora * 1e3:.2f} ms (+{(lora - base) * 1e3:.2f}): base / lora {base / lora:.3f}; fastest "
              f"{fastest['base'] * 1e3:.2f} and {fastest['lora'] * 1e3:.2f} ms "
              f"({fastest['base'] / fastest['lora']:.3f}); {len(times[rows, 'base'])} steps a side")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip-smoke", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="time the decode step alone (module docstring)")
    parser.add_argument("--steps", type=int, default=20, help="--in-process: steps timed per side and round")
    parser.add_argument("--batch", type=int, default=16, help="--in-process: rows of the many-rows step")
    parser.add_argument("--threads", type=int, default=0, help="--in-process: torch threads (0: torch's default)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tidal-lora-bench-")
    adapters = [make_adapter(args.model, os.path.join(root, f"a{i}"), seed=i) for i in range(4 if args.in_process else 5)]
    if args.in_process:
        if args.threads:
            torch.set_num_threads(args.threads)
        return in_process(args.model, adapters, args.rounds, args.steps, args.batch)
    if not args.skip_smoke:
        smoke(args.model, adapters[0])
    modules = [f"a{i}={adapters[i]}" for i in range(4)]
    server = Server("--model", args.model, "--enable-lora", "--lora-modules", *modules, "--max-loras", "4",
                    "--max-lora-rank", "16", "--enable-lora-runtime-updates", "--lora-allowed-dirs", root,
                    "--max-num-seqs", "32")
    try:
        complete(server.url, "a0", 4)  # warm both paths
        complete(server.url, args.model, 4)
        results: dict[str, list[float]] = {k: [] for k in ("base16", "lora16", "base1", "lora1")}
        for _ in range(args.rounds):
            results["base16"].append(tok_per_s(server.url, [args.model] * 16, args.output_len))
            results["lora16"].append(tok_per_s(server.url, [f"a{i % 4}" for i in range(16)], args.output_len))
            results["base1"].append(tok_per_s(server.url, [args.model], 2 * args.output_len))
            results["lora1"].append(tok_per_s(server.url, ["a0"], 2 * args.output_len))
        for key, values in results.items():
            print(f"{key}: median {statistics.median(values):.1f} tok/s over {len(values)} rounds "
                  f"({', '.join(f'{v:.1f}' for v in values)})")
        print(f"16 streams over 4 rank-16 adapters / 16 base streams: "
              f"{statistics.median(results['lora16']) / statistics.median(results['base16']):.2f}x")
        print(f"1 adapter stream / 1 base stream: "
              f"{statistics.median(results['lora1']) / statistics.median(results['base1']):.2f}x")
        start = time.perf_counter()
        answer = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": adapters[4]},
                            timeout=120)
        print(f"load of a rank-16 adapter over HTTP: {time.perf_counter() - start:.3f} s ({answer.status_code})")
    finally:
        server.stop()
    from tidal.gpu.model.config import ModelConfig
    from tidal.gpu.model.lora import read_adapter

    config = ModelConfig.from_dir(args.model)
    start = time.perf_counter()
    read_adapter("a4", adapters[4], config, 16)
    print(f"engine read and check of a rank-16 adapter: {time.perf_counter() - start:.3f} s")


if __name__ == "__main__":
    main()
