"""CUDA graphs for decode steps: one captured forward pass per batch size, replayed instead of launched.

A Llama-3-8B decode step is ~450 kernel launches (14 per layer). At small batches the GPU
finishes each one faster than Python can issue the next, so an eager step is bound by launch
overhead, not by reading the weights. A graph replays the whole step with one launch.

What is captured: ``model(batch)`` then ``compute_logits`` of every row, for a decode-only batch
of each size in ``capture_sizes`` (1, 2, 4 ... 256, capped by ``--max-num-seqs``). A graph
replays fixed addresses and fixed shapes, so its inputs live in static buffers
(``DecodeInputs``) that each step copies into, and a batch of n decodes runs the graph of the
next captured size up: the padding rows have slot -1 (the K/V write skips them) and context
length 1, and their logits are dropped. The block table buffer is as wide as the longest
allowed context (``max_model_len / block_size`` blocks), so nothing in the captured launches
depends on the step's real lengths: the Triton decode kernel reads the lengths from the tensor
and never on the host.

Eager, as before: prefills and mixed batches (their shapes vary with every chunk), decode
batches larger than the largest captured size, and everything with ``--enforce-eager``.

Memory: the graphs share one memory pool, captured largest first so the smaller ones reuse it;
its size is about one forward pass's activations at the largest size plus the static logits
(``size x vocab`` fp32 per captured size). ``ModelRunner`` logs what the capture took.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tidal.gpu.forward_batch import ForwardBatch

log = logging.getLogger("tidal.engine")

# vLLM's sizes up to 256; the larger the batch, the less a launch costs next to the step itself
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: the defaults below ``max_num_seqs``, then ``max_num_seqs`` itself
    (so every decode batch the scheduler can form has a graph) unless it exceeds the largest default."""
    largest = min(max_num_seqs, DEFAULT_CAPTURE_SIZES[-1])
    return [s for s in DEFAULT_CAPTURE_SIZES if s < largest] + [largest]


def padded_size(sizes: list[int], num_decodes: int) -> int | None:
    """The smallest captured size that holds ``num_decodes`` rows; None above the largest (eager)."""
    i = bisect.bisect_left(sizes, num_decodes)
    return sizes[i] if i < len(sizes) else None


class DecodeInputs:
    """The static input buffers a captured decode step reads, ``max_size`` rows each."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        # every row starts as padding: no K/V write, a context of one token in block 0
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self._empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
        self._start_loc = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.decode_block_tables.shape[1] <= self.max_blocks_per_seq

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode-only batch of n <= size rows into rows [0, n) and make rows [n, size) padding.

        Device-to-device copies only, so a step never waits for the GPU here. Block-table columns
        past a row's own table keep stale block ids: the kernel reads no token past the row's length.
        """
        n = batch.num_decodes
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.decode_seq_lens, non_blocking=True)
        width = batch.decode_block_tables.shape[1]
        self.block_tables[:n, :width].copy_(batch.decode_block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)

    def batch(self, size: int) -> ForwardBatch:
        """A ``ForwardBatch`` of views of the first ``size`` rows: what the captured graph reads."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            decode_max_seq_len=self.max_blocks_per_seq * self.block_size,
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_query_start_loc=self._start_loc,
            prefill_seq_lens_tensor=self._empty_i32,
            prefill_block_tables=self._empty_i32.view(0, 0),
            logits_indices=torch.arange(size, device=self.input_ids.device),
        )


class CudaGraphs:
    """Captures the decode step at each size of ``sizes`` and replays the right one."""

    def __init__(self, model, kv_caches, sizes: list[int], max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.inputs = DecodeInputs(self.sizes[-1], max_blocks_per_seq, block_size, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.kv_caches))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        device = self.inputs.input_ids.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = None
        side = torch.cuda.Stream(device)
        for size in reversed(self.sizes):
            batch = self.inputs.batch(size)
            # warm up outside the capture: Triton compiles on a shape's first launch, and the
            # rotary table moves to the device on the first forward; neither may happen in a capture
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(batch)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(batch)
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("CUDA graphs: captured decode batch sizes %s in %.1f s, %.0f MiB of GPU memory",
                 self.sizes, self.capture_seconds, self.capture_bytes / 2**20)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """The logits of ``batch``'s sampling rows by replaying a graph, or None when no graph
        applies (a prefill, a batch above the largest size, a block table wider than captured)."""
        if batch.num_prefills or not batch.num_decodes or not self.inputs.fits(batch):
            return None
        size = padded_size(self.sizes, batch.num_decodes)
        if size is None:
            return None
        self.inputs.load(batch, size)
        # a gather, so the caller owns its logits: the next replay rewrites the static buffer
        return self._replay(size)[batch.logits_indices]

    def _replay(self, size: int) -> torch.Tensor:
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
