"""Request spans over OTLP/HTTP and the hop histograms, against a real server and a real collector.

The collector is a tiny HTTP server in this module that decodes each POST with opentelemetry-proto
(the OTLP protobuf): what a Jaeger or an OpenTelemetry Collector would receive. The server runs
``--otlp-traces-endpoint`` pointing at it, with steps of at least 5 ms so a stream lasts long
enough to cancel or to fall behind.

Rules for determinism: every wait is a poll with a deadline; spans are matched by the trace id
this test sent, never by arrival order. The "collector down" test runs last (it stops the collector).
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest

from live_server import LiveServer, free_port

pytest.importorskip("opentelemetry.proto")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from tidal.observe.timeline import HOP_NAMES  # noqa: E402

STEP = 0.005


class Collector:
    """An OTLP/HTTP trace receiver: every span it got, decoded."""

    def __init__(self):
        self.port = free_port()
        self.spans: list = []
        self.lock = threading.Lock()
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with collector.lock:
                    for resource_spans in request.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            collector.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def trace(self, trace_id: bytes, timeout: float = 15.0) -> tuple[object, list]:
        """The request span of ``trace_id`` and its children, once all have arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            roots = [s for s in spans if s.name.startswith(("chat ", "text_completion "))]
            if roots and len(spans) - 1 >= 1 and all(c.parent_span_id == roots[0].span_id
                                                     for c in spans if c is not roots[0]):
                children = [s for s in spans if s is not roots[0]]
                if len(children) == _num_hops(roots[0]):
                    return roots[0], sorted(children, key=lambda s: s.start_time_unix_nano)
            time.sleep(0.05)
        raise AssertionError(f"no complete trace {trace_id.hex()} within {timeout} s")


def _num_hops(root) -> int:
    return int(span_attributes(root).get("tidal.num_hops", -1))


def span_attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


def _traceparent() -> tuple[bytes, bytes, str]:
    trace_id, parent_id = os.urandom(16), os.urandom(8)
    return trace_id, parent_id, f"00-{trace_id.hex()}-{parent_id.hex()}-01"


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def server(collector):
    with LiveServer("--otlp-traces-endpoint", collector.url, "--min-step-time", str(STEP), "--no-ui") as s:
        yield s


def test_a_streamed_request_is_one_span_under_the_callers_trace_with_its_hops_in_order(server, collector):
    trace_id, parent_id, traceparent = _traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    stream = client.chat.completions.create(model="tidal-tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            extra_headers={"traceparent": traceparent})
    chunks = [c for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    root, hops = collector.trace(trace_id)
    assert root.parent_span_id == parent_id, "the request span is a child of the caller's span"
    attributes = span_attributes(root)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "tidal-tiny"
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    names = [h.name for h in hops]
    assert names == [n for n in HOP_NAMES if n in names], "hops in the order the request went through them"
    assert names[0] == "parse" and names[-1] == "stream"
    for hop in ("pipe_in", "engine_queue", "prefill", "report_out", "pipe_out", "deliver", "first_frame"):
        assert hop in names
    for earlier, later in zip(hops, hops[1:]):
        assert earlier.end_time_unix_nano == later.start_time_unix_nano, "contiguous"
    assert hops[0].start_time_unix_nano == root.start_time_unix_nano
    assert hops[-1].end_time_unix_nano == root.end_time_unix_nano, "the hops add up to the request's duration"
    prefill = next(h for h in hops if h.name == "prefill")
    assert [e.name for e in prefill.events] == ["prefill_chunk"]


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ("/v1/messages", {"model": "tidal-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
])
def test_responses_and_messages_keep_the_callers_trace_and_start_the_clock_at_the_first_byte(server, collector,
                                                                                              path, body):
    trace_id, parent_id, traceparent = _traceparent()
    answer = httpx.post(server.url + path, json=body, headers={"traceparent": traceparent}, timeout=30)
    assert answer.status_code == 200, answer.text
    root, hops = collector.trace(trace_id)
    assert root.parent_span_id == parent_id  # before: a new trace of its own
    assert hops[0].name == "parse" and hops[0].start_time_unix_nano == root.start_time_unix_nano


def test_a_tool_call_answer_is_traced_with_the_finish_reason_its_client_got(server, collector):
    trace_id, _, traceparent = _traceparent()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}}}
    out = client.chat.completions.create(model="tidal-tiny", messages=[{"role": "user", "content": "Time?"}],
                                         tools=[tool], tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         temperature=1.0, seed=0, max_tokens=100,
                                         extra_headers={"traceparent": traceparent})
    assert out.choices[0].finish_reason == "tool_calls"  # the engine said "stop"; the answer is calls
    root, _ = collector.trace(trace_id)
    attributes = span_attributes(root)
    assert attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert attributes["gen_ai.usage.output_tokens"] == out.usage.completion_tokens


def test_a_malformed_traceparent_is_ignored(server, collector):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                          headers={"traceparent": "00-not-a-trace-zz"}, timeout=30)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2


def test_a_cancelled_request_ends_its_span_with_the_abort_reason(server, collector):
    trace_id, _, traceparent = _traceparent()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"traceparent": traceparent}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one frame, then the client leaves
    root, hops = collector.trace(trace_id)
    assert root.status.code == 2  # STATUS_CODE_ERROR
    assert root.status.message == "client_disconnect"
    assert span_attributes(root)["tidal.abort_reason"] == "client_disconnect"
    assert span_attributes(root)["gen_ai.response.finish_reasons"] == ["abort"]
    assert hops[-1].name == "stream"


