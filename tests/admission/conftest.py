"""The admission suite's live servers: one per module, all started at once.

Each module names its server's flags in ``SERVER_ARGS``. A ``tidal serve`` start is mostly
waiting (on its engine process's imports and model build), so starting every module's server
side by side the first time any is needed costs little more than one start; each module then
waits only for its own server, and stops it when it is done.
"""

from __future__ import annotations

import pytest
from live_server import LiveServer, ServerPool


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
