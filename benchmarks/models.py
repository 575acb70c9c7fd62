"""Random-weight Llama models for benchmarks, in Hugging Face format, made offline.

``tiny``: tidal-tiny itself (7M params). ``small``: an 88M-parameter Llama (hidden 768,
12 layers, 12 heads, 4 KV heads, MLP 2048), the shape of the "small" model the published
vLLM-CPU figures used, with the tidal-tiny tokenizer (vocab 8192).

``smol-360m`` and ``smol-1.7b``: SmolLM2-360M's and SmolLM2-1.7B's shapes (deep and narrow, and wide; both with
SmolLM2's 49,152-token vocabulary and a tied head), random bf16 weights, with SmolLM2's tokenizer copied from
``--tokenizer-from`` (default ``/tmp/anchors/models/smol``, the real SmolLM2-135M that real_model.sh makes). They
are made, never committed: 0.7 and 3.4 GB.

    python benchmarks/models.py SIZE OUT_DIR [--tokenizer-from DIR]
"""

from __future__ import annotations

import os
import shutil
import sys

SMALL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048)
SMOL = {  # SmolLM2's published configs, less their weights
    "smol-360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                      intermediate_size=2560, rope_theta=100000.0),
    "smol-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=8192, rope_theta=130000.0),
}
SMOL_TOKENIZER = "/tmp/anchors/models/smol"


def make_model(size: str, out_dir: str, tokenizer_from: str = SMOL_TOKENIZER) -> str:
    from tidal.gpu.model import tiny_model

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    if size == "tiny":
        return tiny_model.save_hf_checkpoint(out_dir)
    if size in SMOL:
        return _make_smol(size, out_dir, tokenizer_from)
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


def _make_smol(size: str, out_dir: str, tokenizer_from: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    names = ("tokenizer.json", "tokenizer_config.json")
    if not all(os.path.exists(os.path.join(tokenizer_from, name)) for name in names):
        raise SystemExit(f"{size} takes SmolLM2's tokenizer from {tokenizer_from}, which has none: make it with "
                         "../shared/anchors/real_model.sh or pass --tokenizer-from")
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, **SMOL[size])
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)  # made in bf16: the 1.7B shape in float32 would be 6.8 GB
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
    model.save_pretrained(out_dir)
    for name in names:
        shutil.copy(os.path.join(tokenizer_from, name), out_dir)
    return out_dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size", choices=["tiny", "small", *SMOL])
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer-from", default=SMOL_TOKENIZER)
    args = parser.parse_args()
    print(make_model(args.size, args.out_dir, args.tokenizer_from))
