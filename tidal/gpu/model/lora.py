"""LoRA adapters as PEFT saves them, checked against the model they adapt, and their product in a mixed batch.

An adapter is a directory with ``adapter_config.json`` and ``adapter_model.safetensors``, whose tensors are
``base_model.model.model.layers.{i}.{self_attn|mlp}.{projection}.lora_A.weight`` [r, in] and ``...lora_B.weight``
[out, r]. A row through the adapter computes ``W x + scale * B (A x)`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); the scale is folded into B when the adapter is read.

Mixed batches (``LoraSlots``): each fused Linear of a decoder layer (qkv_proj, o_proj, gate_up_proj,
down_proj) carries one A and one B that hold every slot's adapter side by side. Slot s, part p (q/k/v of
qkv_proj, gate/up of gate_up_proj) owns ranks ``[(s * parts + p) * R, ... + r)``: its A rows, and its B rows
with non-zero columns only in that part's slice of the fused output. The base weights are read once for all
rows; each row then adds its own slot's ``B (A x)``, a base-model row (slot -1) nothing. A kernel reads only
each row's own slot, its adapter's ranks and each part's columns: on a CPU csrc/lora.cpp (which the one-call
decoder stack runs too) on B packed for it as well (``pack_lora_b``: each part's columns in blocks of 16, a
block's ranks side by side, so a part's B is one sequential read), on a CUDA GPU with triton tidal/kernels/lora.py. Without either, the batch's rows x
and their slots' one-hot mask give ``out += ((x @ A.T) * onehot) @ B``, every slot's product masked.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from tidal.gpu.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# a Hugging Face projection -> (its sublayer, the fused tidal Linear holding it, its part of that Linear)
PROJECTIONS = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
FUSED_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}

# PEFT settings that change what the adapter computes beyond plain LoRA: refused when set (truthy)
VARIANTS = ("modules_to_save", "use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
            "layer_replication", "target_parameters", "trainable_token_indices", "use_qalora", "megatron_config",
            "alora_invocation_tokens", "arrow_config", "use_bdlora", "kasa_config", "monteclora_config",
            "velora_config")

_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the cause."""


@dataclass
class LoraAdapter:
    """One adapter's tensors, checked: (layer, projection) -> (A [r, in], scale * B [out, r]), float32."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, int]:
    """(in, out) features of a Hugging Face projection of ``config``'s decoder layers."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}[projection]


def read_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read the PEFT adapter at ``path`` and check it against ``config``; raises ``AdapterError``."""

    def refuse(why: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r}: {why}")

    settings = _read_config(path, refuse)
    if settings.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {settings['peft_type']!r} is not supported: tidal serves LoRA adapters")
    for key in VARIANTS:
        if settings.get(key):
            raise refuse(f"{key} ({settings[key]!r}) is not supported: tidal serves plain LoRA (A and B of the "
                         "attention and MLP projections)")
    if settings.get("bias", "none") != "none":
        raise refuse(f"bias {settings['bias']!r} is not supported: tidal serves plain LoRA without biases")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, not {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha must be a number, not {alpha!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} exceeds --max-lora-rank {max_rank}")
    _check_targets(settings.get("target_modules"), config, refuse)
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    weights = _read_tensors(path, config, rank, scale, refuse)
    if not weights:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA tensors of the attention or MLP projections")
    return LoraAdapter(name, rank, weights)


def _read_config(path: str, refuse) -> dict:
    if not os.path.isdir(path):
        raise refuse(f"no adapter directory at {path!r}")
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            settings = json.load(f)
    except FileNotFoundError:
        raise refuse(f"{path!r} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(settings, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    return settings


def _check_targets(targets, config: ModelConfig, refuse) -> None:
    """``target_modules`` names only projections the model has (a list of names, or a regex over module names)."""
    if isinstance(targets, str) and targets != "all-linear":
        names = [f"model.layers.{i}.{sublayer}.{projection}" for i in range(config.num_layers)
                 for projection, (sublayer, _, _) in PROJECTIONS.items()]
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise refuse(f"target_modules {targets!r} is not a regular expression: {exc}") from None
        if not any(pattern.fullmatch(module) for module in names):
            raise refuse(f"target_modules {targets!r} matches none of the model's projections "
                         f"({', '.join(PROJECTIONS)})")
    elif isinstance(targets, list):
        for target in targets:
            if not isinstance(target, str) or target.rsplit(".", 1)[-1] not in PROJECTIONS:
                raise refuse(f"target module {target!r} is not in the model: LoRA can target "
                             f"{', '.join(PROJECTIONS)}")
    elif targets not in (None, "all-linear"):
        raise refuse(f"target_modules must be a list of names or a regex, not {targets!r}")


def _read_tensors(path: str, config: ModelConfig, rank: int, scale: float, refuse) -> dict:
    from safetensors import SafetensorError, safe_open

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise refuse(f"{path!r} has no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is not read: save with safe_serialization)"
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                match = _TENSOR.match(key)
                if match is None or match.group(3) not in PROJECTIONS or PROJECTIONS[match.group(3)][0] != match.group(2):
                    raise refuse(f"tensor {key!r} is not the LoRA A or B of an attention or MLP projection")
                layer = int(match.group(1))
                if layer >= config.num_layers:
                    raise refuse(f"tensor {key!r} is for layer {layer}; the model has {config.num_layers} layers")
                halves.setdefault((layer, match.group(3)), {})[match.group(4)] = f.get_tensor(key)
    except (SafetensorError, OSError) as exc:
        raise refuse(f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    weights = {}
    for (layer, projection), pair in sorted(halves.items()):
        where = f"layer {layer} {projection}"
        if set(pair) != {"A", "B"}:
            raise refuse(f"{where} has lora_{next(iter(pair))} without its other half")
        a, b = pair["A"], pair["B"]
        in_features, out_features = projection_shape(config, projection)
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise refuse(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} contradict the model "
                         f"(rank {rank}: expected ({rank}, {in_features}) and ({out_features}, {rank}))")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise refuse(f"{where}: LoRA weights must be floating point, not {a.dtype}")
        weights[(layer, projection)] = (a.float(), b.float() * scale)
    return weights


@dataclass
class LoraRows:
    """Which slot each row of a forward pass runs through: ``slots`` [rows] int32 (-1: the base model) for
    ``kernel`` ("cpu": csrc/lora.cpp, "triton": tidal/kernels/lora.py); without one, ``onehot`` [rows, slots, 1]
    (all zero for a base-model row), in the activations' dtype, only the first ``num_slots`` slots taking part."""

    onehot: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    kernel: str | None = None

    @property
    def num_slots(self) -> int:
        return self.onehot.shape[1]


