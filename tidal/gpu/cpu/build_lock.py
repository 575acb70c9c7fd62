"""One kernel build at a time per cache directory, a killed build never blocking the next, and a start
that says what it waits for.

torch's extension loader guards every load (even of a cached build) with a ``lock`` file that it
creates and deletes: a process killed while building (Ctrl-C twice, SIGKILL, a test's timeout) leaves
it behind, and every later start then waits on it silently, forever. tidal's builders first take an
``flock`` on a file of their own beside it, which the kernel releases when its holder dies, so whoever
holds that flock knows a leftover ``lock`` has no live owner and removes it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 15.0
_FLOCK_NAME = "tidal-build.flock"
_TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


@contextmanager
def exclusive_build(directory: str, interval_s: float = PROGRESS_INTERVAL_S) -> Iterator[None]:
    """Hold the build directory for this process: wait (saying for whom, every ``interval_s``) while
    another tidal process builds or loads there, then remove a ``lock`` that no live process holds."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, _FLOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, interval_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        stale = os.path.join(directory, _TORCH_LOCK_NAME)
        if os.path.exists(stale):
            log.warning("removing %s: a kernel build was killed before it finished (no live process holds it)",
                        stale)
            os.unlink(stale)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: str, interval_s: float) -> None:
    started = time.monotonic()
    next_line = started + min(1.0, interval_s)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= next_line:
            log.info("waiting for process %s, which is building or loading the CPU kernels (%s), for %.0f s so far",
                     _holder(path), path, now - started)
            next_line = now + interval_s
        time.sleep(0.2)


def _holder(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


@contextmanager
def progress(what: str, interval_s: float = PROGRESS_INTERVAL_S) -> Iterator[None]:
    """Log "still building ``what``: N s so far" every ``interval_s`` until the block ends, so a build
    that takes minutes on a busy host is never minutes of silence."""
    done = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not done.wait(interval_s):
            log.info("still building %s: %.0f s so far", what, time.monotonic() - started)

    ticker = threading.Thread(target=tick, name="tidal-build-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
