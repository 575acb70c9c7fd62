"""Random-weight Llama models for benchmarks, in Hugging Face format, made offline.

``tiny``: tidal-tiny itself (7M params). ``small``: an 88M-parameter Llama (hidden 768,
12 layers, 12 heads, 4 KV heads, MLP 2048), the shape of the "small" model the published
vLLM-CPU figures used, with the tidal-tiny tokenizer (vocab 8192).
"""

from __future__ import annotations

import os
import shutil
import sys

SMALL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048)


def make_model(size: str, out_dir: str) -> str:
    from tidal.gpu.model import tiny_model

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    if size == "tiny":
        return tiny_model.save_hf_checkpoint(out_dir)
    if size != "small":
        raise ValueError(f"unknown size {size!r}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    assets = tiny_model.asset_dir()
    config = LlamaConfig(vocab_size=8192, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2, **SMALL)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(assets, name), out_dir)
    return out_dir


if __name__ == "__main__":
    print(make_model(sys.argv[1], sys.argv[2]))
