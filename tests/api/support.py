"""Constants and helpers shared by the API tests (the servers themselves are in conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

API_KEY = "sk-tidal-test"
SERVED_MODEL = "tidal-test"
MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 1000
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = [{"role": "user", "content": "Hello there"}]

# Every metric the server documents (docs/metrics.md); counters are exposed with "_total".
METRIC_NAMES = (
    "tidal:num_requests_running",
    "tidal:num_requests_waiting",
    "tidal:kv_cache_usage_perc",
    "tidal:kv_cache_blocks_used",
    "tidal:kv_cache_blocks_total",
    "tidal:engine_steps_total",
    "tidal:frontend_requests_active",
    "tidal:time_to_first_token_seconds",
    "tidal:inter_token_latency_seconds",
    "tidal:time_to_first_output_seconds",
    "tidal:inter_output_latency_seconds",
    "tidal:request_hop_seconds",
    "tidal:e2e_request_latency_seconds",
    "tidal:request_queue_time_seconds",
    "tidal:requests_aborted_total",
    "tidal:requests_rejected_total",
    "tidal:prompt_tokens_total",
    "tidal:generation_tokens_total",
    "tidal:stream_coalesced_chunks_total",
    "tidal:requests_finished_total",
    "tidal:trace_spans_dropped_total",
)


def assert_openai_error(response: httpx.Response, status: int, param: Any = ..., type: str | None = None
                        ) -> dict[str, Any]:
    """The response is OpenAI's error JSON with this status; returns the inner error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not ...:
        assert error["param"] == param, error
    if type is not None:
        assert error["type"] == type, error
    return error


def sse_data(raw: bytes) -> list[str]:
    """The ``data`` payloads of a complete SSE body, checking the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        out.append(event[len("data: "):])
    return out


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body that must end with ``data: [DONE]`` (and nothing after it)."""
    data = sse_data(raw)
    assert data[-1] == "[DONE]", data[-3:]
    assert "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]
