"""GPU benchmark of tidal's Triton kernels (needs CUDA; on a CPU box it says so and exits 0).

1. A quick correctness check of every kernel on the GPU against its torch reference (compiled
   Triton, not the CPU interpreter the unit tests use).
2. Decode attention at batch 1..256 x context 512..8k: achieved memory bandwidth (bytes of K/V
   read + query/output) against the device peak.
3. One decode step of a Llama-3-8B-shaped layer stack (32 layers, hidden 4096, 32 heads, 8 kv
   heads, intermediate 14336, bf16, random weights), built from torch matmuls and these kernels,
   against the bandwidth floor (weight bytes / peak, and weights + K/V bytes / peak).

Usage: python benchmarks/kernels_gpu.py [--peak-bandwidth 4.8e12] [--skip-check]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

H200_PEAK_BYTES_PER_S = 4.8e12
HEAD_DIM = 128
NUM_QUERY_HEADS = 32
NUM_KV_HEADS = 8
BLOCK_SIZE = 16
DTYPE = torch.bfloat16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-bandwidth", type=float, default=H200_PEAK_BYTES_PER_S, help="device peak, B/s")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--e2e-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--e2e-context", type=int, default=1024, help="context length of every sequence")
    parser.add_argument("--skip-check", action="store_true", help="skip the GPU correctness check")
    return parser.parse_args(argv)


def bench_ms(fn) -> float:
    """Median milliseconds per call; triton's do_bench flushes L2 between calls."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# --- paged cache -------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled block ids
    seq_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [B] int64: the slot of each sequence's last position
    num_blocks: int


def paged_batch(batch: int, context: int, device: torch.device) -> PagedBatch:
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    last = context - 1
    slot_mapping = block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return PagedBatch(block_tables, seq_lens, slot_mapping, num_blocks)


def kv_cache(num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device, dtype=DTYPE), torch.randn(shape, device=device, dtype=DTYPE)


# --- 1. correctness on the GPU ------------------------------------------------------------------


