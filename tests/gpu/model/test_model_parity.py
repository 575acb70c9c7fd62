"""tidal's model code over the paged KV cache matches transformers token for token (CPU, float32)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_models import hf_greedy, load_hf_model
from paged_batch import PagedCache, Sequence, build_batch
from tidal.gpu.model import tiny_model
from tidal.gpu.model.attention import TorchPagedAttention, select_attention_backend
from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.config import ModelConfig, UnsupportedModelError
from tidal.gpu.model.loader import load_model, resolve_model_dir

NUM_NEW_TOKENS = 16
PROMPT = [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77]

ARCH_CASES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "llama-rope-llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "llama-rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


@pytest.fixture
def hf_dirs(hf_model_dir):
    """A model directory for one of ``ARCH_CASES`` ("llama", "llama-rope-linear", ...)."""
    # a different seed per case, so e.g. llama and mistral do not get identical weights
    return lambda case: hf_model_dir(case.split("-")[0], seed=list(ARCH_CASES).index(case), **ARCH_CASES[case])


def run_step(model, cache: PagedCache, batch: ForwardBatch, all_rows: bool = False) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(batch, cache.kv_caches)
        return model.compute_logits(hidden if all_rows else hidden[batch.logits_indices])


def tidal_greedy(model, config: ModelConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Prefill the prompt, then decode one token per step through the paged cache."""
    cache = PagedCache(config)
    seq = Sequence(tokens=list(prompt))
    logits = run_step(model, cache, build_batch(cache, [], [(seq, len(prompt))]))
    generated = []
    while True:
        token = int(logits[-1].argmax())
        generated.append(token)
        if len(generated) == max_new_tokens:
            return generated
        seq.tokens.append(token)
        logits = run_step(model, cache, build_batch(cache, [seq], []))


def load(model_dir: str):
    return load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention())


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_greedy_decode_matches_transformers(hf_dirs, case):
    model_dir = hf_dirs(case)
    model, config = load(model_dir)
    expected = hf_greedy(load_hf_model(model_dir), PROMPT, NUM_NEW_TOKENS)
    assert tidal_greedy(model, config, PROMPT, NUM_NEW_TOKENS) == expected
    assert len(set(expected)) > 1  # the comparison means something only if the output varies


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_mixed_batch_matches_each_sequence_alone(hf_dirs, case):
    """Two decodes, a fresh prefill chunk and a chunk extending a cached prefix, in one step."""
    model_dir = hf_dirs(case)
    model, config = load(model_dir)
    hf_model = load_hf_model(model_dir)
    cache = PagedCache(config)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 7, 13)]
    short_decode, long_decode, fresh, extended = (Sequence(tokens=list(p)) for p in prompts)
    # earlier steps: the decodes' contexts (minus their last token) and the extension's prefix
    run_step(model, cache, build_batch(cache, [], [(short_decode, 8), (long_decode, 13), (extended, 5)]))

    batch = build_batch(cache, [short_decode, long_decode], [(fresh, 7), (extended, 8)])
    logits = run_step(model, cache, batch, all_rows=True)

    expected_rows = [
        hf_logits(hf_model, short_decode.tokens)[-1:],
        hf_logits(hf_model, long_decode.tokens)[-1:],
        hf_logits(hf_model, fresh.tokens),
        hf_logits(hf_model, extended.tokens)[5:],
    ]
    torch.testing.assert_close(logits, torch.cat(expected_rows), rtol=1e-4, atol=1e-4)


