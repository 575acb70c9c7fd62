"""The first start's CPU kernel build is announced as progress (start and done, at INFO); later starts
stay quiet."""

from __future__ import annotations

import logging

import pytest
from torch.utils import cpp_extension

from tidal.gpu.cpu import kernels as cpu_kernels


@pytest.fixture
def kernel():
    """The kernel, built or loaded from the cache once in this process (as conftest.py does)."""
    kernel = cpu_kernels.load_decode_kernel()
    if kernel is None:
        pytest.skip("the CPU kernel cannot be built here (no compiler)")
    return kernel


def test_a_build_logs_when_it_starts_and_when_it_is_done(kernel, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: this start must build
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)  # the op is already registered
    with caplog.at_level(logging.INFO, logger="tidal.gpu.cpu.kernels"):
        assert cpu_kernels._load() is not None
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("building the CPU kernels (first start only")
    assert messages[1].startswith("CPU kernels built in ")
    assert "paged_decode.cpp" in messages[0] and str(tmp_path) in messages[0]  # what is built, and where
    assert {record.levelno for record in caplog.records} == {logging.INFO}  # progress, not a fault


def test_a_cached_build_loads_without_a_warning(kernel, caplog):
    with caplog.at_level(logging.WARNING, logger="tidal.gpu.cpu.kernels"):
        assert cpu_kernels._load() is not None
    assert caplog.records == []
