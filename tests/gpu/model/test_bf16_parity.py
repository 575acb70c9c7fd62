"""bfloat16 on CPU (the default where the CPU has native bf16) stays within bf16 noise of transformers' bf16.

Token-exact parity is a float32 property (test_engine.py, test_model_parity.py); in bf16 two correct
implementations round differently, so these tests bound the divergence instead: logits close to
transformers' bf16 logits, and greedy choices that transformers, fed the same sequence, ranks
first (or within a hair of first) at nearly every position.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_models import make_hf_model
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.engine import Engine
from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.layers import Linear, gemv_ops
from tidal.gpu.model.loader import load_model
from tidal.gpu.cpu.features import cpu_native_bf16
from tidal.gpu.model.precision import resolve_precision
from tidal.wire import AddRequest, EngineConfig, SamplingParams

NUM_NEW_TOKENS = 64
# Logits of these models spread with a std of ~0.64; transformers' own bf16 and float32 logits differ
# by up to ~0.05 on them, and its bf16 greedy picks a token up to ~0.03 below float32's best.
LOGIT_ATOL = 0.1
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_bf16(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def prompt(length: int = 40) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(10, 8000) for _ in range(length)]


def prefill_batch(num_tokens: int, block_size: int) -> ForwardBatch:
    blocks = -(-num_tokens // block_size)
    return ForwardBatch(
        input_ids=torch.zeros(0), positions=torch.arange(num_tokens), slot_mapping=torch.arange(num_tokens),
        num_decodes=0, decode_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32), decode_max_seq_len=0,
        prefill_query_lens=[num_tokens], prefill_seq_lens=[num_tokens],
        prefill_query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        prefill_seq_lens_tensor=torch.tensor([num_tokens], dtype=torch.int32),
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32)[None], logits_indices=torch.arange(num_tokens))


def test_prefill_logits_close_to_transformers_bf16(model_dir, hf_bf16):
    model, config = load_model(model_dir, torch.bfloat16, torch.device("cpu"), TorchPagedAttention("cpu"))
    tokens = prompt()
    shape = (4, 16, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(config.num_layers)]
    batch = prefill_batch(len(tokens), 16)
    batch.input_ids = torch.tensor(tokens)
    with torch.inference_mode():
        logits = model.compute_logits(model(batch, caches))
    expected = hf_logits(hf_bf16, tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGIT_ATOL)
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= MIN_TOP1_AGREEMENT


def test_engine_greedy_tokens_are_transformers_bf16_choices(model_dir, hf_bf16):
    """Prefill, then 64 decode steps through the paged bf16 cache, sampler included."""
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=64, block_size=16))
    tokens = prompt()
    engine.add_request(AddRequest(1, tokens, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0,
                                                            ignore_eos=True), 0, 0.0))
    generated: list[int] = []
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        generated.extend(t for out in (report.outputs if report else []) for t in out.token_ids)
    assert len(generated) == NUM_NEW_TOKENS and len(set(generated)) > 1
    # transformers, fed tidal's sequence, scores every tidal choice (teacher forcing: no cascade)
    logits = hf_logits(hf_bf16, tokens + generated)[len(tokens) - 1 : -1]
    chosen = torch.tensor(generated)
    shortfall = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
    assert shortfall.max() <= LOGIT_ATOL, f"a choice {shortfall.max():.3f} below transformers' best"
    assert (logits.argmax(-1) == chosen).float().mean() >= MIN_TOP1_AGREEMENT


def test_bf16_on_cpu_uses_prepacked_weights_when_onednn_has_bf16(model_dir):
    """Packed once at load, into one layout (two only with AMX): oneDNN's, or the AVX512-BF16 kernel's."""
    model, _ = load_model(model_dir, torch.bfloat16, torch.device("cpu"), TorchPagedAttention("cpu"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kernel = gemv_ops(torch.bfloat16, "cpu") is not None
    packed = [m.weight is None and (m.gemv_packed is not None) == kernel
              and (m.packed is not None) == (not kernel or cpu_native_bf16() == "amx_bf16") for m in linears]
    assert packed == [torch.ops.mkldnn._is_mkldnn_bf16_supported()] * len(linears)


def _dtype_and_reason(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    precision = resolve_precision(name, device)
    return precision.dtype, precision.reason


def test_auto_dtype_is_bf16_exactly_where_the_cpu_has_native_bf16(monkeypatch):
    from tidal.gpu.cpu import features

    cpu = torch.device("cpu")
    dtype, why = _dtype_and_reason("auto", cpu)
    assert (dtype == torch.bfloat16) == (cpu_native_bf16() is not None and torch.backends.mkldnn.is_available())
    assert why.startswith("auto:")
    monkeypatch.setattr(features, "cpu_native_bf16", lambda: None)
    assert _dtype_and_reason("auto", cpu)[0] == torch.float32
    monkeypatch.setattr(features, "cpu_native_bf16", lambda: "avx512_bf16")
    dtype, why = _dtype_and_reason("auto", cpu)
    assert dtype == torch.bfloat16 and "avx512_bf16" in why
    assert _dtype_and_reason("float32", cpu) == (torch.float32, "--dtype float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_precision("int8", cpu)
