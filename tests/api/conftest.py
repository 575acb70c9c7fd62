"""The live ``tidal serve`` processes shared by every module in tests/api (package scope), asked of the
session's server pool together the first time any is needed, and stopped after the package.

``api_server``: the conformance server. It requires an API key, serves the model under another
name, and has small limits the error tests run into (64-token context, 1000-byte bodies, two
concurrent requests per WebSocket connection).

``ws_server``: slow, deterministic steps (every forward pass lasts >= 50 ms) and room for exactly
three running plus one queued request, so WebSocket tests can act mid-stream and fill the queue.

``think_server``: the think model (think_model.py), an API key, the qwen3 reasoning parser and the
hermes tool-call parser, for the Responses, Messages, reasoning and tokenize tests. The model has
random weights: where a test needs it to think, a regex constraint on a prompt that closed the
thinking (``enable_thinking: false``, so the constraint is not gated) makes it write
``<think>...</think>`` itself, tags and all, in several tokens each.
"""

from __future__ import annotations

import openai
import pytest
from live_server import wanted

from . import think_model
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


def think_flags(model_dir: str) -> tuple[str, ...]:
    return ("--model", model_dir, "--served-model-name", think_model.SERVED_MODEL, "--api-key", think_model.API_KEY,
            "--max-model-len", str(think_model.MAX_MODEL_LEN), "--num-kv-blocks", "128", "--dtype", "float32",
            "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--no-ui")


@pytest.fixture(scope="package")
def think_model_dir(tmp_path_factory):
    return think_model.make_think_model(tmp_path_factory.mktemp("qwen3-think"))


@pytest.fixture(scope="package")
def _servers(request, server_pool):
    """Every server the collected tests of this package name, started side by side; stopped after them."""
    names = wanted(request.session, [*SERVER_FLAGS, "think_server"])
    for name in names:
        if name == "think_server":
            server_pool.start(name, *think_flags(request.getfixturevalue("think_model_dir")))
        else:
            server_pool.start(name, *SERVER_FLAGS[name])
    yield server_pool
    server_pool.release(*SERVER_FLAGS, "think_server")


@pytest.fixture(scope="package")
def api_server(_servers):
    return _servers.get("api_server", *SERVER_FLAGS["api_server"])


@pytest.fixture(scope="package")
def ws_server(_servers):
    return _servers.get("ws_server", *SERVER_FLAGS["ws_server"])


@pytest.fixture(scope="package")
def think_server(_servers, think_model_dir):
    return _servers.get("think_server", *think_flags(think_model_dir))


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK against the module's own ``server`` fixture (with its API key, if it wants one)."""
    key = server.args[server.args.index("--api-key") + 1] if "--api-key" in server.args else "none"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120) as c:
        yield c
