"""The LoRA adapters the server serves, by the name a request's ``model`` gives (docs/lora.md).

Each adapter is registered under a fresh id (``wire.AdapterSpec``): every engine replica reads and checks it
before it is served (``load``), so a name is either served everywhere or nowhere. An adapter is in use while
a live request runs through it (``RequestTable.adapters``, derived from each request's moves); ``unload``
refuses an adapter in use (409) rather than change or drop the weights a running request reads, and
admission refuses a request that would put more adapters in use than the engines keep loaded
(``--max-cpu-loras``, 503). Runtime loads take only paths inside the operator's ``--lora-allowed-dirs``.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import trio

from tidal.errors import ApiError, bad_request
from tidal.engines.replicas import ReplicaSet
from tidal.registry.frontend import service_unavailable
from tidal.registry.lifecycle import RequestTable
from tidal.wire import AdapterSpec

MAX_ADAPTERS = 1024  # adapters registered at once: each is a name and a path here, and a file read on every replica
MAX_NAME_CHARS = 256
LOAD_TIMEOUT = 120.0  # seconds for every replica to read and check one adapter


@dataclass(frozen=True)
class LoraModule:
    """One served adapter: its name, where it was read from, and the model it adapts."""

    spec: AdapterSpec
    base_model_name: str

    @property
    def name(self) -> str:
        return self.spec.name


def not_found(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", "not_found_error", "model", "model_not_found")


class AdapterRegistry:
    def __init__(self, base_model_name: str, modules: list[tuple[str, str, str | None]] = (), *,
                 enabled: bool = False, runtime_updates: bool = False, allowed_dirs: tuple[str, ...] = (),
                 max_loaded: int = 1) -> None:
        self.base_model_name = base_model_name
        self.enabled = enabled
        self.runtime_updates = runtime_updates
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs)
        self.max_loaded = max_loaded
        self._ids = itertools.count(1)
        self.modules: dict[str, LoraModule] = {}
        self._updating = trio.Lock()  # one load or unload at a time: each puts one message per replica in flight
        for name, path, base in modules:
            self._check_name(name)
            spec = AdapterSpec(next(self._ids), name, os.path.abspath(os.path.expanduser(path)))
            self.modules[name] = LoraModule(spec, base or base_model_name)

    @property
    def specs(self) -> tuple[AdapterSpec, ...]:
        """What an engine starting now loads (``EngineConfig.lora_modules``): a restarted replica too."""
        return tuple(module.spec for module in self.modules.values())

    def resolve(self, model: str | None) -> LoraModule | None:
        """The adapter a request's ``model`` names (None: the base model); raises 404 for an unknown name."""
        if model is None or model == self.base_model_name:
            return None
        module = self.modules.get(model)
        if module is None:
            raise not_found(model)
        return module

    def check_admission(self, module: LoraModule, table: RequestTable) -> None:
        """503 when running ``module`` would put more adapters in use than the engines keep loaded."""
        in_use = table.adapters
        if module.name not in in_use and len(in_use) >= self.max_loaded:
            raise service_unavailable(
                f"{len(in_use)} LoRA adapters are in use, the most the engine keeps loaded (--max-cpu-loras "
                f"{self.max_loaded}); retry once a request through one of them ends.")

    # ------------------------------------------------------------------ runtime updates

    def _check_updates(self) -> None:
        if not self.enabled:
            raise bad_request("LoRA adapters are off: start the server with --enable-lora")
        if not self.runtime_updates:
            raise ApiError(404, "Loading and unloading LoRA adapters at runtime is off: start the server with "
                                "--enable-lora-runtime-updates (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                           "not_found_error")

    def _check_name(self, name: str) -> None:
        if not name or len(name) > MAX_NAME_CHARS or name != name.strip():
            raise ValueError(f"a LoRA adapter name must be 1-{MAX_NAME_CHARS} characters without surrounding spaces")
        if name == self.base_model_name:
            raise ValueError(f"the LoRA adapter name {name!r} is the base model's")
        if name in self.modules:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")

    def _check_path(self, path: str) -> str:
        if not self.allowed_dirs:
            raise bad_request("lora_path is outside what the operator allows: no --lora-allowed-dirs were given",
                              "lora_path")
        if "\0" in path:  # no file system path holds one (os.path raises ValueError on it)
            raise bad_request("lora_path must not contain a NUL character", "lora_path")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.allowed_dirs):
            raise bad_request(f"lora_path {path!r} is outside the allowed directories (--lora-allowed-dirs)",
                              "lora_path")
        return real

    async def load(self, name: str, path: str, engines: ReplicaSet) -> str:
        """Register an adapter once every serving replica has read and checked it; raises ApiError (400) with
        the first replica's reason, leaving it on none."""
        self._check_updates()
        try:
            self._check_name(name)
        except ValueError as exc:
            raise bad_request(str(exc), "lora_name") from None
        real = self._check_path(path)
        if len(self.modules) >= MAX_ADAPTERS:
            raise bad_request(f"{MAX_ADAPTERS} LoRA adapters are loaded, the most the server registers; "
                              "unload one first", "lora_name")
        async with self._updating:
            if name in self.modules:  # loaded by a request that held the lock before this one
                raise bad_request(f"the LoRA adapter {name!r} has already been loaded", "lora_name")
            spec = AdapterSpec(next(self._ids), name, real)
            errors = await engines.load_adapter(spec, LOAD_TIMEOUT)
            if errors:
                engines.unload_adapter(spec.adapter_id)  # from the replicas that took it
                raise bad_request(errors[0], "lora_path")
            self.modules[name] = LoraModule(spec, self.base_model_name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, engines: ReplicaSet, table: RequestTable) -> str:
        """Forget an adapter no live request runs through: 404 for an unknown name, 409 for one in use."""
        self._check_updates()
        async with self._updating:
            module = self.modules.get(name)
            if module is None:
                raise ApiError(404, f"The LoRA adapter `{name}` is not loaded.", "not_found_error", "lora_name",
                               "model_not_found")
            users = table.adapters.get(name, 0)
            if users:
                raise ApiError(409, f"The LoRA adapter `{name}` is in use by {users} request(s); unload it once "
                                    "they end.", "conflict_error", "lora_name")
            del self.modules[name]
            engines.unload_adapter(module.spec.adapter_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
