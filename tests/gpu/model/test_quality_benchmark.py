"""benchmarks/quality.py measures what it says: on tidal-tiny and a short stretch of its text, a row per mode with
bf16 first (agreeing with itself exactly), a quantized mode and a llama.cpp reference that are different models
(their argmaxes and perplexity differ from bf16's), and a group size given with ``@`` that changes the result."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tidal.gpu.model.loader import resolve_model_dir
from tidal.gpu.model.quantization import int_linear_ops

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "quality.py"


def test_each_mode_is_a_row_scored_against_bf16():
    if int_linear_ops("cpu") is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", resolve_model_dir("tidal-tiny"), "--modes",
                           "w4a8,w4a8@128,q4_0", "--tokens", "256", "--window", "128", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("host flags: ") and "256 tokens in windows of 128" in done.stdout
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = {r[0]: r[1:] for r in cells[1:]}  # mode: perplexity, vs bf16, agreement, seconds (past the header)
    assert list(rows) == ["bf16", "w4a8", "w4a8@128", "q4_0"]  # bf16 first: the reference, added when not named
    assert rows["bf16"][1:3] == ["+0.00%", "1.0000"]
    perplexity = {mode: float(row[0]) for mode, row in rows.items()}
    for mode in ("w4a8", "w4a8@128", "q4_0"):
        assert 1.0 < perplexity[mode] and perplexity[mode] != perplexity["bf16"]
        assert 0.0 < float(rows[mode][2]) < 1.0
    assert perplexity["w4a8@128"] != perplexity["w4a8"]


def test_an_unknown_mode_stops_before_any_model_loads():
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", resolve_model_dir("tidal-tiny"), "--modes",
                           "int3", "--tokens", "256"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "unknown mode 'int3'" in done.stderr
