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


def test_a_hops_p99_is_never_past_the_requests_own():
    # 100 requests of 5-12 s (E2E p99 11.9 s); 15 of them stream for 10-12 s, all inside the
    # histogram's wide 10 s - 30 s bucket. Interpolating there alone places the p99 at 28.7 s, past
    # the end of every request; the requests' own times bound it.
    e2e = [5.0 + 7.0 * i / 99 for i in range(100)]
    stream = [t - 0.1 for t in e2e]
    in_10_to_30 = sum(10 < s <= 30 for s in stream)
    buckets = {"5.0": 0, "10.0": 100 - in_10_to_30, "30.0": 100, "+Inf": 100}
    before = HopSnapshot("")
    after = HopSnapshot(scrape("stream", buckets, sum(stream)))
    unbounded = breakdown(before, after)[0]
    assert unbounded["p99_ms"] > 25_000  # what the table showed

    row = breakdown(before, after, e2e)[0]
    assert row["p99_ms"] <= max(e2e) * 1000
    assert row["p99_ms"] <= 11.94 * 1000  # the requests' own p99 (11.93 s)
    assert 10_000 < row["p99_ms"]  # still in the bucket the histogram says
    assert row["mean_ms"] == pytest.approx(sum(stream) / 100 * 1000)


def test_the_longest_request_bounds_a_hop_some_requests_never_reached():
    # 20 of 40 requests reached "stream" (the rest were refused): no quantile of the requests bounds
    # theirs, but none of them lasted longer than the longest request, 3 s
    requests = [0.01] * 20 + [2.0 + i * 0.05 for i in range(20)]
    after = HopSnapshot(scrape("stream", {"1.0": 0, "2.5": 10, "5.0": 20, "+Inf": 20}, 50.0))
    row = breakdown(HopSnapshot(""), after, requests)[0]
    assert row["count"] == 20
    assert 2_500 < row["p99_ms"] <= 2.95 * 1000
    assert quantile(0.99, [(2.5, 10.0), (float("inf"), 20.0)], largest=2.95) == pytest.approx(2.5 + 0.45 * 0.98)
