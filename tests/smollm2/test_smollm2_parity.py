"""The real model computes what its file says: SmolLM2-135M-Instruct loaded by tidal from the shipped Q4_1 GGUF
(natively on the int kernel, float32 activations) against transformers loading the same file (which dequantizes
every tensor to float32): logits within 1e-3 at every prompt row and the same greedy tokens (up to 64, or to the model's end of turn,
where transformers stops), for 8 prompts. The
same for Q8_0 and Q4_0 files made from it with gguf's own quantizer (the Q4_1 weights dequantized, then rounded)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import paged_batch
from hf_models import hf_greedy
from paged_batch import greedy_tokens, prompt_logits
from tidal.gguf_model import write_model_files
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import load_model, quantized_weights_note
from tidal.gpu.model.quantization import int_linear_ops
from tidal.tokenizer import PromptTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    int_linear_ops("cpu") is None, reason="the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")]

NEW_TOKENS = 64
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 7?",
             "List three primary colors.", "Who wrote Romeo and Juliet?", "Explain photosynthesis in one sentence.",
             "Translate 'good morning' into Spanish.", "Give me a tip for learning to code."]
END_OF_TURN = 2  # <|im_end|>
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def requantized(source: str, path: str, kind: str) -> str:
    """``source`` with every decoder linear dequantized and rounded to ``kind`` by gguf; the rest as it is."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data, dtype = np.array(tensor.data), tensor.tensor_type
        if tensor.name.split(".")[-2] in LINEARS:
            dtype = gguf.GGMLQuantizationType[kind]
            data = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype)
        writer.add_tensor(tensor.name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    tokenizer = PromptTokenizer(smollm2_dir, workers=1)
    return [tokenizer._encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module", autouse=True)
def name_map_built_once():
    """transformers' GGUF loader asks gguf for its tensor-name map once per module of the model (397 times, ~5 s
    of each reference's load); the map depends only on the architecture and the block count."""
    import functools

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module", autouse=True)
def room_for_64_tokens():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_batch, "MAX_BLOCKS_PER_SEQ", 64)
        patch.setattr(paged_batch, "NUM_BLOCKS", 128)
        yield


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0"])
def test_tidal_on_the_gguf_matches_transformers_on_it(smollm2_gguf, smollm2_dir, prompts, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    path = str(smollm2_gguf) if kind == "Q4_1" else requantized(str(smollm2_gguf), str(tmp_path / "m.gguf"), kind)
    model_dir = tmp_path / "prepared"
    model_dir.mkdir()
    write_model_files(path, str(model_dir))
    model, config = load_model(str(model_dir), torch.float32, torch.device("cpu"), TorchPagedAttention())
    assert f"{kind} x210 native int{4 if kind != 'Q8_0' else 8} group 32" in quantized_weights_note(model)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path if kind != "Q4_1" else smollm2_gguf.parent),
                                                     gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32).eval()
    worst, compared = 0.0, 0
    for prompt in prompts:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        hf_tokens = hf_greedy(reference, prompt, NEW_TOKENS)  # up to 64 tokens, ending at the end of turn
        got = prompt_logits(model, config, prompt)
        worst = max(worst, float((got - expected).abs().max()))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
        tokens = greedy_tokens(model, config, prompt, NEW_TOKENS)
        if END_OF_TURN in tokens:  # the model ended its answer: transformers stops there
            tokens = tokens[:tokens.index(END_OF_TURN) + 1]
        assert tokens == hf_tokens
        compared += len(tokens)
    print(f"{kind}: logits max |diff| {worst:.2e} over {len(prompts)} prompts; {compared} greedy tokens equal")
