"""HTTP routes (quart-trio): parse, validate, admit, then stream.

The handler decides the HTTP status before the first byte: it waits for the request's
first output (or for the error that ends it) and only then returns the 200 streaming
response. Everything that can fail before that is a real status with OpenAI's error JSON.

``Api.admit`` then ``Api.first_output`` is the path every request takes, HTTP or WebSocket
(tidal/websocket.py, registered from ``create_app``).
"""

from __future__ import annotations

import hmac
import logging
import math
from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tidal import fast_send
from tidal.frontend import Frontend, SHUTTING_DOWN
from tidal.lifecycle import ActiveRequest
from tidal.protocol import (
    MAX_N,
    ApiError,
    ChunkEncoder,
    Validated,
    bad_request,
    chat_messages,
    completion_prompt,
    fit_max_tokens,
    parse_body,
    validate,
)
from tidal.choices import ChoicesSseBody, collect_choices
from tidal.streaming import OutputReader, SseBody, collect
from tidal.token_logprobs import LogprobsFormatter, TokenTexts
from tidal.tool_calls import ToolCallStream
from tidal.tokenizer import PromptTokenizer
from tidal.websocket import register_websocket

log = logging.getLogger("tidal.api")

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}


# (status, headers, body): body bytes, or an async iterable of SSE frames (SseBody, ChoicesSseBody)
Answer = tuple[int, dict[str, str], Any]


def error_answer(error: ApiError) -> Answer:
    return error.status, {"Content-Type": "application/json", **error.headers}, error.json()


def json_answer(obj: Any, status: int = 200) -> Answer:
    return status, {"Content-Type": "application/json"}, msgspec.json.encode(obj)


def error_response(error: ApiError) -> Response:
    status, headers, body = error_answer(error)
    return Response(body, status, headers)


def json_response(obj: Any, status: int = 200) -> Response:
    status, headers, body = json_answer(obj, status)
    return Response(body, status, headers)


def auth_error(api_key: str | None, authorization: str) -> ApiError | None:
    """The 401 for an ``Authorization`` header that does not carry ``api_key``; None if it does."""
    if api_key is None or hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        return None
    return ApiError(401, "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                    "authentication_error", None, "invalid_api_key")


class Api:
    """Everything a route needs, held by the app (no module globals)."""

    def __init__(self, frontend: Frontend, tokenizer: PromptTokenizer, model_name: str, max_model_len: int,
                 vocab_size: int, tool_call_parser: str | None = None):
        self.frontend = frontend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tool_call_parser = tool_call_parser
        self.token_texts = TokenTexts(tokenizer.tokenizer.backend_tokenizer)

    def tool_call_stream(self, checked: Validated) -> ToolCallStream | None:
        """How the answer is read for tool calls (None: plain content)."""
        use = checked.tools
        if use is None:
            return None
        if use.mode == "auto":
            return ToolCallStream(parser=self.tool_call_parser) if self.tool_call_parser else None
        return ToolCallStream(forced=use.function or "required", named=use.mode == "named")

    def logprobs_formatter(self, checked: Validated) -> LogprobsFormatter | None:
        if checked.params.logprobs is None:
            return None
        return LogprobsFormatter(checked.kind, self.token_texts, checked.return_tokens_as_token_ids)

    async def admit(self, kind: str, body: bytes | dict) -> tuple[ActiveRequest, Validated]:
        """Parse, validate, tokenise and admit. Raises ApiError.

        Once this returns, the caller holds an open request (its RequestScope closes it too).
        """
        actives, checked = await self.admit_choices(kind, body, max_n=1)
        return actives[0], checked

    async def admit_choices(self, kind: str, body: bytes | dict,
                            max_n: int = MAX_N) -> tuple[list[ActiveRequest], Validated]:
        """``admit`` for a request of ``n`` choices: one open request per choice, each counted by
        admission. Choice i > 0 is a fork of choice 0 (the engine prefills the prompt once) and,
        with a seed, draws from seed + i: reproducible and distinct."""
        parsed = parse_body(kind, body)  # type: ignore[arg-type]
        if parsed.model is not None and parsed.model != self.model_name:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", "not_found_error", "model",
                           "model_not_found")
        checked = validate(parsed, self.vocab_size)
        if kind == "chat":
            tools = [msgspec.to_builtins(t) for t in parsed.tools] if parsed.tools else None  # type: ignore[union-attr]
            prompt_ids = await self.tokenizer.encode_chat(chat_messages(parsed), tools)  # type: ignore[arg-type]
        else:
            prompt = completion_prompt(parsed)  # type: ignore[arg-type]
            if isinstance(prompt, str):
                prompt_ids = await self.tokenizer.encode_text(prompt)
            else:
                if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
                    raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
                prompt_ids = list(prompt)
        if checked.n > max_n:
            raise bad_request("n > 1 is supported on /v1/chat/completions and /v1/completions only", "n")
        params = fit_max_tokens(checked, len(prompt_ids), self.max_model_len)
        first = self.frontend.open_request(prompt_ids, params, checked.priority)
        actives = [first]
        for i in range(1, checked.n):
            seed = params.seed
            choice = params if seed is None else msgspec.structs.replace(params, seed=_offset_seed(seed, i))
            actives.append(self.frontend.open_request(prompt_ids, choice, checked.priority, fork_of=first.request_id))
        return actives, checked

    async def first_output(self, active: ActiveRequest, checked: Validated) -> OutputReader:
        """Wait for the request's first output (raises the ApiError that ended it before); the
        reader of the rest, in deltas of the request's stream interval (one delta without stream)."""
        first = await self.frontend.first_output(active)
        if first.error is not None:  # refused by the engine before it was scheduled
            raise bad_request(first.error, checked.structured_param)
        interval = (checked.stream_interval or self.frontend.config.stream_interval) if checked.stream else math.inf
        return OutputReader(self.frontend, active, first, interval,  # type: ignore[arg-type]
                            self.logprobs_formatter(checked), self.tool_call_stream(checked))

    async def respond(self, kind: str, body: bytes | dict, scope: dict) -> Answer:
        """A completion request's answer, for any transport: (status, headers, body), the body
        bytes or the SSE body iterable (``scope``: the ASGI scope, for the direct frame writer)."""
        try:
            actives, checked = await self.admit_choices(kind, body)
            readers = [await self.first_output(active, checked) for active in actives]
        except ApiError as error:
            return error_answer(error)
        if len(readers) > 1:
            return await self._respond_choices(kind, readers, checked, scope)
        active, reader = actives[0], readers[0]
        encoder = ChunkEncoder(kind, self.model_name)  # type: ignore[arg-type]
        if checked.stream:
            return 200, _SSE_HEADERS, SseBody(reader, encoder, checked.include_usage, fast_send.body_writer(scope))
        try:
            return json_answer(await collect(reader, encoder))
        except ApiError as error:
            return error_answer(error)
        finally:
            self.frontend.close(active)

    async def complete(self, kind: str, body: bytes | dict) -> Response:
        """``respond`` as quart's Response (the route of a request ``completion_route`` left to quart)."""
        status, headers, content = await self.respond(kind, body, request.scope)
        return Response(content, status, headers)

    async def _respond_choices(self, kind: str, readers: list[OutputReader], checked: Validated,
                               scope: dict) -> Answer:
        first = ChunkEncoder(kind, self.model_name)  # type: ignore[arg-type]
        encoders = [first] + [ChunkEncoder(kind, self.model_name, i, first)  # type: ignore[arg-type]
                              for i in range(1, len(readers))]
        if checked.stream:
            return 200, _SSE_HEADERS, ChoicesSseBody(readers, encoders, checked.include_usage,
                                                     fast_send.body_writer(scope))
        try:
            return json_answer(await collect_choices(readers, encoders))
        except ApiError as error:
            return error_answer(error)
        finally:
            for reader in readers:
                self.frontend.close(reader.request)


