"""benchmarks/quantized_agreement.py measures what it says: run on tidal-tiny for a few steps, its table has a
row per mode and activation dtype, the dense model agrees with itself exactly, and a quantized mode is a
different model (its logits differ). bf16 activations over int8 weights must load on any CPU, also one
without oneDNN bf16 (the dense LM head then stays a plain weight)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tidal.gpu.model.quantization import int_linear_ops

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "quantized_agreement.py"
STEPS = 4


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--models", "tidal-tiny", "--steps", str(STEPS),
                           "--prompts", "2", "--threads", "1", *args], capture_output=True, text=True, timeout=600)


def test_table_has_a_row_per_mode_and_dtype_and_dense_agrees_with_itself():
    if int_linear_ops("cpu") is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")
    done = run("--modes", "dense,int8", "--dtypes", "float32,bfloat16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("host flags: ")
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| tidal-tiny ")]
    # model, max p, distinct, activations, weights, agreement, KL, max diff, free-running
    assert [(r[3], r[4]) for r in rows] == [(dtype, weights) for dtype in ("float32", "bf16")
                                            for weights in ("dense, decode steps", "dense", "int8")]
    assert all(len(r) == 9 for r in rows)
    for r in rows:
        assert 0.0 <= float(r[5]) <= 1.0 and float(r[6]) >= 0.0
        if r[4] == "dense":  # the same weights through the same path: nothing differs, nothing diverges
            assert (r[5], r[6], r[7], r[8]) == ("1.000", "0", "0", f">={STEPS}, >={STEPS} |")
        if r[4] == "int8":  # a different model was compared, not the reference again
            assert float(r[7]) > 0.0 and float(r[6]) > 0.0


def test_an_unknown_mode_stops_the_run_before_loading():
    done = run("--modes", "dense,int3")
    assert done.returncode != 0
    assert "unknown mode 'int3'" in done.stderr and "int8" in done.stderr
