"""One live ``tidal serve`` for tests/apis (package scope): the think model, an API key, the qwen3
reasoning parser and the hermes tool-call parser.

The model has random weights: where a test needs it to think, a regex constraint on a prompt
that closed the thinking (``enable_thinking: false``, so the constraint is not gated) makes it
write ``<think>...</think>`` itself, tags and all, in several tokens each."""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer

from .support import API_KEY, MAX_MODEL_LEN, SERVED_MODEL, make_think_model


@pytest.fixture(scope="package")
def think_model(tmp_path_factory):
    return make_think_model(tmp_path_factory.mktemp("qwen3-think"))


@pytest.fixture(scope="package")
def server(think_model):
    with LiveServer("--model", think_model, "--served-model-name", SERVED_MODEL, "--api-key", API_KEY,
                    "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128", "--dtype", "float32",
                    "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--no-ui") as s:
        yield s


@pytest.fixture(scope="package")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c
