"""Two live ``tidal serve`` processes shared by every module in tests/api (package scope).

``api_server``: the conformance server. It requires an API key, serves the model under another
name, and has small limits the error tests run into (64-token context, 1000-byte bodies, two
concurrent requests per WebSocket connection).

``ws_server``: slow, deterministic steps (every forward pass lasts >= 50 ms) and room for exactly
three running plus one queued request, so WebSocket tests can act mid-stream and fill the queue.
"""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer, start_all, stop_all

from .support import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN, SERVED_MODEL

WS_STEP_TIME = 0.05
WS_MAX_NUM_SEQS = 3
WS_MAX_QUEUED = 1


SERVER_FLAGS = {
    "api_server": ("--api-key", API_KEY, "--served-model-name", SERVED_MODEL, "--max-model-len", str(MAX_MODEL_LEN),
                   "--num-kv-blocks", "128", "--max-request-body-bytes", str(MAX_BODY_BYTES),
                   "--max-ws-requests-per-connection", "2"),
    "ws_server": ("--min-step-time", str(WS_STEP_TIME), "--max-num-seqs", str(WS_MAX_NUM_SEQS),
                  "--max-queued-requests", str(WS_MAX_QUEUED), "--num-kv-blocks", "128", "--no-ui"),
}


@pytest.fixture(scope="package")
def _servers(request):
    """Every server the collected tests of this package name, started side by side."""
    wanted = {name for item in request.session.items for name in item.fixturenames if name in SERVER_FLAGS}
    servers = {name: LiveServer(*SERVER_FLAGS[name]) for name in sorted(wanted)}
    start_all(list(servers.values()))
    yield servers
    stop_all(list(servers.values()))


def _server(servers: dict[str, LiveServer], name: str) -> LiveServer:
    if name not in servers:  # asked for by getfixturevalue, so not known at collection
        servers[name] = LiveServer(*SERVER_FLAGS[name])
        servers[name].start()
    return servers[name]


@pytest.fixture(scope="package")
def api_server(_servers):
    return _server(_servers, "api_server")


@pytest.fixture(scope="package")
def ws_server(_servers):
    return _server(_servers, "ws_server")


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK against the module's own ``server`` fixture."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c
