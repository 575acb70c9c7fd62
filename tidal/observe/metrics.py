"""Prometheus metrics (prometheus-client), one registry per server.

Gauges that describe the engine are filled from the engine's latest stats when scraped.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tidal.observe.timeline import HOP_NAMES

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
ABORT_REASONS = ("client_disconnect", "client_cancel", "slow_client", "shutdown", "engine_error")
REJECT_REASONS = ("queue_full", "queue_timeout", "preempted_by_priority", "shutdown")
FINISH_REASONS = ("stop", "length")  # aborted requests are counted in requests_aborted
# tidal:engine_aborts_freed's "steps" label, one per bucket of EngineStats.aborts_freed
ABORT_STEP_LABELS = ("0", "1", "2", "3+")


# (vLLM's name, the tidal gauge attribute it mirrors, help): the gauges the Gateway API Inference
# Extension's endpoint picker scrapes from vLLM (vllm:gpu_cache_usage_perc is vLLM's older name)
VLLM_GAUGES = (
    ("vllm:num_requests_running", "num_requests_running", "Requests running in the engine (tidal:num_requests_running)."),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled (tidal:num_requests_waiting)."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV blocks in use (tidal:kv_cache_usage_perc)."),
    ("vllm:gpu_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV blocks in use (tidal:kv_cache_usage_perc; "
                                                         "vLLM's older name)."),
)


# speculative decoding's counters: (tidal's name, vLLM's name, the EngineStats field, help)
SPEC_COUNTERS = (
    ("tidal:spec_decode_drafts", "vllm:spec_decode_num_drafts", "spec_num_drafts",
     "Speculative proposals verified (one per sequence and step that carried one)."),
    ("tidal:spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens",
     "Speculative tokens proposed and verified."),
    ("tidal:spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens",
     "Speculative tokens the target model accepted."),
)
SPEC_PER_POS = ("tidal:spec_decode_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Speculative tokens accepted, by position in the proposal (0: the first proposed token).")


class BatchedObservations:
    """Observations of one histogram child, counted in plain ints and added to it when /metrics
    is rendered (``flush``).

    For the per-token histogram: prometheus-client's ``observe`` takes two locks and scans the
    buckets one by one, which was a tenth of the frontend's per-token CPU. The bucket is chosen
    the same way (the first upper bound >= the value), so the rendered values are the same.
    Uses the child's bucket and sum values (prometheus-client internals since 0.4); if they are
    not there, it observes each value directly.
    """

    __slots__ = ("_child", "_bounds", "_counts", "_sum", "observe")

    def __init__(self, child) -> None:
        self._child = child
        self._bounds = list(getattr(child, "_upper_bounds", ()))
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        direct = not (self._bounds and hasattr(child, "_buckets") and hasattr(child, "_sum"))
        self.observe = child.observe if direct else self._count

    def _count(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def flush(self) -> None:
        counts, total = self._counts, self._sum
        if total or any(counts):
            self._counts, self._sum = [0] * len(counts), 0.0
            for bucket, count in zip(self._child._buckets, counts):
                if count:
                    bucket.inc(count)
            self._child._sum.inc(total)


class Metrics:
    def __init__(self, model_name: str, num_replicas: int = 1, vllm_names: bool = False):
        self.registry = r = CollectorRegistry()
        self.lora_requests_info: Gauge | None = None  # vllm:lora_requests_info, made at the first render with LoRA on
        labels = ["model_name"]
        self.num_requests_running = Gauge("tidal:num_requests_running",
                                          "Requests scheduled in the engine.", labels, registry=r)
        self.num_requests_waiting = Gauge("tidal:num_requests_waiting",
                                          "Requests admitted and waiting to be scheduled.", labels, registry=r)
        self.kv_cache_usage_perc = Gauge(
            "tidal:kv_cache_usage_perc",
            "Fraction of KV blocks held by live requests (cached blocks no request holds count as free).",
            labels, registry=r)
        self.kv_blocks_used = Gauge("tidal:kv_cache_blocks_used", "KV blocks held by live requests.",
                                    labels, registry=r)
        self.kv_blocks_total = Gauge("tidal:kv_cache_blocks_total", "KV blocks in the cache.", labels,
                                     registry=r)
        # a counter (exposed as tidal:engine_steps_total): it only grows, so rate() gives steps per second
        self.engine_steps = Counter("tidal:engine_steps", "Engine steps run so far.", labels, registry=r)
        self._engine_steps_seen = 0
        # the cancellation guarantee, measured where it is kept (docs/cancellation.md): each abort that
        # freed a live request, by engine steps from its arrival in the engine to the report showing
        # its blocks free; "2" and "3+" stay at 0
        self.engine_aborts_freed = Counter(
            "tidal:engine_aborts_freed", "Aborts that freed a request's KV blocks, by engine steps from the "
            "abort's arrival in the engine to the step report that showed the blocks free.", labels + ["steps"],
            registry=r)
        self._engine_aborts_freed_seen = [0] * len(ABORT_STEP_LABELS)
        self.frontend_requests = Gauge("tidal:frontend_requests_active",
                                       "Requests with state in the frontend.", labels, registry=r)
        # what a client sees (docs/metrics.md): from the request's first byte read to its first content
        # frame handed to the socket, and between the frames handed to the socket
        self.ttft = Histogram("tidal:time_to_first_token_seconds",
                              "First byte of the request read to its first content frame written.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tidal:inter_token_latency_seconds",
                             "Time between consecutive content frames of a request written to the socket.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        # the same two from the frontend's side of the pipe (admission, outputs received from the engine)
        self.first_output = Histogram("tidal:time_to_first_output_seconds",
                                      "Admission to the request's first engine output received.", labels,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_output = Histogram("tidal:inter_output_latency_seconds",
                                      "Time between engine outputs of a request received by the frontend.",
                                      labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.hop = Histogram("tidal:request_hop_seconds",
                             "Time a request spent in each hop from its first byte to its last frame "
                             "(docs/metrics.md, the hop story).", labels + ["hop"], buckets=_HOP_BUCKETS,
                             registry=r)
        self.trace_spans_dropped = Counter(
            "tidal:trace_spans_dropped", "Request spans not exported (--otlp-traces-endpoint): export queue "
            "full or the collector unreachable.", labels, registry=r)
        self.e2e = Histogram("tidal:e2e_request_latency_seconds", "Arrival to the end of the request.", labels,
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("tidal:request_queue_time_seconds", "Arrival to first schedule.", labels,
                                    buckets=_E2E_BUCKETS, registry=r)
        self.aborted = Counter("tidal:requests_aborted", "Requests aborted after admission.",
                               labels + ["reason"], registry=r)
        self.rejected = Counter("tidal:requests_rejected", "Requests refused with a 503.",
                                labels + ["reason"], registry=r)
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens of admitted requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("tidal:generation_tokens", "Tokens generated.", labels, registry=r)
        self.coalesced_chunks = Counter(
            "tidal:stream_coalesced_chunks",
            "Engine outputs merged into another one because the client was behind.", labels, registry=r)
        self.finished = Counter("tidal:requests_finished", "Requests finished, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        # Data-parallel replicas (docs/scaling.md): the gauges above are the whole server's (the sum
        # over serving replicas); these are per replica, labelled replica="0".."N-1".
        rlabels = ["model_name", "replica"]
        self.replicas_live = Gauge("tidal:replicas_live", "Engine replicas serving now.", labels, registry=r)
        self.replica_up = Gauge("tidal:replica_up", "1 while the replica serves, 0 while it is down or restarting.",
                                rlabels, registry=r)
        self.replica_restarts = Gauge("tidal:replica_restarts", "Times the replica was restarted so far.",
                                      rlabels, registry=r)
        self.replica_running = Gauge("tidal:replica_num_requests_running", "Requests running in the replica.",
                                     rlabels, registry=r)
        self.replica_waiting = Gauge("tidal:replica_num_requests_waiting", "Requests waiting in the replica.",
                                     rlabels, registry=r)
        self.replica_kv_usage = Gauge("tidal:replica_kv_cache_usage_perc",
                                      "Fraction of the replica's KV blocks held by live requests.", rlabels,
                                      registry=r)
        self.replica_prefix_hits = Gauge("tidal:replica_prefix_cache_hit_tokens",
                                         "Prompt tokens the replica found in its prefix cache so far.", rlabels,
                                         registry=r)
        self.routed = Counter("tidal:requests_routed", "Requests routed to each replica, by why it was chosen "
                              "(load: least loaded; prefix: it caches the prompt's prefix).",
                              rlabels + ["reason"], registry=r)
        # --vllm-metric-names: the engine gauges again under vLLM's names, for what reads those (the
        # Gateway API Inference Extension's endpoint picker, vLLM's dashboards; docs/scaling.md)
        self.vllm_gauges: list[tuple[Gauge, str]] = []
        if vllm_names:
            for name, attribute, doc in VLLM_GAUGES:
                self.vllm_gauges.append((Gauge(name, doc, labels, registry=r), attribute))
        # speculative decoding (docs/metrics.md): tidal's names, and vLLM's too with --vllm-metric-names;
        # each EngineStats count is cumulative, so each counter adds what is new since the last scrape
        self.spec_counters: list[tuple[list[Counter], str]] = []
        for name, vllm_name, field, doc in SPEC_COUNTERS:
            counters = [Counter(name, doc, labels, registry=r)]
            if vllm_names:
                counters.append(Counter(vllm_name, doc, labels, registry=r))
            self.spec_counters.append(([c.labels(model_name) for c in counters], field))
        name, vllm_name, doc = SPEC_PER_POS
        self.spec_per_pos = [Counter(name, doc, labels + ["position"], registry=r)]
        if vllm_names:
            self.spec_per_pos.append(Counter(vllm_name, doc, labels + ["position"], registry=r))
        self._spec_seen: dict[str, int] = {}
        self._spec_per_pos_seen: list[int] = []
        m = model_name
        for replica in range(num_replicas):
            for reason in ("load", "prefix"):
                self.routed.labels(m, str(replica), reason)
        # Export every known label value from the start (at 0), so the series exist before the
        # first abort or rejection and rate() over them works.
        for reason in ABORT_REASONS:
            self.aborted.labels(m, reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(m, reason)
        for reason in FINISH_REASONS:
            self.finished.labels(m, reason)
        self.ttft_m = BatchedObservations(self.ttft.labels(m))
        self.itl_m = BatchedObservations(self.itl.labels(m))  # one observation per frame written
        self.first_output_m = self.first_output.labels(m)
        self.inter_output_m = BatchedObservations(self.inter_output.labels(m))  # one per engine output
        self.hop_m = {hop: BatchedObservations(self.hop.labels(m, hop)) for hop in HOP_NAMES}
        self.trace_spans_dropped_m = self.trace_spans_dropped.labels(m)
        self._batched = [self.ttft_m, self.itl_m, self.inter_output_m, *self.hop_m.values()]
        self.e2e_m = self.e2e.labels(m)
        self.queue_time_m = self.queue_time.labels(m)
        self.generation_tokens_m = self.generation_tokens.labels(m)
        self.prompt_tokens_m = self.prompt_tokens.labels(m)
        self.coalesced_m = self.coalesced_chunks.labels(m)
        self.engine_steps_m = self.engine_steps.labels(m)
        self.engine_aborts_freed_m = [self.engine_aborts_freed.labels(m, steps) for steps in ABORT_STEP_LABELS]
        self.model_name = m

    def render(self, stats, num_frontend_requests: int, replicas=(), lora=None) -> bytes:
        """``replicas``: (index, serving, stats, num_restarts) of each data-parallel replica; ``lora``: (the
        running requests' adapters, the waiting ones', --max-loras) with LoRA on, else None."""
        for observations in self._batched:
            observations.flush()
        m = self.model_name
        live = 0
        for index, serving, replica_stats, num_restarts in replicas:
            label = str(index)
            live += serving
            self.replica_up.labels(m, label).set(int(serving))
            self.replica_restarts.labels(m, label).set(num_restarts)
            self.replica_running.labels(m, label).set(replica_stats.num_running if serving else 0)
            self.replica_waiting.labels(m, label).set(replica_stats.num_waiting if serving else 0)
            total_blocks = replica_stats.num_total_blocks or 1
            self.replica_kv_usage.labels(m, label).set(replica_stats.num_used_blocks / total_blocks if serving else 0)
            self.replica_prefix_hits.labels(m, label).set(replica_stats.num_prefix_hit_tokens)
        self.replicas_live.labels(m).set(live)
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        total = stats.num_total_blocks or 1
        self.kv_cache_usage_perc.labels(m).set(stats.num_used_blocks / total)
        self.kv_blocks_used.labels(m).set(stats.num_used_blocks)
        self.kv_blocks_total.labels(m).set(stats.num_total_blocks)
        # the engine reports its step count; the counter adds what is new since the last scrape. A
        # restarted replica counts from 0 again: the steps before its first report after it are not seen
        self.engine_steps_m.inc(max(0, stats.step - self._engine_steps_seen))
        self._engine_steps_seen = stats.step
        for i, (counter, count) in enumerate(zip(self.engine_aborts_freed_m, stats.aborts_freed)):
            counter.inc(max(0, count - self._engine_aborts_freed_seen[i]))  # as the steps: a restart counts anew
            self._engine_aborts_freed_seen[i] = count
        self.frontend_requests.labels(m).set(num_frontend_requests)
        if lora is not None:
            self._lora_info(*lora)
        self._render_speculation(stats)
        if self.vllm_gauges:  # the same values as tidal's own gauges just set
            values = {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
                      "kv_cache_usage_perc": stats.num_used_blocks / total}
            for gauge, attribute in self.vllm_gauges:
                gauge.labels(m).set(values[attribute])
        return generate_latest(self.registry)

    def _lora_info(self, running, waiting, max_lora: int) -> None:
        """vLLM's ``vllm:lora_requests_info``: one series whose labels name the adapters of the running and the
        waiting requests (comma-separated) and whose value is when it was taken, as vLLM's; the endpoint picker
        of the Gateway API Inference Extension routes by it."""
        if self.lora_requests_info is None:
            self.lora_requests_info = Gauge(
                "vllm:lora_requests_info", "Running stats on LoRA requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(str(max_lora), ",".join(sorted(waiting)), ",".join(sorted(running))).set(
            time.time())

    def _render_speculation(self, stats) -> None:
        """Add the engine's new speculative-decoding counts (as the steps: a restart counts anew)."""
        m = self.model_name
        seen = self._spec_seen
        for counters, field in self.spec_counters:
            count = getattr(stats, field)
            new = max(0, count - seen.get(field, 0))
            seen[field] = count
            if new:
                for counter in counters:
                    counter.inc(new)
        per_pos, previous = stats.spec_accepted_per_pos, self._spec_per_pos_seen
        previous += [0] * (len(per_pos) - len(previous))
        for position, count in enumerate(per_pos):
            new = max(0, count - previous[position])
            previous[position] = count
            for counter in self.spec_per_pos:
                counter.labels(m, str(position)).inc(new)
