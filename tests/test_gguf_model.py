"""GGUF models as an operator names them: a file, a directory holding one, or ``ollama:NAME[:TAG]``; the tokenizer
from the file splitting text as llama.cpp does; clear one-line refusals at start."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import gguf
import pytest
import regex
from tokenizers import Tokenizer, models, pre_tokenizers

from gguf_files import write_gguf
from hf_models import make_hf_model
from tidal import gguf_model
from tidal.gguf_model import GgufModelError
from tidal.tokenizer import PromptTokenizer

# llama.cpp's pre-tokenizer regexes for SmolLM2's "smollm" type (llama-vocab.cpp), applied one after the other
LLAMA_CPP_SMOLLM = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]
CORPUS = [
    "In 2024 there were 12,345 cats and 3.14159 dogs.",
    "Year:  2024",  # two spaces before digits: where GPT-2's split alone differs from llama.cpp's
    "x=  42;  7   \n\n  99 bottles",
    "Call 555-0199 or +44 20 7946 0958 before 9:30am",
    "She's sure they'll say I'm fine, don't you think? We'd've.",
    "def f(x):\n    return x ** 2  # 1e-3\n\n\tprint(f(10))",
    "héllo 世界 🎉 naïve café ١٢٣ ²³ Ⅻ",  # non-ASCII letters, Arabic-Indic digits, superscripts, a Roman numeral
    "   leading and trailing   ",
    "The answer is 42.\nThe year 1999 had 365 days, 52 weeks and 1 day.",
]


def split_like_llama_cpp(text: str, patterns: list[str]) -> list[str]:
    """unicode_regex_split: each regex splits every piece the previous ones made, keeping text between matches."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            start = 0
            for match in regex.finditer(pattern, piece):
                if match.start() > start:
                    out.append(piece[start:match.start()])
                out.append(match.group())
                start = match.end()
            if start < len(piece):
                out.append(piece[start:])
        pieces = out
    return pieces


def byte_level(text: str) -> str:
    """GPT-2's bytes-to-unicode mapping of ``text``'s UTF-8 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode("utf-8"))


def llama_cpp_ids(gguf_path: str, texts: list[str]) -> list[list[int]]:
    """llama.cpp's BPE tokenisation: split (LLAMA_CPP_SMOLLM), map bytes, merge each piece with the file's merges."""
    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    return [[i for piece in split_like_llama_cpp(text, LLAMA_CPP_SMOLLM)
             for i in bpe.encode(byte_level(piece), add_special_tokens=False).ids] for text in texts]


def test_the_files_tokenizer_splits_text_as_llama_cpp_does(smollm2_gguf, smollm2_dir):
    expected = llama_cpp_ids(str(smollm2_gguf), CORPUS)
    tokenizer = PromptTokenizer(smollm2_dir, workers=1)
    assert [tokenizer._encode_text(text, add_special_tokens=False) for text in CORPUS] == expected
    # transformers' conversion alone (GPT-2's split, no digits first) gives other ids: the check has teeth
    plain = Tokenizer.from_str(tokenizer._fast.to_str())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert [plain.encode(text, add_special_tokens=False).ids for text in CORPUS] != expected


def test_the_chat_template_and_end_of_turn_come_from_the_file(smollm2_dir):
    tokenizer = PromptTokenizer(smollm2_dir, workers=1)
    ids = tokenizer._encode_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    assert config["eos_token_id"] == tokenizer._fast.token_to_id("<|im_end|>") == 2
    assert config["tie_word_embeddings"] and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)


def fake_ollama_store(root, gguf_path: str, name: str = "smollm2", tag: str = "135m") -> str:
    """Ollama's layout: manifests/registry.ollama.ai/library/NAME/TAG naming blobs/sha256-<digest>."""
    digest = hashlib.sha256(f"{gguf_path}".encode()).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    os.symlink(gguf_path, blobs / f"sha256-{digest}")
    manifest_dir = root / "manifests" / "registry.ollama.ai" / "library" / name
    manifest_dir.mkdir(parents=True, exist_ok=True)
    (manifest_dir / tag).write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]}))
    return str(blobs / f"sha256-{digest}")


def test_an_ollama_name_resolves_to_its_model_blob(tmp_path, monkeypatch, smollm2_gguf):
    blob = fake_ollama_store(tmp_path, str(smollm2_gguf))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    assert gguf_model.is_gguf_model("ollama:smollm2:135m")
    assert gguf_model.find_gguf("ollama:smollm2:135m") == blob
    with pytest.raises(GgufModelError, match="no model smollm2:latest.*ollama pull smollm2:latest"):
        gguf_model.find_gguf("ollama:smollm2")
    with pytest.raises(GgufModelError, match="not an Ollama model name"):
        gguf_model.find_gguf("ollama:../../etc:x")


def test_a_directory_must_hold_exactly_one_gguf(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    assert gguf_model.find_gguf(str(tmp_path)) == str(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(GgufModelError, match="exactly one .gguf file, found 2: a.gguf, b.gguf"):
        gguf_model.find_gguf(str(tmp_path))


def test_metadata_tidal_cannot_serve_is_refused_in_one_line():
    fields = {"general.architecture": "phi3"}
    with pytest.raises(GgufModelError, match="GGUF architecture 'phi3' is not supported; tidal serves llama"):
        gguf_model.config_from_fields(fields, set())
    fields = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4,
              "qwen2.vocab_size": 100}
    with pytest.raises(GgufModelError, match="lacks qwen2.feed_forward_length"):
        gguf_model.config_from_fields(fields, set())


def serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_refusals_at_start_are_one_line_without_a_traceback(tmp_path):
    hf_dir = make_hf_model("qwen2", tmp_path / "hf", hidden_size=64, head_dim=16, intermediate_size=128)
    env = {"TIDAL_GGUF_CACHE": str(tmp_path / "cache")}
    wrong = write_gguf(hf_dir, str(tmp_path / "wrong.gguf"), tensors={
        "blk.1.ffn_up.weight": (__import__("numpy").zeros((100, 64), dtype="float32"), "F32")})
    result = serve("--model", wrong, "--tokenizer", hf_dir, env=env)  # the engine refuses the tensor
    assert result.returncode == 3, result.stderr
    assert "tensor blk.1.ffn_up.weight has shape (100, 64), the metadata implies (128, 64)" in result.stderr
    assert "Traceback" not in result.stderr
    missing = serve("--model", "ollama:nothing-here", env={**env, "OLLAMA_MODELS": str(tmp_path / "ollama")})
    assert missing.returncode == 3 and "Ollama has no model nothing-here:latest" in missing.stderr
    assert "Traceback" not in missing.stderr
    no_tokenizer = serve("--model", str(tmp_path / "wrong.gguf"), env=env)  # a file without tokenizer metadata
    assert no_tokenizer.returncode == 3 and "cannot build the tokenizer of" in no_tokenizer.stderr
    assert "Traceback" not in no_tokenizer.stderr
