"""LoRA adapters in the engine, in-process: a request through adapter A gives transformers + peft's greedy
tokens with A merged, while requests through adapter B and the base model run in the same steps (each equal to
its own reference); the same over int8/int4 base weights against the rounded weights with A merged. Around it:
the scheduler's bound on the adapters of a step, the prefix cache keyed by adapter, the holds that keep an
adapter in use loaded, and every refusal of a bad adapter naming its cause with nothing left registered.

Rules for determinism: float32 on CPU, greedy sampling, tiny random models and adapters made offline with peft
(tests/hf_models.py, tests/lora_adapters.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import hf_greedy, load_hf_model
from lora_adapters import make_adapter, merged_model
from tidal.gpu.engine import Engine
from tidal.gpu.model.lora import AdapterError, read_adapter
from tidal.gpu.model.config import ModelConfig
from tidal.wire import AdapterSpec, AddRequest, EngineConfig, LoadAdapter, SamplingParams, UnloadAdapter

pytest.importorskip("peft")

PROMPTS = {1: [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77], 2: [0, 55, 3000, 71, 2222, 19, 400],
           3: [0, 900, 1800, 2700, 3600, 4500, 5400, 6300, 7200, 30, 31, 32, 33, 34]}
NEW_TOKENS = 10


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine: Engine, requests: dict[int, tuple[list[int], int | None]], max_steps: int = 2000) -> dict[int, list[int]]:
    """Add every request before the first step (so they share steps), step until done; the tokens of each."""
    for rid, (prompt, adapter_id) in requests.items():
        engine.add_request(AddRequest(rid, prompt, greedy(), adapter_id=adapter_id))
    tokens: dict[int, list[int]] = {rid: [] for rid in requests}
    errors = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else ():
            tokens[out.request_id].extend(out.token_ids)
            if out.error:
                errors[out.request_id] = out.error
    assert not errors, errors
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.sequences
    return tokens


def engine_for(model_dir: str, adapters: dict[int, str], **config) -> Engine:
    specs = tuple(AdapterSpec(i, f"adapter-{i}", path) for i, path in adapters.items())
    settings = dict(model=model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_loras=2,
                    max_lora_rank=16, lora_modules=specs)
    return Engine(EngineConfig(**(settings | config)))


@pytest.fixture(scope="module")
def adapters(hf_model_dir, tmp_path_factory):
    """``adapters(arch) -> (model dir, adapter A dir, adapter B dir)``; B targets a subset, with rsLoRA."""
    made = {}

    def get(arch: str):
        if arch not in made:
            base = hf_model_dir(arch, seed=3)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            a = make_adapter(base, root / "a", seed=1)
            b = make_adapter(base, root / "b", seed=2, r=4, lora_alpha=8, use_rslora=True,
                             target_modules=["q_proj", "v_proj", "down_proj"])
            made[arch] = base, a, b
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_transformers_with_each_adapter_merged(adapters, arch):
    base, a, b = adapters(arch)
    expected = {1: hf_greedy(merged_model(base, a), PROMPTS[1], NEW_TOKENS),
                2: hf_greedy(merged_model(base, b), PROMPTS[2], NEW_TOKENS),
                3: hf_greedy(load_hf_model(base), PROMPTS[3], NEW_TOKENS)}
    engine = engine_for(base, {10: a, 11: b})
    got = run(engine, {1: (PROMPTS[1], 10), 2: (PROMPTS[2], 11), 3: (PROMPTS[3], None)})
    assert got == expected
    # the comparison means something: the adapter changes what the base model says
    assert expected[1] != hf_greedy(load_hf_model(base), PROMPTS[1], NEW_TOKENS)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_mixed_batch_over_int_base_weights_matches_the_rounded_reference(adapters, tmp_path, scheme):
    from tidal.gpu.model.quantization import LM_HEAD, ON_THE_FLY, int_linear_ops, quantize

    if int_linear_ops("cpu") is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")
    base, a, b = adapters("llama")
    rounded = load_hf_model(base)
    with torch.no_grad():
        for name, module in rounded.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                module.weight.copy_(quantize(module.weight, ON_THE_FLY[scheme]).dequantize())
        rounded.lm_head.weight.copy_(quantize(rounded.lm_head.weight, LM_HEAD[16]).dequantize())
    rounded.save_pretrained(tmp_path)
    expected = {1: hf_greedy(merged_model(tmp_path, a), PROMPTS[1], NEW_TOKENS),
                2: hf_greedy(merged_model(tmp_path, b), PROMPTS[2], NEW_TOKENS),
                3: hf_greedy(load_hf_model(tmp_path), PROMPTS[3], NEW_TOKENS)}
    engine = engine_for(base, {10: a, 11: b}, quantization=scheme)
    assert run(engine, {1: (PROMPTS[1], 10), 2: (PROMPTS[2], 11), 3: (PROMPTS[3], None)}) == expected


def test_a_step_runs_at_most_max_loras_adapters_and_every_one_gets_its_turn(adapters):
    base, a, b = adapters("llama")
    engine = engine_for(base, {10: a, 11: b}, max_loras=1, max_cpu_loras=2)
    seen = []
    original = engine.adapters.place

    def place(batch):
        seen.append({seq.adapter_id for seq, _ in batch.entries} - {None})
        original(batch)

    engine.adapters.place = place
    requests = {i: (PROMPTS[1 + i % 3], [10, 11, None][i % 3]) for i in range(6)}
    tokens = run(engine, requests)
    assert all(len(step) <= 1 for step in seen) and {10} in seen and {11} in seen
    assert all(len(t) == NEW_TOKENS for t in tokens.values())
    assert tokens[0] == tokens[3] and tokens[1] == tokens[4]  # same prompt, same adapter, whichever step


def test_two_adapters_never_share_kv_blocks_and_one_adapter_reuses_its_own(adapters):
    base, a, b = adapters("llama")
    engine = engine_for(base, {10: a, 11: b})
    prompt = PROMPTS[3]  # three full blocks of 4 tokens, and two more
    run(engine, {1: (prompt, 10)})
    hits = engine.stats().num_prefix_hit_tokens
    through_b = run(engine, {2: (prompt, 11)})
    assert engine.stats().num_prefix_hit_tokens == hits, "adapter B took adapter A's blocks"
    run(engine, {3: (prompt, None)})
    assert engine.stats().num_prefix_hit_tokens == hits, "the base model took an adapter's blocks"
    assert run(engine, {4: (prompt, 11)}) == {4: through_b[2]}
    assert engine.stats().num_prefix_hit_tokens == hits + 12, "adapter B's own blocks were not reused"


def test_an_adapter_in_use_stays_loaded_and_a_cold_one_is_evicted(adapters, tmp_path):
    base, a, b = adapters("llama")
    c = shutil.copytree(a, tmp_path / "c")
    engine = engine_for(base, {10: a, 11: b}, max_loras=1, max_cpu_loras=2)
    engine.add_request(AddRequest(1, PROMPTS[1], greedy(), adapter_id=10))  # held from here to its end
    engine.load_adapter(LoadAdapter(AdapterSpec(12, "c", str(c))))  # a third: evicts B (cold), never A
    assert set(engine.adapters.loaded) == {10, 12}
    engine.add_request(AddRequest(2, PROMPTS[2], greedy(), adapter_id=12))
    engine.add_request(AddRequest(3, PROMPTS[2], greedy(), adapter_id=11))  # both loaded ones held: refused
    report = engine.take_report()
    assert [o.error for o in report.outputs if o.request_id == 3] == [
        "LoRA adapter 'adapter-11' cannot load: the 2 loaded adapters (--max-cpu-loras) are all in use"]
    engine.unload_adapter(UnloadAdapter(10))  # unregistered while held: its weights stay until request 1 ends
    assert 10 in engine.adapters.loaded
    while engine.has_work():
        engine.step()
    assert 10 not in engine.adapters.loaded and not engine.adapters.holds


def write_adapter(source: str, target, config_changes: dict | None = None, tensors=None) -> str:
    shutil.copytree(source, target)
    if config_changes:
        path = os.path.join(target, "adapter_config.json")
        with open(path) as f:
            config = json.load(f)
        with open(path, "w") as f:
            json.dump(config | config_changes, f)
    if tensors is not None:
        path = os.path.join(target, "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    return str(target)


def renamed(old: str, new: str):
    return lambda tensors: {key.replace(old, new): value for key, value in tensors.items()}


def reshaped(tensors):
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    return tensors | {key: torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])}


BAD = {
    "rank over the bound": ({"r": 32}, None, "rank 32 exceeds --max-lora-rank 16"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save (['lm_head']) is not supported"),
    "DoRA": ({"use_dora": True}, None, "use_dora (True) is not supported"),
    "bias": ({"bias": "all"}, None, "bias 'all' is not supported"),
    "a module the model lacks": ({"target_modules": ["q_proj", "c_attn"]}, None,
                                 "target module 'c_attn' is not in the model"),
    "a regex matching nothing": ({"target_modules": r".*\.c_fc"}, None, "matches none of the model's projections"),
    "a tensor of another module": (None, renamed("self_attn.q_proj", "self_attn.c_attn"),
                                   "is not the LoRA A or B of an attention or MLP projection"),
    "a layer past the model": (None, renamed("layers.1.", "layers.7."), "is for layer 7; the model has 2 layers"),
    "shapes that contradict the base": (None, reshaped, "contradict the model"),
    "another PEFT method": ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not supported"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_adapter_is_refused_naming_the_cause_and_nothing_is_registered(adapters, tmp_path, case):
    base, a, _ = adapters("llama")
    changes, tensors, message = BAD[case]
    path = write_adapter(a, tmp_path / "bad", changes, tensors)
    with pytest.raises(AdapterError, match="LoRA adapter 'bad': .*" + message.replace("(", r"\(").replace(
            ")", r"\)").replace("[", r"\[").replace("]", r"\]").replace("*", r"\*").replace(".", r"\.")):
        read_adapter("bad", path, ModelConfig.from_dir(base), max_rank=16)
    engine = engine_for(base, {})
    answer = engine.load_adapter(LoadAdapter(AdapterSpec(5, "bad", path)))
    assert message in answer.error and not engine.adapters.specs and not engine.adapters.loaded


def test_an_adapter_at_the_rank_bound_loads(adapters, tmp_path):
    base, _, _ = adapters("llama")
    at_bound = make_adapter(base, tmp_path / "r16", r=16)
    assert read_adapter("r16", at_bound, ModelConfig.from_dir(base), max_rank=16).rank == 16


def test_a_bad_lora_module_fails_the_engine_start(adapters, tmp_path):
    base, a, _ = adapters("llama")
    path = write_adapter(a, tmp_path / "dora", {"use_dora": True})
    with pytest.raises(AdapterError, match="use_dora"):
        engine_for(base, {10: path})