def _offset_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into the accepted seed range [-2^63, 2^64)."""
    return seed + i if seed + i < 2**64 else seed + i - 2**64 - 2**63


def create_app(api: Api, api_key: str | None, max_body_bytes: int, metrics_render, health_check,
               max_ws_requests: int = 64) -> QuartTrio:
    app = QuartTrio("tidal")
    app.config["RESPONSE_TIMEOUT"] = None  # SSE streams may run for minutes
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes

    @app.before_request
    async def check_auth():
        if not request.path.startswith("/v1"):
            return None
        error = auth_error(api_key, request.headers.get("Authorization", ""))
        if error is not None:
            await discard_body()
            return error_response(error)
        return None

    async def discard_body() -> None:
        # Answering before the body is read makes hypercorn close the connection, and a client
        # that reuses it at that moment sees "server disconnected": read it (bounded by the
        # body limit) so the connection stays usable.
        try:
            await request.get_data(cache=False)
        except HTTPException:
            pass  # over the limit: the connection is closed instead

    async def body_bytes() -> bytes:
        return await request.get_data(cache=False)

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await api.complete("chat", await body_bytes())

    @app.post("/v1/completions")
    async def completions():
        return await api.complete("completions", await body_bytes())

    def model_card() -> dict[str, Any]:
        return {"id": api.model_name, "object": "model", "created": 0, "owned_by": "tidal",
                "max_model_len": api.max_model_len}

    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")  # path: served names may contain "/" (org/model)
    async def model(model_id: str):
        if model_id != api.model_name:
            return error_response(ApiError(404, f"The model `{model_id}` does not exist.", "not_found_error",
                                           "model", "model_not_found"))
        return json_response(model_card())

    @app.get("/health")
    async def health():
        if api.frontend.draining:
            return error_response(ApiError(503, SHUTTING_DOWN, "service_unavailable"))
        why = await health_check()
        if why is not None:
            return error_response(ApiError(503, f"The engine is not healthy: {why}", "service_unavailable"))
        return Response(b"", 200)

    @app.get("/metrics")
    async def metrics():
        return Response(metrics_render(), 200, {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    register_websocket(app, api, max_ws_requests,
                       lambda headers: auth_error(api_key, headers.get("Authorization", "")))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        status = error.code or 500
        if status not in (408, 413):  # a body that timed out would only time out again
            await discard_body()
        message = {413: f"Request body too large (the limit is {max_body_bytes} bytes).",
                   408: f"Request body not received within {app.config['BODY_TIMEOUT']:g} s."}.get(
            status, error.description or error.name)
        return error_response(ApiError(status, message, _HTTP_ERROR_TYPES.get(status, "invalid_request_error")))

    @app.errorhandler(Exception)
    async def unexpected(error: Exception):
        log.exception("unhandled error")
        return error_response(ApiError(500, f"Internal server error: {type(error).__name__}", "server_error"))

    return app
