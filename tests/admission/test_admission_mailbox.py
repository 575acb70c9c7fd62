"""The per-request mailbox, exactly at its byte bound (the live tests cannot see single bytes:
the kernel's socket buffers sit between the client and the mailbox)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tidal.registry.mailbox import Mailbox
from tidal.wire import RequestOutput


def output(text: str, token_ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=1, token_ids=token_ids, text=text, finish_reason=finish)


async def test_undelivered_bytes_at_the_bound_are_accepted_and_one_more_overflows():
    # an output costs len(text) + 4 bytes per token id: 5 + 4 = 9 bytes
    box = Mailbox(max_bytes=18)
    assert box.put_nowait(output("hello", [1]))
    assert box.put_nowait(output("world", [2]))  # 18 bytes undelivered: at the bound
    assert box.pending_bytes == 18
    assert not box.put_nowait(output("!", []))  # 19: past it

    box = Mailbox(max_bytes=18)
    box.put_nowait(output("hello", [1]))
    box.take_nowait()  # a read empties the account
    assert box.pending_bytes == 0
    assert box.put_nowait(output("hello", [1])) and box.put_nowait(output("world", [2]))


async def test_outputs_merge_losslessly_and_the_backlog_is_reported():
    box = Mailbox(max_bytes=1 << 20)
    for i, piece in enumerate(["a", "b", "c"]):
        box.put_nowait(output(piece, [i]))
    box.put_nowait(output("d", [3], finish="length"))
    merged = await box.take()
    assert merged.text == "abcd" and merged.token_ids == [0, 1, 2, 3]
    assert merged.finish_reason == "length"
    assert box.last_backlog == 4 and box.num_merged == 3


async def test_a_waiting_reader_is_woken_by_a_put():
    box = Mailbox(max_bytes=100)
    async with trio.open_nursery() as nursery:
        got = []

        async def reader():
            got.append(await box.take())

        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        box.put_nowait(output("x", [7]))
    assert got[0].text == "x"


async def test_close_delivers_what_is_pending_unless_told_to_discard_it():
    box = Mailbox(max_bytes=100)
    box.put_nowait(output("kept", [1]))
    box.close(RuntimeError("finished"))
    assert (await box.take()).text == "kept"
    with pytest.raises(RuntimeError, match="finished"):
        await box.take()

    box = Mailbox(max_bytes=100)
    box.put_nowait(output("dropped", [1]))
    box.close(RuntimeError("aborted"), discard=True)  # a slow client's backlog is freed at once
    assert box.pending_bytes == 0 and not box.has_pending
    with pytest.raises(RuntimeError, match="aborted"):
        await box.take()


async def test_a_final_output_ends_the_mailbox_like_the_engines_last_output():
    box = Mailbox(max_bytes=100)
    box.put_nowait(output("dropped", [1]))
    box.close(output("", [], finish="abort"), discard=True)  # what an abort leaves the reader
    final = await box.take()
    assert final.text == "" and final.token_ids == [] and final.finish_reason == "abort"
