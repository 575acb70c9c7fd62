from __future__ import annotations

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
