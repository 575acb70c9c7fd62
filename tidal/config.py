"""The frontend's settings (the engine's are ``tidal.wire.EngineConfig``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tidal.wire import EngineConfig


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    tokenizer_workers: int = 2
    stream_interval: int = 1
    # admission and backpressure (docs/admission.md)
    max_queued_requests: float = 256  # math.inf lifts the bound
    max_queue_wait: float | None = None  # seconds; None: wait as long as it takes
    max_stream_buffer_bytes: int = 1 << 20
    stream_stall_timeout: float = 30.0
    max_request_body_bytes: int = 16 << 20
    body_timeout: float = 60.0  # seconds to receive a whole request body; 408 after
    max_connections: int | None = None  # None: derived from the fd limit (tidal/http/connections.py)
    max_ws_requests_per_connection: int = 64
    shutdown_timeout: float = 30.0
    engine_heartbeat_interval: float = 1.0
    engine_heartbeat_timeout: float = 10.0
    engine_step_timeout: float = 600.0  # a step stuck past this and past its size (tidal/engines/liveness.py)
    engine_start_timeout: float = 600.0
    data_parallel_size: int = 1  # engine replicas (docs/scaling.md)
    engine_restarts: int | None = None  # restarts in a row of a dead replica; None: 5 if several, else 0
    log_level: str = "info"
    tool_call_parser: str | None = None  # the model's tool-call format, parsed under tool_choice "auto"
    reasoning_parser: str | None = None  # the model's thinking format (tidal/service/reasoning.py)
    ui: bool = True  # the chat page at / (docs/ui.md)
    generation_config: str = "auto"  # the model's sampling defaults: auto, vllm or a directory (sampling_defaults.py)
    # origins whose pages may open /v1/ws besides this server's own ("*": any); docs/admission.md
    allowed_origins: tuple[str, ...] = ()
    # Host names served besides loopback's own when bound to loopback ("*": any); tidal/http/browser_gate.py
    allowed_hosts: tuple[str, ...] = ()
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP URL for request spans (docs/tracing.md); None: off
    vllm_metric_names: bool = False  # also export the engine gauges as vllm:* (docs/scaling.md)
    # LoRA adapters (docs/lora.md); the engine's bounds are EngineConfig.max_loras, max_lora_rank, max_cpu_loras
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()  # (name, path, base_model_name or None)
    lora_runtime_updates: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_allowed_dirs: tuple[str, ...] = ()  # where a runtime load may read from
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be at least 1")
        if self.tokenizer_workers < 1:
            raise ValueError("--tokenizer-workers must be at least 1")
        if not (self.max_queued_requests >= 0):
            raise ValueError("--max-queued-requests must be >= 0")
        if self.max_queue_wait is not None and self.max_queue_wait <= 0:
            raise ValueError("--max-queue-wait must be positive")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("--max-connections must be at least 1")
        if not self.body_timeout > 0:
            raise ValueError("--body-timeout must be positive")
        if self.max_stream_buffer_bytes < 1 or self.stream_stall_timeout <= 0:
            raise ValueError("--max-stream-buffer-bytes and --stream-stall-timeout must be positive")
        if not (self.engine_heartbeat_timeout > 0 and self.engine_step_timeout > 0):
            raise ValueError("--engine-heartbeat-timeout and --engine-step-timeout must be positive")
        self._check_lora()

    def _check_lora(self) -> None:
        engine = self.engine
        if not self.enable_lora:
            if self.lora_modules or self.lora_runtime_updates or engine.max_loras:
                raise ValueError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
            return
        if engine.max_loras < 1 or engine.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if engine.max_cpu_loras and engine.max_cpu_loras < engine.max_loras:
            raise ValueError(f"--max-cpu-loras ({engine.max_cpu_loras}) must be at least --max-loras "
                             f"({engine.max_loras}): the adapters of one step stay loaded")
        if engine.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run without tensor parallelism (--tensor-parallel-size 1)")
        names = [name for name, _, _ in self.lora_modules]
        if len(set(names)) != len(names) or self.model_name in names:
            raise ValueError("--lora-modules: each adapter needs its own name, not the base model's")

    @property
    def max_loaded_adapters(self) -> int:
        """Adapters each engine keeps loaded (--max-cpu-loras, else --max-loras)."""
        return self.engine.max_cpu_loras or self.engine.max_loras

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def max_engine_restarts(self) -> int:
        if self.engine_restarts is not None:
            return self.engine_restarts
        return 5 if self.data_parallel_size > 1 else 0


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {text!r}: not JSON ({exc})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs string \"name\" and \"path\"")
        base = entry.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
        return entry["name"], entry["path"], base
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return name, path, None
