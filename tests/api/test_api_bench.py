"""``tidal bench`` as a user runs it (``python -m tidal bench ...``) against live servers.

What it reports must agree with what the server counted: every request it calls completed
generated exactly ``--output-len`` tokens (``--ignore-eos``), the server's
``tidal:generation_tokens_total`` grew by the bench's total output tokens, and every prompt was
``--input-len`` tokens as the server counted it (chat template included).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from .support import API_KEY, SERVED_MODEL

NUM_PROMPTS, CONCURRENCY, OUTPUT_LEN = 8, 4, 16


def run_bench(server, tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "tidal", "bench", "--base-url", server.url,
               "--num-prompts", str(NUM_PROMPTS), "--concurrency", str(CONCURRENCY),
               "--input-len", "16", "--output-len", str(OUTPUT_LEN), "--ignore-eos",
               "--json", str(out), "--no-progress", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    return result, (json.loads(out.read_text()) if out.exists() else None)


def assert_stats(stats: dict, *, positive: bool) -> None:
    assert set(stats) >= {"mean", "p50", "p90", "p99"}, stats
    for value in stats.values():
        assert isinstance(value, float) and math.isfinite(value), stats
        assert value > 0 if positive else value >= 0, stats
    assert stats["p50"] <= stats["p90"] <= stats["p99"], stats


@pytest.mark.parametrize("endpoint", ["chat", "completions", "ws"])
def test_bench_agrees_with_the_server(request, tmp_path, endpoint):
    # chat and completions go through the API-key server; ws through the slow-step one
    # (whose 3 running + 1 queued slots hold --concurrency 4 without a 503).
    server = request.getfixturevalue("ws_server" if endpoint == "ws" else "api_server")
    extra = [] if endpoint == "ws" else ["--api-key", API_KEY]
    before = server.wait_idle()
    result, report = run_bench(server, tmp_path, "--endpoint", endpoint, *extra)
    assert result.returncode == 0, result.stderr
    after = server.wait_idle()

    assert " tidal bench " in result.stdout and "Successful requests:" in result.stdout
    for label in ("TTFT", "TPOT", "ITL", "E2E"):
        assert f"\n{label} " in result.stdout
    assert report["model"] == (SERVED_MODEL if endpoint != "ws" else "tidal-tiny")
    assert report["config"]["endpoint"] == endpoint
    assert (report["completed"], report["failed"]) == (NUM_PROMPTS, 0), report["errors"]
    assert report["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    generated = after["tidal:generation_tokens_total"] - before["tidal:generation_tokens_total"]
    assert generated == report["total_output_tokens"]
    assert report["total_input_tokens"] == after["tidal:prompt_tokens_total"] - before["tidal:prompt_tokens_total"]
    # --input-len counts tokens of the served model's tokenizer (found by its name), not words, as the
    # server counts them: the chat template's tokens (or the completion's BOS) are part of the 16
    assert report["config"]["tokenizer"].endswith("tidal-tiny/tokenizer.json")
    assert report["total_input_tokens"] == NUM_PROMPTS * 16
    assert {record["prompt_tokens"] for record in report["requests"]} == {16}
    assert report["prompt_overhead_tokens"] == (1 if endpoint == "completions" else 7)
    assert "Input tokens per request:" in result.stdout
    assert report["duration_s"] > 0 and report["output_throughput"] > 0
    assert_stats(report["ttft_ms"], positive=True)
    assert_stats(report["e2e_ms"], positive=True)
    assert_stats(report["tpot_ms"], positive=False)
    assert_stats(report["itl_ms"], positive=False)
    assert len(report["requests"]) == NUM_PROMPTS
    for record in report["requests"]:
        assert record["success"] and record["output_tokens"] == OUTPUT_LEN
        assert 0 < record["ttft_ms"] <= record["e2e_ms"]
        # one gap per content frame after the first, all within the request: first content to last
        assert len(record["itl_ms"]) <= OUTPUT_LEN - 1
        assert record["ttft_ms"] + sum(record["itl_ms"]) <= record["e2e_ms"] + 1e-6
    # the server's hop breakdown of this run: every request through every hop to its first frame
    assert "where the time went" in result.stdout and "prefill *" in result.stdout
    hops = {row["hop"]: row for row in report["hops"]}
    for hop in ("parse", "tokenize", "admit", "engine_queue", "prefill", "report_out", "deliver", "first_frame",
                "stream"):
        assert hops[hop]["count"] == NUM_PROMPTS, hop
        assert hops[hop]["mean_ms"] >= 0 and hops[hop]["p50_ms"] <= hops[hop]["p99_ms"]
    assert {hop for hop, row in hops.items() if row["engine"]} == {"engine_queue", "prefill", "report_out"}
    # a hop is part of its request: its p99 is never past the requests' own
    assert all(row["p99_ms"] <= report["e2e_ms"]["p99"] * (1 + 1e-9) for row in hops.values())


def test_bench_without_the_api_key_fails_cleanly(api_server, tmp_path):
    result, report = run_bench(api_server, tmp_path)
    assert result.returncode == 1 and report is None
    assert "cannot list models" in result.stderr and "401" in result.stderr
    assert "Traceback" not in result.stderr
