"""vLLM's routes that load and unload LoRA adapters at runtime (``--enable-lora-runtime-updates``).

The bodies are vLLM's; what a load or an unload does, and every refusal, is the adapter registry's
(tidal/registry/adapters.py). The answers are vLLM's: a plain-text success line, or OpenAI's error JSON.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from quart import Response

from tidal.errors import ApiError
from tidal.service.decode import decode_struct
from tidal.registry.adapters import MAX_NAME_CHARS
from tidal.service.api import Api, error_answer
from tidal.wire import INT32_MAX

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


class LoadLoraAdapterRequest(msgspec.Struct):
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]


class UnloadLoraAdapterRequest(msgspec.Struct):
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    lora_int_id: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] | None = None  # vLLM's; the name alone says which


REQUEST_BODIES: dict[tuple[str, str], type] = {
    ("POST", "/v1/load_lora_adapter"): LoadLoraAdapterRequest,
    ("POST", "/v1/unload_lora_adapter"): UnloadLoraAdapterRequest,
}


def register_adapter_routes(app, api: Api, body_bytes) -> None:
    async def answer(update) -> Response:
        try:
            text = await update()
        except ApiError as error:
            status, headers, content = error_answer(error)
            return Response(content, status, headers)
        return Response(text, 200, {"Content-Type": "text/plain; charset=utf-8"})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter():
        body = await body_bytes()

        async def load() -> str:
            request = decode_struct(body, LoadLoraAdapterRequest)
            return await api.adapters.load(request.lora_name, request.lora_path, api.frontend.engine)

        return await answer(load)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter():
        body = await body_bytes()

        async def unload() -> str:
            request = decode_struct(body, UnloadLoraAdapterRequest)
            return await api.adapters.unload(request.lora_name, api.frontend.engine, api.frontend.requests)

        return await answer(unload)
