"""Every way a request can be wrong gets the right status and OpenAI's error JSON, never a 500.

The server (conftest ``api_server``) runs with ``--api-key``, ``--max-model-len 64`` and
``--max-request-body-bytes 1000``. The last test sends every bad request at once and then
checks that the server is healthy and holds no request state.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
import trio

from .support import API_KEY, AUTH, HELLO, MAX_BODY_BYTES, SERVED_MODEL, assert_openai_error, sse_chunks

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_TEXT = "hello " * 80  # ~80 tokens: over the 64-token context, under the 1000-byte body limit


def chat_body(**fields):
    return {"model": SERVED_MODEL, "messages": HELLO, "max_tokens": 4, **fields}


def completion_body(**fields):
    return {"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


# (id, path, body (bytes: sent as is), status, param, a piece of the message)
BAD_REQUESTS = [
    ("invalid-json", CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    ("trailing-garbage", CHAT, json.dumps(chat_body()).encode() + b"x", 400, None, "not valid JSON"),
    ("not-an-object", CHAT, b"[1, 2]", 400, None, "Expected `object`"),
    ("missing-messages", CHAT, {"model": SERVED_MODEL}, 400, "messages", "messages"),
    ("missing-prompt", COMPLETIONS, {"model": SERVED_MODEL}, 400, "prompt", "prompt"),
    ("missing-role", CHAT, chat_body(messages=[{"content": "x"}]), 400, "messages[0].role", "role"),
    ("messages-not-a-list", CHAT, chat_body(messages="hi"), 400, "messages", "Expected `array`"),
    ("max-tokens-a-string", CHAT, chat_body(max_tokens="ten"), 400, "max_tokens", "Expected `int"),
    ("temperature-a-string", CHAT, chat_body(temperature="hot"), 400, "temperature", "Expected"),
    ("role-an-int", CHAT, chat_body(messages=[{"role": 1, "content": "x"}]), 400, "messages[0].role", "str"),
    ("temperature-too-high", CHAT, chat_body(temperature=2.5), 400, "temperature", "between 0 and 2"),
    ("temperature-negative", CHAT, chat_body(temperature=-0.1), 400, "temperature", "between 0 and 2"),
    ("top-p-zero", CHAT, chat_body(top_p=0), 400, "top_p", "top_p"),
    ("top-k-below-minus-one", CHAT, chat_body(top_k=-2), 400, "top_k", "top_k"),
    ("min-p-over-one", CHAT, chat_body(min_p=1.5), 400, "min_p", "min_p"),
    ("presence-penalty", CHAT, chat_body(presence_penalty=3), 400, "presence_penalty", "between -2 and 2"),
    ("frequency-penalty", CHAT, chat_body(frequency_penalty=-3), 400, "frequency_penalty", "between -2 and 2"),
    ("repetition-penalty", CHAT, chat_body(repetition_penalty=0), 400, "repetition_penalty", "(0, 10]"),
    ("max-tokens-zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens", "at least 1"),
    ("max-completion-tokens-zero", CHAT, chat_body(max_completion_tokens=0), 400, "max_completion_tokens",
     "at least 1"),
    ("empty-messages", CHAT, chat_body(messages=[]), 400, "messages", "at least one message"),
    ("unknown-role", CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role",
     "'wizard'"),
    ("image-part", CHAT, chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]), 400, "messages[0].content",
     "only text content parts"),
    ("prompt-over-context", CHAT, chat_body(messages=[{"role": "user", "content": LONG_TEXT}]), 400, "messages",
     "maximum context length is 64 tokens"),
    ("prompt-plus-max-tokens-over-context", CHAT, chat_body(max_tokens=60), 400, "max_tokens",
     "maximum context length is 64 tokens"),
    ("n-17", CHAT, chat_body(n=17), 400, "n", "n must be between 1 and 16"),
    ("logprobs-int", CHAT, chat_body(logprobs=3), 400, "logprobs", "boolean"),
    ("empty-stop-string", CHAT, chat_body(stop=[""]), 400, "stop", "must not be empty"),
    ("stop-token-id-out-of-vocab", CHAT, chat_body(stop_token_ids=[10**6]), 400, "stop_token_ids", "8192"),
    ("stream-interval-zero", CHAT, chat_body(stream_interval=0), 400, "stream_interval", "at least 1"),
    # a streaming request that fails validation still gets a status, not a 200 stream
    ("streaming-and-invalid", CHAT, chat_body(stream=True, temperature=9), 400, "temperature", "between 0 and 2"),
    ("completion-ids-out-of-vocab", COMPLETIONS, completion_body(prompt=[1, 8192]), 400, "prompt", "[0, 8192)"),
    ("completion-ids-negative", COMPLETIONS, completion_body(prompt=[-1]), 400, "prompt", "[0, 8192)"),
    ("completion-batched-strings", COMPLETIONS, completion_body(prompt=["a", "b"]), 400, "prompt", "Batched"),
    ("completion-batched-ids", COMPLETIONS, completion_body(prompt=[[1, 2], [3, 4]]), 400, "prompt", "Batched"),
    ("completion-empty-prompt", COMPLETIONS, completion_body(prompt=""), 400, "prompt", "must not be empty"),
    ("completion-echo", COMPLETIONS, completion_body(echo=True), 400, "echo", "not supported"),
    ("completion-prompt-over-context", COMPLETIONS, completion_body(prompt=LONG_TEXT), 400, "messages",
     "maximum context length is 64 tokens"),
    ("unknown-model", CHAT, chat_body(model="gpt-4o"), 404, "model", "`gpt-4o` does not exist"),
    ("unknown-model-completions", COMPLETIONS, completion_body(model="nope"), 404, "model", "does not exist"),
]


def post(client: httpx.Client, path: str, body, headers=AUTH) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
    return client.post(path, json=body, headers=headers)


@pytest.fixture(scope="module")
def http(api_server):
    with httpx.Client(base_url=api_server.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("path, body, status, param, message", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_openai_error(http, path, body, status, param, message):
    error = assert_openai_error(post(http, path, body), status, param)
    assert message in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["code"] == ("model_not_found" if status == 404 else 400)


def test_openai_sdk_raises_typed_errors(api_server):
    client = openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_MODEL, messages=HELLO, max_tokens=4, temperature=3)
    assert (info.value.status_code, info.value.param) == (400, "temperature")
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=4)
    assert info.value.code == "model_not_found"
    bad_key = openai.OpenAI(base_url=api_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


# ------------------------------------------------------------------ authentication


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}],
                         ids=["missing", "wrong-key", "no-bearer", "basic"])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMPLETIONS),
                                          ("POST", "/v1/no-such-route")])
def test_api_key_is_required_on_v1(http, headers, method, path):
    response = http.request(method, path, json=chat_body(), headers=headers)
    error = assert_openai_error(response, 401, None, "authentication_error")
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]


def test_health_and_metrics_stay_open_without_a_key(http):
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


# ------------------------------------------------------------------ routes and methods, body size


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/nope", 404), ("GET", "/v1/nope", 404), ("POST", "/v1/embeddings", 404),
    ("GET", CHAT, 405), ("GET", COMPLETIONS, 405), ("DELETE", "/v1/models", 405), ("POST", "/health", 405),
])
def test_unknown_routes_and_wrong_methods_answer_json(http, method, path, status):
    assert_openai_error(http.request(method, path, headers=AUTH), status, None)


# A 413 closes the connection (the rest of the body is never read), so these use their own.


def test_body_over_the_limit_is_413(api_server):
    big = chat_body(messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        error = assert_openai_error(post(http, CHAT, big), 413, None)
    assert error["message"] == f"Request body too large (the limit is {MAX_BODY_BYTES} bytes)."


def test_chunked_body_over_the_limit_is_413(api_server):
    """Without a Content-Length the limit is enforced while reading."""
    def chunks():
        for _ in range(10):
            yield b" " * 200
        yield json.dumps(chat_body()).encode()

    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        response = http.post(CHAT, content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert_openai_error(response, 413, None)


def test_body_just_under_the_limit_is_served(http):
    body = chat_body()
    raw = json.dumps(body).encode()
    padded = raw[:-1] + b" " * (MAX_BODY_BYTES - len(raw)) + b"}"
    assert len(padded) == MAX_BODY_BYTES
    response = post(http, CHAT, padded)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_body_one_byte_over_the_limit_is_413(api_server):
    # the completion route serves a Content-Length up to the limit itself and leaves the rest to quart
    raw = json.dumps(chat_body()).encode()
    padded = raw[:-1] + b" " * (MAX_BODY_BYTES + 1 - len(raw)) + b"}"
    assert len(padded) == MAX_BODY_BYTES + 1
    with httpx.Client(base_url=api_server.url, timeout=30) as http:
        assert_openai_error(post(http, CHAT, padded), 413, None)


# ------------------------------------------------------------------ afterwards


async def test_server_is_healthy_and_idle_after_all_of_them_at_once(api_server):
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=api_server.url, headers=AUTH, timeout=60) as client:
        async def send(path, body):
            if isinstance(body, bytes):
                response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                response = await client.post(path, json=body)
            statuses.append(response.status_code)

        async with trio.open_nursery() as nursery:
            for _, path, body, *_ in BAD_REQUESTS * 3:
                nursery.start_soon(send, path, body)
        assert len(statuses) == 3 * len(BAD_REQUESTS) and max(statuses) < 500
        assert (await client.get("/health")).status_code == 200
        good = await client.post(CHAT, json=chat_body())
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
    api_server.wait_idle()
    assert api_server.process.poll() is None


@pytest.mark.parametrize("path", [CHAT, "/no-such-route"], ids=["401", "404"])
def test_answer_before_the_body_arrives_does_not_hang_the_connection(api_server, path):
    """An early 401/404 leaves the connection usable: the server reads the body first. (Answered
    before its body was read, hypercorn + quart-trio left the connection open and silent.)"""
    body = json.dumps(chat_body()).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # no API key: 401, or 404 for the route
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(0.2)  # the server answers from the headers alone
        sock.sendall(body)
        received = b""
        while not received.endswith(b"}}"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 401" if path == CHAT else b"HTTP/1.1 404"), received
        sock.sendall(head + body)  # the connection is kept alive: the next request is answered
        assert sock.recv(65536).startswith(received[:12])


def test_413_closes_the_connection_rather_than_leaving_it_silent(api_server):
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {5 * MAX_BODY_BYTES}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api_server.port), timeout=10) as sock:
        sock.sendall(head + b" " * (2 * MAX_BODY_BYTES))  # the rest never comes
        received = b""
        while chunk := sock.recv(65536):  # until the server closes (a timeout fails the test)
            received += chunk
    assert received.startswith(b"HTTP/1.1 413"), received
    assert received.endswith(b'"code":413}}'), received


def _same_answer_shape(answer: httpx.Response) -> tuple:
    """What must not depend on which handler served the request (ids and times aside)."""
    headers = {k: v for k, v in answer.headers.items() if k not in ("date", "content-length")}
    if headers.get("content-type") == "text/event-stream":
        body = sse_chunks(answer.content)
        body = [{k: v for k, v in chunk.items() if k not in ("id", "created")} for chunk in body]
        choices = [chunk["choices"][0] for chunk in body if chunk["choices"]]
        assert choices[0]["delta"]["role"] == "assistant"
        text = "".join(choice["delta"].get("content") or "" for choice in choices)
        return answer.status_code, headers, text, choices[-1]["finish_reason"], body[-1]["usage"]
    body = {k: v for k, v in answer.json().items() if k not in ("id", "created")}
    return answer.status_code, headers, body


@pytest.mark.parametrize("stream", [False, True])
def test_a_chunked_body_is_answered_like_one_with_a_content_length(http, stream):
    """A body with a Content-Length is served by ``tidal.http.completion_route``, a chunked one by
    quart's route: same status, headers and answer (greedy, so the text is the same too)."""
    body = chat_body(max_tokens=5, temperature=0, stream=stream, stream_options={"include_usage": True}
                     if stream else None)
    raw = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    with_length = http.post(CHAT, content=raw, headers=headers)
    chunked = http.post(CHAT, content=iter([raw[:10], raw[10:]]), headers=headers)
    assert with_length.status_code == 200
    assert _same_answer_shape(with_length) == _same_answer_shape(chunked)
    # and an error: the same OpenAI error either way
    bad = json.dumps(chat_body(max_tokens=-1)).encode()
    errors = [assert_openai_error(http.post(CHAT, content=content, headers=headers), 400, "max_tokens")
              for content in (bad, iter([bad]))]
    assert errors[0] == errors[1]
