"""HTTP routes (quart-trio): the OpenAI endpoints, models, health and metrics, and the error handlers.

The handler decides the HTTP status before the first byte: the service (tidal/service/api.py)
waits for the request's first output (or for the error that ends it) and only then is the 200
streaming response returned. Everything that can fail before that is a real status with OpenAI's
error JSON. The hot completion routes usually never reach quart (tidal/http/completion_route.py).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tidal.errors import ApiError
from tidal.registry.frontend import SHUTTING_DOWN
from tidal.anthropic import errors as anthropic_errors
from tidal.anthropic.service import MessagesService
from tidal.http import fast_send
from tidal.http.agent_routes import AUTHORIZED_PATHS, is_anthropic_path, register_agent_routes
from tidal.http.agent_routes import REQUEST_BODIES as AGENT_REQUEST_BODIES
from tidal.http.adapter_routes import REQUEST_BODIES as ADAPTER_REQUEST_BODIES
from tidal.http.adapter_routes import register_adapter_routes
from tidal.http.auth import auth_error, authorization
from tidal.http.openapi import app_routes, openapi_document
from tidal.http.websocket import register_websocket
from tidal.openai.completions import Completions
from tidal.openai.requests import ChatCompletionRequest, CompletionRequest
from tidal.openai.responses_service import ResponsesService
from tidal.service.api import Api, Route, error_answer, json_answer

log = logging.getLogger("tidal.http.routes")

# The body type of every route that takes one: /openapi.json describes it and the fuzzer sends it
# (a POST route missing here fails tests/hardening/test_openapi_fuzz.py).
REQUEST_BODIES: dict[tuple[str, str], type] = {
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/v1/completions"): CompletionRequest,
    **AGENT_REQUEST_BODIES,  # /v1/responses, /v1/messages, /tokenize, /detokenize
    **ADAPTER_REQUEST_BODIES,  # /v1/load_lora_adapter, /v1/unload_lora_adapter
}

_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}


def error_response(error: ApiError) -> Response:
    """The error in the shape of the API the request spoke: Anthropic's on its routes, else OpenAI's."""
    status, headers, body = (anthropic_errors.error_answer(error) if is_anthropic_path(request.path)
                             else error_answer(error))
    return Response(body, status, headers)


def json_response(obj: Any, status: int = 200) -> Response:
    status, headers, body = json_answer(obj, status)
    return Response(body, status, headers)


def service_routes(api: Api) -> dict[str, Route]:
    """The completion-style routes, by path: each an API's request shape and renderer over ``Api``.
    ``completion_route`` serves them in front of quart; quart serves what it leaves (``create_app``)."""
    return {"/v1/chat/completions": Completions(api, "chat"), "/v1/completions": Completions(api, "completions"),
            "/v1/responses": ResponsesService(api), "/v1/messages": MessagesService(api)}


def _quart_view(route: Route, body_bytes):
    async def view() -> Response:
        """A request ``completion_route`` left to quart: the same answer, as quart's Response."""
        status, headers, content = await route.respond(await body_bytes(), request.scope,
                                                       fast_send.body_writer(request.scope))
        return Response(content, status, headers)

    return view


def create_app(api: Api, api_key: str | None, max_body_bytes: int, metrics_render, health_check,
               max_ws_requests: int = 64) -> QuartTrio:
    app = QuartTrio("tidal")
    app.config["RESPONSE_TIMEOUT"] = None  # SSE streams may run for minutes
    app.config["BODY_TIMEOUT"] = 60
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes

    @app.before_request
    async def check_auth():
        if not request.path.startswith("/v1") and request.path not in AUTHORIZED_PATHS:
            return None
        error = auth_error(api_key, authorization(request.headers))
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

    routes = app.config["SERVICE_ROUTES"] = service_routes(api)  # served first by completion_route
    for path, route in routes.items():
        app.add_url_rule(path, path, _quart_view(route, body_bytes), methods=["POST"])

    def model_card(adapter=None) -> dict[str, Any]:
        """The base model's card (root: where it was read from), or a LoRA adapter's (vLLM's: its parent is the
        model it adapts, its root its directory)."""
        if adapter is None:
            return {"id": api.model_name, "object": "model", "created": 0, "owned_by": "tidal",
                    "root": api.model_root, "parent": None, "max_model_len": api.max_model_len,
                    "sampling_defaults": api.sampling_defaults}
        return {"id": adapter.name, "object": "model", "created": 0, "owned_by": "tidal", "root": adapter.spec.path,
                "parent": adapter.base_model_name, "max_model_len": api.max_model_len}

    @app.get("/v1/models")
    async def models():
        cards = [model_card()] + [model_card(adapter) for adapter in api.adapters.modules.values()]
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/<path:model_id>")  # path: served names may contain "/" (org/model)
    async def model(model_id: str):
        try:
            return json_response(model_card(api.adapters.resolve(model_id)))
        except ApiError as error:
            return error_response(error)

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

    register_agent_routes(app, api, routes["/v1/responses"], body_bytes)  # type: ignore[arg-type]
    register_adapter_routes(app, api, body_bytes)
    register_websocket(app, api, max_ws_requests,
                       lambda headers: auth_error(api_key, headers.get("Authorization", "")))

    @app.get("/openapi.json")
    async def openapi():
        # built at the first call: routes registered after create_app (the page, /state) are in it
        if "openapi" not in app.config:
            app.config["openapi"] = msgspec.json.encode(openapi_document(app_routes(app), REQUEST_BODIES, "tidal"))
        return Response(app.config["openapi"], 200, {"Content-Type": "application/json"})

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
