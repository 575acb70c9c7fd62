"""What tidal needs to know about a Hugging Face model directory, read from its JSON files.

Only ``config.json`` and (optionally) ``generation_config.json`` are read; no transformers
import, so the engine can start without paying for it. Both the old spelling
(``rope_theta`` + ``rope_scaling``) and the transformers 5 spelling (``rope_parameters``)
of the rotary settings are understood.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The model directory describes a model tidal cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family model (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rotary; otherwise a dict with "rope_type" in ("linear", "llama3") and its knobs
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 if configured)
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before rotary
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None  # the checkpoint's dtype name, e.g. "bfloat16"
    attention_output_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False  # Llama's mlp_bias
    # tidal-tiny: weights are generated from this seed when the directory has no safetensors
    init_seed: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read ``config.json`` (+ ``generation_config.json``) of a Hugging Face model directory.

        Raises ``UnsupportedModelError`` for architectures or settings tidal cannot run, and
        ``FileNotFoundError`` when there is no ``config.json``.
        """
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
        generation: dict[str, Any] = {}
        generation_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path, encoding="utf-8") as f:
                generation = json.load(f)
        return cls.from_dicts(raw, generation, source=str(path))

    @classmethod
    def from_dicts(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None, source: str = "config"
    ) -> "ModelConfig":
        """Build from the parsed ``config.json`` and ``generation_config.json`` contents."""
        architecture = _architecture(raw, source)
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise UnsupportedModelError(
                f"{source}: {architecture} with hidden_act={hidden_act!r} is not supported (only 'silu')"
            )
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        rope_theta, rope_scaling = _rope(raw, source)
        max_position_embeddings = int(raw.get("max_position_embeddings", 2048))

        if architecture == "Qwen2ForCausalLM":
            attention_bias, output_bias = True, False
        elif architecture == "MistralForCausalLM":
            attention_bias = output_bias = False
        else:  # Llama and Qwen3 put the bias (if any) on all four projections
            attention_bias = output_bias = bool(raw.get("attention_bias", False))

        sliding_window = _sliding_window(raw, architecture)
        if sliding_window is not None and sliding_window < max_position_embeddings:
            # Deliberate simplification: exact while every sequence is shorter than the window.
            logger.warning(
                "%s: sliding-window attention (window %d) is not implemented; tidal attends to the "
                "whole context, which matches the model only for sequences up to %d tokens",
                source,
                sliding_window,
                sliding_window,
            )

        generation = generation or {}
        dtype = raw.get("torch_dtype") or raw.get("dtype")
        init_seed = raw.get("tidal_init_seed")
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            eos_token_ids=_token_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            bos_token_id=_first_id(generation.get("bos_token_id"), raw.get("bos_token_id")),
            torch_dtype=str(dtype) if dtype is not None else None,
            attention_output_bias=output_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
            init_seed=int(init_seed) if init_seed is not None else None,
        )


def _architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not architectures:
        raise UnsupportedModelError(
            f"{source}: config.json names no architecture (model_type={raw.get('model_type')!r}); "
            f"tidal supports {supported}"
        )
    name = architectures[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: architecture {name!r} is not supported; tidal supports {supported}"
        )
    return name


def _rope(raw: dict[str, Any], source: str) -> tuple[float, dict | None]:
    """Return (rope_theta, rope_scaling or None for plain rotary)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    # transformers 5 may key rope_parameters by layer type; all layers must agree for us
    if params and all(isinstance(v, dict) for v in params.values()):
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise UnsupportedModelError(f"{source}: per-layer rotary settings are not supported")
        params = dict(next(iter(params.values())))
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported; tidal supports "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise UnsupportedModelError(f"{source}: rope scaling {rope_type!r} needs a 'factor'")
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(params["factor"])}
    if rope_type == "llama3":
        scaling["low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
        scaling["high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
        scaling["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 8192)
        )
    return theta, scaling


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    # Qwen2/Qwen3 carry a window size but use it only when use_sliding_window is set
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window"):
        return None
    return int(window)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _token_ids(*values: Any) -> tuple[int, ...]:
    """Union of token ids from several int-or-list fields, in first-seen order."""
    seen: dict[int, None] = {}
    for value in values:
        for token_id in _as_list(value):
            seen[token_id] = None
    return tuple(seen)


def _first_id(*values: Any) -> int | None:
    for value in values:
        ids = _as_list(value)
        if ids:
            return ids[0]
    return None
