"""tidal tokenises exactly as ``transformers.AutoTokenizer.from_pretrained(model_dir)``, and the
engine decodes as it does, for every supported architecture.

Each model directory is a tiny random model (tests/hf_models.py) whose tokenizer_config.json
names the tokenizer class real checkpoints of that family name. The reference is AutoTokenizer
in this process, as a user runs it (with torch importable).
"""

from __future__ import annotations

import json
import os

import pytest
from hf_models import make_hf_model
from tokenizers import Tokenizer

from tidal.tokenizer import INLINE_MAX_CHARS, PromptTokenizer

# (architecture, tokenizer_class in tokenizer_config.json): as the families' checkpoints declare it
CASES = [
    ("llama", "PreTrainedTokenizerFast"),  # Llama 3
    ("llama", "LlamaTokenizer"),  # Llama 2
    ("mistral", "LlamaTokenizer"),
    ("qwen2", "Qwen2Tokenizer"),
    ("qwen3", "Qwen2Tokenizer"),
]

TEXTS = [
    "import os\nimport sys\n\nclass ",  # the example
    "a  b   c\t\td\n\n\n  x    \n",  # runs of spaces, tabs and newlines
    "héllo 世界 🎉 naïve café 12345 e\u0301 Ελληνικά",  # non-ASCII, digits, a combining accent
    " leading space and trailing ",
    "<|user|>special tokens written in the text<|end|>",
    "\n",
]

MESSAGES = [
    [{"role": "user", "content": "hi  there\n\nhow are   you? é 世界 2024"}],
    [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "  x\ty  "},
     {"role": "assistant", "content": "Sure:\n\n- 1\n- 2"}, {"role": "user", "content": "naïve 🎉"}],
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{c}" for a, c in CASES])
def model_dir(request, tmp_path_factory):
    arch, tokenizer_class = request.param
    out = make_hf_model(arch, tmp_path_factory.mktemp(f"{arch}-{tokenizer_class}"))
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = tokenizer_class
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out


@pytest.fixture(scope="module")
def auto(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tidal_tokenizer(model_dir):
    return PromptTokenizer(model_dir, workers=1)


def chat_ids(auto, messages) -> list[int]:
    ids = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def test_completion_prompts_get_autotokenizers_ids(auto, tidal_tokenizer):
    for text in TEXTS:
        assert await tidal_tokenizer.encode_text(text) == auto(text).input_ids, repr(text)
    long_text = " ".join(TEXTS) * (INLINE_MAX_CHARS // 40)  # the worker-thread path
    assert len(long_text) > INLINE_MAX_CHARS
    assert await tidal_tokenizer.encode_text(long_text) == auto(long_text).input_ids


async def test_chat_prompts_get_autotokenizers_ids(auto, tidal_tokenizer):
    for messages in MESSAGES:
        assert await tidal_tokenizer.encode_chat(messages) == chat_ids(auto, messages)
    long_chat = [{"role": "user", "content": "\n".join(TEXTS) * (INLINE_MAX_CHARS // 40)}]
    assert await tidal_tokenizer.encode_chat(long_chat) == chat_ids(auto, long_chat)


def test_the_engine_decodes_as_autotokenizer(model_dir, auto):
    # the engine's detokenizer decodes with tokenizer.json's own decoder
    engine_tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    for text in TEXTS:
        ids = auto(text).input_ids
        for skip in (True, False):
            assert engine_tokenizer.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip), repr(text)


def test_qwen2_differs_from_reading_tokenizer_json_as_is(tmp_path):
    """Why the above matters: Qwen2Tokenizer splits text (digits one by one, NFC) before the
    byte-level step, so tokenizer.json read as is (what tidal did) gives other ids."""
    from transformers import AutoTokenizer

    model_dir = make_hf_model("qwen2", tmp_path)
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "Qwen2Tokenizer"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    auto = AutoTokenizer.from_pretrained(model_dir)
    as_is = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    assert any(as_is.encode(t).ids != auto(t).input_ids for t in TEXTS)


def test_a_served_qwen2_model_answers_as_transformers_generate(tmp_path):
    """End to end: the server's prompt ids (usage) and greedy text equal AutoTokenizer +
    ``generate`` for a Qwen2 directory, on text where tokenizer.json read as is differs."""
    import httpx
    from hf_models import hf_greedy, load_hf_model
    from live_server import LiveServer
    from transformers import AutoTokenizer

    model_dir = make_hf_model("qwen2", tmp_path)
    path = os.path.join(model_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "Qwen2Tokenizer"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    auto = AutoTokenizer.from_pretrained(model_dir)
    as_is = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    text = next(t for t in TEXTS if as_is.encode(t).ids != auto(t).input_ids)
    prompt_ids = auto(text).input_ids
    expected = auto.decode(hf_greedy(load_hf_model(model_dir), prompt_ids, 8), skip_special_tokens=True)
    messages = MESSAGES[0]
    chat_prompt_ids = chat_ids(auto, messages)
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # float32: greedy text is compared with transformers' float32 generate (auto is bf16 on CPUs with native bf16)
    with LiveServer("--model", model_dir, "--max-model-len", "512", "--dtype", "float32") as server:
        completion = httpx.post(server.url + "/v1/completions", json={"prompt": text, **body}, timeout=60).json()
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, **body}, timeout=60).json()
    assert completion["usage"]["prompt_tokens"] == len(prompt_ids)
    assert completion["choices"][0]["text"] == expected
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt_ids)
