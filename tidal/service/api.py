"""The one service path every completion-style request takes, whatever its API: admit -> first output -> answer.

``Api.admit`` parses, validates, tokenises and opens the request (every API's body is translated
to a chat or completions request first: tidal/openai/requests.py is that common shape);
``Api.first_output`` waits for the engine's first output (or the error that ended it) so the
status is known before any byte; ``answer`` turns the rest into the API's answer through its
renderer: one ``EventStream`` (tidal/service/stream.py), or one ``collect``. ``guarded`` is every
route's error boundary until its status is sent.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from tidal.errors import ApiError, bad_request, internal_error
from tidal.registry.adapters import AdapterRegistry
from tidal.registry.frontend import Frontend
from tidal.registry.lifecycle import ActiveRequest
from tidal.openai.requests import (MAX_N, Validated, chat_messages, completion_prompt, fit_max_tokens, read_body,
                                   template_kwargs, validate)
from tidal.service import body_cost
from tidal.openai.token_logprobs import LogprobsFormatter, TokenTexts
from tidal.service.reasoning import THINK_END, ReasoningSplitter, prompt_state
from tidal.service.reader import Collector, OutputReader, collect
from tidal.service.stream import EventStream, Renderer, Writer
from tidal.service.tool_calls import ToolCallStream
from tidal.observe.timeline import Timeline
from tidal.tokenizer import PromptTokenizer

PROMPT_TAIL_TOKENS = 32  # the prompt's end that says whether a template opened or closed the thinking
log = logging.getLogger("tidal.service.api")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# (status, headers, body): body bytes, or an async iterable of frames (an EventStream)
Answer = tuple[int, dict[str, str], Any]


def error_answer(error: ApiError) -> Answer:
    """The error in OpenAI's shape (Anthropic's routes have their own: tidal/anthropic/errors.py)."""
    return error.status, {"Content-Type": "application/json", **error.headers}, error.json()


def json_answer(obj: Any, status: int = 200) -> Answer:
    return status, {"Content-Type": "application/json"}, msgspec.json.encode(obj)


class Route(Protocol):
    """A completion-style route: its API's request shape in, its answer out (tidal/http/completion_route.py)."""

    async def respond(self, body: bytes, scope: dict, writer: Writer | None) -> Answer: ...

    def error_answer(self, error: ApiError) -> Answer: ...


async def guarded(respond: Awaitable[Answer], errors: Callable[[ApiError], Answer], what: str) -> Answer:
    """The request's error boundary until its status is sent: whatever goes wrong is this request's
    answer in its API's error shape (``errors``; a bug a 500), and nothing else's."""
    try:
        return await respond
    except ApiError as error:
        return errors(error)
    except Exception as exc:
        log.exception("unexpected error in a %s request", what)
        return errors(internal_error(exc))


async def answer(reader: OutputReader, renderer: Renderer, collector: Collector, stream: bool,
                 writer: Writer | None) -> Answer:
    """After the first output: the 200 with the event stream, or the whole answer (raises ApiError)."""
    if stream:
        return 200, SSE_HEADERS, EventStream(reader, renderer, writer)
    return json_answer(await collect(reader, collector))


