"""The weights of a GGUF file (llama.cpp's format), read memory-mapped with the ``gguf`` package.

A GGUF model directory (``tidal/gguf_model.py`` prepares it in the frontend) holds ``config.json`` and the
tokenizer, and ``gguf.json`` naming the file. How each tensor type loads:

* Q8_0 (int8, one float16 scale per 32), Q4_0 (int4 offset by 8, a scale per 32) and Q4_1 (int4, a scale and a
  minimum per 32): natively on a CPU with the int kernels, repacked once into ``QuantizedWeight`` group-32
  schemes (w = (q - zp) * scale + min, exactly the file's values); elsewhere dequantized;
* F32, F16, BF16: dense;
* Q5_0, Q5_1 and the K-quants (Q2_K .. Q6_K): dequantized at load by ``gguf.quants.dequantize`` to the dense
  compute dtype, which the ready line says;
* anything else: refused, naming the tensor and its type.

Embeddings and norms are always dense. llama.cpp's converter permutes the rows of Llama's and Mistral's
attn_q / attn_k for its interleaved rotary; they are permuted back here (rows only, so a quantized weight's
groups move whole). A tensor whose name, shape or count contradicts the metadata is refused, naming it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch

from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.quantization import QuantizedWeight
from tidal.wire import GGUF_POINTER

log = logging.getLogger("tidal.gguf")

GROUP = 32  # the block size of Q8_0, Q4_0 and Q4_1
NATIVE = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}  # type -> bits on the int kernel
DENSE = {"F32", "F16", "BF16"}
DEQUANTIZED = {"Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}
PERMUTED = {"LlamaForCausalLM", "MistralForCausalLM"}  # attn_q / attn_k rows interleaved by llama.cpp's converter

_LAYER_TENSORS = {  # GGUF name in a block -> Hugging Face name under model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def gguf_file(model_dir: str) -> str | None:
    """The GGUF file a prepared model directory points at, or None for any other directory."""
    pointer = os.path.join(model_dir, GGUF_POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        return json.load(f)["gguf"]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the file must hold for ``config``, by its GGUF name, with its [rows, columns] shape."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, h), "output_norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, h)
    per_layer = {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                 "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_gate.weight": (inter, h),
                 "ffn_up.weight": (inter, h), "ffn_down.weight": (h, inter)}
    if config.attention_bias:
        per_layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if config.attention_output_bias:
        per_layer["attn_output.bias"] = (h,)
    if config.qk_norm:
        per_layer.update({"attn_q_norm.weight": (config.head_dim,), "attn_k_norm.weight": (config.head_dim,)})
    for layer in range(config.num_layers):
        shapes.update({f"blk.{layer}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"


class GgufCheckpoint:
    """The tensors of one GGUF file, checked against ``config``, and turned into tidal's weights."""

    def __init__(self, path: str, config: ModelConfig) -> None:
        import gguf

        self.path, self.config = path, config
        self.reader = gguf.GGUFReader(path)  # memory-mapped: nothing is read until a tensor is used
        self.native = False  # set by the loader: Q8_0 / Q4_0 / Q4_1 stay integers (a CPU with the int kernels)
        self.activation_bits = 16  # set by the loader: 8 rounds each step's activations to int8, as llama.cpp does
        self.kept: dict[str, QuantizedWeight] = {}  # Hugging Face module name -> its integers
        self.tied_head: QuantizedWeight | None = None  # a quantized embedding's integers, for the tied LM head
        self.loaded: Counter[tuple[str, str]] = Counter()  # (type, how it loaded) -> tensors, for ``describe``
        self._check()

    def _check(self) -> None:
        """Refuse a file whose tensors contradict the metadata, or whose types tidal cannot load, naming the tensor."""
        expected = expected_shapes(self.config)
        count = self.reader.fields.get("GGUF.tensor_count")
        if count is not None and int(count.contents()) != len(self.reader.tensors):
            raise ValueError(f"{self.path}: the header counts {count.contents()} tensors but the file holds "
                             f"{len(self.reader.tensors)}")
        seen = set()
        for tensor in self.reader.tensors:
            name, kind = tensor.name, tensor.tensor_type.name
            if name == "rope_freqs.weight":
                raise ValueError(f"{self.path}: tensor rope_freqs.weight (llama3 rotary frequencies) is not supported")
            if name not in expected:
                raise ValueError(f"{self.path}: tensor {name!r} has no place in a {self.config.architecture} of "
                                 f"{self.config.num_layers} layers")
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first
            if shape != expected[name]:
                raise ValueError(f"{self.path}: tensor {name} has shape {shape}, the metadata implies {expected[name]}")
            if kind not in NATIVE and kind not in DENSE and kind not in DEQUANTIZED:
                raise ValueError(f"{self.path}: tensor {name} has type {kind}, which tidal does not load "
                                 f"(it loads {', '.join(sorted(NATIVE.keys() | DENSE | DEQUANTIZED))})")
            seen.add(name)
        missing = sorted(expected.keys() - seen)
        if missing:
            raise ValueError(f"{self.path}: the metadata implies {len(missing)} tensors the file lacks, e.g. "
                             f"{', '.join(missing[:3])}")

    def describe(self) -> str:
        """For the ready line: the file's types and how each loaded, e.g. "GGUF Q4_1 x210 native int4 group 32 +
        min, F32 x61 dense, Q8_0 x1 dequantized embedding, native int8 group 32 head" (an embedding is always
        dequantized; a tied head of a native type multiplies the integers)."""
        return "GGUF " + ", ".join(f"{kind} x{n} {how}" for (kind, how), n in self.loaded.most_common())

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) of every tensor; the linears kept native are also in ``kept``."""
        import gguf

        started, total = time.monotonic(), len(self.reader.tensors)
        step = max(1, total // 10)
        for i, tensor in enumerate(self.reader.tensors):
            name, kind = tensor.name, tensor.tensor_type.name
            target = hf_name(name)
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            is_linear = name.endswith(".weight") and len(shape) == 2 and name != "token_embd.weight"
            permute = self.config.architecture in PERMUTED and name.rsplit(".", 2)[-2] in ("attn_q", "attn_k")
            heads = self.config.num_heads if ".attn_q." in name else self.config.num_kv_heads
            if kind in NATIVE and self.native and name == "token_embd.weight" and self.config.tie_word_embeddings:
                # the lookup needs the table dense; the tied head multiplies the file's own integers (llama.cpp's
                # files keep it Q8_0: half the bytes a step reads of a bf16 copy, and its exact values)
                self.tied_head = unpack(kind, np.asarray(tensor.data), shape, self.activation_bits)
                dense = self.tied_head.dequantize()
                self.loaded[kind, f"dequantized embedding, native int{self.tied_head.bits} group {GROUP} head"] += 1
            elif kind in NATIVE and self.native and is_linear:
                weight = unpack(kind, np.asarray(tensor.data), shape, self.activation_bits)
                if permute:
                    weight = weight[unpermute_rows(shape[0], heads)]
                self.kept[target.removesuffix(".weight")] = weight
                dense = weight.dequantize()
                self.loaded[kind, f"native int{weight.bits} group {GROUP}{' + min' if weight.mins is not None else ''}"] += 1
            else:
                if kind == "BF16":  # numpy has no bfloat16: the reader hands its bytes over as uint8
                    dense = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
                elif kind in DENSE:
                    dense = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(shape)
                else:
                    dense = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
                self.loaded[kind, "dense" if kind in DENSE else "dequantized"] += 1
                if permute:
                    dense = dense[unpermute_rows(shape[0], heads)]
            yield target, dense
            if (i + 1) % step == 0 or i + 1 == total:
                log.info("GGUF tensors: %d/%d read (%.1f s)", i + 1, total, time.monotonic() - started)

    def attach(self, modules: dict) -> int:
        """Give tidal's Linears their kept integers (a fused q/k/v or gate/up Linear its parts stacked); a fused
        Linear whose parts have different types stays dense. Returns how many Linears stayed dense that way."""
        from tidal.gpu.model.llama import _target

        fused: dict[str, dict[int, QuantizedWeight]] = {}
        for prefix, weight in self.kept.items():
            target, part = _target(prefix + ".weight")
            fused.setdefault(target.removesuffix(".weight"), {})[part or 0] = weight
        mixed = 0
        for name, parts in fused.items():
            expected = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
            ordered = [parts.get(i) for i in range(expected)]
            if any(p is None for p in ordered) or len({p.bits for p in ordered}) > 1:
                mixed += 1  # e.g. Q4_0 q/k with a Q6_K v: the dense weight already loaded serves
                continue
            modules[name].quantized = QuantizedWeight.cat(ordered)
        return mixed


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's ``permute`` (each head's rotary halves interleaved) of a
    [rows, K] attn_q or attn_k: row i of the result is row ``index[i]`` of the file's tensor."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def unpack(kind: str, blocks: np.ndarray, shape: tuple[int, int], activation_bits: int = 16) -> QuantizedWeight:
    """A Q8_0 / Q4_0 / Q4_1 tensor's bytes ([N, K / 32 * block bytes] uint8) as a group-32 ``QuantizedWeight``
    holding exactly its values: Q8_0 w = d * q; Q4_0 w = d * (u - 8); Q4_1 w = d * u + m, u the unsigned nibble,
    the first 16 inputs of a block in the low nibbles and the last 16 in the high ones. ``activation_bits`` 8:
    multiplied against int8 activations (``QuantizedWeight.activation_bits``)."""
    n, k = shape
    raw = torch.from_numpy(np.array(blocks)).view(n, k // GROUP, -1)  # a copy: the map is read-only
    scales = raw[:, :, 0:2].contiguous().view(torch.float16).view(n, -1).float()
    if kind == "Q8_0":
        q = raw[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)
        return QuantizedWeight(q, scales, None, 8, GROUP, activation_bits)
    first = 4 if kind == "Q4_1" else 2
    nibbles = raw[:, :, first:]
    u = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)  # [N, groups, 32]: inputs 0-15, then 16-31
    q = (u.to(torch.int16) - 8).to(torch.int8).reshape(n, k)
    if kind == "Q4_0":
        return QuantizedWeight(q, scales, None, 4, GROUP, activation_bits)
    mins = raw[:, :, 2:4].contiguous().view(torch.float16).view(n, -1).float()
    # w = d * u + m = (q - (-8)) * d + m
    return QuantizedWeight(q, scales, torch.full_like(scales, -8, dtype=torch.int8), 4, GROUP, activation_bits,
                           mins=mins)
