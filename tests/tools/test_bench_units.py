"""Tests of ``tidal bench`` (statistics, SSE parsing, arrivals, reports) and ``tidal.tools.ws_client``.

The end-to-end parts run against a small OpenAI-compatible stub server (quart-trio on hypercorn,
real sockets) that streams at a known fixed rate, so the measured TTFT/ITL can be checked against
the schedule. The stub also speaks tidal's ``/v1/ws`` protocol for the WebSocket client.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from contextlib import asynccontextmanager
from functools import partial

import hypercorn.trio
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypothesis import given, settings
from hypothesis import strategies as st
from quart import request, websocket
from quart_trio import QuartTrio

from tidal.tools import bench
from tidal.tools.bench import BenchConfig, SSEParser, build_report, make_prompts, run_benchmark
from tidal.tools.bench_metrics import RequestRecord, StreamObserver, arrival_offsets, percentile, summarize
from tidal.tools.ws_client import TidalWSConnectionLost, TidalWSError, open_tidal_ws

# -- pure statistics ----------------------------------------------------------------------------


def test_percentile_interpolates_linearly_between_ranks():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0  # order of input does not matter
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def _chat_chunk(content=None, role=None, usage=None, finish=None):
    delta = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choices = [] if usage is not None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"object": "chat.completion.chunk", "choices": choices, "usage": usage}


def test_ttft_skips_role_only_frame_and_itl_are_gaps_between_content_frames():
    observer = StreamObserver(start=10.0)
    observer.on_chunk(_chat_chunk(role="assistant", content=""), 10.01)  # role-only first frame
    observer.on_chunk(_chat_chunk(content="Hel"), 10.25)
    observer.on_chunk(_chat_chunk(content="lo"), 10.30)
    observer.on_chunk(_chat_chunk(content=""), 10.32)  # empty delta: not a token
    observer.on_chunk(_chat_chunk(content=" world"), 10.40)
    observer.on_chunk(_chat_chunk(finish="length"), 10.41)
    record = observer.succeed(10.45, status=200)
    assert record.ttft_s == pytest.approx(0.25)
    assert record.itl_s == pytest.approx([0.05, 0.10])
    assert record.e2e_s == pytest.approx(0.45)
    assert record.output_tokens == 3  # no usage chunk: counted frames
    assert record.tpot_s == pytest.approx((0.45 - 0.25) / 2)


def test_usage_chunk_sets_token_counts_and_completion_text_counts_as_content():
    observer = StreamObserver(start=0.0, prompt_tokens=5)
    observer.on_chunk({"choices": [{"index": 0, "text": "ab"}]}, 0.1)
    observer.on_chunk({"choices": [{"index": 0, "text": "cd"}]}, 0.2)  # e.g. several tokens per frame
    observer.on_chunk({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}}, 0.21)
    record = observer.succeed(0.22)
    assert record.ttft_s == pytest.approx(0.1)
    assert record.output_tokens == 7
    assert record.prompt_tokens == 12
    assert record.tpot_s == pytest.approx(0.12 / 6)


def test_single_token_has_no_tpot():
    observer = StreamObserver(start=0.0)
    observer.on_chunk(_chat_chunk(content="x"), 0.1)
    assert observer.succeed(0.1).tpot_s is None


def test_summary_splits_errors_by_status_and_exception_and_counts_throughput():
    ok = RequestRecord(success=True, status=200, prompt_tokens=10, output_tokens=4, ttft_s=0.1,
                       itl_s=[0.02, 0.04, 0.06], e2e_s=0.22)
    records = [
        ok,
        RequestRecord(success=False, status=503),
        RequestRecord(success=False, status=503),
        RequestRecord(success=False, status=200, error_type="RemoteProtocolError"),
    ]
    summary = summarize(records, duration_s=2.0)
    assert (summary["completed"], summary["failed"]) == (1, 3)
    assert summary["errors"] == {"by_status": {"503": 2}, "by_exception": {"RemoteProtocolError": 1}}
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["output_throughput"] == pytest.approx(2.0)
    assert summary["total_token_throughput"] == pytest.approx(7.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(40.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(40.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(40.0)


def test_summary_without_known_prompt_tokens_reports_no_total_throughput():
    record = RequestRecord(success=True, output_tokens=3, ttft_s=0.1, e2e_s=0.3)
    summary = summarize([record], duration_s=1.0)
    assert summary["total_input_tokens"] is None
    assert summary["total_token_throughput"] is None
    assert summary["output_throughput"] == pytest.approx(3.0)


# -- SSE ------------------------------------------------------------------------------------------

_SSE_STREAM = (
    ": keep-alive comment\r\n\r\n"
    'data: {"choices": [{"delta": {"content": "caf\u00e9 \U0001f30a"}}]}\r\n\r\n'
    "event: message\n"
    "data: first line\n"
    "data:second line\n\n"
    "data: [DONE]\n\n"
).encode()
_SSE_EVENTS = [
    '{"choices": [{"delta": {"content": "caf\u00e9 \U0001f30a"}}]}',
    "first line\nsecond line",
    "[DONE]",
]


def test_sse_parser_whole_stream():
    parser = SSEParser()
    assert parser.feed(_SSE_STREAM) + parser.close() == _SSE_EVENTS


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(_SSE_STREAM)), max_size=12))
def test_sse_parser_is_independent_of_read_boundaries(cuts):
    # Reads split lines, CRLF pairs and multi-byte characters anywhere.
    bounds = [0, *sorted(cuts), len(_SSE_STREAM)]
    parser = SSEParser()
    events = []
    for low, high in zip(bounds, bounds[1:]):
        events += parser.feed(_SSE_STREAM[low:high])
    assert events + parser.close() == _SSE_EVENTS


def test_sse_parser_flushes_an_unterminated_last_event():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b") == ["a"]
    assert parser.close() == ["b"]


# -- arrivals and prompts -------------------------------------------------------------------------


def test_poisson_arrivals_average_the_requested_rate_and_are_reproducible():
    offsets = arrival_offsets(20_000, rate=50.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0
    assert statistics.fmean(gaps) == pytest.approx(1 / 50, rel=0.03)
    # Exponential gaps: standard deviation equals the mean (uniform spacing would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert arrival_offsets(100, 50.0, seed=1) == offsets[:100]
    assert arrival_offsets(100, 50.0, seed=2) != offsets[:100]
    assert arrival_offsets(5, math.inf, seed=1) == [0.0] * 5


def test_random_prompts_are_reproducible_distinct_and_sized():
    prompts = make_prompts(8, input_len=30, seed=3)
    assert prompts == make_prompts(8, input_len=30, seed=3)
    assert prompts != make_prompts(8, input_len=30, seed=4)
    assert len({p.text for p in prompts}) == 8
    assert all(len(p.text.split()) == 30 and p.tokens is None for p in prompts)


def test_tokenizer_prompts_have_exactly_input_len_tokens(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # A small vocabulary merges within and across words, so word count != token count.
    corpus = [" ".join(bench._WORDS[i : i + 7]) for i in range(0, len(bench._WORDS), 3)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    prompts = make_prompts(6, input_len=40, seed=0, tokenizer_dir=str(tmp_path))
    for prompt in prompts:
        assert prompt.tokens == 40
        assert len(tokenizer.encode(prompt.text, add_special_tokens=False).ids) == 40


def test_json_report_schema_round_trips():
    config = BenchConfig(num_prompts=2, request_rate=math.inf)
    records = [
        RequestRecord(success=True, status=200, prompt_tokens=3, output_tokens=2, ttft_s=0.1,
                      itl_s=[0.05], e2e_s=0.15),
        RequestRecord(success=False, status=None, error_type="ConnectError", error_message="refused"),
    ]
    report = json.loads(json.dumps(build_report(config, "m", records, 1.0), allow_nan=False))
    assert report["config"]["request_rate"] is None  # inf is not JSON
    assert report["model"] == "m"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    for key in ("duration_s", "completed", "failed", "request_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "errors"):
        assert key in report
    first, second = report["requests"]
    assert first["ttft_ms"] == pytest.approx(100.0)
    assert first["itl_ms"] == pytest.approx([50.0])
    assert first["e2e_ms"] == pytest.approx(150.0)
    assert (first["output_tokens"], first["prompt_tokens"], first["status"]) == (2, 3, 200)
    assert second["success"] is False and second["error_type"] == "ConnectError"
    assert report["errors"]["by_exception"] == {"ConnectError": 1}
    assert "TTFT" in bench.format_report(report)


# -- a fixed-rate OpenAI-compatible stub server ---------------------------------------------------

STUB_TTFT_S = 0.08
STUB_ITL_S = 0.02
# a token is a word; like a real server, the stub's prompt counts add its "chat template" to a
# message's words, and a BOS to a completion prompt's
STUB_TEMPLATE_TOKENS = 7


def stub_prompt_tokens(text: str, chat: bool, special: bool = True) -> int:
    return len(text.split()) + (STUB_TEMPLATE_TOKENS if chat else int(special))


def _make_stub_app(fail_every: int | None = None, tokenize: bool = True) -> QuartTrio:
    """Streams max_tokens tokens: a role-only frame at once, the first token after STUB_TTFT_S,
    then one every STUB_ITL_S. Every ``fail_every``-th request is answered 503. ``/tokenize`` (vLLM's
    shape) unless ``tokenize`` is false."""
    app = QuartTrio("stub")
    app.config["calls"] = 0
    app.config["ws_cancelled"] = []
    # what the stub did, by prompt: when it had the request and sent each token (its sleeps run late on a
    # busy host, so the tests hold the client's measures against these, not against the constants)
    app.config["sent"] = {}
    app.config["ws_active"] = app.config["ws_most_active"] = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    if tokenize:  # a word is a token: its id is its place in bench's word list; the template's and BOS are -1
        @app.post("/tokenize")
        async def tokenize_route():
            body = await request.get_json()
            if "messages" in body:
                text, count = body["messages"][0]["content"], stub_prompt_tokens(body["messages"][0]["content"], True)
            else:
                text = body["prompt"]
                count = stub_prompt_tokens(text, chat=False, special=body.get("add_special_tokens", True))
            ids = [bench._WORDS.index(word) for word in text.split()]
            return {"count": count, "tokens": [-1] * (count - len(ids)) + ids}

        @app.post("/detokenize")
        async def detokenize_route():
            return {"prompt": " ".join(bench._WORDS[i] for i in (await request.get_json())["tokens"] if i >= 0)}

    def frames(body: dict, chat: bool, received: float):
        def choice(text, role=None, finish=None):
            if chat:
                delta = {"content": text} if role is None else {"role": role, "content": ""}
                return {"index": 0, "delta": delta if text is not None or role else {}, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        tokens = body["max_tokens"]
        sent = app.config["sent"][prompt] = {"received": received, "tokens": []}

        async def generate():
            if chat:
                yield {"choices": [choice(None, role="assistant")]}
            await trio.sleep(STUB_TTFT_S)
            for index in range(tokens):
                if index:
                    await trio.sleep(STUB_ITL_S)
                sent["tokens"].append(time.perf_counter())  # bench's clock
                yield {"choices": [choice(f" t{index}")]}
            yield {"choices": [choice(None, finish="length")]}
            prompt_tokens = stub_prompt_tokens(prompt, chat)
            yield {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                                            "total_tokens": prompt_tokens + tokens}}

        return generate()

    async def sse(chat: bool):
        received = time.perf_counter()
        body = await request.get_json()
        app.config["calls"] += 1
        if fail_every and app.config["calls"] % fail_every == 0:
            return {"error": {"message": "overloaded", "type": "server_error", "param": None, "code": 503}}, 503
        app.config["last_body"] = body

        async def events():
            async for frame in frames(body, chat, received):
                yield f"data: {json.dumps(frame)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return events(), 200, {"Content-Type": "text/event-stream"}

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await sse(chat=True)

    @app.post("/v1/completions")
    async def completions():
        return await sse(chat=False)

    @app.websocket("/v1/ws")
    async def ws_route():
        ws = websocket._get_current_object()
        scopes: dict[str, trio.CancelScope] = {}

        async def serve_one(request_id: str, endpoint: str, body: dict, scope: trio.CancelScope):
            app.config["ws_active"] += 1
            app.config["ws_most_active"] = max(app.config["ws_most_active"], app.config["ws_active"])
            with scope:
                async for frame in frames(body, endpoint == "chat.completions", time.perf_counter()):
                    if frame.get("usage"):
                        await ws.send(json.dumps({"type": "done", "id": request_id, "usage": frame["usage"]}))
                    else:
                        await ws.send(json.dumps({"type": "chunk", "id": request_id, "data": frame}))
            app.config["ws_active"] -= 1

        async with trio.open_nursery() as nursery:
            while True:
                message = json.loads(await ws.receive())
                if message["type"] == "cancel":
                    app.config["ws_cancelled"].append(message["id"])
                    if message["id"] in scopes:
                        scopes[message["id"]].cancel()
                    continue
                model = message["body"]["model"]
                if model == "bad-request":
                    error = {"message": "no such model", "type": "invalid_request_error", "param": "model",
                             "code": None}
                    await ws.send(json.dumps({"type": "error", "id": message["id"], "status": 404, "error": error}))
                elif model == "connection-error":
                    error = {"message": "unparseable", "type": "invalid_request_error", "param": None, "code": None}
                    await ws.send(json.dumps({"type": "error", "id": None, "status": 400, "error": error}))
                elif model == "hang-up":
                    await ws.close(1011)
                    return
                else:
                    scopes[message["id"]] = trio.CancelScope()
                    nursery.start_soon(serve_one, message["id"], message["endpoint"], message["body"],
                                       scopes[message["id"]])

    return app


@asynccontextmanager
async def stub_server(**options):
    app = _make_stub_app(**options)
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config))
        yield binds[0], app
        nursery.cancel_scope.cancel()


async def test_measured_ttft_and_itl_follow_the_servers_schedule(monkeypatch):
    prompts = make_prompts(8, 12, seed=0)
    built = {}  # when bench built each request, just before its clock starts (nothing awaits between)

    def build_body(config, model, prompt, **kwargs):
        built[prompt] = time.perf_counter()
        return bench_build_body(config, model, prompt, **kwargs)

    bench_build_body = bench.build_body
    monkeypatch.setattr(bench, "build_body", build_body)
    async with stub_server() as (url, app):
        config = BenchConfig(base_url=url, num_prompts=8, concurrency=4, input_len=12, output_len=10)
        records, duration = await run_benchmark(config, prompts, "stub-model")
    assert all(r.success and r.status == 200 for r in records)
    ttfts = [r.ttft_s for r in records]
    gaps = [g for r in records for g in r.itl_s]
    # The role-only frame comes at once; TTFT must wait for the first token (and cannot beat it).
    assert min(ttfts) >= STUB_TTFT_S
    # Held against the moments the stub sent its tokens (a busy host makes its sleeps late), so a loaded
    # machine cannot fail this: TTFT ends when the first token arrives, never before the stub sent it
    # and, as a rule, just after (not at a later token, not at the end of the stream).
    sent = [app.config["sent"][prompt.text] for prompt in prompts]
    arrived = [built[prompt.text] + r.ttft_s - s["tokens"][0] for prompt, r, s in zip(prompts, records, sent)]
    assert min(arrived) > -0.001 and statistics.median(arrived) < 0.1, arrived
    assert len(gaps) == 8 * 9
    # ITL are the gaps between token frames: a request's gaps add up to the stub's first-to-last token
    spans = [abs(sum(r.itl_s) - (s["tokens"][-1] - s["tokens"][0])) for r, s in zip(records, sent)]
    assert statistics.median(spans) < 0.05, spans
    assert all(r.output_tokens == 10 and r.prompt_tokens == 12 + STUB_TEMPLATE_TOKENS for r in records)
    # The stream ends right after the last token, so TPOT is close to the mean gap.
    assert statistics.median(abs(r.tpot_s / statistics.fmean(r.itl_s) - 1) for r in records) < 0.1
    # Two waves of 4 concurrent requests, each about TTFT + 9 ITL long.
    assert duration >= 2 * (STUB_TTFT_S + 9 * STUB_ITL_S)


async def test_completions_endpoint_and_http_errors_are_counted_by_status():
    async with stub_server(fail_every=3) as (url, _):
        config = BenchConfig(base_url=url, endpoint="completions", num_prompts=6, input_len=5, output_len=3)
        records, duration = await run_benchmark(config, make_prompts(6, 5, seed=0), "stub-model")
    summary = summarize(records, duration)
    assert (summary["completed"], summary["failed"]) == (4, 2)
    assert summary["errors"]["by_status"] == {"503": 2}
    assert {r.error_message for r in records if not r.success} == {"overloaded"}
    assert all(r.ttft_s >= STUB_TTFT_S and r.output_tokens == 3 for r in records if r.success)


async def test_unreachable_server_is_counted_by_exception_type():
    async with stub_server() as (url, _):
        pass  # the port is free again once the stub is gone
    config = BenchConfig(base_url=url, num_prompts=2, output_len=2)
    records, _ = await run_benchmark(config, make_prompts(2, 3, seed=0), "stub-model")
    assert summarize(records, 1.0)["errors"]["by_exception"] == {"ConnectError": 2}


async def test_ws_endpoint_measures_streams_over_one_connection():
    async with stub_server() as (url, _):
        config = BenchConfig(base_url=url, endpoint="ws", num_prompts=4, input_len=6, output_len=5)
        records, _ = await run_benchmark(config, make_prompts(4, 6, seed=0), "stub-model")
    assert all(r.success for r in records)
    assert all(r.ttft_s >= STUB_TTFT_S and len(r.itl_s) == 4 for r in records)
    assert all(r.output_tokens == 5 and r.prompt_tokens == 6 + STUB_TEMPLATE_TOKENS for r in records)


# -- the WebSocket client -------------------------------------------------------------------------


def _body(model="stub-model", tokens=4):
    return {"model": model, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": tokens}


async def _collect(client, body, results, key):
    async with client.stream("chat.completions", body) as stream:
        results[key] = [data["choices"][0]["delta"].get("content") async for data in stream]
    results[key + "-usage"] = stream.usage


async def test_ws_client_interleaves_concurrent_streams_on_one_connection():
    async with stub_server() as (url, app):
        async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws") as client:
            results: dict = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_collect, client, _body(tokens=4), results, "a")
                nursery.start_soon(_collect, client, _body(tokens=6), results, "b")
    assert results["a"] == ["", " t0", " t1", " t2", " t3", None]
    assert results["b"][1:-1] == [f" t{i}" for i in range(6)]
    assert results["a-usage"]["completion_tokens"] == 4
    assert results["b-usage"] == {"prompt_tokens": 3 + STUB_TEMPLATE_TOKENS, "completion_tokens": 6,
                                  "total_tokens": 9 + STUB_TEMPLATE_TOKENS}
    # Run together, not one after the other: the stub streamed both at once (an event, not a time a busy
    # host could stretch).
    assert app.config["ws_most_active"] == 2


async def test_ws_client_leaving_a_stream_early_cancels_it_on_the_server():
    async with stub_server() as (url, app):
        async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws") as client:
            async with client.stream("chat.completions", _body(tokens=50), request_id="early") as stream:
                async for data in stream:
                    if data["choices"][0]["delta"].get("content"):
                        break
            assert not stream.cancelled and stream.usage is None
            # The connection stays usable for the next request.
            results: dict = {}
            await _collect(client, _body(tokens=2), results, "next")
        assert app.config["ws_cancelled"] == ["early"]
    assert results["next"][1:-1] == [" t0", " t1"]


async def test_ws_client_cancel_stops_the_stream_from_another_task():
    async with stub_server() as (url, app):
        async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws") as client:
            async with client.stream("chat.completions", _body(tokens=50), request_id="x") as stream:
                seen = 0
                async for data in stream:
                    seen += 1
                    if seen == 3:
                        await client.cancel("x")
            assert stream.cancelled and seen < 10
        assert app.config["ws_cancelled"] == ["x"]


async def test_ws_client_raises_errors_with_their_status():
    async with stub_server() as (url, _):
        async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws") as client:
            with pytest.raises(TidalWSError) as caught:
                async with client.stream("chat.completions", _body(model="bad-request")) as stream:
                    async for _ in stream:
                        pass
            assert caught.value.status == 404 and caught.value.error["param"] == "model"

            # A connection-level error (null id) fails the streams that are open.
            with pytest.raises(TidalWSError) as caught:
                async with client.stream("chat.completions", _body(model="connection-error")) as stream:
                    async for _ in stream:
                        pass
            assert caught.value.status == 400 and len(client.connection_errors) == 1

            with pytest.raises(TidalWSConnectionLost):
                async with client.stream("chat.completions", _body(model="hang-up")) as stream:
                    async for _ in stream:
                        pass
            with pytest.raises(TidalWSConnectionLost):
                async with client.stream("chat.completions", _body()):
                    pass


async def test_ws_client_lets_the_callers_own_exception_through_unwrapped():
    async with stub_server() as (url, _):
        with pytest.raises(KeyError):
            async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws"):
                raise KeyError("mine")


async def test_ws_client_rejects_a_duplicate_request_id():
    async with stub_server() as (url, _):
        async with open_tidal_ws(url.replace("http", "ws") + "/v1/ws") as client:
            async with client.stream("chat.completions", _body(tokens=30), request_id="same"):
                with pytest.raises(ValueError):
                    async with client.stream("chat.completions", _body(), request_id="same"):
                        pass


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_prints_report_and_writes_json_and_plot(tmp_path, capsys):
    ready = threading.Event()
    state: dict = {}

    async def serve():
        async with stub_server() as (url, app):
            state["url"], state["app"] = url, app
            state["token"] = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                state["scope"] = scope
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    try:
        assert ready.wait(30)
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        args = parser.parse_args([
            "--base-url", state["url"] + "/v1/", "--num-prompts", "6", "--concurrency", "3", "--request-rate", "200",
            "--input-len", "20", "--output-len", "4", "--ignore-eos", "--seed", "7", "--no-progress",
            "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png"),
        ])
        assert bench.main(args) == 0
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(30)
    captured = capsys.readouterr()
    out = captured.out
    assert "TTFT" in out and "stub-model" in out
    # a model with no local tokenizer: prompts are cut with the server's own, through its /tokenize
    assert "no tokenizer found" not in captured.err
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["model"] == "stub-model"  # found via GET /v1/models
    assert report["completed"] == 6 and report["total_output_tokens"] == 24
    assert report["config"]["request_rate"] == 200 and report["config"]["ignore_eos"] is True
    assert len(report["requests"]) == 6 and all(len(r["itl_ms"]) == 3 for r in report["requests"])
    assert (tmp_path / "out.png").read_bytes().startswith(b"\x89PNG")
    assert f"tidal bench: plot written to {tmp_path / 'out.png'}" in captured.err
    assert f"tidal bench: results written to {tmp_path / 'out.json'}" in captured.err
    sent = state["app"].config["last_body"]
    assert sent["ignore_eos"] is True and sent["max_tokens"] == 4 and sent["temperature"] == 0
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "stub-model"
    # --input-len is the prompt as the server counts it: 13 words and the stub's 7-token template
    assert len(sent["messages"][0]["content"].split()) == 20 - STUB_TEMPLATE_TOKENS
    assert {r["prompt_tokens"] for r in report["requests"]} == {20} and report["total_input_tokens"] == 6 * 20
    assert report["prompt_overhead_tokens"] == STUB_TEMPLATE_TOKENS
    assert report["config"]["tokenizer"] == bench.SERVER_TOKENIZER
    assert "Input tokens per request:" in out and out.count(" 20 (template/BOS: 7)\n") == 1


def test_cli_without_a_server_fails_cleanly(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-progress"])
    assert bench.main(args) == 1
    err = capsys.readouterr().err
    assert "cannot list models" in err and "ConnectError" in err
    assert "\\n" not in err and err.count("\n") == 1  # one line, no escaped newlines



def test_the_itl_plot_axis_ends_at_the_p99_and_says_so():
    gaps = [5.0] * 99 + [4000.0]  # one preemption-sized outlier
    shown, label = bench.clip_at_p99(gaps, 6.0, "ITL (ms)")
    assert max(shown) == 6.0 and len(shown) == 100  # every gap drawn, none stretching the axis
    assert label == "ITL (ms), axis clipped at p99 = 6.0 ms (1 above, in the last bar)"
    assert bench.clip_at_p99(gaps[:99], 6.0, "ITL (ms)") == (gaps[:99], "ITL (ms)")  # nothing to clip


def test_base_url_with_or_without_v1():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert bench.normalize_base_url(url) == "http://h:1"


def test_tokenizer_of_a_built_in_model_a_folder_or_a_file(tmp_path):
    built_in = bench.resolve_tokenizer("tidal-tiny")
    assert built_in is not None and built_in.is_file() and bench.resolve_tokenizer("tidal-test") == built_in
    (tmp_path / "tokenizer.json").write_text(built_in.read_text())
    assert bench.resolve_tokenizer(str(tmp_path)) == tmp_path / "tokenizer.json"
    assert bench.resolve_tokenizer(str(tmp_path / "tokenizer.json")) == tmp_path / "tokenizer.json"
    assert bench.resolve_tokenizer("meta-llama/Llama-3-8B") is None
    prompts = bench.make_prompts(3, input_len=16, seed=0, tokenizer_dir=str(built_in))
    assert [p.tokens for p in prompts] == [16, 16, 16]


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.main(parser.parse_args(["--num-prompts", "1", "--no-progress", *argv]))


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert run_cli("--base-url", "http://127.0.0.1:9", "--plot", "out.png") == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib: pip install 'tidal[bench]'" in err
    assert "cannot list models" not in err  # nothing was sent


def test_a_tokenizer_that_does_not_exist_is_named(capsys):
    assert run_cli("--base-url", "http://127.0.0.1:9", "--tokenizer", "/no/such/dir") == 2
    assert "--tokenizer /no/such/dir: no such .json file" in capsys.readouterr().err


def test_a_served_gguf_file_is_no_tokenizer_json(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert bench.resolve_tokenizer(str(gguf)) is None  # the server's own tokenizer is asked instead


def run_cli_against_stub(tmp_path, *flags: str, **stub_options) -> dict:
    """``tidal bench`` (its main) against a stub server in a thread; its JSON report."""
    ready = threading.Event()
    state: dict = {}

    async def serve():
        async with stub_server(**stub_options) as (url, app):
            state["url"], state["token"] = url, trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                state["scope"] = scope
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,))
    thread.start()
    try:
        assert ready.wait(30)
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        out = tmp_path / "out.json"
        args = parser.parse_args(["--base-url", state["url"], "--num-prompts", "3", "--output-len", "2",
                                  "--no-progress", "--json", str(out), *flags])
        code = bench.main(args)
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(30)
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint, added", [("completions", 1), ("ws", STUB_TEMPLATE_TOKENS)])
def test_input_len_counts_what_the_server_adds_on_every_endpoint(tmp_path, endpoint, added):
    report = run_cli_against_stub(tmp_path, "--endpoint", endpoint, "--input-len", "10")
    assert report["prompt_overhead_tokens"] == added
    assert [r["prompt_tokens"] for r in report["requests"]] == [10, 10, 10]


def test_without_tokenize_the_prompt_is_input_len_before_the_template_and_it_says_so(tmp_path, capsys):
    report = run_cli_against_stub(tmp_path, "--input-len", "10", tokenize=False)
    err = capsys.readouterr().err
    assert "the server has no /tokenize" in err
    assert "no tokenizer found for model 'stub-model': --input-len counts words" in err
    assert report["prompt_overhead_tokens"] is None and report["config"]["tokenizer"] is None
    # the report gives the true count, the server's: the template's tokens on top of --input-len
    assert [r["prompt_tokens"] for r in report["requests"]] == [10 + STUB_TEMPLATE_TOKENS] * 3


def test_an_input_len_shorter_than_the_template_is_named(tmp_path, capsys):
    report = run_cli_against_stub(tmp_path, "--input-len", "5")
    assert "adds 7 tokens to every prompt" in capsys.readouterr().err
    assert [r["prompt_tokens"] for r in report["requests"]] == [STUB_TEMPLATE_TOKENS + 1] * 3


def test_the_table_shows_the_runs_speculative_acceptance():
    from tidal.tools.hop_breakdown import HopSnapshot

    text = ('tidal:spec_decode_draft_tokens_total{model_name="m"} 40.0\n'
            'tidal:spec_decode_accepted_tokens_total{model_name="m"} 30.0\n')
    snapshot = HopSnapshot(text)
    assert (snapshot.spec["draft_tokens"], snapshot.spec["accepted_tokens"]) == (40.0, 30.0)
    config = BenchConfig(num_prompts=1, request_rate=math.inf)
    records = [RequestRecord(success=True, status=200, prompt_tokens=3, output_tokens=2, ttft_s=0.1,
                             itl_s=[0.05], e2e_s=0.15)]
    report = build_report(config, "m", records, 1.0)
    assert "Spec decode" not in bench.format_report(report)
    report["speculation"] = {"draft_tokens": 40.0, "accepted_tokens": 30.0, "acceptance_rate": 0.75}
    assert "Spec decode acceptance (accepted/proposed):" in bench.format_report(report)
    assert "30/40 = 0.75" in bench.format_report(report)
