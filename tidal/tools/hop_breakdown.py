"""Where the benchmark's requests spent their time, hop by hop, from the server's own /metrics.

``tidal bench`` scrapes ``tidal:request_hop_seconds`` before and after its run; the difference is
the run's requests alone. Each hop's mean is its sum over its count; p50 and p99 are interpolated
within the histogram's buckets, as Prometheus' ``histogram_quantile`` does, so they are as fine as
the buckets (docs/metrics.md). A bucket can be wide (10 s to 30 s), and interpolating in it places
values toward its top whatever they were: ``stream`` p99 28.7 s for requests whose own p99 was
11.6 s. The bench knows how long each request took, and no hop outlasts its request, so those times
bound the interpolation (see ``breakdown``). Hops the engine process spends are marked: they are the
engine's critical path; the rest are the frontend's and the pipes'.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from tidal.observe.timeline import ENGINE_HOPS, HOP_NAMES
from tidal.tools.bench_metrics import percentile

_LINE = re.compile(r'^tidal:request_hop_seconds_(bucket|sum|count)\{([^}]*)\}\s+(\S+)$')
_SPEC_LINE = re.compile(r"^tidal:spec_decode_(draft_tokens|accepted_tokens)_total(?:\{[^}]*\})? (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class HopSnapshot:
    """One scrape of the hop histograms: per hop, cumulative bucket counts by upper bound, sum, count."""

    def __init__(self, text: str):
        self.buckets: dict[str, dict[float, float]] = defaultdict(dict)
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)
        for line in text.splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            kind, labels, value = m.group(1), dict(_LABEL.findall(m.group(2))), float(m.group(3))
            hop = labels.get("hop")
            if hop is None:
                continue
            if kind == "bucket":
                bound = math.inf if labels["le"] == "+Inf" else float(labels["le"])
                self.buckets[hop][bound] = self.buckets[hop].get(bound, 0.0) + value
            elif kind == "sum":
                self.sums[hop] += value
            else:
                self.counts[hop] += value

        # speculative decoding's counters (tidal:spec_decode_*_total), summed over their labels
        self.spec: dict[str, float] = defaultdict(float)
        for name, value in _SPEC_LINE.findall(text):
            self.spec[name] += float(value)

    @property
    def empty(self) -> bool:
        return not self.counts


def quantile(q: float, buckets: list[tuple[float, float]], largest: float | None = None) -> float | None:
    """``histogram_quantile``: q in 0..1 over cumulative (upper bound, count) pairs, sorted by bound.
    ``largest``, when known, is no observation's less: it stands for the top of the bucket that holds it."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            top = bound if largest is None or largest <= lower else min(bound, largest)
            if math.isinf(top):
                return lower  # in the overflow bucket: the highest finite bound is all that is known
            inside = count - below
            return lower + (top - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, count
    return lower


def breakdown(before: HopSnapshot, after: HopSnapshot, request_seconds: list[float] | None = None) -> list[dict]:
    """One row per hop the run's requests reached, in hop order: mean, p50, p99 in ms, how many.

    ``request_seconds``: how long each of the run's requests took as its client timed it, send to last
    byte (the server's own span of it lies inside, to within the moment between its last write and the
    client's read). No hop lasts longer than the longest request, which bounds the interpolation; and
    where every request went through a hop (the hop's count is theirs), its q-th quantile is at most
    theirs: each request's hop is at most the request, so the sorted hops lie under the sorted requests.
    """
    longest = max(request_seconds) if request_seconds else None
    rows = []
    for hop in HOP_NAMES:
        count = after.counts.get(hop, 0.0) - before.counts.get(hop, 0.0)
        if count <= 0:
            continue
        total = after.sums.get(hop, 0.0) - before.sums.get(hop, 0.0)
        earlier = before.buckets.get(hop, {})
        buckets = sorted((bound, n - earlier.get(bound, 0.0)) for bound, n in after.buckets[hop].items())
        p50, p99 = quantile(0.5, buckets, longest), quantile(0.99, buckets, longest)
        if request_seconds and int(count) == len(request_seconds):
            p50 = _at_most(p50, percentile(request_seconds, 50))
            p99 = _at_most(p99, percentile(request_seconds, 99))
        rows.append({"hop": hop, "count": int(count), "mean_ms": total / count * 1000,
                     "p50_ms": None if p50 is None else p50 * 1000, "p99_ms": None if p99 is None else p99 * 1000,
                     "engine": hop in ENGINE_HOPS})
    return rows


def _at_most(value: float | None, bound: float | None) -> float | None:
    return value if value is None or bound is None else min(value, bound)


def format_breakdown(rows: list[dict], width: int = 60) -> str:
    """The hop table ``tidal bench`` prints under its summary."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:,.3f}"

    lines = [" where the time went (server hops) ".center(width, "-"),
             f"{'hop (ms)':<14}{'mean':>11}{'p50':>11}{'p99':>11}{'requests':>10}"]
    for row in rows:
        mark = " *" if row["engine"] else ""
        lines.append(f"{row['hop'] + mark:<14}{num(row['mean_ms']):>11}{num(row['p50_ms']):>11}"
                     f"{num(row['p99_ms']):>11}{row['count']:>10}")
    to_first = sum(r["mean_ms"] for r in rows if r["hop"] not in ("stream", "end"))
    lines.append(f"{'to 1st frame':<14}{num(to_first):>11}   (sum of the means: the server's TTFT)")
    lines.append("* the engine's critical path (its step loop); the rest is the frontend's and the pipes'")
    lines.append("  p50/p99 are interpolated within the histogram's buckets, bounded by the requests' own times")
    return "\n".join(lines)
