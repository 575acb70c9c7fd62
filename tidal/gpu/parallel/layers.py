"""Megatron-style tensor-parallel layers: each rank holds a slice of every large matrix.

* column-parallel (qkv, gate_up): output features split, no communication; the row-parallel
  layer after it takes the split activations as they are;
* row-parallel (o_proj, down_proj): input features split, partial sums all-reduced. Only rank 0
  holds the bias (the others hold zeros), so the sum carries it once;
* vocab-parallel embedding: rank r holds token rows [r*s, (r+1)*s); ids outside look up zeros
  and the all-reduce assembles every row;
* vocab-parallel LM head: each rank computes its slice of the vocabulary, rank 0 gathers them.

Attention heads are split with their projections: rank r runs query heads [r*H/N, (r+1)*H/N)
and the KV heads they read, so its KV cache holds only those. With fewer KV heads than ranks
each KV head is replicated on the N/K ranks whose query heads read it.

The linear shards subclass ``layers.Linear``: a shard is an ordinary, smaller Linear, so its
kernels and oneDNN prepacking apply unchanged; only which slice is loaded (``shard``) and the
all-reduce after a row-parallel layer differ. ``tp`` is the rank's ``parallel.TensorParallel``.
A single-rank model uses none of this.

``shard(kind, tensor)`` returns the part of a checkpoint tensor this rank loads; ``tensor`` is a
torch tensor or a safetensors slice, which reads only the indexed part from disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.gpu.model import quantization
from tidal.gpu.model.layers import GatedMLP, Linear
from tidal.gpu.model.config import ModelConfig


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` (one line) unless the model can be split over ``size`` ranks."""
    if config.num_heads % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's "
                         f"{config.num_heads} attention heads")
    if config.intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's "
                         f"intermediate size {config.intermediate_size}")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ValueError(f"--tensor-parallel-size {size} must divide, or be a multiple of, the model's "
                         f"{kv} KV heads")