def test_decode_ignores_stale_cache_beyond_sequence_length(hf_dirs):
    """Slots past a sequence's length hold garbage (freed blocks); decode must mask them."""
    model_dir = hf_dirs("llama")
    model, config = load(model_dir)
    cache = PagedCache(config)
    for k_cache, v_cache in cache.kv_caches:
        k_cache.normal_(0, 100)
        v_cache.normal_(0, 100)
    seq = Sequence(tokens=PROMPT[:6])
    run_step(model, cache, build_batch(cache, [], [(seq, 5)]))
    logits = run_step(model, cache, build_batch(cache, [seq], []))
    torch.testing.assert_close(logits[0], hf_logits(load_hf_model(model_dir), seq.tokens)[-1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ config and loading


def test_sharded_checkpoint_loads_the_same_weights(hf_dirs, tmp_path):
    model_dir = hf_dirs("qwen2")
    load_hf_model(model_dir).save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    single, _ = load(model_dir)
    sharded, _ = load(str(tmp_path))
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_missing_a_tensor_is_an_error(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(hf_dirs("llama"), tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load(str(model_dir))


def test_unsupported_architecture_is_rejected_clearly(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 10})
    )
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load(str(tmp_path))


def test_unsupported_rope_scaling_is_rejected(hf_dirs, tmp_path):
    model_dir = shutil.copytree(hf_dirs("llama"), tmp_path / "m")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dir(model_dir)


def test_config_reads_eos_from_both_files(hf_dirs):
    config = ModelConfig.from_dir(resolve_model_dir("tidal-tiny"))
    assert config.eos_token_ids == (1, 6)
    assert config.bos_token_id == 0
    qwen3 = ModelConfig.from_dir(hf_dirs("qwen3"))
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.tie_word_embeddings) == ("Qwen3ForCausalLM", True, True)
    assert ModelConfig.from_dir(hf_dirs("qwen2")).attention_bias


def test_resolve_model_dir(tmp_path):
    assert resolve_model_dir("tidal-tiny") == tiny_model.asset_dir()
    assert resolve_model_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model directory .* a Hub id ORG/NAME"):
        resolve_model_dir("meta-llama/Llama-3.1-8B")


def test_attention_backend_selection():
    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("auto", cpu), TorchPagedAttention)
    assert isinstance(select_attention_backend("torch", cpu), TorchPagedAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_attention_backend("flash", cpu)


# ------------------------------------------------------------------ tidal-tiny


@pytest.fixture(scope="module")
def tiny():
    return load(resolve_model_dir("tidal-tiny"))


def test_tiny_model_weights_are_deterministic(tiny):
    other, _ = load(resolve_model_dir("tidal-tiny"))
    for (name, a), (_, b) in zip(tiny[0].state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tiny_model_emits_text_not_eos(tiny):
    model, config = tiny
    tokens = tidal_greedy(model, config, PROMPT, 24)
    specials = set(tiny_model.special_token_ids(tiny_model.asset_dir()))
    assert not specials & set(tokens)
    assert len(set(tokens)) > 5
    # sampling sees ordinary tokens too: every special token is far below the best logit
    cache = PagedCache(config)
    logits = run_step(model, cache, build_batch(cache, [], [(Sequence(tokens=PROMPT), len(PROMPT))]))
    assert (logits[0].max() - logits[0, sorted(specials)].max()) > 20


def test_tiny_checkpoint_round_trips_through_transformers(tiny, tmp_path):
    model, config = tiny
    out = tiny_model.save_hf_checkpoint(tmp_path / "tiny")
    assert tidal_greedy(model, config, PROMPT, NUM_NEW_TOKENS) == hf_greedy(load_hf_model(out), PROMPT, NUM_NEW_TOKENS)


def test_tiny_tokenizer_and_chat_template():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    directory = tiny_model.asset_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    raw = Tokenizer.from_file(f"{directory}/tokenizer.json")
    assert len(tokenizer) == raw.get_vocab_size() == ModelConfig.from_dir(directory).vocab_size
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.<|end|>\n<s><|user|>\nHi there<|end|>\n<|assistant|>\n"
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert ids[:2] == [0, raw.token_to_id("<|system|>")] and ids.count(0) == 2  # no doubled <s>
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert raw.encode("hello").ids[0] == raw.token_to_id("<s>")  # plain prompts get <s>
    assert raw.decode(ids, skip_special_tokens=True) == "\nBe brief.\n\nHi there\n\n"
