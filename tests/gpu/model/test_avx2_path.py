"""The AVX2 path (float32 arithmetic on bf16-stored linear weights) on a bf16 checkpoint: ``--dtype auto``
takes it on a CPU without native bf16 and says why; it generates the float32 model's greedy tokens; a
float32 checkpoint and an explicit ``--dtype float32`` keep float32 weights unless TIDAL_CPU_GEMV=avx2."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

from hf_models import make_hf_model
from tidal.gpu.cpu import features
from tidal.gpu.model import layers
from tidal.gpu.engine import Engine
from tidal.gpu.model.layers import Linear, avx2_linear_ops
from tidal.gpu.model.loader import checkpoint_weight_dtype
from tidal.gpu.model.precision import resolve_precision
from tidal.wire import AddRequest, EngineConfig, SamplingParams

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(avx2_linear_ops("cpu") is None,
                                reason="the AVX2 linear needs a CPU with AVX2+FMA and the C++ kernels built")


@pytest.fixture(scope="module")
def float32_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("llama32"), hidden_size=96, intermediate_size=200)


@pytest.fixture(scope="module")
def bf16_dir(float32_dir, tmp_path_factory):
    """The same model saved as a bf16 checkpoint (as most Hugging Face models are)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("llama_bf16")
    for name in os.listdir(float32_dir):
        if not name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(float32_dir, name), out / name)
    tensors = load_file(os.path.join(float32_dir, "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def linears(engine: Engine) -> list[Linear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, Linear)]


def greedy(engine: Engine, n: int = 48) -> list[int]:
    tokens = [random.Random(0).randrange(10, 8000) for _ in range(30)]
    engine.add_request(AddRequest(1, tokens, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), 0, 0.0))
    generated: list[int] = []
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        generated.extend(t for out in (report.outputs if report else []) for t in out.token_ids)
    return generated


def engine(model_dir: str, dtype: str) -> Engine:
    return Engine(EngineConfig(model=model_dir, dtype=dtype, num_kv_blocks=32, block_size=16))


def test_checkpoint_dtype_is_read_from_the_safetensors_headers(float32_dir, bf16_dir):
    from tidal.gpu.model import tiny_model

    assert checkpoint_weight_dtype(bf16_dir) == torch.bfloat16
    assert checkpoint_weight_dtype(float32_dir) == torch.float32
    assert checkpoint_weight_dtype(tiny_model.asset_dir()) == torch.float32  # tidal-tiny's generated weights


def test_auto_without_native_bf16_keeps_a_bf16_checkpoints_linear_weights_in_bf16(monkeypatch, bf16_dir, float32_dir):
    monkeypatch.delenv("TIDAL_CPU_GEMV", raising=False)
    monkeypatch.setattr(features, "cpu_native_bf16", lambda: None)
    chosen = resolve_precision("auto", CPU, torch.bfloat16)
    assert (chosen.dtype, chosen.linear_weights) == (torch.float32, torch.bfloat16)
    # the reason names the cause: this CPU's missing bf16 units, or TIDAL_CPU_ISA=avx2 acting as such a CPU
    assert "native bf16" in chosen.reason and "float32 is faster" in chosen.reason and "lossless" in chosen.reason
    # a float32 checkpoint stays float32, and so does an explicit --dtype float32
    assert resolve_precision("auto", CPU, torch.float32).linear_weights == torch.float32
    assert resolve_precision("float32", CPU, torch.bfloat16).linear_weights == torch.float32
    # the user's TIDAL_CPU_GEMV: avx2 forces the path, even for --dtype float32 or a float32 checkpoint; 0 turns it off
    monkeypatch.setenv("TIDAL_CPU_GEMV", "avx2")
    for name, checkpoint in (("float32", torch.bfloat16), ("auto", torch.float32)):
        forced = resolve_precision(name, CPU, checkpoint)
        assert (forced.dtype, forced.linear_weights) == (torch.float32, torch.bfloat16), name
        assert "TIDAL_CPU_GEMV=avx2" in forced.reason
    assert "rounded to bf16" in resolve_precision("auto", CPU, torch.float32).reason
    monkeypatch.setattr(layers, "USE_GEMV", False)
    monkeypatch.delenv("TIDAL_CPU_GEMV")
    assert resolve_precision("auto", CPU, torch.bfloat16).linear_weights == torch.float32
    monkeypatch.setattr(layers, "USE_GEMV", True)
    # with native bf16 nothing changes: bf16 throughout
    monkeypatch.setattr(features, "cpu_native_bf16", lambda: "avx512_bf16")
    assert resolve_precision("auto", CPU, torch.bfloat16).linear_weights == torch.bfloat16
    assert resolve_precision("auto", CPU, torch.bfloat16).dtype == torch.bfloat16

    monkeypatch.setattr(features, "cpu_native_bf16", lambda: None)
    auto = engine(bf16_dir, "auto")
    assert auto.runner.dtype == torch.float32 and "linear weights stay bf16" in auto.runner.dtype_reason
    assert all(m.avx2_packed is not None and m.weight is None for m in linears(auto))
    assert auto.runner.model._packed_lm_head.avx2_packed is not None
    assert all(m.avx2_packed is None and m.weight.dtype == torch.float32 for m in linears(engine(float32_dir, "auto")))


def test_forced_avx2_path_generates_the_float32_models_greedy_tokens(monkeypatch, bf16_dir):
    """Same checkpoint: plain float32 against float32 on the weights kept in bf16 (equal values)."""
    monkeypatch.delenv("TIDAL_CPU_GEMV", raising=False)
    plain = engine(bf16_dir, "float32")
    assert all(m.avx2_packed is None for m in linears(plain))
    expected = greedy(plain)
    monkeypatch.setenv("TIDAL_CPU_GEMV", "avx2")
    forced = engine(bf16_dir, "auto")  # on any CPU with AVX2+FMA, native bf16 or not
    assert forced.runner.dtype == torch.float32 and "TIDAL_CPU_GEMV=avx2" in forced.runner.dtype_reason
    assert all(m.avx2_packed is not None for m in linears(forced))
    assert len(expected) == 48 and len(set(expected)) > 1
    assert greedy(forced) == expected
