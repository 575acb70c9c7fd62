"""``tidal serve``, ``tidal bench`` and ``tidal build-kernels``. Flag names follow vLLM / SGLang where one exists."""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import os
import sys

from tidal.wire import EngineConfig


def _queue_bound(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (or 'inf' to lift the bound)")
    return value if math.isinf(value) else int(value)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="tidal-tiny",
                   help="A Hugging Face Hub id (ORG/NAME; downloaded once into the Hub cache), a local Hugging "
                        "Face model directory (config.json, *.safetensors, tokenizer.json), a GGUF file (or a "
                        "directory holding one), 'ollama:NAME[:TAG]' (a model Ollama pulled; docs/models.md), or "
                        "'tidal-tiny', the embedded 7M-parameter Llama with deterministic weights (default).")
    g.add_argument("--generation-config", default="auto",
                   help="Sampling defaults for requests that leave them unset (temperature, top_p, top_k, "
                        "repetition_penalty): 'auto' from the model's generation_config.json (default), 'vllm' "
                        "ignores it (temperature 1.0), or a directory holding a generation_config.json (e.g. for "
                        "a GGUF file). The ready log says which apply; GET /v1/models shows them.")
    g.add_argument("--tokenizer", default=None,
                   help="GGUF models only: a Hugging Face model directory whose tokenizer (and chat template) to "
                        "use instead of the one in the file.")
    g.add_argument("--revision", default=None,
                   help="Hub ids only: the branch, tag or commit to serve (default: main).")
    g.add_argument("--download-dir", default=None,
                   help="Hub ids only: the cache directory to download into and look in (default: the Hugging "
                        "Face cache, $HF_HOME/hub).")
    g.add_argument("--served-model-name", default=None,
                   help="The model name clients send and /v1/models lists (default: the --model value, the "
                        "Hub id for a Hub model).")
    g.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu or cuda[:N].")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="Weights and activations dtype. auto: bfloat16 on CUDA and on CPUs with native bf16 "
                        "(avx512_bf16 or amx_bf16), float32 on other CPUs; the engine-ready log line says which.")
    g.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8", "w4a8", "fp8"],
                   help="Quantize a full-precision checkpoint's linear weights at load: int8 (one scale per "
                        "output channel) or int4 (one per 32 inputs, as llama.cpp's Q4_0), read 2x / ~3.5x fewer "
                        "bytes per decode step than bf16 (CPU: C++ kernel; CUDA: Triton kernel); w8a8 / w4a8 (CPU): the same weights "
                        "with each step's activations rounded to int8 (blocks of 32, llama.cpp's Q8_0/Q4_0 "
                        "arithmetic): integer math, the faster kernel on every CPU measured, so int8 / int4 run "
                        "as w8a8 / w4a8 on a CPU under --dtype auto (a named --dtype keeps the activations exact); "
                        "fp8 (CUDA GPUs with FP8, compute "
                        "capability 8.9+: FP8 weights per channel, activations per token, torch._scaled_mm). "
                        "Quantized (compressed-tensors) checkpoints need no flag.")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="Longest prompt + completion in tokens (default: the model's max_position_embeddings, "
                        "capped by the KV cache size).")
    g.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences in one engine step (default 256).")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="Token budget of one engine step; longer prompts are prefilled in chunks (default 2048).")
    g.add_argument("--block-size", type=int, default=16, help="Tokens per KV-cache block (default 16).")
    g.add_argument("--kv-cache-memory", type=float, default=1.0,
                   help="KV cache size in GiB (default 1). Ignored if --num-kv-blocks is given.")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="Exact number of KV blocks (overrides "
                   "--kv-cache-memory).")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="Speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' proposes up to K tokens per step from "
                        "the request's own prompt and output and verifies them in one pass; the output is exactly "
                        "what it would be without (docs/engine.md). Off by default.")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="Seconds a structured-output request waits for its grammar to compile before a 400 "
                        "(default 10).")
    g.add_argument("--grammar-cache-bytes", type=int, default=512 << 20,
                   help="Compiled grammars kept for reuse, in bytes (default 512 MiB).")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="Disable the prefix cache (on by default).")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: first come, first served. priority: lower 'priority' values first; a more "
                        "urgent arrival at a full queue evicts the least urgent waiting request (503).")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                   help="auto: Triton kernels on CUDA, torch on CPU. Force either.")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every step's kernels instead of replaying the decode steps' captured "
                        "CUDA graphs (saves the graphs' memory and the capture at start). No effect on CPU.")
    g.add_argument("--engine-threads", type=int, default=None, help="torch threads in the engine (default: "
                   "torch's default, one per core).")
    g.add_argument("--seed", type=int, default=0, help="Engine RNG seed for requests without a 'seed' (default 0).")
    g.add_argument("--data-parallel-size", "--dp-size", type=int, default=1,
                   help="Engine replicas, each its own process with the whole model (on CUDA: replica k on "
                        "GPU k). Requests are routed to the least loaded, preferring the one that caches "
                        "their prompt prefix (docs/scaling.md). Default 1.")
    g.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1,
                   help="Rank processes per replica, each holding 1/N of every layer (Megatron-style; "
                        "torch.distributed: NCCL on CUDA, gloo on CPU). N must divide the model's attention "
                        "heads and intermediate size (docs/scaling.md). Default 1.")
    g.add_argument("--nnodes", type=int, default=1,
                   help="Nodes the tensor-parallel ranks are spread over (each runs N / nnodes of them). Default 1.")
    g.add_argument("--node-rank", type=int, default=0,
                   help="This node's index. 0 runs the server and rank 0; any other runs its ranks only, "
                        "headless (no HTTP server), until node 0 shuts them down. Default 0.")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="Address of node 0, where the ranks meet (torch.distributed env:// rendezvous). "
                        "Default 127.0.0.1.")
    g.add_argument("--master-port", type=int, default=None,
                   help="Rendezvous port on node 0; replica k uses this + k. Default: a free port on one node, "
                        "29500 with --nnodes > 1.")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="SGLang's spelling of --master-addr HOST --master-port PORT.")
    g.add_argument("--engine-restarts", type=int, default=None,
                   help="Times a dead engine replica is restarted in a row (backoff 1, 2, 4 ... s) before it "
                        "is given up. Default: 5 with --data-parallel-size > 1; 0 with one replica, which "
                        "keeps the server's behaviour of exiting with code 3 when its engine dies.")
    g.add_argument("--min-step-time", type=float, default=0.0, help=argparse.SUPPRESS)  # test model knob

    g = p.add_argument_group("LoRA adapters (see docs/lora.md)")
    g.add_argument("--enable-lora", action="store_true",
                   help="Serve LoRA adapters: a request's 'model' names the adapter it runs through.")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="Adapters to serve from the start, each name=path (a PEFT directory) or vLLM's JSON form "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'.")
    g.add_argument("--max-loras", type=int, default=1,
                   help="Most adapters in one engine step (default 1); a request for another waits its turn.")
    g.add_argument("--max-lora-rank", type=int, default=16, help="Largest adapter rank served (default 16).")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="Adapters each engine keeps loaded (default: --max-loras); more in use at once is a 503.")
    g.add_argument("--enable-lora-runtime-updates", action="store_true",
                   default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                   help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).")
    g.add_argument("--lora-allowed-dirs", default="", metavar="DIR[,DIR...]",
                   help="Directories a runtime load may read adapters from (none by default: every path is refused).")

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    g.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000; 0 picks a free one).")
    g.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise).")
    g.add_argument("--tokenizer-workers", type=int, default=2,
                   help="Threads for chat templating and tokenisation, off the event loop (default 2).")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="Send a stream frame every K tokens (plus the last); per-request 'stream_interval' "
                        "overrides it. Default 1.")
    g.add_argument("--max-request-body-bytes", type=int, default=16 << 20, help="413 above this (default 16 MiB).")
    g.add_argument("--body-timeout", type=float, default=60.0,
                   help="Seconds a client may take to send a whole request body; 408 after (default 60).")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="Log level of the server (default info); the engine process logs at TIDAL_ENGINE_LOG_LEVEL "
                        "(default WARNING).")
    g.add_argument("--allowed-origins", default="",
                   help="Comma-separated origins (e.g. https://app.example) whose web pages may call the API "
                        "(HTTP, with CORS, and /v1/ws); '*' allows any. By default only this server's own page may "
                        "(a page on another origin could otherwise drive the model through the user's browser).")
    g.add_argument("--allowed-hosts", default="",
                   help="Comma-separated Host names served besides localhost, 127.0.0.1 and ::1 when bound to a "
                        "loopback address; '*' allows any (keeps DNS-rebinding pages out by default).")
    g.add_argument("--no-ui", dest="ui", action="store_false",
                   help="Do not serve the chat page at / (docs/ui.md). The API is unaffected.")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="The model's tool-call format, parsed into message.tool_calls under tool_choice 'auto' "
                        "(hermes: Qwen2/Qwen3 <tool_call>; llama3_json; mistral [TOOL_CALLS]). "
                        "tool_choice 'required' or a named function needs no parser.")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="Split the model's thinking (<think>...</think>) into message.reasoning_content "
                        "(chat) and reasoning items (Responses); output constraints apply after it ends.")

    g = p.add_argument_group("admission and backpressure (see docs/admission.md)")
    g.add_argument("--max-queued-requests", type=_queue_bound, default=256,
                   help="Requests allowed to wait for the engine beyond its free slots; more get 503 "
                        "'The request queue is full.' (default 256; 'inf' lifts the bound).")
    g.add_argument("--max-queue-wait", type=float, default=None,
                   help="Seconds a request may wait to be scheduled before a 503 'Request waiting timeout "
                        "reached.' (default: no limit).")
    g.add_argument("--max-stream-buffer-bytes", type=int, default=1 << 20,
                   help="Undelivered output one stream may hold before it is aborted as a slow client "
                        "(default 1 MiB).")
    g.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="Seconds a client may take no bytes while output waits before it is aborted as a "
                        "slow client (default 30).")
    g.add_argument("--max-connections", type=int, default=None,
                   help="Connections served at once (HTTP and WebSocket); more are answered 503 'Too many "
                        "connections' and closed (default: the fd limit, raised towards 65536, minus 256).")
    g.add_argument("--max-ws-requests-per-connection", type=int, default=64,
                   help="Concurrent requests on one WebSocket connection (default 64).")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="On SIGINT/SIGTERM, seconds to let requests in flight finish before aborting them "
                        "(default 30). A second signal stops at once.")
    g.add_argument("--engine-heartbeat-timeout", type=float, default=10.0,
                   help="Seconds without an answer from the engine process (answered beside its steps, "
                        "however long they take) before it is declared hung (default 10).")
    g.add_argument("--engine-step-timeout", type=float, default=600.0,
                   help="Seconds one engine step may run before it is declared hung, raised for a step "
                        "whose size explains more (10x its tokens at the slowest rate seen) (default 600).")

    g = p.add_argument_group("observability (see docs/metrics.md and docs/tracing.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="Export one span per request, a child per hop, over OTLP/HTTP (protobuf) to URL, e.g. "
                        "http://localhost:4318/v1/traces (needs the 'otel' extra: pip install tidal[otel]).")
    g.add_argument("--vllm-metric-names", action="store_true",
                   help="Also export the engine-state gauges under vLLM's names (vllm:num_requests_waiting, ...), "
                        "for the Gateway API Inference Extension's endpoint picker (docs/scaling.md).")


