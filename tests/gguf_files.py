"""GGUF files for tests, written as llama.cpp's converter writes them, with the ``gguf`` package's own writer and
quantizer: ``write_gguf(hf_dir, path, "Q4_1")`` turns a (tiny, random) Hugging Face model directory into a GGUF
whose linear weights are of that type (norms F32, the embedding F32 or ``embedding_type``), Llama's and Mistral's
attn_q / attn_k rows permuted as llama.cpp permutes them. ``reference_state_dict`` gives the weights the file
holds, dequantized by ``gguf`` itself, in Hugging Face's layout: what transformers should compute with.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3"}
NAMES = {  # Hugging Face name under model.layers.N -> GGUF name under blk.N
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{NAMES[rest]}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(w: np.ndarray, kind: str) -> np.ndarray:
    """``w`` stored as ``kind``: F32 as is, else gguf's bytes for it."""
    return w if kind == "F32" else gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])


def is_linear(name: str) -> bool:
    return name.endswith("_proj.weight")


def write_gguf(hf_dir: str, path: str, linear_type: str = "F32", embedding_type: str = "F32",
               tensors: dict[str, tuple[np.ndarray, str]] | None = None, metadata: dict | None = None) -> str:
    """The model of ``hf_dir`` as a GGUF at ``path``. ``tensors`` (GGUF name -> (data, type name)) replaces or adds
    tensors as stored (bytes for a quantized type); ``metadata`` overrides ``{arch}.*`` keys (None drops one)."""
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    arch = ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    keys = {
        "block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "rope.freq_base": config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        "attention.key_length": config["head_dim"], "attention.value_length": config["head_dim"],
        "vocab_size": config["vocab_size"],
    }
    keys.update(metadata or {})
    writer = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if value is None:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, int(value))
    writer.add_uint32("tokenizer.ggml.eos_token_id", config["eos_token_id"])
    stored: dict[str, tuple[np.ndarray, str]] = {}
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        w = tensor.float().numpy()
        target = gguf_name(name)
        if arch == "llama" and target.split(".")[-2] in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, heads if ".attn_q." in target else kv_heads)
        kind = linear_type if is_linear(name) else embedding_type if target == "token_embd.weight" else "F32"
        stored[target] = (quantized(w, kind), kind)
    stored.update(tensors or {})
    for target, (data, kind) in stored.items():
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_state_dict(hf_dir: str, linear_type: str, embedding_type: str = "F32") -> dict[str, torch.Tensor]:
    """The weights ``write_gguf(hf_dir, ..., linear_type, embedding_type)`` stores, dequantized by ``gguf``, in
    Hugging Face's names and row order."""
    out = {}
    for name, tensor in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        w = tensor.float().numpy()
        kind = linear_type if is_linear(name) else embedding_type if name == "model.embed_tokens.weight" else "F32"
        if kind != "F32":
            w = gguf.quants.dequantize(quantized(w, kind), gguf.GGMLQuantizationType[kind])
        out[name] = torch.from_numpy(np.ascontiguousarray(w)).reshape(tensor.shape)
    return out
