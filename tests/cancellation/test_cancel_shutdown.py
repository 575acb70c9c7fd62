"""SIGTERM with requests in flight: drain, then end the rest cleanly; a second signal stops at once.

Each test owns (and ends) its server. There is no ``wait_idle`` at the end: the process is
gone; its exit code and its last log lines are what is checked instead.
"""

from __future__ import annotations

import signal
import time

import httpx
import psutil

from cancel_helpers import RawHttp, completion_body, finish_reasons, scrape_health, unique_prompt

SHUTTING_DOWN = "The server is shutting down."


def _health_status(server) -> int | None:
    """/health's status, or None once the server no longer answers."""
    try:
        return scrape_health(server)
    except httpx.HTTPError:
        return None


def _wait_draining(server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _health_status(server) != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.02)


def test_sigterm_drains_then_aborts_what_cannot_finish(drain_server):
    """--shutdown-timeout 1: a short request finishes; long streams end with "abort" + [DONE]; exit 0."""
    server = drain_server
    long_streams = [RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(6, seed=500 + i), 2000))
                    for i in range(2)]
    short = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(6, seed=510), 5))
    try:
        for client in (*long_streams, short):
            client.next_chunk()
        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        _wait_draining(server)

        # a new request while draining: refused before any stream starts
        with RawHttp(server.port, "/v1/completions", completion_body("Hello", 4)) as late:
            assert late.read_head() == 503
            assert late.headers.get("retry-after") == "1"
            assert late.read_json()["error"]["message"] == SHUTTING_DOWN

        # 4 more tokens at 0.05 s/step: well inside the 1 s drain
        assert finish_reasons(short.rest_of_stream())[-1] == "length"

        for client in long_streams:
            events = client.rest_of_stream()
            assert events[-1] == "[DONE]"
            assert finish_reasons(events)[-1] == "abort"
            assert finish_reasons(events)[:-1] == [None] * (len(events) - 2)  # a clean end, no error frame
        seconds = time.monotonic() - signalled_at
        assert 0.9 < seconds < 5.0, f"aborted {seconds:.2f} s after SIGTERM with --shutdown-timeout 1"
        assert server.process.wait(timeout=20) == 0
    finally:
        for client in (*long_streams, short):
            client.close()
    assert "shutdown: aborting 2 requests still in flight" in server.log()
    assert server.log().rstrip().splitlines()[-1].endswith("tidal stopped (exit code 0)")  # the last word said


def test_second_sigterm_stops_at_once(second_signal_server):
    """--shutdown-timeout 30: the first SIGTERM starts a long drain; the second ends the process now."""
    server = second_signal_server
    engine = psutil.Process(server.engine_pid())
    with RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(6, seed=520), 2000)) as client:
        client.next_chunk()
        server.process.send_signal(signal.SIGTERM)
        _wait_draining(server)
        server.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        code = server.process.wait(timeout=20)
        seconds = time.monotonic() - signalled_at
        print(f"second SIGTERM: exit code {code} after {seconds:.2f} s")
        assert code != 0
        assert seconds < 6.0  # the engine is told to stop and reaped; the drain would take 30 s
        # the stream ends (no final frame is promised), it does not hang
        client.settimeout(5)
        try:
            while True:
                client.next_event()
        except (EOFError, ConnectionError):
            pass
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, "the engine outlived the server"


def test_sigterm_while_the_engine_starts_stops_within_the_drain_bound(tmp_path):
    """Before, it logged "draining (up to 30 s)" and stayed up until the engine was ready (50 s and more
    for a big model); only a second signal stopped it. Now there is nothing to drain: it stops at once."""
    import subprocess
    import sys

    from live_server import child_processes, free_port

    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "tidal", "serve", "--port", str(free_port()),
                                    "--shutdown-timeout", "5", "--min-step-time", "0.01"],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        engine = None
        while engine is None:  # the engine process is starting: the frontend's signal handler is set
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()
            engine = next(iter(child_processes(process.pid, "tidal.gpu")), None)
            time.sleep(0.02)
        assert "tidal ready" not in log.read_text()
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert process.wait(timeout=30) == 0, log.read_text()
        took = time.monotonic() - signalled
        print(f"SIGTERM while starting: stopped in {took:.2f} s")
        assert took < 5  # within the drain bound (--shutdown-timeout 5): a loading engine is killed at once
        assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
        text = log.read_text()
        assert "SIGTERM while starting: stopping" in text and "tidal stopped (exit code 0)" in text, text
    finally:
        if process.poll() is None:
            process.kill()