def add_lora(out: torch.Tensor, x: torch.Tensor, linear, rows: LoraRows) -> torch.Tensor:
    """``out`` (``linear(x)``) plus each row's adapter product, in place (``linear.lora``: ``LoraWeights``)."""
    weights = linear.lora
    if rows.kernel == "cpu":  # each row reads only its own slot (csrc/lora.cpp)
        from tidal.gpu.cpu.kernels import load_cpu_ops

        return load_cpu_ops().lora_add_(out, x.contiguous(), weights.a, weights.b_packed, rows.slots, weights.ranks,
                                        list(weights.part_sizes), weights.max_rank)
    if rows.kernel == "triton":  # the same on CUDA
        from tidal import kernels

        return kernels.lora_add(out, x.contiguous(), weights.a, weights.b, rows.slots, weights.slot_width)
    width = rows.num_slots * weights.slot_width
    h = torch.mm(x, weights.a[:width].t())
    h = (h.view(h.shape[0], rows.num_slots, weights.slot_width) * rows.onehot).view(h.shape[0], width)
    return out.addmm_(h, weights.b[:width])


@dataclass
class LoraWeights:
    """One fused Linear's A [slots * parts * R, in] and B [slots * parts * R, out], every slot side by side."""

    a: torch.Tensor
    b: torch.Tensor
    parts: int
    part_sizes: tuple[int, ...]  # the fused output's slice of each part
    max_rank: int
    ranks: torch.Tensor  # [slots] int32: each slot's adapter's rank (rows past it are zero), shared by all Linears
    b_packed: torch.Tensor | None = None  # B as csrc/lora.cpp reads it (pack_lora_b), where that kernel runs

    @property
    def slot_width(self) -> int:
        return self.parts * self.max_rank


LORA_BLOCK = 16  # output columns per block of a packed B (csrc/ops.h kLoraBlock)


