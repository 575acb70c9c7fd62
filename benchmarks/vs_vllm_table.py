"""The rounds of ``benchmarks/vs_vllm.sh`` as one table: each round's tok/s and ratio, and the median ratio.

    python benchmarks/vs_vllm_table.py vs_vllm.jsonl

Rows of the same model and concurrency are paired in file order (round k's vLLM with round k's tidal),
so the ratio of a round compares two servers measured minutes apart, never across rounds. The lowest
ratio is the one to hold against a target: a median of two rounds is their mean.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    runs: dict[tuple[str, int], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    with open(path) as lines:
        for line in lines:
            if line.strip():
                row = json.loads(line)
                side = "tidal" if row["name"].startswith("tidal") else "vllm"
                runs[(row["model"], row["conc"])][side].append(row)
    print("| model, concurrency | vLLM tok/s by round | tidal tok/s by round | ratio by round | **median ratio** |"
          " lowest ratio | TPOT p50 ms vLLM / tidal (medians) |")
    print("|---|---|---|---|---:|---:|---|")
    for (model, conc), sides in sorted(runs.items(), key=lambda kv: (kv[0][0] != "tiny", kv[0][1])):
        pairs = list(zip(sides["vllm"], sides["tidal"]))
        if not pairs:
            continue
        ratios = [t["tok_s"] / v["tok_s"] for v, t in pairs]
        tpot = (f"{statistics.median(v['tpot_p50'] for v, _ in pairs):.2f} / "
                f"{statistics.median(t['tpot_p50'] for _, t in pairs):.2f}")
        vllm = ", ".join(f"{v['tok_s']:.1f}" for v, _ in pairs)
        tidal = ", ".join(f"{t['tok_s']:.1f}" for _, t in pairs)
        by_round = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {model}, c={conc} | {vllm} | {tidal} | {by_round} "
              f"| **{statistics.median(ratios):.2f}** | {min(ratios):.2f} | {tpot} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vs_vllm.jsonl")