def server_config(args: argparse.Namespace):
    from tidal.config import ServerConfig, parse_lora_module

    gib = 1 << 30
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_memory * gib),
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        num_threads=args.engine_threads,
        min_step_time=args.min_step_time,
        grammar_compile_timeout=args.grammar_compile_timeout,
        grammar_cache_bytes=args.grammar_cache_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_loras=args.max_loras if args.enable_lora else 0,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras or 0,
        speculative=getattr(args, "speculative", None),
    )
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        tokenizer_workers=args.tokenizer_workers,
        stream_interval=args.stream_interval,
        max_queued_requests=args.max_queued_requests,
        max_queue_wait=args.max_queue_wait,
        max_stream_buffer_bytes=args.max_stream_buffer_bytes,
        stream_stall_timeout=args.stream_stall_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_ws_requests_per_connection=args.max_ws_requests_per_connection,
        shutdown_timeout=args.shutdown_timeout,
        engine_heartbeat_timeout=args.engine_heartbeat_timeout,
        engine_step_timeout=args.engine_step_timeout,
        data_parallel_size=args.data_parallel_size,
        engine_restarts=args.engine_restarts,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        ui=args.ui,
        generation_config=args.generation_config,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        vllm_metric_names=args.vllm_metric_names,
        enable_lora=args.enable_lora,
        lora_modules=tuple(parse_lora_module(entry) for entry in args.lora_modules),
        lora_runtime_updates=args.enable_lora_runtime_updates and args.enable_lora,
        lora_allowed_dirs=tuple(d.strip() for d in args.lora_allowed_dirs.split(",") if d.strip()),
    )


