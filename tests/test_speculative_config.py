"""``--speculative-config`` as an operator meets it: vLLM's JSON accepted, every mistake one clear line at
start (exit 2, no traceback, no engine started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tidal.speculative_config import MAX_SPECULATIVE_TOKENS, parse_speculative_config
from tidal.wire import SpeculativeConfig


def test_vllms_ngram_config_is_taken_as_written():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 6}')
    assert config == SpeculativeConfig("ngram", 4, 2, 6)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "ngram", 3, 2, 5)
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 1}') \
        == SpeculativeConfig("ngram", 1, 1, 1)
    assert parse_speculative_config(
        f'{{"method": "ngram", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS}}}').num_speculative_tokens == 16


def test_vllms_draft_model_config_is_taken_as_written():
    assert parse_speculative_config('{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 4}') \
        == SpeculativeConfig("draft_model", 4, model="org/small")
    # vLLM reads a config that names a model and no method as draft_model
    assert parse_speculative_config('{"model": "/m/small.gguf", "num_speculative_tokens": 2, "quantization": "int8", '
                                    '"draft_tensor_parallel_size": 1}') \
        == SpeculativeConfig("draft_model", 2, model="/m/small.gguf", quantization="int8")


@pytest.mark.parametrize("text, message", [
    ('{"method": "lookahead", "num_speculative_tokens": 4}', "unknown method 'lookahead'; supported: ngram, draft_model"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "method 'draft_model' needs \"model\""),
    ('{"method": "draft_model", "model": "", "num_speculative_tokens": 4}', "method 'draft_model' needs \"model\""),
    ('{"method": "draft_model", "model": "x"}', "num_speculative_tokens is required"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
     "unknown key 'prompt_lookup_max' for method 'draft_model'"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "quantization": "fp8"}',
     "quantization must be one of int8, int4, w8a8, w4a8 or null, not 'fp8'"),
    ('{"method": "draft_model", "model": "x", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 2}',
     "draft_tensor_parallel_size must be 1"),
    ('{"method": "ngram", "model": "x", "num_speculative_tokens": 4}', "unknown key 'model' for method 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 16], not 0"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "must be an integer in [1, 16], not 17"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer in [1, 16], not '4'"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_min (5) must not exceed prompt_lookup_max (3)"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 65}',
     "prompt_lookup_max must be an integer in [1, 64], not 65"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}',
     "unknown key 'draft_tensor_parallel_size'"),
    ('[4]', "must be a JSON object"),
    ('{"method": ', "must be a JSON object: Expecting value"),
])
def test_a_bad_config_is_one_clear_line(text, message):
    with pytest.raises(ValueError) as caught:
        parse_speculative_config(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle", "num_speculative_tokens": 4}', "method 'eagle' is not supported; supported: ngram, draft_model"),
    ('{"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 4}',
     "the draft model '/no/such/draft': no such file or directory"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be an integer in [1, 16]"),
])
def test_serve_refuses_a_bad_config_at_start(text, message):
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", "tidal-test", "--port", "0",
                             "--speculative-config", text], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    last = result.stderr.splitlines()[-1]
    assert last.startswith("tidal serve: error: --speculative-config: ") and message in last, result.stderr
    assert "Traceback" not in result.stderr and "engine ready" not in result.stderr


def test_serve_refuses_a_draft_of_another_vocabulary_at_start(smollm2_gguf):
    """The engine compares the vocabularies before loading weights: it fails to start with one line."""
    spec = json.dumps({"method": "draft_model", "model": str(smollm2_gguf), "num_speculative_tokens": 3})
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", "tidal-test", "--port", "0",
                             "--speculative-config", spec], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3  # an engine that cannot start, as with a bad --model directory
    refusal = [line for line in result.stderr.splitlines() if "engine failed to start" in line]
    assert len(refusal) == 1 and "vocabulary of 49152 tokens, the target 8192" in refusal[0], result.stderr
    assert "Traceback" not in result.stderr and "engine ready" not in result.stderr
