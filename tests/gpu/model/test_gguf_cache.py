"""A GGUF model's packed weights are cached beside its prepared directory: the second load reads the cache, not
the file, and computes exactly what the first did; a file changed since is read again, never served stale."""

from __future__ import annotations

import glob
import logging
import os

import pytest
import torch

from gguf_files import write_gguf
from hf_models import make_hf_model
from paged_batch import greedy_tokens, prompt_logits
from tidal.gguf_model import write_model_files
from tidal.gpu.model import gguf_checkpoint
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import load_model, quantized_weights_note
from tidal.gpu.model.quantization import int_linear_ops

pytestmark = pytest.mark.skipif(int_linear_ops("cpu") is None,
                                reason="native GGUF weights need the int linear kernel (AVX2+FMA, C++ kernels built)")

PROMPT = [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77]
SIZES = dict(hidden_size=128, head_dim=32, intermediate_size=256)


def prepared(tmp_path, hf_dir: str, kind: str = "Q4_1") -> tuple[str, str]:
    """(the GGUF file, its prepared model directory)."""
    path = write_gguf(hf_dir, str(tmp_path / "model.gguf"), kind, embedding_type="Q8_0")
    out = tmp_path / "prepared"
    out.mkdir(exist_ok=True)
    write_model_files(path, str(out))
    return path, str(out)


def load(model_dir: str, dtype=torch.float32):
    return load_model(model_dir, dtype, torch.device("cpu"), TorchPagedAttention())


def outputs(model, config) -> tuple[torch.Tensor, list[int]]:
    return prompt_logits(model, config, PROMPT), greedy_tokens(model, config, PROMPT, 12)


def cache_files(model_dir: str) -> list[str]:
    return glob.glob(os.path.join(model_dir, "weights-*.safetensors"))


@pytest.mark.parametrize("kind, arch", [("Q4_1", "llama"), ("Q8_0", "llama"), ("Q4_0", "llama"),
                                        ("Q4_1", "qwen3")])  # qwen3: a tied head on the Q8_0 embedding's integers
def test_second_load_reads_the_cache_and_computes_exactly_the_same(tmp_path, monkeypatch, caplog, kind, arch):
    _, model_dir = prepared(tmp_path, make_hf_model(arch, tmp_path / "hf", seed=3, **SIZES), kind)
    first, config = load(model_dir)
    logits, tokens = outputs(first, config)
    assert len(set(tokens)) > 1 and len(cache_files(model_dir)) == 1
    note = quantized_weights_note(first)

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read although its packed weights are cached")

    monkeypatch.setattr(gguf_checkpoint, "GgufCheckpoint", refuse)
    with caplog.at_level(logging.INFO, logger="tidal.gguf"):
        second, config = load(model_dir)
    assert "weights from the packed cache" in caplog.text
    assert quantized_weights_note(second) == note  # the ready line still says what the file held and how it runs
    if arch == "qwen3":
        assert second._packed_lm_head.int_packed.bits == 8
    again_logits, again_tokens = outputs(second, config)
    assert torch.equal(again_logits, logits) and again_tokens == tokens


def test_a_changed_file_is_read_again_not_served_from_the_stale_cache(tmp_path, caplog):
    path, model_dir = prepared(tmp_path, make_hf_model("llama", tmp_path / "a", seed=3, **SIZES))
    old_logits, _ = outputs(*load(model_dir))
    stale = cache_files(model_dir)
    # the same path, shape and size, other weights; its modification time moves as an edit or a copy moves it
    prepared(tmp_path, make_hf_model("llama", tmp_path / "b", seed=4, **SIZES))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with caplog.at_level(logging.INFO, logger="tidal.gguf"):
        new_logits, _ = outputs(*load(model_dir))
    assert "weights from the packed cache" not in caplog.text
    os.environ["TIDAL_GGUF_WEIGHT_CACHE"] = "0"
    try:
        uncached_logits, _ = outputs(*load(model_dir))
    finally:
        del os.environ["TIDAL_GGUF_WEIGHT_CACHE"]
    assert torch.equal(new_logits, uncached_logits) and not torch.allclose(new_logits, old_logits)
    assert len(cache_files(model_dir)) == 1 and cache_files(model_dir) != stale  # the stale one replaced


def test_a_damaged_cache_is_rebuilt_from_the_file(tmp_path, caplog):
    _, model_dir = prepared(tmp_path, make_hf_model("llama", tmp_path / "hf", seed=3, **SIZES))
    logits, _ = outputs(*load(model_dir))
    (cache,) = cache_files(model_dir)
    with open(cache, "r+b") as f:
        f.truncate(os.path.getsize(cache) // 2)
    with caplog.at_level(logging.INFO, logger="tidal.gguf"):
        again, _ = outputs(*load(model_dir))
    assert "ignoring the unreadable packed-weight cache" in caplog.text
    assert torch.equal(again, logits)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tidal.gguf"):
        third, _ = outputs(*load(model_dir))
    assert "weights from the packed cache" in caplog.text and torch.equal(third, logits)  # rewritten whole
