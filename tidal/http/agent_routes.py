"""The routes beside chat and completions: OpenAI's Responses, Anthropic's Messages, vLLM's
tokenize/detokenize.

Each answers through a service module that knows its API's shapes; this module only moves
bytes between quart and that service, as routes.py does for the completion routes.
"""

from __future__ import annotations

from quart import Response, request

from tidal.anthropic.service import MessagesService
from tidal.errors import ApiError
from tidal.service.api import Api, error_answer, json_answer
from tidal.openai.response_store import ResponseStore
from tidal.openai.responses_service import ResponsesService
from tidal.anthropic.messages import MessagesRequest
from tidal.openai.responses import ResponsesRequest
from tidal.openai.tokenize import DetokenizeRequest, Tokenization, TokenizeRequest

# The body type of each route here, for GET /openapi.json and its fuzzer (tidal/http/openapi.py).
REQUEST_BODIES: dict[tuple[str, str], type] = {
    ("POST", "/v1/responses"): ResponsesRequest,
    ("POST", "/v1/messages"): MessagesRequest,
    ("POST", "/tokenize"): TokenizeRequest,
    ("POST", "/detokenize"): DetokenizeRequest,
}

# Paths outside /v1 that still need the API key (vLLM's tokenizer routes).
AUTHORIZED_PATHS = frozenset({"/tokenize", "/detokenize"})


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def _answer(answer) -> Response:
    status, headers, content = answer
    return Response(content, status, headers)


def register_agent_routes(app, api: Api, body_bytes, response_store: ResponseStore | None = None) -> None:
    tokenization = Tokenization(api.tokenizer, api.adapters.resolve, api.max_model_len, api.vocab_size)
    responses = ResponsesService(api, response_store)
    messages = MessagesService(api)

    @app.post("/v1/messages")
    async def create_message():
        return _answer(await messages.respond(await body_bytes(), request.scope))

    @app.post("/v1/responses")
    async def create_response():
        return _answer(await responses.respond(await body_bytes(), request.scope))

    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str):
        try:
            return _answer(json_answer(responses.retrieve(response_id)))
        except ApiError as error:
            return _answer(error_answer(error))

    @app.post("/tokenize")
    async def tokenize():
        try:
            return _answer(json_answer(await tokenization.tokenize(await body_bytes())))
        except ApiError as error:
            return _answer(error_answer(error))

    @app.post("/detokenize")
    async def detokenize():
        try:
            return _answer(json_answer(await tokenization.detokenize(await body_bytes())))
        except ApiError as error:
            return _answer(error_answer(error))