def pack_lora_b(b: torch.Tensor, part_sizes: tuple[int, ...], max_rank: int) -> torch.Tensor:
    """``b`` [slots * parts * max_rank, out] (LoraWeights.b) as csrc/lora.cpp reads it: [slots, blocks, max_rank,
    16], each part's columns in blocks of 16 (its last zero-padded, the next part's starting a new block), and in a
    block each rank's 16 columns side by side. Only each part's own columns are kept: its B rows are zero elsewhere."""
    parts = len(part_sizes)
    slots = b.shape[0] // (parts * max_rank)
    rows = b.view(slots, parts, max_rank, b.shape[1])
    packed, column = [], 0
    for part, size in enumerate(part_sizes):
        blocks = -(-size // LORA_BLOCK)
        own = torch.nn.functional.pad(rows[:, part, :, column:column + size], (0, blocks * LORA_BLOCK - size))
        packed.append(own.view(slots, max_rank, blocks, LORA_BLOCK).transpose(1, 2))
        column += size
    return torch.cat(packed, dim=1).contiguous()


class LoraSlots:
    """The adapters the model can run at once: ``num_slots`` slots in every decoder Linear (``linear.lora``).

    ``place`` puts the adapters of a batch in slots before its pass (a slot's adapter stays until a batch
    needs the slot for another), ``rows`` builds the pass's one-hot mask. Written only between passes.
    """

    def __init__(self, model, num_slots: int, max_rank: int) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._layers = model.model.layers
        self.dtype = model.model.embed_tokens.dtype
        self.device = model.model.embed_tokens.device
        self._kernel = _kernel(self.device)  # reads each row's own slot; None: the masked matmuls
        self.ranks = torch.zeros(num_slots, dtype=torch.int32)  # the CPU kernel's; read on the host only
        for layer in self._layers:
            attn = layer.self_attn
            sizes = {"qkv_proj": (attn.q_size, attn.kv_size, attn.kv_size), "o_proj": (attn.o_proj.out_features,),
                     "gate_up_proj": (layer.mlp.intermediate_size,) * 2, "down_proj": (layer.mlp.down_proj.out_features,)}
            for fused, parts in FUSED_PARTS.items():
                linear = self._linear(layer, fused)
                width = num_slots * parts * max_rank
                in_features = attn.q_size if fused == "o_proj" else (
                    layer.mlp.intermediate_size if fused == "down_proj" else model.config.hidden_size)
                b = torch.zeros(width, sum(sizes[fused]), dtype=self.dtype, device=self.device)
                linear.lora = LoraWeights(torch.zeros(width, in_features, dtype=self.dtype, device=self.device), b,
                                          parts, sizes[fused], max_rank, self.ranks,
                                          pack_lora_b(b, sizes[fused], max_rank) if self._kernel == "cpu" else None)
        if self._kernel == "cpu":  # what a step streams, in 2 MiB pages as the base weights are (huge_pages.py)
            from tidal.gpu.cpu import huge_pages

            huge_pages.place([(self._linear(layer, fused).lora, name) for layer in self._layers
                              for fused in FUSED_PARTS for name in ("a", "b_packed")])
        if self._kernel == "cpu" and hasattr(model, "use_lora"):
            model.use_lora(self.ranks, max_rank)  # adapter rows stay on its one-call decoder stack

    @staticmethod
    def _linear(layer, fused: str):
        return getattr(layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp, fused)

    def place(self, adapters: dict[int, LoraAdapter]) -> None:
        """Give each of ``adapters`` (id -> adapter, at most ``num_slots``) a slot, writing the new ones into
        slots no adapter of this batch holds."""
        free = [s for s in range(self.num_slots) if s not in self.slot_of.values()]
        spare = [s for adapter_id, s in self.slot_of.items() if adapter_id not in adapters]
        for adapter_id, adapter in adapters.items():
            if adapter_id in self.slot_of:
                continue
            slot = free.pop() if free else spare.pop()
            self.slot_of = {i: s for i, s in self.slot_of.items() if s != slot}
            self._write(slot, adapter)
            self.slot_of[adapter_id] = slot

    def forget(self, adapter_id: int) -> None:
        self.slot_of.pop(adapter_id, None)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for index, layer in enumerate(self._layers):
            for fused in FUSED_PARTS:
                weights = self._linear(layer, fused).lora
                rows = slice(slot * weights.slot_width, (slot + 1) * weights.slot_width)
                weights.a[rows].zero_()
                weights.b[rows].zero_()
            for projection, (_, fused, part) in PROJECTIONS.items():
                pair = adapter.weights.get((index, projection))
                if pair is None:
                    continue
                weights = self._linear(layer, fused).lora
                start = slot * weights.slot_width + part * self.max_rank
                column = sum(weights.part_sizes[:part])
                a, b = pair
                weights.a[start:start + adapter.rank].copy_(a)
                weights.b[start:start + adapter.rank, column:column + weights.part_sizes[part]].copy_(b.t())
            for fused in FUSED_PARTS:
                weights = self._linear(layer, fused).lora
                if weights.b_packed is not None:
                    rows = slice(slot * weights.slot_width, (slot + 1) * weights.slot_width)
                    weights.b_packed[slot].copy_(pack_lora_b(weights.b[rows], weights.part_sizes, self.max_rank)[0])
        self.ranks[slot] = adapter.rank

    def rows(self, slots_of_entries: list[tuple[int | None, int]], num_rows: int) -> LoraRows | None:
        """Each row's slot (or the mask) of a pass whose entries (slot or None, rows) come in row order; None when no
        row has an adapter."""
        used = [slot for slot, _ in slots_of_entries if slot is not None]
        if not used:
            return None
        if self._kernel:
            per_row = [-1 if slot is None else slot for slot, count in slots_of_entries for _ in range(count)]
            return LoraRows(slots=torch.tensor(per_row, dtype=torch.int32).to(self.device), kernel=self._kernel)
        onehot = torch.zeros(num_rows, max(used) + 1, 1, dtype=self.dtype)
        row = 0
        for slot, count in slots_of_entries:
            if slot is not None:
                onehot[row:row + count, slot] = 1
            row += count
        return LoraRows(onehot if self.device.type == "cpu" else onehot.to(self.device))


def _kernel(device: torch.device) -> str | None:
    """The per-row kernel ``device`` runs: "cpu" (the C++ CPU kernels), "triton" (CUDA), or None."""
    if device.type == "cpu":
        from tidal.gpu.cpu.kernels import load_cpu_ops

        return "cpu" if load_cpu_ops() is not None else None
    from tidal import kernels

    return "triton" if device.type == "cuda" and kernels.HAS_TRITON else None
