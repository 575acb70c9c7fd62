"""``GET /state``: the server's state as one small JSON object, for the chat page's live panel.

Read from the objects the server already keeps (the engine's latest stats, the frontend's
registry, the Prometheus counters), never from /metrics text. "Aborted in the last minute"
needs history the counters do not keep, so ``sample`` takes a snapshot of the abort and
rejection counters every second and ``snapshot`` subtracts the one from a minute ago.
"""

from __future__ import annotations

from collections import deque

import trio

from tidal.observe.metrics import ABORT_REASONS, REJECT_REASONS, Metrics

WINDOW_SECONDS = 60.0
SAMPLE_INTERVAL = 1.0


class ServerState:
    def __init__(self, metrics: Metrics, engine_stats, frontend_requests):
        """``engine_stats()`` -> the latest ``EngineStats``; ``frontend_requests()`` -> requests in the frontend."""
        self.metrics = metrics
        self.engine_stats = engine_stats
        self.frontend_requests = frontend_requests
        # (time, aborted counts, rejected counts), oldest first; the first one is the window's base
        self._samples: deque[tuple[float, dict[str, float], dict[str, float]]] = deque()

    def _counts(self, counter, reasons: tuple[str, ...]) -> dict[str, float]:
        # One counter's own samples: the registry's get_sample_value would collect every metric
        # (histograms included) once per reason, which was a tenth of an idle frontend's CPU.
        counts = dict.fromkeys(reasons, 0.0)
        model = self.metrics.model_name
        for family in counter.collect():
            for sample in family.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and labels.get("model_name") == model and labels["reason"] in counts:
                    counts[labels["reason"]] = sample.value
        return counts

    def _now_counts(self) -> tuple[dict[str, float], dict[str, float]]:
        return (self._counts(self.metrics.aborted, ABORT_REASONS),
                self._counts(self.metrics.rejected, REJECT_REASONS))

    def take_sample(self) -> None:
        now = trio.current_time()
        self._samples.append((now, *self._now_counts()))
        # keep one sample at or before the window's start: it is what "a minute ago" subtracts
        while len(self._samples) > 1 and self._samples[1][0] <= now - WINDOW_SECONDS:
            self._samples.popleft()

    async def sample(self) -> None:
        """Run for the server's lifetime (a background task)."""
        while True:
            self.take_sample()
            await trio.sleep(SAMPLE_INTERVAL)

    def snapshot(self) -> dict:
        stats = self.engine_stats()
        aborted, rejected = self._now_counts()
        base_aborted, base_rejected = (self._samples[0][1], self._samples[0][2]) if self._samples else ({}, {})
        total = stats.num_total_blocks
        return {
            "model": self.metrics.model_name,
            "requests_running": stats.num_running,
            "requests_waiting": stats.num_waiting,
            "frontend_requests": self.frontend_requests(),
            "kv_blocks_used": stats.num_used_blocks,
            "kv_blocks_total": total,
            "kv_usage": stats.num_used_blocks / total if total else 0.0,
            "engine_steps": stats.step,
            "window_seconds": WINDOW_SECONDS,
            "aborted_last_minute": _since(aborted, base_aborted),
            "rejected_last_minute": _since(rejected, base_rejected),
        }


def _since(now: dict[str, float], base: dict[str, float]) -> dict[str, int]:
    return {reason: int(count - base.get(reason, 0.0)) for reason, count in now.items()}
