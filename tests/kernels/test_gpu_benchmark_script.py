from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_gpu.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_gpu_benchmark_exits_cleanly_without_cuda():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_gpu_decode_benchmark_exits_cleanly_without_cuda():
    script = SCRIPT.parent / "gpu_decode.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite runs everything")
def test_gpu_suite_exits_cleanly_without_cuda(tmp_path):
    suite = SCRIPT.parent / "gpu_suite.sh"
    result = subprocess.run(["bash", str(suite)], capture_output=True, text=True, timeout=120,
                            cwd=SCRIPT.parents[1], env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    assert "CUDA is not available" in (tmp_path / "summary.txt").read_text()
