"""``tidal bench``'s hop table from two scrapes of /metrics: only the run's requests, quantiles as
Prometheus' histogram_quantile computes them."""

from __future__ import annotations

import pytest

from tidal.tools.hop_breakdown import HopSnapshot, breakdown, format_breakdown, quantile


def scrape(hop: str, buckets: dict[str, float], total: float) -> str:
    lines = [f'tidal:request_hop_seconds_bucket{{hop="{hop}",le="{le}",model_name="m"}} {n}'
             for le, n in buckets.items()]
    count = buckets["+Inf"]
    lines += [f'tidal:request_hop_seconds_count{{hop="{hop}",model_name="m"}} {count}',
              f'tidal:request_hop_seconds_sum{{hop="{hop}",model_name="m"}} {total}']
    return "\n".join(lines)


def test_quantile_interpolates_within_the_bucket():
    buckets = [(0.001, 0.0), (0.002, 10.0), (0.004, 20.0), (float("inf"), 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.002)
    assert quantile(0.25, buckets) == pytest.approx(0.0015)
    assert quantile(0.75, buckets) == pytest.approx(0.003)
    assert quantile(0.5, []) is None


def test_breakdown_counts_only_the_run_and_marks_the_engines_hops():
    before = HopSnapshot(scrape("prefill", {"0.01": 5, "0.1": 5, "+Inf": 5}, 0.02))
    after = HopSnapshot(scrape("prefill", {"0.01": 5, "0.1": 15, "+Inf": 15}, 0.52) + "\n"
                        + scrape("parse", {"0.01": 10, "0.1": 10, "+Inf": 10}, 0.01))
    rows = breakdown(before, after)
    assert [r["hop"] for r in rows] == ["parse", "prefill"]  # hop order, not scrape order
    prefill = rows[1]
    assert prefill["count"] == 10 and prefill["mean_ms"] == pytest.approx(50.0)
    assert 10 < prefill["p50_ms"] <= prefill["p99_ms"] <= 100
    assert prefill["engine"] and not rows[0]["engine"]
    table = format_breakdown(rows)
    assert "prefill *" in table and "parse " in table
