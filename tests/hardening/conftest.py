"""One live ``tidal serve`` shared by the hardening tests (package scope).

``server``: the default 16 MiB body limit (so deeply nested JSON fits under it), a 64-token
context so that any request the fuzzer makes valid finishes in a few steps, and slow-enough
steps (>= 20 ms) that a stream is still running while a test acts beside it, and a 3 s
`--body-timeout` so that a body that never finishes is cut quickly. LoRA is on with runtime updates
(adapters may load from an empty allowed directory), so the fuzzer reaches the adapter routes' checks.
"""

from __future__ import annotations

import pytest
from live_server import LiveServer

MAX_MODEL_LEN = 64
STEP_TIME = 0.02
BODY_TIMEOUT = 3.0


def server_args(allowed_lora_dir, step_time: float = STEP_TIME) -> tuple[str, ...]:
    return ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128", "--body-timeout", str(BODY_TIMEOUT),
            "--min-step-time", str(step_time), "--enable-lora", "--enable-lora-runtime-updates",
            "--lora-allowed-dirs", str(allowed_lora_dir))


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    with LiveServer(*server_args(tmp_path_factory.mktemp("lora-allowed"))) as live:
        yield live
