"""benchmarks/vs_vllm_table.py pairs each round's vLLM row with the same round's tidal row (never across
rounds) and reports the lowest ratio, the one a target is held against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_vllm_table.py"


def row(name: str, model: str, conc: int, tok_s: float, tpot: float) -> str:
    return json.dumps({"name": name, "model": model, "conc": conc, "tok_s": tok_s, "tpot_p50": tpot})


def test_rounds_pair_in_file_order_and_the_lowest_ratio_is_reported(tmp_path):
    lines = [  # round 1 then round 2, small before tiny in the file: the table puts tiny first
        row("vllm-bfloat16", "small", 16, 600.0, 20.0), row("tidal", "small", 16, 900.0, 15.0),
        row("vllm-bfloat16", "tiny", 1, 400.0, 2.0), row("tidal", "tiny", 1, 1200.0, 0.8),
        row("vllm-bfloat16", "small", 16, 800.0, 22.0), row("tidal", "small", 16, 880.0, 14.0),
        row("vllm-bfloat16", "tiny", 1, 500.0, 2.2), row("tidal", "tiny", 1, 1000.0, 0.9),
    ]
    path = tmp_path / "rounds.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True).stdout
    table = [line for line in out.splitlines() if line.startswith("| ") and "c=" in line]
    assert table[0].startswith("| tiny, c=1 ") and table[1].startswith("| small, c=16 ")
    # tiny: 1200/400 = 3.00 and 1000/500 = 2.00 -> median 2.50, lowest 2.00
    assert "| 3.00, 2.00 | **2.50** | 2.00 | 2.10 / 0.85 |" in table[0]
    # small: 900/600 = 1.50 and 880/800 = 1.10 (never 900/800 or 880/600)
    assert "| 1.50, 1.10 | **1.30** | 1.10 | 21.00 / 14.50 |" in table[1]
