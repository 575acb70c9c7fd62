"""``serve()``: the root nursery. Engine client, HTTP server, watchdogs and signals live here.

Nursery nesting is lifetime nesting::

    serve()                                   root nursery
      ReplicaSet.run                          one supervisor per engine replica (tidal/engines/replicas.py)
        EngineClient.run                      engine process + writer/demux/heartbeat tasks
      hypercorn.trio.serve                    one task per connection; quart-trio one per request
      Frontend.watch_stalls                   slow-client watchdog
      ServerState.sample                      abort counts for /state's last-minute window
      _handle_signals                         SIGINT/SIGTERM: drain, then stop

Policy on engine failure: every request in flight on the failed engine is failed at once
(the engine client tells ``Frontend.on_engine_dead``). With one engine and no
``--engine-restarts``, /health answers 503, and after a one-second grace for those errors to
reach the clients ``serve`` raises ``EngineDead``: the process exits non-zero so that a
supervisor (systemd, Kubernetes) restarts it. With replicas the others keep serving and the
dead one is restarted (docs/scaling.md); the process exits only when no replica is left.
"""

from __future__ import annotations

import logging
import signal
import socket
from functools import partial

import hypercorn.config
import hypercorn.trio
import msgspec
import trio
from prometheus_client import Counter, Gauge

from tidal.service.api import Api
from tidal.http.routes import REQUEST_BODIES, create_app
from tidal.http import connections, fast_send
from tidal.config import ServerConfig
from tidal.engines.client import EngineClient, EngineDead, channel_capacity
from tidal.http.completion_route import completion_routes
from tidal.http.browser_gate import browser_gate
from tidal.http.websocket_gate import websocket_gate
from tidal.registry.frontend import Frontend
from tidal.http.request_scope import request_scope_middleware
from tidal.observe.trace_recorder import TraceRecorder
from tidal.observe.metrics import Metrics
from tidal.engines.replicas import ReplicaSet, replica_config
from tidal.registry.adapters import AdapterRegistry
from tidal.engines.router import Router
from tidal.observe.server_state import ServerState
from tidal import sampling_defaults
from tidal.openai.requests import within_request_bounds
from tidal.tokenizer import TokenizerAhead
from tidal.ui import register_state, register_ui

log = logging.getLogger("tidal.server")

ENGINE_FAILURE_GRACE = 1.0  # seconds for error frames to reach clients before the server exits


