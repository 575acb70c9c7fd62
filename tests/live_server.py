"""Start a real ``tidal serve`` process for a test and talk to it like a user would.

    with LiveServer("--max-num-seqs", "2") as server:
        httpx.get(server.url + "/health")
        server.metrics()["tidal:kv_cache_blocks_used"]

A free port is picked first. The server's log goes to a file, shown if startup fails.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_rendezvous_ports(count: int = 1) -> int:
    """A port p with p .. p + count - 1 all free now, below Linux's ephemeral range (32768 up).

    For --master-port (replica k meets at p + k). A free_port() result is ephemeral: while replica 0's
    ranks connect to their store at p, the kernel may hand one of those connections p + 1 as its local
    port before replica 1 binds it (seen once in CI as EADDRINUSE). Below the range no connection is
    given these ports, as with torch.distributed's default 29500.
    """
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32768 - count)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, s in enumerate(sockets):
                s.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports below 32768")


_METRIC_LINE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+\deE.naInf]+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}; label-less keys also get the bare name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        # metrics labelled only by model_name are also reachable by their bare name
        if re.fullmatch(r'\{model_name="[^"]*"\}', labels):
            out[name] = value
    return out


class LiveServer:
    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 120.0):
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None
        self.client = httpx.Client(timeout=10)  # one client: a new one costs ~50 ms of CPU
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)

    def __enter__(self) -> "LiveServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = dict(os.environ)
        env.setdefault("TIDAL_ENGINE_LOG_LEVEL", "WARNING")
        if self.env:
            env.update(self.env)
        cmd = [sys.executable, "-m", "tidal", "serve", "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tidal serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.client.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tidal serve did not become healthy:\n{self.log()}")

    def log(self) -> str:
        if self.log_file.closed:  # stopped: the file is gone, its text was kept
            return self._final_log
        self.log_file.flush()
        with open(self.log_file.name) as fh:
            return fh.read()

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        self.client.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self.log_file.closed:
            self._final_log = self.log()
            self.log_file.close()
            os.unlink(self.log_file.name)
        return self.process.returncode

    def engine_pid(self) -> int:
        import psutil

        children = psutil.Process(self.process.pid).children()
        return next(c.pid for c in children if "tidal.gpu" in " ".join(c.cmdline()))

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.client.get(self.url + "/metrics").text)

    def wait_for(self, predicate, timeout: float = 10.0, interval: float = 0.02) -> dict[str, float]:
        """Poll /metrics until ``predicate(metrics)`` holds; return those metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s; last metrics: "
                                     f"{ {k: v for k, v in m.items() if '{' not in k} }")
            time.sleep(interval)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request state is left anywhere and every KV block is free."""
        return self.wait_for(
            lambda m: m["tidal:kv_cache_blocks_used"] == 0
            and m["tidal:num_requests_running"] == 0
            and m["tidal:num_requests_waiting"] == 0
            and m["tidal:frontend_requests_active"] == 0,
            timeout,
        )


def start_all(servers: list[LiveServer]) -> None:
    """Start servers side by side: most of a start is waiting on another process's imports."""
    errors: list[BaseException] = []

    def start(server: LiveServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        stop_all(servers)
        raise errors[0]


def stop_all(servers: list[LiveServer]) -> None:
    """Stop servers side by side: each takes a moment to drain and reap its engine."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        server.stop()


class ServerPool:
    """Servers with different flags, all started at once in threads the first time any is needed.

    A ``tidal serve`` start is mostly waiting on another process's imports, so side-by-side starts
    cost little more than one. ``get`` waits only for the server asked for.
    """

    def __init__(self, flags: dict[str, tuple[str, ...]], server_class: type[LiveServer] = LiveServer):
        self.server_class = server_class
        self.servers = {name: server_class(*args) for name, args in flags.items()}
        self.errors: dict[str, BaseException] = {}
        self.threads = {name: threading.Thread(target=self._start, args=(name,), daemon=True) for name in flags}
        for thread in self.threads.values():
            thread.start()

    def _start(self, name: str) -> None:
        try:
            self.servers[name].start()
        except BaseException as exc:  # handed to the test that needs this server
            self.errors[name] = exc

    def get(self, name: str) -> LiveServer:
        self.threads[name].join()
        if name in self.errors:
            raise RuntimeError(f"{name} did not start") from self.errors[name]
        server = self.servers[name]
        if server.process.poll() is not None:
            # Pooled servers idle until their test; one with a 2 s engine heartbeat can be declared
            # dead while a loaded host starves it. The test needs a live one: start it again.
            server.stop()
            server = self.servers[name] = self.server_class(*server.args)
            server.start()
        return server

    def stop_all(self) -> None:
        for thread in self.threads.values():
            thread.join()
        stop_all(list(self.servers.values()))
