"""The runner's two attention paths agree: the engine on the Triton kernels (run by Triton's
interpreter on CPU) produces the same greedy tokens as on the torch path, through a step that
mixes decodes with a chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from tidal.gpu.model.attention import TorchPagedAttention, TritonPagedAttention, select_attention_backend
from tidal.gpu.engine import Engine
from tidal.kernels import HAS_TRITON
from tidal.wire import AddRequest, EngineConfig, SamplingParams


def test_auto_picks_torch_on_cpu():
    assert isinstance(select_attention_backend("auto", torch.device("cpu")), TorchPagedAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("flash", torch.device("cpu"))


def generate(backend: str) -> dict[int, list[int]]:
    engine = Engine(EngineConfig(model="tidal-tiny", dtype="float32", attention_backend=backend, num_kv_blocks=32,
                                 block_size=16, max_num_batched_tokens=24))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    shared = list(range(100, 132))  # two full blocks: the second request hits them in the prefix cache
    engine.add_request(AddRequest(1, shared + [7, 8], params, 0, 0.0))
    tokens: dict[int, list[int]] = {1: [], 2: []}
    added = False
    while engine.has_work() or not added:
        engine.step()
        if not added and engine.num_steps >= 3:
            engine.add_request(AddRequest(2, shared + [9, 10, 11], params, 0, 0.0))
            added = True
        report = engine.take_report()
        for out in report.outputs if report else []:
            tokens[out.request_id].extend(out.token_ids)
    assert engine.block_manager.num_used_blocks == 0
    assert engine.stats().num_prefix_hit_tokens > 0
    return tokens


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_backend_matches_torch_backend():
    assert isinstance(select_attention_backend("triton", torch.device("cpu")), TritonPagedAttention)
    assert generate("triton") == generate("torch")
