"""Tiny random-weight Hugging Face models of every architecture tidal supports, for parity tests.

``make_hf_model("llama", tmp_path)`` writes a complete model directory (config, safetensors,
generation config and the tidal-tiny tokenizer) that both transformers and tidal can load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tidal.gpu.model import tiny_model

# short name -> (transformers config class name, architecture, config defaults for that family)
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
}
SHORT_NAMES = {arch: short for short, (_, arch, _) in ARCHITECTURES.items()}

# Weight scale of the random models: large enough that greedy decoding has clear winners
# (top-2 logit gaps far above float32 noise), small enough that activations stay tame.
WEIGHT_STD = 0.08
NORM_WEIGHT_STD = 0.1


def tokenizer_vocab_size() -> int:
    """Number of tokens of the tidal-tiny tokenizer (the vocab of every test model)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(tiny_model.asset_dir(), "tokenizer.json")).get_vocab_size()


def make_hf_model(arch: str, out_dir: str | os.PathLike, seed: int = 0, **config_overrides) -> str:
    """Save a tiny random float32 model of ``arch`` with the tidal-tiny tokenizer into ``out_dir``.

    ``arch`` is a short name ("llama", "mistral", "qwen2", "qwen3") or an architecture name
    ("LlamaForCausalLM", ...). Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16;
    ``config_overrides`` are passed to the transformers config (e.g. ``rope_scaling=...``).
    Every parameter (biases and norm weights included) is random, so a weight loaded into the
    wrong place shows up as a mismatch. Returns the directory.
    """
    import transformers

    short = SHORT_NAMES.get(arch, arch)
    if short not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    config_class_name, architecture, family_defaults = ARCHITECTURES[short]
    settings = {
        "vocab_size": tokenizer_vocab_size(),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        **family_defaults,
        **config_overrides,
    }
    config = getattr(transformers, config_class_name)(**settings)
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config).to(torch.float32).eval()
    _randomize(model, seed)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in tiny_model.TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tiny_model.asset_dir(), name), out / name)
    return str(out)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + NORM_WEIGHT_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def load_hf_model(model_dir: str | os.PathLike):
    """The transformers model of a directory (float32, CPU, eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ignoring EOS (always ``max_new_tokens`` tokens)."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=model.config.pad_token_id
    )
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), generation_config=generation)
    return output[0, len(prompt) :].tolist()
