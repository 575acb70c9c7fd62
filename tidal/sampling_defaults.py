"""The model's own sampling defaults (``--generation-config``, as vLLM's): a checkpoint's ``generation_config.json``
gives ``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty`` to requests that do not set them.

``auto`` (the default) reads the served model directory's file; ``vllm`` ignores it (temperature 1.0 and no
truncation, OpenAI's defaults); any other value is a directory whose ``generation_config.json`` to read, e.g.
for a GGUF file, which carries none.
"""

from __future__ import annotations

import json
import os

KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def read(model_dir: str, source: str = "auto") -> dict[str, float]:
    """The defaults ``source`` gives for the model in ``model_dir`` (only the keys the file sets)."""
    if source == "vllm":
        return {}
    directory = model_dir if source == "auto" else os.path.expanduser(source)
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return {key: config[key] for key in KEYS if isinstance(config.get(key), (int, float))
            and not isinstance(config.get(key), bool)}


def describe(defaults: dict[str, float], source: str) -> str:
    """For the ready line."""
    if not defaults:
        return "sampling defaults: temperature 1.0" + (" (--generation-config vllm)" if source == "vllm" else "")
    where = "the model's generation_config.json" if source == "auto" else f"{source}/generation_config.json"
    return "sampling defaults from " + where + ": " + ", ".join(f"{k} {v}" for k, v in defaults.items())