def check_quantized_split(config: ModelConfig, size: int, scheme: str, group_size: int) -> None:
    """Raise ``ValueError`` (one line) unless each row-parallel layer's slice of inputs is whole groups of
    ``group_size`` (the int kernel's scales start at a group; ``QuantizedWeight`` slices refuse the rest)."""
    for layer, k in (("o_proj", config.num_heads * config.head_dim), ("down_proj", config.intermediate_size)):
        if group_size < k and (k // size) % group_size:
            raise ValueError(f"--tensor-parallel-size {size} gives each rank {k // size} of {layer}'s {k} inputs (its "
                             f"shard's K), not whole groups of {group_size} of the {scheme} weights")


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank runs: query heads [q_start, q_start + num_heads), KV heads likewise."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_shard(config: ModelConfig, rank: int, size: int) -> HeadShard:
    num_heads = config.num_heads // size
    if config.num_kv_heads >= size:
        num_kv = config.num_kv_heads // size
        return HeadShard(num_heads, num_kv, rank * num_heads, rank * num_kv)
    # fewer KV heads than ranks: the one KV head this rank's query heads read (a replica of it)
    return HeadShard(num_heads, 1, rank * num_heads, rank * config.num_kv_heads // size)


class ColumnParallelLinear(Linear):
    """Output features split. ``parts`` are (start, size) of this rank's rows in each checkpoint tensor
    fused into this one (q, k, v; gate, up), in fused order."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool, dtype: torch.dtype, device) -> None:
        super().__init__(in_features, sum(size for _, size in parts), bias, dtype, device)
        self.parts = parts

    def shard(self, kind: str, tensor, part: int | None = None):
        start, size = self.parts[part or 0]
        return tensor[start:start + size]


class RowParallelLinear(Linear):
    """Input features [start, start + size) of this rank; the partial outputs are all-reduced."""

    def __init__(self, in_part: tuple[int, int], out_features: int, bias: bool, dtype: torch.dtype, device,
                 tp) -> None:
        super().__init__(in_part[1], out_features, bias, dtype, device)
        self.in_part = in_part
        self.tp = tp

    def shard(self, kind: str, tensor, part: int | None = None):
        if kind == "bias":  # added once: by rank 0's partial sum
            return tensor[:] if self.tp.rank == 0 else torch.zeros(self.bias.shape)
        start, size = self.in_part
        return tensor[:, start:start + size]

    def quantize(self, scheme: quantization.Scheme) -> quantization.QuantizedWeight:
        """This rank's slice rounded as the slice of the whole quantized weight would be: groups are local when
        the slice is whole groups (refused otherwise); one scale per channel is the whole row's, its largest
        magnitude taken over every rank's slice."""
        start, size = self.in_part
        k = size * self.tp.size  # every rank's slice is the same size
        if scheme.group_size is not None and scheme.group_size < k:
            quantization.check_whole_groups(start, start + size, k, scheme.bits, scheme.group_size)
            return quantization.quantize(self.weight, scheme)
        amax = self.tp.all_reduce_max(self.weight.detach().abs().amax(dim=1, keepdim=True).float())
        return quantization.quantize(self.weight, quantization.Scheme(scheme.bits, None, scheme.symmetric), amax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


@dataclass(frozen=True)
class VocabShard:
    """Token rows [start, start + size) of this rank; every rank holds ``size`` rows, padded with zeros."""

    start: int
    size: int
    vocab_size: int

    @classmethod
    def of(cls, vocab_size: int, rank: int, ranks: int) -> "VocabShard":
        size = -(-vocab_size // ranks)
        return cls(rank * size, size, vocab_size)

    def shard(self, kind: str, tensor, part: int | None = None):
        end = min(self.start + self.size, self.vocab_size)
        rows = tensor[self.start:end]
        if end - self.start == self.size:
            return rows
        return torch.cat([rows, rows.new_zeros((self.size - (end - self.start), *rows.shape[1:]))])


class VocabParallelLMHead(Linear):
    """The LM head's rows of this rank's vocabulary slice (rank 0 gathers the logits)."""

    def __init__(self, hidden_size: int, vocab: VocabShard, dtype: torch.dtype, device) -> None:
        super().__init__(hidden_size, vocab.size, False, dtype, device)
        self.vocab = vocab

    def shard(self, kind: str, tensor, part: int | None = None):
        return self.vocab.shard(kind, tensor)


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor, vocab: VocabShard, tp) -> torch.Tensor:
    """Rows of ``input_ids`` from the embedding table split by vocabulary: each rank fills the rows of
    its own tokens, zeros elsewhere, and the all-reduce sums them into every rank's copy."""
    local = input_ids - vocab.start
    outside = (local < 0) | (local >= vocab.size)
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    rows.masked_fill_(outside[:, None], 0)
    return tp.all_reduce(rows)


def attention_projections(config: ModelConfig, heads: HeadShard, dtype: torch.dtype, device, tp):
    """This rank's (qkv_proj, o_proj): qkv column-parallel by heads, o_proj row-parallel to match."""
    d = config.head_dim
    q_part = (heads.q_start * d, heads.num_heads * d)
    kv_part = (heads.kv_start * d, heads.num_kv_heads * d)
    qkv = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], config.attention_bias, dtype, device)
    o = RowParallelLinear(q_part, config.hidden_size, config.attention_output_bias, dtype, device, tp)
    return qkv, o


class ParallelGatedMLP(GatedMLP):
    """``GatedMLP`` over this rank's slice of the intermediate features: gate_up column-parallel,
    down row-parallel (one all-reduce per MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device, tp) -> None:
        size = intermediate_size // tp.size
        super().__init__(hidden_size, size, bias, dtype, device)
        part = (tp.rank * size, size)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [part, part], bias, dtype, device)
        self.down_proj = RowParallelLinear(part, hidden_size, bias, dtype, device, tp)
