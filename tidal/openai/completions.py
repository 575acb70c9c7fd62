"""``POST /v1/chat/completions`` and ``/v1/completions``: the service path with OpenAI's chunks.

Admitted by ``Api`` (one request per choice), answered through ``ChatRenderer``: one event stream
or one collected response, and for n > 1 the choices joined (tidal/openai/choices.py).
"""

from __future__ import annotations

from typing import Literal

from tidal.errors import ApiError
from tidal.openai.choices import collect_choices, stream_choices
from tidal.openai.encoding import ChatRenderer, ChunkEncoder
from tidal.service.api import SSE_HEADERS, Answer, Api, answer, error_answer, guarded, json_answer
from tidal.service.reader import OutputReader
from tidal.service.stream import Writer


class Completions:
    """One of the two completion routes (a ``Route``: tidal/service/api.py)."""

    def __init__(self, api: Api, kind: Literal["chat", "completions"]):
        self.api = api
        self.kind = kind

    def error_answer(self, error: ApiError) -> Answer:
        return error_answer(error)

    async def respond(self, body: bytes | dict, scope: dict, writer: Writer | None) -> Answer:
        """The answer: (status, headers, body), the body bytes or the event stream (``scope``: the ASGI
        scope, for the request's clock; ``writer``: the transport's direct frame writer, if any)."""
        return await guarded(self._respond(body, scope, writer), error_answer, self.kind)

    async def _respond(self, body: bytes | dict, scope: dict, writer: Writer | None) -> Answer:
        api, kind = self.api, self.kind
        actives, checked = await api.admit_choices(kind, body, timeline=api.timeline(scope))
        # the first choice decides the status; the others are read as their output comes (some may
        # still be queued behind the first ones: waiting for them here would leave those unread)
        readers = [await api.first_output(actives[0], checked)]
        readers += [api.later_choice(active, checked) for active in actives[1:]]
        if len(readers) > 1:
            return await self._respond_choices(readers, checked.stream, checked.include_usage, writer)
        renderer = ChatRenderer(ChunkEncoder(kind, api.served_name(actives[0])), checked.include_usage)
        return await answer(readers[0], renderer, renderer, checked.stream, writer)

    async def _respond_choices(self, readers: list[OutputReader], stream: bool, include_usage: bool,
                               writer: Writer | None) -> Answer:
        name = self.api.served_name(readers[0].request)
        first = ChunkEncoder(self.kind, name)
        encoders = [first] + [ChunkEncoder(self.kind, name, i, first) for i in range(1, len(readers))]
        if stream:
            return 200, SSE_HEADERS, stream_choices(readers, encoders, include_usage, writer)
        # an ApiError: the choices still running end with the handler's RequestScope
        return json_answer(await collect_choices(readers, encoders))