def _check_engine_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.otlp_traces_endpoint is not None:
        import importlib.util

        try:  # find_spec imports the parents, so a missing "opentelemetry" raises instead of answering None
            exporter = importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http")
        except ImportError:
            exporter = None
        if exporter is None:
            p.error("--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
                    "pip install 'tidal[otel]'")
        if not args.otlp_traces_endpoint.startswith(("http://", "https://")):
            p.error("--otlp-traces-endpoint must be an http:// or https:// URL (OTLP over HTTP)")
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tokenizer_workers", "stream_interval"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.generation_config not in ("auto", "vllm") and not os.path.isfile(
            os.path.join(os.path.expanduser(args.generation_config), "generation_config.json")):
        p.error(f"--generation-config {args.generation_config}: no generation_config.json there "
                "(give auto, vllm or a directory holding one)")
    if args.max_model_len is not None and args.max_model_len < 2:
        p.error("--max-model-len must be at least 2")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        p.error("--num-kv-blocks must be at least 1")
    if args.data_parallel_size < 1:
        p.error("--data-parallel-size must be at least 1")
    if args.engine_restarts is not None and args.engine_restarts < 0:
        p.error("--engine-restarts must be >= 0")
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be at least 1")
    if args.nnodes < 1 or args.tensor_parallel_size % args.nnodes:
        p.error(f"--nnodes must be at least 1 and divide --tensor-parallel-size ({args.tensor_parallel_size})")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be in [0, --nnodes) = [0, {args.nnodes})")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            p.error(f"--dist-init-addr must be HOST:PORT, not {args.dist_init_addr!r}")
        args.master_addr, args.master_port = host, int(port)
    args.speculative = None
    if args.speculative_config is not None:
        from tidal.speculative_config import parse_speculative_config

        try:
            args.speculative = parse_speculative_config(args.speculative_config)
        except ValueError as exc:
            p.error(str(exc))
    if args.master_port is not None and not 0 < args.master_port + args.data_parallel_size - 1 < 65536:
        p.error("--master-port (+ replicas - 1) must be a port number, 1-65535")


