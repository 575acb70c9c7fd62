"""A ``tidal serve`` child for benchmarks: a free port, wait for /health, terminate on exit."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(*args: str, env: dict[str, str] | None = None, start_timeout: float = 120.0) -> Iterator[str]:
    """Run ``tidal serve ARGS`` from outside the checkout's ./tidal (so PYTHONPATH decides which
    tidal runs) and yield its base URL once /health answers 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    server = subprocess.Popen([sys.executable, "-m", "tidal", "serve", "--port", str(port), *args],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    try:
        deadline = time.monotonic() + start_timeout
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)
