"""tidal-tiny: the embedded default model, so tidal runs (and its tests run) with no download.

The package ships only small text files in ``tidal/assets/tidal-tiny/``: ``config.json``
(a 4-layer Llama with ``"tidal_init_seed"``), ``generation_config.json`` and the tokenizer.
There are no weight files: the loader calls ``generate_weights`` when a directory has a
``tidal_init_seed`` and no safetensors. The weights are random but shaped so the model
behaves like a chatty LM on a budget: it emits varied ordinary text tokens that depend on
the context, and runs to ``max_tokens``, because hidden dimension 0 carries a large
constant (from the embedding) and the lm_head rows of EOS and the special tokens have a
negative weight there (and only there), which puts their logits ~30 below the best token's.

Tokenizer: byte-level BPE (8192 entries incl. 7 special tokens) trained on this
interpreter's stdlib sources by ``python -m tidal.gpu.model.tiny_model --build-tokenizer OUT``.
Training is not reproducible across machines, so the committed ``tokenizer.json`` is the
source of truth. Its post-processor prepends ``<s>`` to every encoding; the chat template
also starts every message with ``<s>``, so a rendered conversation must be encoded with
``add_special_tokens=False`` (transformers' ``apply_chat_template`` does exactly that).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from tidal.gpu.model.config import ModelConfig

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "tidal-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
VOCAB_SIZE = 8192

# Shape of the generated weights (see the module docstring). Tuned so that greedy output varies
# and depends on context (not one token forever), yet EOS/special logits stay ~30 below the best.
EMBED_STD = 1.0  # token identity strong next to what the layers add
EMBED_DIM0_OFFSET = 16.0  # ~ the norm of the other 255 dims: dim 0 keeps half the final hidden's energy
LAYER_STD = 0.04  # attention/MLP matrices
LM_HEAD_STD = 0.25  # logits of ordinary tokens spread with std ~3
SPECIAL_DIM0_WEIGHT = -2.0  # the whole lm_head row of EOS and special tokens: this on dim 0, zero elsewhere

CHAT_TEMPLATE = (
    # no whitespace control: the string has no incidental whitespace, and "-" would eat the "\n"s
    "{% for message in messages %}"
    "<s><|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def asset_dir() -> str:
    """The packaged tidal-tiny model directory."""
    return str(ASSET_DIR)


def has_generated_weights(model_dir: str, config: ModelConfig) -> bool:
    """True when the directory's weights are to be generated (a seed and no safetensors)."""
    return config.init_seed is not None and not glob.glob(os.path.join(model_dir, "*.safetensors"))


def special_token_ids(model_dir: str) -> list[int]:
    """Ids of the tokenizer's special tokens (EOS, BOS, pad and the chat markers)."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        added = json.load(f)["added_tokens"]
    return sorted(token["id"] for token in added if token.get("special"))


def generate_weights(config: ModelConfig, special_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights for ``config``, keyed by Hugging Face parameter names."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = LAYER_STD) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    hidden, inter = config.hidden_size, config.intermediate_size
    weights: dict[str, torch.Tensor] = {}
    embed = normal(config.vocab_size, hidden, std=EMBED_STD)
    embed[:, 0] += EMBED_DIM0_OFFSET
    weights["model.embed_tokens.weight"] = embed
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "self_attn.q_proj.weight"] = normal(config.q_size, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = normal(config.kv_size, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = normal(config.kv_size, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, config.q_size)
        weights[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, inter)
        weights[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    lm_head = normal(config.vocab_size, hidden, std=LM_HEAD_STD)
    lm_head[:, 0] = 0.0  # dim 0 is the same for every position: it only pushes specials down
    lm_head[special_ids] = 0.0
    lm_head[special_ids, 0] = SPECIAL_DIM0_WEIGHT
    weights["lm_head.weight"] = lm_head
    return weights


def save_hf_checkpoint(out_dir: str | os.PathLike) -> str:
    """Write tidal-tiny as an ordinary Hugging Face directory (config, model.safetensors, tokenizer).

    The weights are the ones the loader generates, so transformers and tidal run the same model.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dir(ASSET_DIR)
    weights = generate_weights(config, special_token_ids(str(ASSET_DIR)), config.init_seed or 0)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(ASSET_DIR / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    raw.pop("tidal_init_seed", None)  # the weights are real now
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    for name in ("generation_config.json", *TOKENIZER_FILES):
        shutil.copyfile(ASSET_DIR / name, out / name)
    return str(out)


# ---------------------------------------------------------------------------- tokenizer


def stdlib_sources() -> list[str]:
    """The ``.py`` files of this interpreter's standard library (minus its test suites)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        relative = os.path.relpath(path, root)
        parts = relative.split(os.sep)
        if parts[0] in ("site-packages", "test", "idlelib") or "tests" in parts:
            continue
        files.append(path)
    return files


def build_tokenizer(out_dir: str | os.PathLike, files: list[str] | None = None, vocab_size: int = VOCAB_SIZE) -> str:
    """Train the byte-level BPE tokenizer and write ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files or stdlib_sources(), trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos_id)]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config, f, indent=2)
        f.write("\n")
    return str(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.gpu.model.tiny_model", description=__doc__.split("\n")[0])
    parser.add_argument("--build-tokenizer", metavar="OUT", help="train the tokenizer into directory OUT")
    parser.add_argument("--save-hf", metavar="OUT", help="write tidal-tiny as a Hugging Face checkpoint")
    args = parser.parse_args(argv)
    if not (args.build_tokenizer or args.save_hf):
        parser.print_help()
        return 2
    if args.build_tokenizer:
        print(build_tokenizer(args.build_tokenizer))
    if args.save_hf:
        print(save_hf_checkpoint(args.save_hf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
