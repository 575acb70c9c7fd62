"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's own tokenizer, for clients that count.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` would) or chat ``messages``
(rendered by the chat template as ``/v1/chat/completions`` would, ``chat_template_kwargs``
included) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize``
takes ``tokens`` and answers ``{"prompt"}``. Both take the bounds a prompt has: text with more
characters than the context can hold is refused before tokenising, more ids than the context
holds are refused, and ids must be in the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from tidal.errors import bad_request, context_too_long
from tidal.openai.requests import ChatMessage, Tool, template_kwargs, template_messages
from tidal.service.decode import read_struct
from tidal.tokenizer import PromptTokenizer
from tidal.wire import INT32_MAX

# A static cap for the schema; the context length (usually smaller) is checked per server.
MAX_TOKEN_IDS = 1 << 20


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """One of ``prompt`` or ``messages`` (vLLM's two shapes in one struct)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # for a prompt (default true); messages get the template's own
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]], msgspec.Meta(max_length=MAX_TOKEN_IDS)]


class Tokenization:
    """The two routes' answers, given the server's tokenizer and limits."""

    def __init__(self, tokenizer: PromptTokenizer, resolve_model: Callable[[str | None], object], max_model_len: int,
                 vocab_size: int):
        self.tokenizer = tokenizer
        self.resolve_model = resolve_model  # raises the 404 for a name that is neither the model nor a LoRA adapter
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def _check_model(self, model: str | None) -> None:
        self.resolve_model(model)

    def _check_count(self, count: int, param: str) -> None:
        if count > self.max_model_len:
            raise context_too_long(self.max_model_len, f"your request has {count} tokens.", param)

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        request: TokenizeRequest = await read_struct(body, TokenizeRequest)
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", "prompt")
        if request.prompt is not None:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await self.tokenizer.encode_text(request.prompt, add_special)
            param = "prompt"
        else:
            messages = template_messages(request.messages)  # type: ignore[arg-type]
            tools = [msgspec.to_builtins(t) for t in request.tools] if request.tools else None
            ids = await self.tokenizer.encode_chat(messages, tools, template_kwargs(request.chat_template_kwargs),
                                                   request.add_generation_prompt)
            param = "messages"
        self._check_count(len(ids), param)
        strs = self.tokenizer.token_strings(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        request: DetokenizeRequest = await read_struct(body, DetokenizeRequest)
        self._check_model(request.model)
        self._check_count(len(request.tokens), "tokens")
        if not all(t < self.vocab_size for t in request.tokens):
            raise bad_request(f"tokens must be integers in [0, {self.vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

