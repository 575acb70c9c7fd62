"""Model implementations, keyed by the Hugging Face ``architectures`` name they run."""

from __future__ import annotations

from tidal.gpu.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from tidal.gpu.model.llama import LlamaForCausalLM

MODEL_CLASSES = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that implements ``config.architecture``."""
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {config.architecture!r} is not supported; tidal supports {', '.join(MODEL_CLASSES)}"
        ) from None


__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "model_class"]
