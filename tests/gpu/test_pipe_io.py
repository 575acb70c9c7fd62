"""The engine's outbox never blocks the step loop and never loses a token: while the frontend
does not read, step reports merge request by request; once it reads, everything arrives."""

from __future__ import annotations

import os
import threading
import time

from tidal.gpu.pipe_io import Inbox, Outbox
from tidal.wire import (
    AbortRequests,
    EngineStats,
    FrameSplitter,
    Ping,
    Pong,
    RequestOutput,
    Shutdown,
    StepReport,
    decode_from_engine,
    encode_frame,
)


def read_all(fd: int) -> list:
    splitter = FrameSplitter()
    messages = []
    while data := os.read(fd, 1 << 16):
        messages.extend(decode_from_engine(body) for body in splitter.feed(data))
    return messages


def test_reports_merge_losslessly_while_the_reader_is_behind():
    read_fd, write_fd = os.pipe()
    outbox = Outbox(write_fd)
    sent: dict[int, list[int]] = {1: [], 2: [], 3: []}
    text: dict[int, str] = {1: "", 2: "", 3: ""}
    start = time.monotonic()
    num_reports = 3000
    for step in range(num_reports):  # nobody reads: the 64 KiB pipe fills after a few hundred
        outputs = []
        for rid in (1, 2, 3):
            if rid == 3 and step >= 2000:
                continue  # request 3 finished at step 1999
            token = step * 10 + rid
            sent[rid].append(token)
            text[rid] += f"<{token}>"
            finish = "length" if rid == 3 and step == 1999 else None
            outputs.append(RequestOutput(rid, [token], f"<{token}>", finish, None, num_cached_tokens=0))
        outbox.put_report(StepReport([rid for rid in (1, 2, 3) if step == 0], outputs,
                                     [3] if step == 1999 else [], EngineStats(step=step)))
    outbox.put_control(Pong(7, EngineStats(step=num_reports)))
    put_time = time.monotonic() - start
    assert put_time < 5.0, "put_report must never wait for the reader"
    assert outbox.num_merged_reports > 0, "the pipe filled up, so reports were merged"

    received = _close_and_read_all(outbox, read_fd, write_fd)
    reports = [m for m in received if isinstance(m, StepReport)]
    assert len(reports) < num_reports
    got: dict[int, list[int]] = {1: [], 2: [], 3: []}
    got_text: dict[int, str] = {1: "", 2: "", 3: ""}
    finished, started, reasons = [], [], {}
    for report in reports:
        started.extend(report.started)
        finished.extend(report.finished)
        for out in report.outputs:
            got[out.request_id].extend(out.token_ids)
            got_text[out.request_id] += out.text
            if out.finish_reason:
                reasons[out.request_id] = out.finish_reason
    assert got == sent and got_text == text
    assert started == [1, 2, 3] and finished == [3] and reasons == {3: "length"}
    assert reports[-1].stats.step == num_reports - 1  # stats are the latest
    assert any(isinstance(m, Pong) and m.nonce == 7 for m in received)


def test_inbox_decodes_frames_and_turns_eof_into_shutdown():
    read_fd, write_fd = os.pipe()
    inbox = Inbox(read_fd)
    os.write(write_fd, encode_frame(Ping(1)) + encode_frame(AbortRequests([4, 5]))[:7])
    assert inbox.get(timeout=5) == Ping(1)
    assert inbox.get_nowait() is None  # half a frame is not a message
    os.write(write_fd, encode_frame(AbortRequests([4, 5]))[7:])
    assert inbox.get(timeout=5) == AbortRequests([4, 5])
    os.close(write_fd)
    assert isinstance(inbox.get(timeout=5), Shutdown)


def test_step_loop_writes_reports_itself_and_a_frame_cut_short_is_finished_first():
    """With the writer idle and room in the pipe, put_report writes the frame on the caller's
    thread (no hand-off per step). A frame the pipe takes only in part is finished by the
    writer thread before any later frame, and the reports after it merge meanwhile."""
    read_fd, write_fd = os.pipe()
    outbox = Outbox(write_fd)
    outbox.put_report(StepReport([1], [RequestOutput(1, [5], "a", None, None)], [], EngineStats(step=0)))
    assert outbox.num_direct_reports == 1
    assert [m.outputs[0].token_ids for m in _read_frames(read_fd, 1)] == [[5]]

    big = "x" * (200 << 10)  # larger than the pipe: the first write is cut short
    outbox.put_report(StepReport([], [RequestOutput(1, [6], big, None, None)], [], EngineStats(step=1)))
    for step in range(2, 6):
        outbox.put_report(StepReport([], [RequestOutput(1, [step + 5], "b", None, None)], [], EngineStats(step=step)))
    outbox.put_control(Pong(9, EngineStats(step=5)))
    assert outbox.num_direct_reports == 2 and outbox.num_merged_reports == 3

    received = _close_and_read_all(outbox, read_fd, write_fd)
    reports = [m for m in received if isinstance(m, StepReport)]
    assert [t for r in reports for o in r.outputs for t in o.token_ids] == [6, 7, 8, 9, 10]
    assert "".join(o.text for r in reports for o in r.outputs) == big + "bbbb"
    assert any(isinstance(m, Pong) and m.nonce == 9 for m in received)


def _close_and_read_all(outbox, read_fd: int, write_fd: int) -> list:
    """Close the outbox (it flushes what it holds) while a reader drains the pipe; every message read."""
    received: list = []
    reader = threading.Thread(target=lambda: received.extend(read_all(read_fd)))
    reader.start()
    outbox.close()
    os.close(write_fd)
    reader.join(30)
    return received


def _read_frames(fd: int, count: int) -> list:
    splitter = FrameSplitter()
    messages: list = []
    while len(messages) < count:
        messages.extend(decode_from_engine(body) for body in splitter.feed(os.read(fd, 1 << 16)))
    return messages
