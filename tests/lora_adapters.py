"""LoRA adapters made offline with peft for tests: random non-zero A and B over a model directory, and the
transformers reference with an adapter merged.

``make_adapter(base_dir, out_dir)`` writes what PEFT's ``save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``); ``merged_model(base_dir, adapter_dir)`` is transformers + peft with the adapter
merged into the weights, float32.
"""

from __future__ import annotations

import os

import torch

from hf_models import load_hf_model

ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_STD = 0.1  # with lora_alpha / r = 2 the product changes the greedy tokens clearly


def make_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, r: int = 8,
                 lora_alpha: float = 16, target_modules=ATTENTION_AND_MLP, **config) -> str:
    """A PEFT LoRA adapter of ``base_dir``'s model with random A and B (``seed``); returns ``out_dir``."""
    import peft

    model = load_hf_model(base_dir)
    lora = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, init_lora_weights=False,
                           **config)
    adapted = peft.get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(adapted.named_parameters()):
            if ".lora_" in name:
                param.copy_(LORA_STD * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(str(out_dir))
    return str(out_dir)


def merged_model(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, base=None):
    """transformers' model of ``base_dir`` (or ``base``, a model already loaded) with the adapter merged in."""
    import peft

    model = base if base is not None else load_hf_model(base_dir)
    return peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()