def check_kernels(device: torch.device) -> None:
    import tidal.kernels as K

    torch.manual_seed(0)
    tol = {"atol": 2e-2, "rtol": 2e-2}
    paged = paged_batch(3, 300, device)
    paged.seq_lens = torch.tensor([1, 160, 300], dtype=torch.int32, device=device)
    k_cache, v_cache = kv_cache(paged.num_blocks, device)
    query = torch.randn(3, NUM_QUERY_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    args = (query, k_cache, v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5)
    expected = K.paged_decode_attention_reference(*args)
    torch.testing.assert_close(K.paged_decode_attention(*args), expected, **tol)
    torch.testing.assert_close(K.paged_decode_attention(*args, partition_size=64), expected, **tol)

    query_lens = [1, 37, 100]  # chunks ending each sequence: a decode-like row, extensions
    query_start_loc = torch.tensor([0, 1, 38, 138], dtype=torch.int32, device=device)
    query = torch.randn(138, NUM_QUERY_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    args = (query, k_cache, v_cache, paged.block_tables, query_start_loc, paged.seq_lens, HEAD_DIM**-0.5)
    got = K.paged_prefill_attention(*args, max_query_len=max(query_lens))
    torch.testing.assert_close(got, K.paged_prefill_attention_reference(*args), **tol)

    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    value = torch.randn_like(key)
    caches = [c.clone() for c in (k_cache, v_cache, k_cache, v_cache)]
    K.reshape_and_cache(key, value, caches[0], caches[1], paged.slot_mapping)
    K.reshape_and_cache_reference(key, value, caches[2], caches[3], paged.slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

    x = torch.randn(5, 4096, device=device, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.rand(4096, device=device, dtype=DTYPE)
    for got, want in zip(K.rms_norm(x, weight, 1e-5, residual), K.rms_norm_reference(x, weight, 1e-5, residual)):
        torch.testing.assert_close(got, want, **tol)

    cos, sin = rotary_caches(4096, device)
    positions = torch.tensor([0, 7, 4095], device=device)
    query = torch.randn(3, NUM_QUERY_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    got = K.rotary_embedding(positions, query, key, cos, sin)
    want = K.rotary_embedding_reference(positions, query, key, cos, sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    print("correctness check on the GPU: all five kernels match their references")


def rotary_caches(max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(max_position, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


# --- 2. decode attention bandwidth --------------------------------------------------------------


def bench_decode_attention(batches, contexts, peak: float, device: torch.device) -> None:
    from tidal.kernels import paged_decode_attention

    element = torch.tensor([], dtype=DTYPE).element_size()
    print(f"\ndecode attention: Hq={NUM_QUERY_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE} bf16")
    print(f"{'batch':>6} {'context':>8} {'us':>10} {'GB/s':>9} {'% peak':>7}")
    for context in contexts:
        for batch in batches:
            paged = paged_batch(batch, context, device)
            k_cache, v_cache = kv_cache(paged.num_blocks, device)
            query = torch.randn(batch, NUM_QUERY_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
            ms = bench_ms(
                lambda: paged_decode_attention(
                    query, k_cache, v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5
                )
            )
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
            io_bytes = 2 * batch * NUM_QUERY_HEADS * HEAD_DIM * element  # query in, output out
            achieved = (kv_bytes + io_bytes) / (ms * 1e-3)
            print(f"{batch:>6} {context:>8} {ms * 1e3:>10.1f} {achieved / 1e9:>9.0f} {100 * achieved / peak:>6.1f}%")
            del k_cache, v_cache
    torch.cuda.empty_cache()


# --- 3. Llama-3-8B-shaped decode step -----------------------------------------------------------

HIDDEN = 4096
INTERMEDIATE = 14336
NUM_LAYERS = 32
EPS = 1e-5


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    o: torch.Tensor  # [hidden, Hq D]
    gate_up: torch.Tensor  # [2 inter, hidden]
    down: torch.Tensor  # [hidden, inter]
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())


def random_layers(device: torch.device) -> list[LayerWeights]:
    def weight(*shape):
        return torch.randn(shape, device=device, dtype=DTYPE) * 0.02

    qkv_out = (NUM_QUERY_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    return [
        LayerWeights(
            qkv=weight(qkv_out, HIDDEN),
            o=weight(HIDDEN, NUM_QUERY_HEADS * HEAD_DIM),
            gate_up=weight(2 * INTERMEDIATE, HIDDEN),
            down=weight(HIDDEN, INTERMEDIATE),
            input_norm=torch.ones(HIDDEN, device=device, dtype=DTYPE),
            post_attention_norm=torch.ones(HIDDEN, device=device, dtype=DTYPE),
        )
        for _ in range(NUM_LAYERS)
    ]


def decode_step(hidden, layers, caches, paged: PagedBatch, positions, cos, sin, final_norm):
    """One token per sequence through every layer (HF Llama maths, fused add+norm between layers)."""
    import tidal.kernels as K

    batch = hidden.shape[0]
    residual = None
    for weights, (k_cache, v_cache) in zip(layers, caches):
        normed, residual = K.rms_norm(hidden, weights.input_norm, EPS, residual)
        qkv = torch.nn.functional.linear(normed, weights.qkv)
        query, key, value = qkv.split(
            [NUM_QUERY_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1
        )
        query, key = K.rotary_embedding(
            positions,
            query.view(batch, NUM_QUERY_HEADS, HEAD_DIM),
            key.view(batch, NUM_KV_HEADS, HEAD_DIM),
            cos,
            sin,
        )
        K.reshape_and_cache(key, value.view(batch, NUM_KV_HEADS, HEAD_DIM), k_cache, v_cache, paged.slot_mapping)
        attention = K.paged_decode_attention(
            query, k_cache, v_cache, paged.block_tables, paged.seq_lens, HEAD_DIM**-0.5
        )
        hidden = torch.nn.functional.linear(attention.view(batch, -1), weights.o)
        normed, residual = K.rms_norm(hidden, weights.post_attention_norm, EPS, residual)
        gate, up = torch.nn.functional.linear(normed, weights.gate_up).chunk(2, dim=1)
        hidden = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weights.down)
    out, _ = K.rms_norm(hidden, final_norm, EPS, residual)
    return out


def bench_decode_step(batches, context: int, peak: float, device: torch.device) -> None:
    layers = random_layers(device)
    weight_bytes = sum(layer.nbytes() for layer in layers)
    final_norm = torch.ones(HIDDEN, device=device, dtype=DTYPE)
    cos, sin = rotary_caches(context, device)
    element = torch.tensor([], dtype=DTYPE).element_size()
    print(
        f"\nLlama-3-8B-shaped decode step ({NUM_LAYERS} layers, no embedding / lm_head), context {context}: "
        f"weights {weight_bytes / 1e9:.2f} GB, weight floor {1e3 * weight_bytes / peak:.3f} ms"
    )
    print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'graph/floor':>11}")
    for batch in batches:
        paged = paged_batch(batch, context, device)
        caches = [kv_cache(paged.num_blocks, device) for _ in range(NUM_LAYERS)]
        kv_bytes = NUM_LAYERS * 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * element
        floor_ms = 1e3 * (weight_bytes + kv_bytes) / peak
        hidden = torch.randn(batch, HIDDEN, device=device, dtype=DTYPE)
        positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)

        def step():
            return decode_step(hidden, layers, caches, paged, positions, cos, sin, final_norm)

        eager_ms = bench_ms(step)
        graph_ms = bench_ms(capture_graph(step).replay)
        print(f"{batch:>6} {eager_ms:>9.3f} {graph_ms:>9.3f} {floor_ms:>9.3f} {graph_ms / floor_ms:>10.2f}x")
        del caches
        torch.cuda.empty_cache()
    print("floor = (weight bytes + K/V bytes read) / peak bandwidth")


def capture_graph(step) -> torch.cuda.CUDAGraph:
    # warm up on a side stream first: triton compiles on first launch, which a capture cannot hold
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu: CUDA is not available here; this benchmark needs an NVIDIA GPU. Nothing run.")
        return 0
    import tidal.kernels

    if not tidal.kernels.HAS_TRITON:
        print("kernels_gpu: triton is not installed (pip install 'tidal[cuda]').")
        return 1
    device = torch.device("cuda")
    peak_tb_s = args.peak_bandwidth / 1e12
    print(f"device: {torch.cuda.get_device_name(device)}, peak {peak_tb_s:.2f} TB/s (--peak-bandwidth)")
    with torch.inference_mode():
        if not args.skip_check:
            check_kernels(device)
        bench_decode_attention(args.batches, args.contexts, args.peak_bandwidth, device)
        bench_decode_step(args.e2e_batches, args.e2e_context, args.peak_bandwidth, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
