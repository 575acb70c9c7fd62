"""The LoRA kernel (tidal/kernels/lora.py) against its torch reference and against tidal's CPU path (the masked
matmul of tidal/gpu/model/lora.py), on rows of several adapters and of none, in the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from tidal.kernels.lora import lora_add, lora_add_reference


def slots_side_by_side(num_slots: int, width: int, k: int, n: int, dtype):
    a = torch.randn(num_slots * width, k).to(dtype)
    b = torch.randn(num_slots * width, n).mul(0.1).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n, width", [(64, 96, 16), (100, 40, 48)])
def test_kernel_matches_reference(dtype, k, n, width, tolerances):
    a, b = slots_side_by_side(3, width, k, n, dtype)
    x = torch.randn(7, k).to(dtype)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0], dtype=torch.int32)
    out = torch.randn(7, n).to(dtype)
    expected = lora_add_reference(out.clone(), x, a, b, slots, width)
    got = lora_add(out.clone(), x, a, b, slots, width)
    tolerance = tolerances[dtype] if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got, expected, **tolerance)
    assert torch.equal(got[1], out[1]) and torch.equal(got[5], out[5]), "a base-model row is left as it was"


def test_kernel_equals_the_cpu_paths_masked_matmul():
    from tidal.gpu.model.lora import LoraRows, LoraWeights, add_lora

    width, k, n = 16, 64, 48
    a, b = slots_side_by_side(2, width, k, n, torch.float32)
    x = torch.randn(5, k)
    slots = torch.tensor([1, 0, -1, 1, 0], dtype=torch.int32)
    onehot = torch.zeros(5, 2, 1)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            onehot[row, slot] = 1
    linear = type("Linear", (), {"lora": LoraWeights(a, b, 1, (n,), width, torch.full((2,), width, dtype=torch.int32))})()
    masked = add_lora(torch.zeros(5, n), x, linear, LoraRows(onehot))
    torch.testing.assert_close(lora_add(torch.zeros(5, n), x, a, b, slots, width), masked, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused():
    a, b = slots_side_by_side(2, 16, 64, 48, torch.float32)
    with pytest.raises(ValueError, match="slots must be"):
        lora_add(torch.zeros(3, 48), torch.zeros(3, 64), a, b, torch.zeros(3, dtype=torch.int64), 16)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(torch.zeros(3, 40), torch.zeros(3, 64), a, b, torch.zeros(3, dtype=torch.int32), 16)


def test_a_mixed_batch_through_the_kernel_gives_transformers_tokens(tmp_path):
    """The engine with the kernel in place of the masked matmuls (as on a CUDA GPU), here in the interpreter:
    adapter A's greedy tokens equal transformers + peft with A merged, beside a base-model request."""
    pytest.importorskip("peft")
    from hf_models import hf_greedy, load_hf_model, make_hf_model
    from lora_adapters import make_adapter, merged_model
    from tidal.gpu.engine import Engine
    from tidal.wire import AdapterSpec, AddRequest, EngineConfig, SamplingParams

    base = make_hf_model("qwen2", tmp_path / "model", seed=3)
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    prompts = {1: [0, 1013, 318, 2047, 57, 4000, 911], 2: [0, 55, 3000, 71, 2222]}
    engine = Engine(EngineConfig(model=base, dtype="float32", num_kv_blocks=32, block_size=4, max_loras=1,
                                 lora_modules=(AdapterSpec(7, "a", adapter),)))
    engine.runner.lora_slots._kernel = "triton"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(AddRequest(1, prompts[1], params, adapter_id=7))
    engine.add_request(AddRequest(2, prompts[2], params))
    tokens = {1: [], 2: []}
    while engine.has_work():
        engine.step()
        for out in engine.take_report().outputs:
            tokens[out.request_id].extend(out.token_ids)
    assert tokens == {1: hf_greedy(merged_model(base, adapter), prompts[1], 6),
                      2: hf_greedy(load_hf_model(base), prompts[2], 6)}
