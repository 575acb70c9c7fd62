"""The engine's LoRA adapters: which it knows, which it keeps loaded, which live sequences hold.

The frontend registers each adapter under a fresh id (``wire.AdapterSpec``; a name loaded again gets a new
id, so an id always means the same weights) and unregisters it once no request uses it. A sequence holds
its adapter from ``add_request`` to its end (``acquire`` / ``release``): a held adapter stays loaded.
At most ``max_cpu_loras`` adapters are loaded; a load past that evicts the least recently used adapter
no sequence holds, and refuses when every loaded one is held (the frontend's admission keeps the
adapters in use within the bound, so this is a last guard). The scheduler bounds the adapters of one
step (``max_loras``); ``place`` puts a batch's adapters in the model's slots before its pass.

Pure bookkeeping over ``model.lora`` (the reading and the slots); no I/O but the adapter files.
"""

from __future__ import annotations

import collections
import logging

from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.lora import AdapterError, LoraAdapter, LoraSlots, read_adapter
from tidal.gpu.scheduler import ScheduledBatch
from tidal.wire import AdapterSpec

log = logging.getLogger("tidal.engine")


class Adapters:
    def __init__(self, model_config: ModelConfig, slots: LoraSlots, max_rank: int, max_loaded: int) -> None:
        self.model_config = model_config
        self.slots = slots
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.specs: dict[int, AdapterSpec] = {}  # registered: id -> spec
        self.loaded: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()  # LRU: oldest first
        self.holds: collections.Counter[int] = collections.Counter()  # id -> live sequences using it

    def register(self, spec: AdapterSpec) -> None:
        """Read and check the adapter now (raises ``AdapterError``, leaving nothing registered); keep it
        loaded if there is room."""
        adapter = read_adapter(spec.name, spec.path, self.model_config, self.max_rank)
        self.specs[spec.adapter_id] = spec
        if self._make_room():
            self.loaded[spec.adapter_id] = adapter

    def unregister(self, adapter_id: int) -> None:
        """Forget an adapter (its weights go once no sequence holds it: the last ``release``)."""
        self.specs.pop(adapter_id, None)
        if not self.holds[adapter_id]:
            self._drop(adapter_id)

    def acquire(self, adapter_id: int) -> None:
        """Hold an adapter for a new sequence, loading it if it is not; raises ``AdapterError`` (holding nothing)."""
        spec = self.specs.get(adapter_id)
        if spec is None:
            raise AdapterError(f"LoRA adapter id {adapter_id} is not loaded")
        if adapter_id in self.loaded:
            self.loaded.move_to_end(adapter_id)
        else:
            if not self._make_room():
                raise AdapterError(f"LoRA adapter {spec.name!r} cannot load: the {self.max_loaded} loaded adapters "
                                   "(--max-cpu-loras) are all in use")
            self.loaded[adapter_id] = read_adapter(spec.name, spec.path, self.model_config, self.max_rank)
        self.holds[adapter_id] += 1

    def release(self, adapter_id: int) -> None:
        self.holds[adapter_id] -= 1
        if not self.holds[adapter_id]:
            del self.holds[adapter_id]
            if adapter_id not in self.specs:  # unregistered while held
                self._drop(adapter_id)

    def place(self, batch: ScheduledBatch) -> None:
        """Put the batch's adapters (held, so loaded; at most ``max_loras``) in the model's slots."""
        ids = {seq.adapter_id for seq, _ in batch.entries if seq.adapter_id is not None}
        if ids:
            self.slots.place({adapter_id: self.loaded[adapter_id] for adapter_id in ids})

    def _make_room(self) -> bool:
        """Evict the least recently used unheld adapters until one more fits; False if every one is held."""
        for adapter_id in list(self.loaded):
            if len(self.loaded) < self.max_loaded:
                break
            if not self.holds[adapter_id]:
                self._drop(adapter_id)
        return len(self.loaded) < self.max_loaded

    def _drop(self, adapter_id: int) -> None:
        self.loaded.pop(adapter_id, None)
        self.slots.forget(adapter_id)
