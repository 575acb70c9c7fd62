"""The bounded in-memory store behind ``store`` / ``previous_response_id`` (Responses API).

Each stored response keeps the conversation that produced it (chat messages: its history, its
input, its output) so the next turn needs only its new input. Bounded three ways
(docs/admission.md): at most ``max_entries`` responses, none older than ``max_age`` seconds, at
most ``max_bytes`` in all, counting everything an entry keeps (the response object with its
metadata, tools, instructions and user, and the conversation, as JSON bytes: empty messages
too); the oldest go first. A missing id is a 404, never a guess.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

_encode = msgspec.json.encode

MAX_STORED_RESPONSES = 1024
MAX_STORED_AGE_S = 3600.0
MAX_STORED_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # chat messages up to and including its output (no instructions)
    size: int  # bytes of what it keeps, as JSON
    stored_at: float


def stored_size(response: dict[str, Any], conversation: list[dict[str, Any]]) -> int:
    """What an entry keeps, in bytes of JSON: a fair count of the memory it holds, whatever its fields."""
    return len(_encode(response)) + len(_encode(conversation))


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_age: float = MAX_STORED_AGE_S,
                 max_bytes: int = MAX_STORED_BYTES, clock=time.monotonic):
        self.max_entries = max_entries
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = stored_size(response, conversation)
        if size > self.max_bytes:
            return  # larger than the whole store: never kept (its id will answer 404)
        entry = StoredResponse(response, conversation, size, self.clock())
        self._entries[response["id"]] = entry
        self.num_bytes += size
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        self._evict()
        return self._entries.get(response_id)

    def _evict(self) -> None:
        oldest_allowed = self.clock() - self.max_age
        while self._entries:
            first = next(iter(self._entries.values()))
            if (len(self._entries) <= self.max_entries and self.num_bytes <= self.max_bytes
                    and first.stored_at >= oldest_allowed):
                return
            self._entries.popitem(last=False)
            self.num_bytes -= first.size