class Server:
    """A running tidal server (for tests and embedding): ``await nursery.start(Server(cfg).run)``."""

    def __init__(self, config: ServerConfig):
        self.config = config
        num_replicas = config.data_parallel_size
        self.metrics = m = Metrics(config.model_name, num_replicas, config.vllm_metric_names)
        # admission bounds what all replicas hold together; any one replica may get all of it
        max_in_flight = config.max_queued_requests + config.engine.max_num_seqs * num_replicas

        # the LoRA adapters served; an engine (re)starting now loads those registered now
        self.adapters = adapters = AdapterRegistry(
            config.model_name, list(config.lora_modules), enabled=config.enable_lora,
            runtime_updates=config.lora_runtime_updates, allowed_dirs=config.lora_allowed_dirs,
            max_loaded=config.max_loaded_adapters)

        def make_client(index: int) -> EngineClient:
            engine = msgspec.structs.replace(config.engine, lora_modules=adapters.specs)
            return EngineClient(
                replica_config(engine, index, num_replicas),
                channel_capacity=channel_capacity(max_in_flight),
                heartbeat_interval=config.engine_heartbeat_interval,
                heartbeat_timeout=config.engine_heartbeat_timeout,
                step_timeout=config.engine_step_timeout,
                start_timeout=config.engine_start_timeout,
            )

        router = Router(num_replicas, config.engine.block_size, prefix_affinity=config.engine.enable_prefix_caching)
        self.engine = ReplicaSet(make_client, num_replicas, router, max_restarts=config.max_engine_restarts)
        self.engine.on_routed = lambda d: m.routed.labels(m.model_name, str(d.index), d.reason).inc()
        self.frontend: Frontend | None = None
        self.connection_limit: connections.ConnectionLimit | None = None
        self.urls: list[str] = []
        self.stopping = False
        self._shutdown = trio.Event()
        self._stopped = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        async with trio.open_nursery() as nursery:
            ahead = TokenizerAhead(cfg.engine.model, cfg.tokenizer_workers)
            nursery.start_soon(ahead.run)
            ready = await nursery.start(self._run_engine)
            tokenizer = await ahead.get(ready.model, ready.max_model_len)
            recorder = TraceRecorder(self.metrics, self._span_export())
            frontend = self.frontend = Frontend(cfg, self.engine, self.metrics,
                                                ready.max_num_seqs * cfg.data_parallel_size, recorder)
            defaults, refused = within_request_bounds(sampling_defaults.read(ready.model, cfg.generation_config))
            for line in refused:
                log.warning("generation_config.json: %s; ignored, as a request giving it would be refused", line)
            log.info("%s", sampling_defaults.describe(defaults, cfg.generation_config))
            api = Api(frontend, tokenizer, cfg.model_name, ready.max_model_len, ready.vocab_size,
                      cfg.tool_call_parser, cfg.reasoning_parser, self.adapters, ready.model, defaults)
            lora_info = (lambda: (frontend.requests.running_adapters, frontend.requests.queued_adapters,
                                  cfg.engine.max_loras)) if cfg.enable_lora else lambda: None
            app = create_app(api, cfg.api_key, cfg.max_request_body_bytes,
                             lambda: self.metrics.render(self.engine.stats, len(frontend.active),
                                                         self.engine.snapshot(), lora_info()),
                             self._health_check, cfg.max_ws_requests_per_connection)
            app.config["BODY_TIMEOUT"] = cfg.body_timeout
            state = ServerState(self.metrics, lambda: self.engine.stats, lambda: len(frontend.active))
            register_state(app, state)
            if cfg.ui:
                register_ui(app)
            gated = websocket_gate(completion_routes(app, app.config["SERVICE_ROUTES"], cfg.api_key))
            json_paths = frozenset(path for method, path in REQUEST_BODIES if method == "POST")
            gated = browser_gate(gated, cfg.host, json_paths, cfg.allowed_origins, cfg.allowed_hosts)
            asgi = request_scope_middleware(gated, lambda: frontend)
            fast_send.install()
            connections.install()
            hconfig = hypercorn.config.Config()
            hconfig.bind = [f"{cfg.host}:{cfg.port}"]
            hconfig.graceful_timeout = 2.0
            hconfig.keep_alive_timeout = 75
            hconfig.accesslog = None
            hconfig.errorlog = logging.getLogger("hypercorn.error")
            hconfig.tidal_connection_limit = self.connection_limit = self._connection_limit()
            self.urls = await nursery.start(partial(hypercorn.trio.serve, asgi, hconfig,
                                                    shutdown_trigger=self._shutdown.wait))
            nursery.start_soon(frontend.watch_stalls)
            nursery.start_soon(state.sample)
            pids = ", ".join(str(r.ready.pid) for r in self.engine.replicas if r.ready is not None)
            log.info("tidal ready: serving %s at %s (engine pid %s)", cfg.model_name, self.urls[0], pids)
            if cfg.ui:
                log.info("chat page: %s/ (--no-ui turns it off)", self.urls[0])
            task_status.started(self.urls)
            try:
                await self._stopped.wait()
            finally:
                if recorder.exporter is not None:  # flush the last spans, on the export thread's time
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await trio.to_thread.run_sync(recorder.exporter.shutdown, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()

    def _span_export(self):
        """The OTLP span exporter (tidal/observe/otel.py) with --otlp-traces-endpoint, else None (nothing imported)."""
        endpoint = self.config.otlp_traces_endpoint
        if endpoint is None:
            return None
        from tidal.observe.otel import SpanExport  # the opentelemetry SDK: only when tracing is on

        log.info("tracing: one span per request to %s (OTLP/HTTP)", endpoint)
        return SpanExport(endpoint, self.metrics.model_name, self.metrics.trace_spans_dropped_m.inc)

    def _connection_limit(self) -> connections.ConnectionLimit:
        fd_limit = connections.raise_fd_limit()
        limit = self.config.max_connections or connections.default_max_connections(fd_limit)
        if limit > fd_limit - connections.FD_RESERVE:
            log.warning("--max-connections %d is close to the fd limit (%d): the server may run out of "
                        "file descriptors before it refuses connections", limit, fd_limit)
        registry, model = self.metrics.registry, [self.metrics.model_name]
        refused = Counter("tidal:connections_refused", "Connections refused over --max-connections.",
                          ["model_name"], registry=registry).labels(*model)
        connection_limit = connections.ConnectionLimit(limit, on_refused=refused.inc)
        Gauge("tidal:connections_open", "Connections served (HTTP and WebSocket).", ["model_name"],
              registry=registry).labels(*model).set_function(lambda: connection_limit.num_open)
        return connection_limit

    async def _run_engine(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.engine.run(task_status=task_status)
        except* EngineDead:
            if self.engine.ever_served:  # failed while serving: let the errors reach clients
                with trio.CancelScope(shield=True):
                    await trio.sleep(ENGINE_FAILURE_GRACE)
            raise

    async def _health_check(self) -> str | None:
        """None (200) while at least one engine replica answers; else why not (503)."""
        return await self.engine.health(timeout=2.0)

    async def stop(self) -> None:
        """Graceful stop: refuse new requests, drain for --shutdown-timeout, abort the rest, exit."""
        if self.stopping:
            return
        self.stopping = True
        if self.frontend is not None:
            await self.frontend.drain(self.config.shutdown_timeout)
            with trio.move_on_after(2.0):  # let aborted streams write their final frame
                while self.frontend.active:
                    await trio.sleep(0.01)
        self._shutdown.set()
        await trio.sleep(0.05)
        self._stopped.set()

    def stop_now(self) -> None:
        self._shutdown.set()
        self._stopped.set()


async def serve(config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM (graceful; a second signal stops at once). Returns the exit code."""
    server = Server(config)
    exit_code = 0
    try:
        check_port_free(config.host, config.port)  # before the engine loads: that can take minutes
        async with trio.open_nursery() as nursery:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async def on_signals():
                    async for signum in signals:
                        if server.stopping:
                            log.warning("second signal: stopping now")
                            nonlocal exit_code
                            exit_code = 1
                            server.stop_now()
                            nursery.cancel_scope.cancel()
                            return
                        if server.frontend is None:  # still starting: nothing to drain, stop now
                            log.info("%s while starting: stopping", signal.Signals(signum).name)
                            server.stopping = True
                            nursery.cancel_scope.cancel()  # the engine client stops its process
                            return
                        log.info("%s: draining (up to %.0f s), then stopping", signal.Signals(signum).name,
                                 config.shutdown_timeout)
                        nursery.start_soon(server.stop)

                nursery.start_soon(on_signals)
                await server.run()
                nursery.cancel_scope.cancel()
    except* EngineDead:  # the engine client logged why, once, when it declared the engine dead
        log.info("exiting with code 3 (engine failure)")
        exit_code = 3
    except* OSError as group:  # e.g. the port is taken
        log.error("exiting: cannot serve on %s:%d: %s", config.host, config.port, _innermost(group))
        exit_code = 2
    if exit_code in (0, 1):  # the failures above said their own last line
        log.info("tidal stopped (exit code %d)", exit_code)
    return exit_code


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (e.g. "Address already in use") if hypercorn could not bind host:port."""
    if port == 0:
        return
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
        probe.bind(address)


def _innermost(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):  # nested nurseries nest the groups
        error = error.exceptions[0]
    return error
