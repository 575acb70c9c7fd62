"""A kernel build killed half-way never blocks later starts, a start waiting on another's build says so,
and a long build says how long so far (tidal/gpu/cpu/build_lock.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import subprocess
import sys
import threading

import pytest

from tidal.gpu.cpu import build_lock

_LOAD = ("import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s');"
         "from tidal.gpu.cpu import kernels; sys.exit(0 if kernels.load_cpu_ops() is not None else 7)")
_DIRECTORY = ("from tidal.gpu.cpu import kernels; print(kernels.cache_directory())")


def _build_directory() -> str:
    return subprocess.run([sys.executable, "-c", _DIRECTORY], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def _start_load() -> tuple[subprocess.Popen, queue.Queue]:
    process = subprocess.Popen([sys.executable, "-c", _LOAD], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stderr:
            lines.put(line.rstrip())
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def _lines_until(lines: queue.Queue, wanted: str, timeout: float) -> list[str]:
    seen = []
    while True:
        line = lines.get(timeout=timeout)
        if line is None:
            return seen
        seen.append(line)
        if wanted in line:
            return seen


def test_a_lock_left_by_a_killed_build_is_removed_and_the_load_goes_on():
    directory = _build_directory()
    os.makedirs(directory, exist_ok=True)
    stale = os.path.join(directory, "lock")
    open(stale, "w").close()  # what torch's FileBaton leaves when its builder is SIGKILLed
    process, lines = _start_load()
    seen = _lines_until(lines, "no more lines", timeout=900)
    assert process.wait(timeout=60) != 7 or pytest.skip("no C++ toolchain here: " + "\n".join(seen[-3:]))
    assert process.returncode == 0, "\n".join(seen)
    assert any("removing" in line and stale in line for line in seen), "\n".join(seen)
    assert not os.path.exists(stale)


def test_a_start_waiting_on_another_build_names_the_holder_then_proceeds():
    directory = _build_directory()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tidal-build.flock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # this test process "is building"
        held.seek(0)
        held.truncate()
        held.write(f"{os.getpid()}\n")
        held.flush()
        process, lines = _start_load()
        seen = _lines_until(lines, "waiting for process", timeout=300)
        assert process.poll() is None, "\n".join(seen)
        assert f"waiting for process {os.getpid()}" in seen[-1]
    _lines_until(lines, "no more lines", timeout=900)
    assert process.wait(timeout=60) in (0, 7)


def test_a_long_build_reports_its_progress(caplog):
    caplog.set_level(logging.INFO, logger=build_lock.__name__)
    said = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("still building the kernels: "):
                said.set()

    watch = Watch()
    logging.getLogger(build_lock.__name__).addHandler(watch)
    try:
        with build_lock.progress("the kernels", interval_s=0.05):
            assert said.wait(timeout=30)
    finally:
        logging.getLogger(build_lock.__name__).removeHandler(watch)
    count = sum("still building" in record.getMessage() for record in caplog.records)
    with build_lock.progress("the kernels", interval_s=60):
        pass  # a quick block says nothing and returns at once
    assert sum("still building" in record.getMessage() for record in caplog.records) == count