def _resolve_hub_model(args: argparse.Namespace) -> None:
    """A Hub id becomes its local snapshot here, once, before any engine starts (docs/scaling.md)."""
    from tidal.hub import is_hub_id, resolve_hub_model

    if is_hub_id(args.model):
        path = resolve_hub_model(args.model, args.revision, args.download_dir)
        args.served_model_name = args.served_model_name or args.model
        args.model = path


def _resolve_gguf_model(args: argparse.Namespace) -> None:
    """A GGUF file (or ollama:NAME) becomes a prepared model directory here, once, before any engine starts."""
    from tidal import gguf_model

    if not gguf_model.is_gguf_model(args.model):
        if args.tokenizer is not None:
            raise gguf_model.GgufModelError("--tokenizer applies to GGUF models; a model directory brings its own")
        return
    path = gguf_model.find_gguf(args.model)
    args.served_model_name = args.served_model_name or args.model
    args.model = gguf_model.prepare(path, args.tokenizer)


def _resolve_draft_model(args: argparse.Namespace) -> None:
    """The draft model of ``--speculative-config`` (method ``draft_model``) is whatever --model takes: a Hub id,
    a GGUF file or a model directory, resolved here, once, before any engine starts. ValueError: one line."""
    spec = args.speculative
    if spec is None or spec.model is None:
        return
    import msgspec

    from tidal import gguf_model
    from tidal.hub import ModelNotAvailable, is_hub_id, resolve_hub_model

    name = spec.model
    try:
        if is_hub_id(name):
            path = resolve_hub_model(name, None, args.download_dir)
        elif gguf_model.is_gguf_model(name):
            path = gguf_model.prepare(gguf_model.find_gguf(name))
        elif name in ("tidal-tiny", "tidal-test") or os.path.isdir(os.path.expanduser(name)):
            path = name
        else:
            raise ValueError(f"no such file or directory {name!r}")
    except (ValueError, ModelNotAvailable, gguf_model.GgufModelError) as exc:
        raise ValueError(f"--speculative-config: the draft model {name!r}: {exc}") from None
    args.speculative = msgspec.structs.replace(spec, model=path)


