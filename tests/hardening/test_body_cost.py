"""A body's decoding cost is bounded before it is paid, and paid off the event loop.

Before: 15 MiB of small values in any loosely typed field was decoded and walked value by value on
the event loop, the cyclic GC passing over millions of fresh containers: a neighbour stream's longest
gap was 5.9-75 s on a loaded host, and the server was sometimes declared dead. Now a large body is
scanned as bytes first (tidal/service/body_cost.py: 413 past the value or container bound, 400 past
the depth bound), decoded on a worker thread with the GC paused, and a chat whose earlier tool calls
render megabytes goes to a tokenizer worker. The neighbour's bound is generous on purpose (a loaded
2-core host): it tells seconds of stall from a normal stream, it is not a benchmark.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import trio
import trio_websocket
from live_server import LiveServer

from tidal.errors import ApiError
from tidal.service import body_cost
from tidal.service.body_cost import MAX_JSON_CONTAINERS, MAX_JSON_VALUES, JsonShape, check, scan
from tidal.service.json_depth import MAX_DEPTH

HELLO = [{"role": "user", "content": "Hello there"}]
BODY = 15 << 20  # under the default 16 MiB body limit
NEIGHBOUR_GAP = 2.0  # seconds; a 20-token-a-second stream, stalled for seconds before


def test_scan_counts_outside_strings_and_sees_escaped_quotes():
    text = json.dumps({"a": [1, 2, {"b": "x,[{"}], "c": 'q"[,\\', "d": []}).encode()
    # 8 values; the count is "at most": the empty list counts one too
    assert scan(text) == JsonShape(values=9, containers=4, depth=3)


def _ints(count: int) -> bytes:
    """A chat body whose chat_template_kwargs hold one list: values = 1 + 2 containers + ... = count + 3."""
    return b'{"messages":[{"role":"user","content":"Hi"}],"chat_template_kwargs":{"x":[' + \
        b",".join([b"0"] * count) + b"]}}"


def test_values_at_the_bound_pass_and_one_more_is_a_413():
    # root, messages list, message dict, 2 message values, kwargs dict, its list: 7 values before the ints
    base = scan(_ints(1)).values - 1
    check(_ints(MAX_JSON_VALUES - base))
    with pytest.raises(ApiError) as info:
        check(_ints(MAX_JSON_VALUES - base + 1))
    assert info.value.status == 413 and f"the limit is {MAX_JSON_VALUES}" in info.value.message


def test_containers_at_the_bound_pass_and_one_more_is_a_413():
    def lists(count: int) -> bytes:
        return b'{"x":[' + b",".join([b"[]"] * count) + b"]}"
    check(lists(MAX_JSON_CONTAINERS - 2))  # with the root object and the outer list
    with pytest.raises(ApiError) as info:
        check(lists(MAX_JSON_CONTAINERS - 1))
    assert info.value.status == 413 and "objects and arrays" in info.value.message


def test_depth_at_the_bound_passes_and_one_more_is_a_400():
    check(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)
    with pytest.raises(ApiError) as info:
        check(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    assert info.value.status == 400


class Neighbour:
    """A streaming completion read on a thread; its longest gap between chunks while ``watch`` runs."""

    def __init__(self, server: LiveServer, max_tokens: int = 4000):
        self.server, self.max_tokens = server, max_tokens
        self.arrivals: list[float] = []
        self.first = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "Hi", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", self.server.url + "/v1/completions",
                                                               json=body) as answer:
            for _ in answer.iter_raw():
                self.arrivals.append(time.monotonic())
                self.first.set()
                if self.stop.is_set():
                    return  # closing the stream aborts the request

    def __enter__(self) -> "Neighbour":
        self.thread.start()
        assert self.first.wait(60)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)

    def longest_gap(self, since: float, until: float) -> float:
        times = [since] + [t for t in self.arrivals if since < t < until] + [until]
        return max(b - a for a, b in zip(times, times[1:]))


@pytest.fixture(scope="module")
def server():
    with LiveServer("--min-step-time", "0.05", "--no-ui") as live:
        yield live


def _small_values(field_json: bytes, size: int = BODY) -> bytes:
    return field_json.replace(b"@", b",".join([b"0"] * (size // 2)))


# (path, body): 15 MiB of small values in a loosely typed field of each API
MANY_VALUES = {
    "chat-template-kwargs": ("/v1/chat/completions", lambda: b'{"messages":[{"role":"user","content":"Hi"}],'
                             b'"max_tokens":2,"chat_template_kwargs":{"x":[@]}}'),
    "tool-parameters": ("/v1/chat/completions", lambda: b'{"messages":[{"role":"user","content":"Hi"}],'
                        b'"max_tokens":2,"tools":[{"type":"function","function":{"name":"f","parameters":'
                        b'{"type":"object","enum":[@]}}}]}'),
    "guided-json-text": ("/v1/chat/completions", lambda: json.dumps({
        "messages": HELLO, "max_tokens": 2, "guided_json": '{"enum":[' + ",".join(["0"] * (BODY // 2)) + "]}",
    }).encode()),
    "responses-metadata": ("/v1/responses", lambda: b'{"input":"Hi","max_output_tokens":2,"metadata":{"x":[@]}}'),
    "messages-tool-use-input": ("/v1/messages", lambda: b'{"model":"tidal-tiny","max_tokens":2,"messages":[{"role":"user","content":"Hi"},'
                                b'{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f",'
                                b'"input":{"x":[@]}}]},{"role":"user","content":[{"type":"tool_result",'
                                b'"tool_use_id":"t","content":"1"}]}]}'),
}


@pytest.mark.parametrize("name", list(MANY_VALUES))
def test_15_mib_of_small_values_is_refused_before_decoding_and_the_neighbour_streams_on(server, name):
    path, make = MANY_VALUES[name]
    body = _small_values(make()) if b"@" in make() else make()
    assert len(body) > 8 << 20
    with Neighbour(server) as neighbour:
        started = time.monotonic()
        answer = server.client.post(server.url + path, content=body, timeout=120,
                                    headers={"Content-Type": "application/json"})
        ended = time.monotonic() + 0.5
        time.sleep(0.5)
        gap = neighbour.longest_gap(started, ended)
    print(f"{name}: {answer.status_code} in {ended - 0.5 - started:.2f} s, neighbour's longest gap {gap:.2f} s")
    assert answer.status_code in (400, 413), answer.text
    assert "JSON values" in answer.text or "too many" in answer.text, answer.text
    assert gap < NEIGHBOUR_GAP, gap
    assert server.process.poll() is None


def test_megabytes_of_earlier_tool_call_arguments_render_off_the_loop(server):
    """7 MiB of arguments text under 2,048 characters of content: served, the template ran on a worker."""
    arguments = json.dumps({"text": "x" * (7 << 20)})
    body = {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}], "max_tokens": 2}
    with Neighbour(server) as neighbour:
        started = time.monotonic()
        answer = server.client.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        ended = time.monotonic()
        gap = neighbour.longest_gap(started, ended)
    print(f"7 MiB of arguments: {answer.status_code} in {ended - started:.2f} s, neighbour's longest gap {gap:.2f} s")
    assert answer.status_code == 200, answer.text
    assert gap < NEIGHBOUR_GAP, gap
    assert server.process.poll() is None


async def test_a_15_mib_websocket_message_of_small_values_is_an_error_frame_beside_a_live_stream(server):
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    message = _small_values(b'{"type":"request","id":"big","endpoint":"chat.completions","body":'
                            b'{"messages":[{"role":"user","content":"Hi"}],"chat_template_kwargs":{"x":[@]}}}')
    async with trio_websocket.open_websocket_url(url, max_message_size=32 << 20) as ws:
        await ws.send_message(json.dumps({"type": "request", "id": "long", "endpoint": "completions",
                                          "body": {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}}))
        arrivals = []
        assert json.loads(await ws.get_message())["id"] == "long"
        started = trio.current_time()
        await ws.send_message(message)
        with trio.fail_after(120):
            while True:
                reply = json.loads(await ws.get_message())
                if reply["id"] == "long":
                    arrivals.append(trio.current_time())
                else:
                    break
        ended = trio.current_time()
        times = [started, *arrivals, ended]
        gap = max(b - a for a, b in zip(times, times[1:]))
        print(f"websocket: {reply['type']} {reply.get('status')}, neighbour's longest gap {gap:.2f} s")
        assert reply["id"] == "big" and reply["type"] == "error" and reply["status"] == 413, reply
        assert gap < NEIGHBOUR_GAP, gap
    assert server.process.poll() is None


def test_is_large_counts_a_decoded_bodys_values_only_up_to_the_bound():
    assert not body_cost.is_large({"messages": HELLO})
    assert body_cost.is_large({"x": list(range(10**6))})


def test_the_gc_is_paused_while_any_decode_runs_and_restored_after_the_last():
    import gc

    assert gc.isenabled()
    with body_cost.gc_paused():
        with body_cost.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other decode is still running
    assert gc.isenabled()
