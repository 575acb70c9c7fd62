"""The pure statistics behind ``tidal bench``: per-request timing, percentiles, totals, arrivals.

Nothing here does I/O. A :class:`StreamObserver` is fed each streamed chunk (the object an OpenAI
SSE ``data:`` line or a tidal WebSocket ``chunk`` carries) with the time it arrived, and turns them
into a :class:`RequestRecord`; :func:`summarize` aggregates records into the numbers the report and
the JSON file show. All times are seconds in the records and milliseconds in the summary.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PERCENTILES",
    "RequestRecord",
    "StreamObserver",
    "arrival_offsets",
    "chunk_content",
    "distribution",
    "percentile",
    "summarize",
]

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values_s: list[float]) -> dict[str, float | None]:
    """Mean and the :data:`PERCENTILES` of ``values_s`` (seconds), in milliseconds."""
    values_ms = [v * 1000 for v in values_s]
    stats: dict[str, float | None] = {"mean": sum(values_ms) / len(values_ms) if values_ms else None}
    for q in PERCENTILES:
        stats[f"p{q}"] = percentile(values_ms, q)
    return stats


def chunk_content(data: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries, from either endpoint's format.

    Chat chunks carry ``choices[i].delta.content`` (reasoning models may stream
    ``reasoning_content``/``reasoning`` first: those are generated tokens too); completion chunks
    carry ``choices[i].text``. Role-only and usage-only chunks carry "".
    """
    parts = []
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str):
                    parts.append(delta[key])
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
    return "".join(parts)


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds from the moment the request was sent."""

    success: bool = False
    status: int | None = None  # HTTP status, or the status of a WebSocket/in-stream error
    error_type: str | None = None  # exception class name when no status explains the failure
    error_message: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    elapsed_s: float | None = None  # send to the end of the exchange, failed or not (bounds the server's hops)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None when fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """The per-request entry of the JSON report (milliseconds)."""

        def ms(value: float | None) -> float | None:
            return None if value is None else value * 1000

        return {
            "success": self.success,
            "status": self.status,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "itl_ms": [v * 1000 for v in self.itl_s],
            "e2e_ms": ms(self.e2e_s),
        }


class StreamObserver:
    """Builds a :class:`RequestRecord` from the chunks of one streaming response as they arrive.

    ``start`` and every ``now`` come from the same monotonic clock (``time.perf_counter``).
    ``prompt_tokens`` is the client's own count, used when the server reports no usage.
    """

    def __init__(self, start: float, prompt_tokens: int | None = None) -> None:
        self.start = start
        self.record = RequestRecord(prompt_tokens=prompt_tokens)
        self._content_frames = 0
        self._last_content: float | None = None
        self._usage_output_tokens: int | None = None

    def on_chunk(self, data: dict[str, Any], now: float) -> None:
        """Account for one chunk received at ``now``."""
        if data.get("usage"):
            self.on_usage(data["usage"])
        if not chunk_content(data):
            return  # the role-only first frame and usage-only frames are not tokens
        self._content_frames += 1
        if self._last_content is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self._last_content)
        self._last_content = now

    def on_usage(self, usage: dict[str, Any]) -> None:
        """Take the server's token counts (the final usage chunk, or a WebSocket ``done``)."""
        if isinstance(usage.get("completion_tokens"), int):
            self._usage_output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            self.record.prompt_tokens = usage["prompt_tokens"]

    def succeed(self, now: float, status: int | None = None) -> RequestRecord:
        """The stream ended normally at ``now``."""
        record = self.record
        record.success = True
        record.status = status
        record.e2e_s = now - self.start
        # Servers may put several tokens in one frame; their usage count is the truth.
        record.output_tokens = (
            self._usage_output_tokens if self._usage_output_tokens is not None else self._content_frames
        )
        return record

    def fail(
        self, *, status: int | None = None, error_type: str | None = None, message: str | None = None
    ) -> RequestRecord:
        """The request failed: by ``status`` (HTTP or protocol error) or by ``error_type`` (exception)."""
        record = self.record
        record.success = False
        record.status = status
        record.error_type = error_type
        record.error_message = message
        return record


def arrival_offsets(count: int, rate: float, seed: int | None) -> list[float]:
    """Send times (seconds from start) of ``count`` requests arriving as a Poisson process.

    Gaps are exponential with mean ``1/rate``, so arrivals average ``rate`` per second; the first
    request goes at 0. ``rate=inf`` sends everything at once. The same seed gives the same schedule.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Aggregate results: totals, throughputs, latency distributions (ms) and the error breakdown."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    output_tokens = sum(r.output_tokens or 0 for r in done)
    known_inputs = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    input_tokens = sum(known_inputs) if known_inputs else None

    def per_second(amount: float | None) -> float | None:
        return amount / duration_s if amount is not None and duration_s > 0 else None

    by_status = Counter(str(r.status) for r in failed if r.status is not None and r.error_type is None)
    by_exception = Counter(r.error_type for r in failed if r.error_type is not None)
    return {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(failed),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(None if input_tokens is None else input_tokens + output_tokens),
        "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot_s) is not None]),
        # Gaps are pooled over all requests: every gap is one user-visible stall.
        "itl_ms": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "errors": {"by_status": dict(sorted(by_status.items())), "by_exception": dict(sorted(by_exception.items()))},
    }