def test_a_slow_client_shows_its_coalescing(server, collector):
    trace_id, _, traceparent = _traceparent()
    body = json.dumps({"prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}).encode()
    before = server.metrics()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a small window: the server's buffer fills
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"traceparent: " + traceparent.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    # the client reads nothing until the engine has generated everything: the socket buffers fill
    # (a 2 KiB window) and the mailbox merges what the engine keeps producing
    # (until 50 more engine outputs arrived than frames were written, well within --stream-stall-timeout)
    m0 = before
    server.wait_for(lambda m: (m["tidal:inter_output_latency_seconds_count"] - m0["tidal:inter_output_latency_seconds_count"])
                    - (m["tidal:inter_token_latency_seconds_count"] - m0["tidal:inter_token_latency_seconds_count"]) >= 50,
                    timeout=25, interval=0.2)
    sock.settimeout(60)
    data = b""
    while b"[DONE]" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk
        data += chunk
    sock.close()
    root, _ = collector.trace(trace_id)
    attributes = span_attributes(root)
    assert attributes["tidal.coalesced_outputs"] > 0 and attributes["tidal.max_backlog"] > 1, attributes
    assert attributes["tidal.frames"] < 1500  # fewer frames than tokens: the client got merged deltas


def test_hop_histograms_exist_and_move(server):
    before = server.wait_idle()
    response = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
    assert response.status_code == 200
    after = server.wait_idle()
    for hop in ("parse", "tokenize", "admit", "pipe_in", "engine_queue", "prefill", "report_out", "pipe_out",
                "deliver", "first_frame", "stream"):
        key = f'tidal:request_hop_seconds_count{{hop="{hop}",model_name="tidal-tiny"}}'
        assert after[key] == before[key] + 1, hop
    assert after["tidal:time_to_first_token_seconds_count"] == before["tidal:time_to_first_token_seconds_count"] + 1
    assert after["tidal:inter_token_latency_seconds_count"] >= before["tidal:inter_token_latency_seconds_count"] + 1


async def test_a_websocket_request_is_traced_from_its_message_and_its_done_carries_its_hops(server, collector):
    import trio_websocket

    trace_id, parent_id, traceparent = _traceparent()
    url = f"ws://127.0.0.1:{server.port}/v1/ws"
    async with trio_websocket.open_websocket_url(url) as ws:
        await ws.send_message(json.dumps({"type": "request", "id": 1, "endpoint": "chat.completions",
                                          "traceparent": traceparent,
                                          "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}))
        while True:
            message = json.loads(await ws.get_message())
            if message["type"] != "chunk":
                break
    assert message["type"] == "done", message
    hops = message["hops"]  # what the chat page draws: the hops in order, ms
    names = [name for name, _ in hops]
    assert names[0] == "parse" and names[-1] == "stream" and "prefill" in names
    root, spans = collector.trace(trace_id)
    assert root.parent_span_id == parent_id
    assert [s.name for s in spans] == names
    # each hop the page draws is its exported span's duration (both rounded to us)
    for (name, ms), span in zip(hops, spans):
        assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6 - ms) < 0.002, (name, ms)
    duration_ms = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e6
    assert abs(sum(ms for _, ms in hops) - duration_ms) < 0.05  # the same clock, rounded to us


def test_collector_down_costs_no_request_anything_but_counted_drops(server, collector):
    collector.stop()
    dropped0 = server.metrics()["tidal:trace_spans_dropped_total"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    for _ in range(3):
        started = time.monotonic()
        out = client.completions.create(model="tidal-tiny", prompt="Hello", max_tokens=4)
        assert out.usage.completion_tokens == 4
        assert time.monotonic() - started < 5, "a request waited on the dead collector"
    server.wait_for(lambda m: m["tidal:trace_spans_dropped_total"] > dropped0, timeout=30)


def test_a_collector_that_answers_without_end_costs_a_bounded_read():
    """A hostile collector's endless answer: the exporter keeps at most 64 KiB of it and moves on."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider

    from tidal.observe.otel import EXPORT_TIMEOUT_S, MAX_COLLECTOR_ANSWER_BYTES, BoundedAnswers

    listener = socket.create_server(("127.0.0.1", 0))
    sent = [0]

    def answer_forever() -> None:
        conn, _ = listener.accept()
        conn.recv(1 << 16)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n")
        chunk = b"\0" * (1 << 16)
        try:
            while sent[0] < 1 << 30:
                conn.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass  # the exporter closed the connection
        conn.close()

    threading.Thread(target=answer_forever, daemon=True).start()
    session = BoundedAnswers()
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces",
                                timeout=EXPORT_TIMEOUT_S, session=session)
    span = TracerProvider().get_tracer("t").start_span("request")
    span.end()
    started = time.monotonic()
    exporter.export([span])
    took = time.monotonic() - started
    response_bytes = sent[0]
    listener.close()
    print(f"an endless answer: export returned after {took:.2f} s; the collector got {response_bytes >> 20} MiB out")
    assert took < EXPORT_TIMEOUT_S * 2 + 2
    assert response_bytes < 64 << 20  # socket buffers at most, never the 1 GiB it offered
    assert MAX_COLLECTOR_ANSWER_BYTES == 64 << 10
