"""The engine process's main loop: drain the inbox, step, send the report. Nothing else.

Messages are handled in order between steps. Aborts also reach the step directly: the
inbox's reader thread hands each to ``engine.abort_arrived`` as it arrives, and the step
applies them between the forward pass and the booking of its outputs (and again before it
launches the next pass), so an abort that arrives mid-forward frees the request's KV blocks in
that same step.

Pings never wait for a step: the reader thread answers each at once with the engine's progress
(``answer_ping``), so a step of a minute is a live engine, and a stopped process a silent one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import traceback

from tidal.gpu.pipe_io import Inbox, Outbox, read_config
from tidal.wire import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    LoadAdapter,
    Ping,
    Pong,
    Shutdown,
    UnloadAdapter,
)

log = logging.getLogger("tidal.engine")


def run_engine_process(in_fd: int, out_fd: int) -> int:
    tighten_timer_slack()  # first: threads inherit it from the thread that starts them
    logging.basicConfig(level=os.environ.get("TIDAL_ENGINE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s engine %(levelname)s %(message)s")
    if "TIDAL_ENGINE_LOG_LEVEL" not in os.environ:  # the first start's kernel build is progress worth seeing
        logging.getLogger("tidal.gpu.cpu.kernels").setLevel(logging.INFO)
        logging.getLogger("tidal.gguf").setLevel(logging.INFO)  # and so is a GGUF load's
    config = read_config(in_fd)

    # Everything below the config read may fail; the frontend must hear why.
    outbox = Outbox(out_fd)
    try:
        import torch

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        from tidal.gpu.engine import Engine

        engine = Engine(config)
    except Exception as exc:  # startup failure: report it, exit non-zero
        outbox.put_control(EngineFailed(f"{type(exc).__name__}: {exc}"))
        outbox.close()
        if not isinstance(exc, (ValueError, OSError)):  # a bad flag or path needs no traceback
            traceback.print_exc()
        return 1
    if engine.runner.tp is not None:  # a tensor-parallel rank that exits fails the engine at once, busy or idle
        engine.runner.tp.on_rank_death = lambda why: _fail_now(outbox, why)
    inbox = Inbox(in_fd, on_abort=engine.abort_arrived, on_ping=lambda ping: answer_ping(engine, outbox, ping))
    outbox.put_control(engine.ready_message())
    try:
        _loop(engine, inbox, outbox)
    except Exception as exc:
        traceback.print_exc()
        why = f"{type(exc).__name__}: {exc}"
        if engine.runner.tp is not None:  # a collective that failed: most often a rank that died
            why = engine.runner.tp.dead_rank() or why
        outbox.put_control(EngineFailed(why))
        outbox.close()
        return 1
    outbox.close()
    return 0


PR_SET_TIMERSLACK = 29


def tighten_timer_slack() -> bool:
    """Let this thread's sleeps and timed waits end on time. True if it took effect.

    Linux lets a normal thread's timers fire up to 50 us late (the timer slack) to batch
    wake-ups. The engine's waits are on its critical path (a ``min_step_time`` pass, a step loop
    waiting for a pass): 50 us is 1% of a 4.48 ms step, paid every step. Threads started later
    inherit the setting. A no-op elsewhere than Linux.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0  # 1 ns: 0 would mean "the default"
    except (OSError, AttributeError):
        return False


def answer_ping(engine, outbox, ping: Ping) -> None:
    """The engine's pulse, from the pipe reader thread: alive, and how far the step loop has come."""
    outbox.put_control(Pong(ping.nonce, engine.stats(), engine.progress()))


def _fail_now(outbox, why: str) -> None:
    """Tell the frontend why and exit, from whichever thread noticed (the rank's collective may never return)."""
    log.error("%s", why)
    outbox.put_control(EngineFailed(why))
    outbox.close(timeout=1.0)
    os._exit(1)


def _loop(engine, inbox, outbox) -> None:
    shutting_down = False

    def handle(message) -> None:
        nonlocal shutting_down
        if isinstance(message, AddRequest):
            engine.add_request(message)
        elif isinstance(message, AbortRequests):
            engine.abort(message.request_ids, message.received_step)
        elif isinstance(message, Ping):  # only where no reader thread answers it (see answer_ping)
            answer_ping(engine, outbox, message)
        elif isinstance(message, Shutdown):
            shutting_down = True
        elif isinstance(message, LoadAdapter):
            outbox.put_control(engine.load_adapter(message))
        elif isinstance(message, UnloadAdapter):
            engine.unload_adapter(message)

    def drain() -> None:
        while (message := inbox.get_nowait()) is not None:
            handle(message)

    while not shutting_down:
        if not engine.has_work():  # idle: sleep until the frontend says something
            handle(inbox.get(timeout=None))
        drain()
        if shutting_down:
            break
        if engine.has_work() and not engine.step():
            # nothing fits right now (all blocks held): wait for a message, not a spin
            message = inbox.get(timeout=0.005)
            if message is not None:
                handle(message)
        report = engine.take_report()
        if report is not None:
            outbox.put_report(report)
    engine.abort_all()
    report = engine.take_report()
    if report is not None:
        outbox.put_report(report)
