"""Real ``tidal serve`` processes for the tests, and the one pool that shares them.

    with LiveServer("--max-num-seqs", "2") as server:
        httpx.get(server.url + "/health")
        server.metrics()["tidal:kv_cache_blocks_used"]

    server = server_pool.get("wide", "--min-step-time", "0.05")   # the session fixture: shared by name

Starts are bounded: at most ``TIDAL_TEST_SERVER_STARTS`` (default 2) servers start at once in one pytest
run, across its threads and any xdist workers, because on two cores side-by-side starts only slow each
other down. A start is given up only when the server stops making progress (no new log line and no CPU
used by it or its engine for ``stall_timeout`` seconds) or after a generous overall bound, so a slow,
loaded host makes a start slow rather than failed; a failed start names the server's last log lines.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import os
import random
import re
import shutil
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


def child_processes(pid: int, marker: str) -> list:
    """The live children of ``pid`` whose command line holds ``marker`` (psutil.Process, by pid). A child that
    exits while it is read (a server's short-lived helper: a zombie until reaped) is no match, not an error."""
    import psutil

    found = []
    for child in psutil.Process(pid).children():
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return sorted(found, key=lambda c: c.pid)


READY_LINE = "tidal ready:"
STARTS_AT_ONCE = int(os.environ.get("TIDAL_TEST_SERVER_STARTS", "2"))
LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    pass


@functools.cache
def _gate_dir() -> str:
    """One folder of start slots per pytest run: shared by its xdist workers, apart from other runs."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    path = os.path.join(tempfile.gettempdir(), f"tidal-test-starts-{os.getuid()}-{run or f'pid{os.getpid()}'}")
    os.makedirs(path, exist_ok=True)
    if not run:  # xdist workers share theirs, and any of them may outlive the others
        atexit.register(shutil.rmtree, path, True)
    return path


@contextlib.contextmanager
def start_slot():
    """Hold one of STARTS_AT_ONCE start slots (flock: held per open file, so threads and processes alike)."""
    gate = _gate_dir()
    files = [open(os.path.join(gate, f"slot-{i}"), "a") for i in range(STARTS_AT_ONCE)]
    held = None
    try:
        while held is None:
            for fh in files:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                held = fh
                break
            else:
                time.sleep(0.05)  # every slot is starting a server: look again shortly
        yield
    finally:
        for fh in files:
            fh.close()  # closing releases the lock


class LiveServer:
    def __init__(self, *args: str, env: dict[str, str] | None = None, start_timeout: float = 900.0,
                 stall_timeout: float = 180.0):
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.start_timeout = start_timeout  # overall bound, counted once a start slot is held
        self.stall_timeout = stall_timeout  # no log line and no CPU for this long: the start is stuck
        self.process: subprocess.Popen | None = None
        self.client = httpx.Client(timeout=10)  # one client: a new one costs ~50 ms of CPU
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)

    def __enter__(self) -> "LiveServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and return once it says it is ready and /health answers 200."""
        with start_slot():
            env = dict(os.environ)
            env.setdefault("TIDAL_ENGINE_LOG_LEVEL", "WARNING")
            if self.env:
                env.update(self.env)
            cmd = [sys.executable, "-m", "tidal", "serve", "--port", str(self.port), *self.args]
            self.process = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
            try:
                self._wait_ready()
            except ServerStartError:
                self.stop()
                raise

    def _wait_ready(self) -> None:
        started = last_progress = time.monotonic()
        log_size, cpu, next_check = 0, 0.0, started
        while True:
            text = self.log()
            if self.process.poll() is not None:
                self._fail(f"exited with code {self.process.returncode}")
            now = time.monotonic()
            if READY_LINE in text:
                health = self._health()
                if health == 200:
                    return
                self._fail(f"said it was ready, but /health answered {health}")
            if now >= next_check:  # once a second: CPU used, and /health (a server logging above INFO)
                next_check = now + 1.0
                used = self._cpu_seconds()
                if used > cpu + 0.01:
                    cpu, last_progress = used, now
                if self._health() == 200:
                    return
            if len(text) > log_size:
                log_size, last_progress = len(text), now
            if now - last_progress > self.stall_timeout:
                self._fail(f"made no progress for {self.stall_timeout:.0f} s (no log line, no CPU used)")
            if now - started > self.start_timeout:
                self._fail(f"was not ready after {self.start_timeout:.0f} s")
            time.sleep(0.1)

    def _health(self) -> int | None:
        try:
            return self.client.get(self.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return None

    def _cpu_seconds(self) -> float:
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            total = 0.0
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    total += times.user + times.system
            return total
        except psutil.Error:
            return 0.0

    def _fail(self, why: str) -> None:
        tail = "\n".join(self.log().splitlines()[-LOG_TAIL_LINES:])
        raise ServerStartError(f"tidal serve {' '.join(self.args)} {why}; its last log lines:\n{tail}")

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
        return next(c.pid for c in child_processes(self.process.pid, "tidal.gpu"))

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
    """Start servers side by side (through the start slots); stop them all if one fails."""
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
    """Live servers by name, shared by every test that names them (the session's ``server_pool`` fixture).

    ``start`` begins a server in a background thread (through the start slots), so a package can ask
    for all of its servers at once and each test waits only for its own; ``get`` returns it running,
    starting it again if it died while it idled (a server with a short engine heartbeat can be declared
    dead while a loaded host starves it); ``release`` stops it when its tests are done.
    """

    def __init__(self):
        self._servers: dict[str, LiveServer] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, BaseException] = {}
        self._stopping: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        with self._lock:
            if name in self._servers:
                if self._servers[name].args != list(args) or self._servers[name].env != env:
                    raise ValueError(f"server {name!r} is already in the pool with other flags")
                return
            server = self._servers[name] = LiveServer(*args, env=env)
            thread = self._threads[name] = threading.Thread(target=self._start, args=(name, server), daemon=True)
            thread.start()

    def _start(self, name: str, server: LiveServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # handed to the test that needs this server
            self._errors[name] = exc

    def get(self, name: str, *args: str, env: dict[str, str] | None = None) -> LiveServer:
        self.start(name, *args, env=env)
        self._threads[name].join()
        if name in self._errors:
            raise self._errors[name]
        server = self._servers[name]
        if server.process.poll() is not None:
            server.stop()
            server = self._servers[name] = LiveServer(*server.args, env=server.env)
            server.start()
        return server

    def release(self, *names: str) -> None:
        """Forget these servers and stop them in the background (a drain takes seconds the next tests
        need not wait for); a later ``get`` starts them afresh."""
        with self._lock:
            gone = [(self._threads.pop(n), self._servers.pop(n)) for n in names if n in self._servers]
            for name in names:
                self._errors.pop(name, None)

        def stop() -> None:
            for thread, _ in gone:
                thread.join()
            stop_all([server for _, server in gone])

        if gone:
            stopping = threading.Thread(target=stop, daemon=True)
            stopping.start()
            self._stopping.append(stopping)

    def stop_all(self) -> None:
        self.release(*list(self._servers))
        for stopping in self._stopping:
            stopping.join()


def wanted(session, names) -> list[str]:
    """Which of these fixture names the collected tests use (what a package's pool should start)."""
    return sorted({name for item in session.items for name in getattr(item, "fixturenames", ()) if name in names})
