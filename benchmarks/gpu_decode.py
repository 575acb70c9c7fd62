"""Llama-3-8B-shaped decode on a GPU through tidal's own code.

    python benchmarks/gpu_decode.py [--batches 1 8 32 64 128 256] [--context 1024]
                                    [--engine-batches 1 64 256] [--engine-steps 50]
                                    [--skip-forward] [--skip-engine] [--shape 8b|tiny] [--device cuda]
                                    [--quantization int8|int4|fp8]

The model is tidal's ``LlamaForCausalLM`` (tidal/gpu/model/llama.py) with Llama-3-8B's shape
(32 layers, hidden 4096, 32 query / 8 kv heads, intermediate 14336, vocab 128256) and random
bf16 weights drawn on the GPU: ``ModelRunner``'s ``load_model`` is swapped for that draw, so
no 16 GB checkpoint is written or read. The tokenizer is a word-level one with 128256 entries.

1. Forward only, through ``ModelRunner`` (its KV cache, its Triton attention, its captured CUDA
   graphs): one decode step at each batch size with every sequence at ``--context`` tokens,
   eager launches vs graph replay, against the bandwidth floor = (weights read + K/V read +
   logits written) / the copy bandwidth measured in the same run (a device-to-device copy,
   bytes read + written).
2. The engine: the real ``Engine`` (scheduler, forward thread, sampler, detokenizer, stop
   checks, reports) stepping the same model at each ``--engine-batches`` size, greedy with
   ``ignore_eos``, prompts of 64 tokens; step time against the forward-only time of the same
   batch at the same context (graph replay) = the overhead not hidden behind the forward.
   With CUDA graphs (launch-now passes, then the forward thread, same run) and with ``--enforce-eager``.

Part 1 also replays graphs captured with RMSNorm and rotary on their torch ops (what the CUDA
model ran before they moved onto the Triton kernels), side by side in the same run.

``--quantization int8|int4|fp8`` rounds the random decoder linears as ``--quantization`` does at load
(quantized_linear: the Triton int kernel, or FP8 through ``torch._scaled_mm``); the floor then counts
the quantized bytes (the LM head and embedding stay bf16).

``--shape tiny --device cpu`` runs the same harness on a 2-layer model on a CPU (no graphs):
a check that the script works, not a figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tidal.gpu import model_runner  # noqa: E402
from tidal.gpu.engine import Engine  # noqa: E402
from tidal.gpu.forward_batch import ForwardBatch  # noqa: E402
from tidal.gpu.model import quantization, quantized_linear  # noqa: E402
from tidal.gpu.model.layers import Linear, packs_weights  # noqa: E402
from tidal.gpu.model.config import ModelConfig# noqa: E402
from tidal.gpu.model.registry import LlamaForCausalLM# noqa: E402
from tidal.wire import AddRequest, EngineConfig, SamplingParams  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TINY = {**LLAMA3_8B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512}
PROMPT_LEN = 64
ENGINE_WARMUP_STEPS = 10


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20, help="timed forward passes per row")
    p.add_argument("--engine-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--engine-steps", type=int, default=50)
    p.add_argument("--skip-forward", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-torch-layers", action="store_true",
                   help="skip the graph replay with RMSNorm/rotary on torch ops (the before figure)")
    p.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quantization", choices=["int8", "int4", "fp8"], default=None,
                   help="quantize the decoder linears as --quantization does at load")
    return p.parse_args(argv)


def make_model_dir(path: Path, config: dict) -> str:
    """config.json and a word-level tokenizer with one entry per vocabulary id (no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


def random_model(model_dir: str, dtype: torch.dtype, device: torch.device, attention, tp=None,
                 linear_weights: torch.dtype | None = None, quantize: str | None = None,
                 gguf_activation_bits: int = 16):
    """Stands in for ``model_loader.load_model`` (same signature): the same model class, random weights
    drawn in place (never a GGUF file: ``gguf_activation_bits`` has nothing to apply to)."""
    if tp is not None:
        raise ValueError("gpu_decode.py runs one rank: no tensor parallelism")
    if quantize == "fp8" and not quantized_linear.fp8_runs_on(device):
        raise ValueError(quantized_linear.FP8_REFUSAL)
    if quantize in ("int8", "int4") and quantized_linear.int_kernel(device) is None:
        raise ValueError(f"--quantization {quantize}: no int kernel on {device}")
    config = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(config, attention, dtype=dtype, device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # norm weights
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.eval()
    named_linears = [(name, m) for name, m in model.model.layers.named_modules() if isinstance(m, Linear)]
    if quantize == "fp8":
        quantized_linear.quantize_fp8_linears([m for _, m in named_linears])
    elif quantize is not None:
        quantization.quantize_linears(named_linears, quantization.ON_THE_FLY[quantize])
    if quantize is not None or packs_weights(dtype, device, linear_weights):
        model.pack_weights(linear_weights if linear_weights != dtype else None)
    return model, config


model_runner.load_model = random_model  # ModelRunner looks it up at construction


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls (device events on CUDA)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1e3 / iters


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = min(time_ms(lambda: dst.copy_(src), device, 10) for _ in range(3))
    del src, dst
    return 2 * n / (ms * 1e-3)


def decode_batch(batch: int, context: int, num_blocks: int, block_size: int, vocab: int,
                 device: torch.device) -> ForwardBatch:
    """``batch`` sequences of ``context`` tokens each in distinct shuffled blocks; one new token each."""
    blocks_per_seq = -(-context // block_size)
    assert batch * blocks_per_seq <= num_blocks, "KV cache too small for the batch"
    tables = torch.randperm(num_blocks, device=device)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    last = context - 1
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (batch,), device=device),
        positions=torch.full((batch,), last, dtype=torch.int64, device=device),
        slot_mapping=tables[:, last // block_size].long() * block_size + last % block_size,
        num_decodes=batch,
        decode_block_tables=tables,
        decode_seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        decode_max_seq_len=context,
        prefill_query_lens=[], prefill_seq_lens=[],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_seq_lens_tensor=torch.zeros(0, dtype=torch.int32, device=device),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=device),
        logits_indices=torch.arange(batch, device=device),
    )


def weight_bytes_read(model: LlamaForCausalLM, batch: int) -> int:
    """Bytes of weights one decode step reads: every matrix once (quantized ones with their scales), but only
    ``batch`` embedding rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.int_packed.nbytes for m in model.modules() if isinstance(m, Linear) and m.int_packed is not None)
    embed = model.model.embed_tokens
    return total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()


def kv_bytes_read(config: ModelConfig, batch: int, context: int, element: int) -> int:
    return config.num_layers * 2 * batch * context * config.num_kv_heads * config.head_dim * element


# ------------------------------------------------------------------ 1. forward only


def bench_forward(args, model_dir: str, device: torch.device, bandwidth: float) -> None:
    block_size = 16
    max_batch = max(args.batches)
    num_blocks = max_batch * -(-args.context // block_size) + 64
    start = time.perf_counter()
    runner = model_runner.ModelRunner(EngineConfig(
        model=model_dir, device=str(device), dtype="bfloat16", max_model_len=args.context + 64,
        max_num_seqs=max_batch, block_size=block_size, num_kv_blocks=num_blocks, quantization=args.quantization))
    setup_s = time.perf_counter() - start
    model, config, graphs = runner.model, runner.model_config, runner.cuda_graphs
    for k_cache, v_cache in runner.kv_caches:  # a context of random K/V, not zeros
        k_cache.normal_()
        v_cache.normal_()
    element = runner.dtype.itemsize
    print(f"\n1. forward only: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
          f"bf16{' + ' + args.quantization + ' decoder linears' if args.quantization else ''}, context {args.context}, KV cache {num_blocks} blocks of {block_size} "
          f"({num_blocks * 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element / 2**30:.1f} GiB); "
          f"model + cache + graphs ready in {setup_s:.1f} s")
    if graphs is not None:
        print(f"   CUDA graphs: sizes {graphs.sizes} captured in {graphs.capture_seconds:.1f} s, "
              f"{graphs.capture_bytes / 2**20:.0f} MiB of GPU memory")
    print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11} {'eager/graph':>11} "
          f"{'weights GB':>10} {'KV GB':>7} {'argmax =':>8}")
    for batch in args.batches:
        fb = decode_batch(batch, args.context, num_blocks, block_size, config.vocab_size, device)
        with torch.inference_mode():
            eager_logits = model.compute_logits(model(fb, runner.kv_caches))
            eager_ms = time_ms(lambda: model.compute_logits(model(fb, runner.kv_caches)), device, args.iters)
            if graphs is not None:
                graph_logits = graphs.run(fb)
                same = (graph_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
                graph_ms = time_ms(lambda: graphs.run(fb), device, args.iters)
            else:
                same, graph_ms = float("nan"), float("nan")
        weights = weight_bytes_read(model, batch)
        kv = kv_bytes_read(config, batch, args.context, element)
        logits = batch * config.vocab_size * 4
        floor_ms = 1e3 * (weights + kv + logits) / bandwidth
        best = graph_ms if graph_ms == graph_ms else eager_ms
        print(f"{batch:>6} {eager_ms:>9.3f} {graph_ms:>9.3f} {floor_ms:>9.3f} {best / floor_ms:>10.2f}x "
              f"{eager_ms / graph_ms:>10.2f}x {weights / 1e9:>10.2f} {kv / 1e9:>7.2f} {same:>8.3f}")
    print("floor = (weights read + K/V read + fp32 logits written) / measured copy bandwidth; "
          "argmax = = share of rows whose greedy token is the same eager and replayed")
    if graphs is not None and not args.skip_torch_layers:
        graphs = None  # the comparison captures its own graphs in the freed memory
        compare_torch_layers(args, runner, num_blocks, block_size, device)
    del runner, model, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare_torch_layers(args, runner, num_blocks: int, block_size: int, device: torch.device) -> None:
    """Graph replay with RMSNorm and rotary on their torch ops (as before the Triton kernels were
    wired into the CUDA model), side by side with the figures above."""
    from tidal.gpu.cuda_graphs import CudaGraphs
    from tidal.gpu.model.layers import RMSNorm

    model = runner.model
    with_kernels = {}
    for batch in args.batches:
        fb = decode_batch(batch, args.context, num_blocks, block_size, runner.model_config.vocab_size, device)
        with torch.inference_mode():
            with_kernels[batch] = time_ms(lambda: runner.cuda_graphs.run(fb), device, args.iters)
    runner.cuda_graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module._kernels = None
    model.rotary._kernels = None
    graphs = CudaGraphs(model, runner.kv_caches, sorted(set(args.batches)), -(-runner.max_model_len // block_size),
                        block_size, device)
    graphs.capture()
    print("\n   graph replay, RMSNorm + rotary on Triton kernels vs on torch elementwise ops (same run):")
    print(f"{'batch':>6} {'triton ms':>10} {'torch ms':>9} {'torch/triton':>12}")
    for batch in args.batches:
        fb = decode_batch(batch, args.context, num_blocks, block_size, runner.model_config.vocab_size, device)
        with torch.inference_mode():
            torch_ms = time_ms(lambda: graphs.run(fb), device, args.iters)
        print(f"{batch:>6} {with_kernels[batch]:>10.3f} {torch_ms:>9.3f} {torch_ms / with_kernels[batch]:>11.2f}x")
    del graphs


# ------------------------------------------------------------------ 2. the engine


def engine_steps(engine: Engine, batch: int, steps: int, first_id: int) -> float:
    """Mean wall seconds per ``Engine.step`` + ``take_report`` with ``batch`` sequences decoding."""
    params = SamplingParams(max_tokens=ENGINE_WARMUP_STEPS + steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(first_id + i * 7 + j) % 1000 + 1000 for j in range(PROMPT_LEN)]
        engine.add_request(AddRequest(first_id + i, prompt, params, 0, 0.0))
    for _ in range(ENGINE_WARMUP_STEPS):  # the prefill and a few decodes
        engine.step()
        engine.take_report()
    assert len(engine.scheduler.running) == batch, (len(engine.scheduler.running), batch)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
        engine.take_report()
    elapsed = time.perf_counter() - start
    engine.abort_all()
    engine.take_report()
    while engine.has_work():  # the in-flight forward of the aborted batch
        engine.step()
        engine.take_report()
    return elapsed / steps


def bench_engine(args, model_dir: str, device: torch.device) -> None:
    max_batch = max(args.engine_batches)
    tokens_per_seq = PROMPT_LEN + ENGINE_WARMUP_STEPS + args.engine_steps + 16
    num_blocks = max_batch * -(-tokens_per_seq // 16) + 256
    context = PROMPT_LEN + ENGINE_WARMUP_STEPS + args.engine_steps // 2  # mid-run context
    print(f"\n2. engine: greedy, ignore_eos, prompts of {PROMPT_LEN} tokens, {ENGINE_WARMUP_STEPS} warm-up steps, "
          f"{args.engine_steps} timed steps; forward-only = graph replay (eager launches for the eager engine) "
          f"of the same batch at context {context}")
    print(f"{'mode':>14} {'batch':>6} {'step ms':>9} {'forward ms':>10} {'overhead ms':>11} {'steps/s':>8} "
          f"{'% of ideal':>10}")
    # passes: "launched" (CUDA's default: the step loop queues the kernels and reads the tokens back
    # at the next step) against "thread" (the forward thread used before), same run
    modes = ([("graphs", False, "launched"), ("graphs/thread", False, "thread"), ("eager", True, "launched")]
             if device.type == "cuda" else [("eager", True, None)])
    for mode, eager, passes in modes:
        engine = Engine(EngineConfig(
            model=model_dir, device=str(device), dtype="bfloat16", max_num_seqs=max_batch,
            max_num_batched_tokens=max(2048, PROMPT_LEN * max_batch // 2), num_kv_blocks=num_blocks,
            max_model_len=tokens_per_seq + 64, enforce_eager=eager, quantization=args.quantization), passes=passes)
        runner = engine.runner
        next_id = 0
        for batch in args.engine_batches:
            step_s = statistics.median(engine_steps(engine, batch, args.engine_steps, next_id + r * batch)
                                       for r in range(3))
            next_id += 3 * batch
            fb = decode_batch(batch, context, runner.num_blocks, runner.block_size,
                              runner.model_config.vocab_size, device)
            with torch.inference_mode():
                if runner.cuda_graphs is not None:
                    forward_ms = time_ms(lambda: runner.cuda_graphs.run(fb), device, args.iters)
                else:
                    forward_ms = time_ms(
                        lambda: runner.model.compute_logits(runner.model(fb, runner.kv_caches)), device, args.iters)
            step_ms = step_s * 1e3
            print(f"{mode:>14} {batch:>6} {step_ms:>9.3f} {forward_ms:>10.3f} {step_ms - forward_ms:>11.3f} "
                  f"{1e3 / step_ms:>8.0f} {100 * forward_ms / step_ms:>9.0f}%")
        del engine, runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("overhead = step - forward-only; % of ideal = forward-only / step "
          "(targets: overhead <= 0.2 ms at batch 64, <= 0.5 ms at batch 256)")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: CUDA is not available here; run with --shape tiny --device cpu to check the script. "
              "Nothing run.")
        return 0
    torch.manual_seed(0)
    if device.type == "cuda":
        import triton

        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}")
    bandwidth = copy_bandwidth(device)
    print(f"measured copy bandwidth: {bandwidth / 1e12:.3f} TB/s (2 GiB device-to-device copy, read + write)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "llama3-8b-shape", LLAMA3_8B if args.shape == "8b" else TINY)
        if not args.skip_forward:
            bench_forward(args, model_dir, device, bandwidth)
        if not args.skip_engine:
            bench_engine(args, model_dir, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