def _exec_headless_node(config) -> None:
    """Become this node's launcher of tensor-parallel ranks (``tidal.gpu.parallel.worker --node``): no HTTP
    server, no tokenizer, only the ranks of each replica, until node 0 shuts them down. The engine
    config goes in as the first frame on stdin, as to an engine."""
    import os

    from tidal.wire import encode_frame

    read_end, write_end = os.pipe()
    os.write(write_end, encode_frame(config.engine))  # a few hundred bytes: fits the pipe's buffer
    os.close(write_end)
    os.dup2(read_end, 0)
    os.close(read_end)
    logging.getLogger("tidal.server").info("node %d of %d: starting tensor-parallel ranks only (headless)",
                                           config.engine.node_rank, config.engine.nnodes)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tidal.gpu.parallel.worker", "--node",
                              "--replicas", str(config.data_parallel_size),
                              "--restarts", str(config.max_engine_restarts)])


def _unknown_arguments(p: argparse.ArgumentParser, unknown: list[str]) -> None:
    flags = [flag for action in p._actions for flag in action.option_strings]
    hints = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        if name.startswith("-"):
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    p.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"\n  {hint}" for hint in hints))


def _build_kernels() -> int:
    """``tidal build-kernels``, in a child: building needs torch, which the frontend never imports."""
    import subprocess

    return subprocess.call([sys.executable, "-m", "tidal.gpu.cpu.build"])


def main(argv: list[str] | None = None) -> int:
    from tidal import __version__

    # allow_abbrev=False on every parser: a misspelt flag (--max-num-seq) is an error, never a silent
    # match; the subcommands' usage is one line, so an error's "did you mean" is not lost under 37 lines
    parser = argparse.ArgumentParser(prog="tidal", description="An OpenAI-compatible LLM server on Trio.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"tidal {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="Start the OpenAI-compatible server.", allow_abbrev=False,
                             usage="%(prog)s [options]",
                             description="Start the OpenAI-compatible server (SSE and WebSocket streaming).")
    add_serve_arguments(serve_p)
    bench_p = sub.add_parser("bench", help="Load-test any OpenAI-compatible server.", allow_abbrev=False,
                             usage="%(prog)s [options]")
    sub.add_parser("build-kernels", allow_abbrev=False,
                   help="Build the C++ CPU kernels now (the first serve does it otherwise) and say where they are "
                        "cached.",
                   description="Build the C++ CPU kernels now (the first serve does it otherwise), print where "
                               "they are cached and how long it took.")
    from tidal.tools import bench

    bench.add_arguments(bench_p)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage and the nearest flag, not the top-level usage
        _unknown_arguments({"serve": serve_p, "bench": bench_p}.get(args.command, parser), unknown)
    if args.command == "bench":
        return bench.main(args)
    if args.command == "build-kernels":
        return _build_kernels()

    _check_engine_args(serve_p, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tidal.hub import ModelNotAvailable
    from tidal.server import check_port_free

    headless = args.node_rank > 0
    try:  # before a Hub download or an engine start, either of which can take minutes
        if not headless:
            check_port_free(args.host, args.port)
    except OSError as exc:
        logging.getLogger("tidal.server").error("exiting: cannot serve on %s:%d: %s", args.host, args.port, exc)
        return 2
    from tidal.gguf_model import GgufModelError

    try:
        _resolve_hub_model(args)
        _resolve_gguf_model(args)
    except (ModelNotAvailable, GgufModelError) as exc:  # the same exit code as a bad local model directory
        logging.getLogger("tidal.server").error("exiting: %s", exc)
        return 3
    try:
        _resolve_draft_model(args)
    except ValueError as exc:  # a usage error, as the config's other mistakes are
        serve_p.error(str(exc))
    try:
        config = server_config(args)
    except ValueError as exc:
        serve_p.error(str(exc))
    if headless:
        _exec_headless_node(config)
    import trio

    from tidal.server import serve

    return trio.run(serve, config)


if __name__ == "__main__":
    sys.exit(main())
