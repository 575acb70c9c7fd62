"""TIDAL_CPU_ISA=avx2: one host runs what a CPU with AVX2 and no AVX-512 runs (precision, build flags, tiles).
test_linear_int_a8.py runs the held library itself and compares its integer tiles with the native ones."""

from __future__ import annotations

import logging

import torch

from tidal.gpu.cpu import features, kernels
from tidal.gpu.model.precision import resolve_precision


def test_the_hold_builds_without_avx512_and_reports_no_native_bf16(monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx2")
    isa, flags = kernels._compile_flags()
    assert features.cpu_native_bf16() is None
    assert not any(flag.startswith("-mavx512") for flag in flags)
    if "avx2" in open("/proc/cpuinfo").read().split():
        assert isa == "avx2" and {"-mavx2", "-mfma"} <= set(flags)
    precision = resolve_precision("auto", torch.device("cpu"), torch.bfloat16)
    assert precision.dtype == torch.float32 and "TIDAL_CPU_ISA=avx2" in precision.reason


def test_an_unknown_hold_is_ignored_with_one_warning(monkeypatch, caplog):
    monkeypatch.delenv("TIDAL_CPU_ISA", raising=False)
    native = kernels._compile_flags()
    monkeypatch.setenv("TIDAL_CPU_ISA", "avx512")
    features._ignored.cache_clear()
    with caplog.at_level(logging.WARNING, logger="tidal.gpu.cpu.features"):
        assert kernels._compile_flags() == native
        assert features.cpu_native_bf16() == features.cpu_native_bf16()
    assert caplog.text.count("TIDAL_CPU_ISA=avx512 ignored") == 1
