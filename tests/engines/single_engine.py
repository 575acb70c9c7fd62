"""One engine client as the frontend's engines, without a supervisor: for tests that drive a
``Frontend`` over a bare ``EngineClient`` (no process: what it would send stays in its channel).

It answers what the frontend asks of a ``ReplicaSet`` (tidal/engines/replicas.py): whether an
engine serves, why not, and which client takes a request (always this one, unless it is dead).
"""

from __future__ import annotations

from tidal.engines.client import EngineClient, EngineDead


class SingleEngine:
    def __init__(self, client: EngineClient):
        self.client = client

    def attach(self, listener) -> None:
        self.client.attach(listener)

    @property
    def healthy(self) -> bool:
        return self.client.healthy

    @property
    def dead(self) -> str | None:
        return self.client.dead

    def pick(self, prompt_token_ids: list[int]) -> EngineClient:
        if self.client.dead is not None:
            raise EngineDead(self.client.dead)
        return self.client
