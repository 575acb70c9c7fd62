"""The routes beside the completion-style ones: a stored response (GET /v1/responses/<id>), vLLM's
tokenize/detokenize, and the body types of Responses and Messages (served with chat and
completions: routes.service_routes).

Each answers through a service module that knows its API's shapes; this module only moves
bytes between quart and that service.
"""

from __future__ import annotations

from quart import Response

from tidal.errors import ApiError
from tidal.service.api import Api, error_answer, json_answer
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


def register_agent_routes(app, api: Api, responses: ResponsesService, body_bytes) -> None:
    tokenization = Tokenization(api.tokenizer, api.adapters.resolve, api.max_model_len, api.vocab_size)

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
