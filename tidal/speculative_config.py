"""``--speculative-config``: vLLM's JSON object, checked into a ``wire.SpeculativeConfig``.

Every mistake is one ``ValueError`` line naming the key and its range, which the CLI turns into
a usage error (exit 2) before any engine starts.
"""

from __future__ import annotations

import json

from tidal.wire import SpeculativeConfig

METHODS = ("ngram", "draft_model")
# methods vLLM knows that tidal does not run yet: named, so the refusal says what is supported
KNOWN_ELSEWHERE = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
MAX_SPECULATIVE_TOKENS = 16  # a verification pass carries at most this many proposed tokens per sequence
MAX_PROMPT_LOOKUP = 64  # the longest n-gram matched against the sequence's own tokens
# the keys of vLLM's config each method takes; vLLM's others (e.g. draft_tensor_parallel_size > 1) are refused
KEYS = {"ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
        "draft_model": ("method", "model", "num_speculative_tokens", "quantization", "draft_tensor_parallel_size")}
DRAFT_QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8")  # --quantization's CPU schemes, applied to the draft at load


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The config a ``--speculative-config`` value asks for; ValueError with one line if it is wrong."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config must be a JSON object: {exc.msg} at character {exc.pos}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    method = spec.get("method")
    if method is None and "model" in spec:
        method = "draft_model"  # vLLM's reading of a config that names a draft model and no method
    if method not in METHODS:
        known = f"unknown method {method!r}" if method not in KNOWN_ELSEWHERE else f"method {method!r} is not supported"
        raise ValueError(f"--speculative-config: {known}; supported: {', '.join(METHODS)}")
    unknown = sorted(set(spec) - set(KEYS[method]))
    if unknown:
        raise ValueError(f"--speculative-config: unknown key {unknown[0]!r} for method {method!r} "
                         f"(known: {', '.join(KEYS[method])})")
    k = _integer(spec, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    if method == "draft_model":
        return _draft_model(spec, k)
    high = _integer(spec, "prompt_lookup_max", None, 1, MAX_PROMPT_LOOKUP)
    low = _integer(spec, "prompt_lookup_min", None, 1, MAX_PROMPT_LOOKUP)
    # neither bound: n-grams of 5 down to 2 tokens; one alone: the other widens to include it
    if low is None and high is None:
        low, high = 2, 5
    elif low is None:
        low = min(2, high)
    elif high is None:
        high = max(low, 5)
    if low > high:
        raise ValueError(f"--speculative-config: prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
    return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)


def _draft_model(spec: dict, k: int) -> SpeculativeConfig:
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("--speculative-config: method 'draft_model' needs \"model\": the draft model "
                         "(a directory, a .gguf file or a Hub id, as --model takes)")
    quantization = spec.get("quantization")
    if quantization is not None and quantization not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"--speculative-config: quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} "
                         f"or null, not {quantization!r}")
    if spec.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1 (the draft runs in the "
                         "engine's one process)")
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=model, quantization=quantization)


def _integer(spec: dict, key: str, default: int | None, low: int, high: int) -> int | None:
    value = spec.get(key, default)
    if key == "num_speculative_tokens" and value is None:
        raise ValueError(f"--speculative-config: num_speculative_tokens is required (an integer in [{low}, {high}])")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"--speculative-config: {key} must be an integer in [{low}, {high}], not {value!r}")
    return value
