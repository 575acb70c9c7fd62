"""The admission suite's live servers: one per module, all started at once.

Each module names its server's flags in ``SERVER_ARGS``. A ``tidal serve`` start is mostly
waiting (on its engine process's imports and model build), so starting every module's server
side by side the first time any is needed costs little more than one start; each module then
waits only for its own server, and stops it when it is done.
"""

from __future__ import annotations

import threading

import pytest
from live_server import LiveServer


class ServerPool:
    def __init__(self, flags: dict[str, tuple[str, ...]]):
        self.servers = {name: LiveServer(*args) for name, args in flags.items()}
        self.errors: dict[str, BaseException] = {}
        self.threads = {name: threading.Thread(target=self._start, args=(name,), daemon=True) for name in flags}
        for thread in self.threads.values():
            thread.start()

    def _start(self, name: str) -> None:
        try:
            self.servers[name].start()
        except BaseException as exc:  # handed to the module that needs this server
            self.errors[name] = exc

    def get(self, name: str) -> LiveServer:
        self.threads[name].join()
        if name in self.errors:
            raise RuntimeError(f"the server of {name} did not start") from self.errors[name]
        return self.servers[name]

    def stop_all(self) -> None:
        for thread in self.threads.values():
            thread.join()
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def _admission_servers(request):
    flags = {item.module.__name__: item.module.SERVER_ARGS for item in request.session.items
             if "server" in item.fixturenames and hasattr(item.module, "SERVER_ARGS")}
    pool = ServerPool(flags)
    yield pool
    pool.stop_all()  # any a module did not stop (e.g. after an interrupted run)


@pytest.fixture(scope="module")
def server(request, _admission_servers) -> LiveServer:
    live = _admission_servers.get(request.module.__name__)
    yield live
    live.stop()