class Api:
    """Everything a route needs, held by the app (no module globals)."""

    def __init__(self, frontend: Frontend, tokenizer: PromptTokenizer, model_name: str, max_model_len: int,
                 vocab_size: int, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 adapters: AdapterRegistry | None = None, model_root: str | None = None,
                 sampling_defaults: dict[str, float] | None = None):
        self.frontend = frontend
        self.sampling_defaults = sampling_defaults or {}  # the model's, for fields a request leaves unset
        self.model_root = model_root  # where the engine read the model from (its /v1/models card's root)
        # the LoRA adapters a request's ``model`` may name besides the base model
        self.adapters = adapters if adapters is not None else AdapterRegistry(model_name)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # the ids a gated constraint waits for (one token in Qwen3's and R1's vocabularies)
        self._think_end_ids = tuple(tokenizer.tokenizer.encode(THINK_END, add_special_tokens=False)) if reasoning_parser else ()
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

    async def admit(self, kind: str, body: bytes | dict,
                    timeline: Timeline | None = None) -> tuple[ActiveRequest, Validated]:
        """Parse, validate, tokenise and admit. Raises ApiError.

        Once this returns, the caller holds an open request; its RequestScope (tidal/registry/frontend.py)
        ends it if it is not over when the handler is done.
        ``timeline``: the request's clock, started at its first byte (now if None).
        """
        actives, checked = await self.admit_choices(kind, body, max_n=1, timeline=timeline)
        return actives[0], checked

    async def admit_choices(self, kind: str, body: bytes | dict, max_n: int = MAX_N,
                            timeline: Timeline | None = None) -> tuple[list[ActiveRequest], Validated]:
        """``admit`` for a request of ``n`` choices: one open request per choice, each counted by
        admission. Choice i > 0 is a fork of choice 0 (the engine prefills the prompt once) and,
        with a seed, draws from seed + i: reproducible and distinct."""
        if timeline is None:
            timeline = Timeline(time.monotonic())
        timeline.operation = "chat" if kind == "chat" else "text_completion"
        parsed = await read_body(kind, body)  # type: ignore[arg-type]
        adapter = self.adapters.resolve(parsed.model)  # 404 for a name that is neither the model nor an adapter
        # a large body's schemas and earlier tool calls hold JSON text to decode: off the loop too
        large = body_cost.is_large(body)
        defaults = self.sampling_defaults
        checked = (await body_cost.run(validate, parsed, self.vocab_size, defaults) if large
                   else validate(parsed, self.vocab_size, defaults))
        timeline.parsed = time.monotonic()
        if kind == "chat":
            tools = [msgspec.to_builtins(t) for t in parsed.tools] if parsed.tools else None  # type: ignore[union-attr]
            messages = await body_cost.run(chat_messages, parsed) if large else chat_messages(parsed)  # type: ignore[arg-type]
            prompt_ids = await self.tokenizer.encode_chat(messages, tools,  # type: ignore[arg-type]
                                                          template_kwargs(parsed.chat_template_kwargs))  # type: ignore[union-attr]
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
        if kind == "chat" and self.reasoning_parser is not None:
            checked = self._with_thinking(checked, prompt_ids)
        params = fit_max_tokens(checked, len(prompt_ids), self.max_model_len)
        timeline.tokenized = time.monotonic()
        spec = None
        if adapter is not None:  # checked with nothing awaited before the request is open: the count holds
            self.adapters.check_admission(adapter, self.frontend.requests)
            spec = adapter.spec
        first = self.frontend.open_request(prompt_ids, params, checked.priority, timeline=timeline, adapter=spec)
        actives = [first]
        for i in range(1, checked.n):
            seed = params.seed
            choice = params if seed is None else msgspec.structs.replace(params, seed=_offset_seed(seed, i))
            actives.append(self.frontend.open_request(prompt_ids, choice, checked.priority, fork_of=first.request_id,
                                                      timeline=timeline.fork(), adapter=spec))
        return actives, checked

    def served_name(self, active: ActiveRequest) -> str:
        """The ``model`` an answer names: the adapter the request ran through, else the served model."""
        return active.adapter or self.model_name

    def _with_thinking(self, checked: Validated, prompt_ids: list[int]) -> Validated:
        """Note where the prompt leaves the thinking; unless it closed it, a constraint waits for ``</think>``."""
        thinking = prompt_state(self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        structured = checked.params.structured
        if structured is not None and thinking != "closed":
            gated = msgspec.structs.replace(structured, after=self._think_end_ids)
            checked = dataclasses.replace(checked, params=msgspec.structs.replace(checked.params, structured=gated))
        return dataclasses.replace(checked, thinking=thinking)

    def reasoning_splitter(self, checked: Validated) -> ReasoningSplitter | None:
        if checked.thinking is None:
            return None
        return ReasoningSplitter(self.reasoning_parser, checked.thinking)  # type: ignore[arg-type]

    def timeline(self, scope: dict) -> Timeline:
        """An HTTP request's clock, from its first byte (stamped by ``request_scope_middleware``); with
        tracing on, it carries the caller's ``traceparent`` header."""
        received = scope.get("tidal.received") or time.monotonic()
        if self.frontend.recorder.exporter is None:
            return Timeline(received)
        traceparent = next((value.decode("latin-1") for name, value in scope.get("headers", ())
                            if name == b"traceparent"), None)
        return Timeline(received, traceparent)

    async def first_output(self, active: ActiveRequest, checked: Validated) -> OutputReader:
        """Wait for the request's first output (raises the ApiError that ended it before); the
        reader of the rest, in deltas of the request's stream interval (one delta without stream)."""
        first = await self.frontend.first_output(active)
        if first.error is not None:  # refused by the engine before it was scheduled
            raise bad_request(first.error, checked.structured_param)
        return OutputReader(self.frontend, active, first, self._interval(checked),  # type: ignore[arg-type]
                            self.logprobs_formatter(checked), self.tool_call_stream(checked),
                            self.reasoning_splitter(checked))

    def later_choice(self, active: ActiveRequest, checked: Validated) -> OutputReader:
        """The reader of choice i > 0 of a request, which waits for its first output at its first read."""
        return OutputReader(self.frontend, active, None, self._interval(checked),
                            self.logprobs_formatter(checked), self.tool_call_stream(checked),
                            self.reasoning_splitter(checked))

    def _interval(self, checked: Validated) -> float:
        return (checked.stream_interval or self.frontend.config.stream_interval) if checked.stream else math.inf


def _offset_seed(seed: int, i: int) -> int:
    """seed + i, wrapped into the accepted seed range [-2^63, 2^63)."""
    return seed + i if seed + i < 2**63 else seed + i - 2**64
