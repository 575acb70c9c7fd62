"""``tidal bench``: a streaming load generator for any OpenAI-compatible server (tidal, vLLM, SGLang).

It sends ``--num-prompts`` random prompts (reproducible with ``--seed``) as streaming requests,
arriving as a Poisson process at ``--request-rate`` per second with at most ``--concurrency`` in
flight, and measures on the client, per request:

* TTFT: send -> first chunk that carries generated text (the role-only first chat chunk does not);
* ITL: gaps between consecutive text-carrying chunks;
* TPOT: (E2E - TTFT) / (output tokens - 1);
* E2E: send -> end of stream; output tokens from the final usage chunk, else counted chunks.

Only the OpenAI streaming format is relied on (``data: {...}`` SSE lines, ``data: [DONE]``), except
for ``--endpoint ws``, which speaks tidal's own ``/v1/ws`` protocol via :mod:`tidal.tools.ws_client`.
The report goes to stdout, the progress bar to stderr; ``--json`` and ``--plot`` save the results.

``add_arguments``/``main`` are the CLI hooks; :func:`run_benchmark` is the async core.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

from tidal.tools.bench_metrics import RequestRecord, StreamObserver, arrival_offsets, summarize
from tidal.tools.hop_breakdown import HopSnapshot, breakdown, format_breakdown
from tidal.tools.ws_client import TidalWSClient, TidalWSError, open_tidal_ws

__all__ = [
    "BenchConfig",
    "Prompt",
    "SSEParser",
    "add_arguments",
    "build_report",
    "format_report",
    "main",
    "make_prompts",
    "run_benchmark",
    "write_plot",
    "clip_at_p99",
]

ENDPOINTS = ("chat", "completions", "ws")

# Plain common words: most are one token in any BPE vocabulary, so N words is roughly N tokens.
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river light blue green "
    "small large early young important few public bad same able open red white black long little "
    "old great high different local sure real best better free strong whole clear full simple "
    "run walk talk read write sing play move live bring happen stand lose pay meet include "
    "continue set learn lead understand watch follow stop create speak allow add spend grow offer"
).split()


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs; built from the CLI flags by :func:`main`."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"
    model: str | None = None
    num_prompts: int = 100
    concurrency: int | None = None  # None: no cap beyond the arrival schedule
    request_rate: float = math.inf
    input_len: int = 256
    output_len: int = 128
    ignore_eos: bool = False
    api_key: str | None = None
    seed: int = 0
    tokenizer: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The config as JSON; an infinite request rate ("all at once") is written as null."""
        out = asdict(self)
        if math.isinf(self.request_rate):
            out["request_rate"] = None
        return out


@dataclass(frozen=True)
class Prompt:
    """A prompt and, when a tokenizer built it, its exact token count."""

    text: str
    tokens: int | None = None


# -- prompts ------------------------------------------------------------------------------------


def make_prompts(count: int, input_len: int, seed: int, tokenizer_dir: str | None = None,
                 tokenizer: Any = None) -> list[Prompt]:
    """``count`` distinct random prompts of about ``input_len`` words, the same for the same seed.

    With ``tokenizer_dir`` (a folder holding ``tokenizer.json``) or a ``tokenizer`` (anything with
    ``tokenizers.Tokenizer``'s ``encode``/``decode``, such as :class:`ServerTokenizer`) each prompt is
    cut to exactly ``input_len`` tokens of it (special tokens and chat templates excluded).
    """
    rng = random.Random(f"prompts-{seed}")
    if tokenizer_dir:
        tokenizer = _load_tokenizer(tokenizer_dir)
    prompts = []
    for _ in range(count):
        # A few spare words so a tokenizer that merges words still has input_len tokens to cut.
        words = [rng.choice(_WORDS) for _ in range(input_len + (input_len // 4 + 8 if tokenizer else 0))]
        text = " ".join(words)
        prompts.append(Prompt(text) if tokenizer is None else _cut_to_tokens(tokenizer, text, input_len))
    return prompts


_BUILT_IN_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "tidal-tiny" / "tokenizer.json"
_BUILT_IN_MODELS = ("tidal-tiny", "tidal-test")  # tidal's embedded models share one tokenizer


def resolve_tokenizer(name: str) -> Path | None:
    """The tokenizer.json of a model: tidal's built-in ones by name, or a local folder or .json file
    (a served GGUF file's name is no tokenizer.json: None, and the server's own is asked instead)."""
    if name in _BUILT_IN_MODELS:
        return _BUILT_IN_TOKENIZER
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    return path if path.is_file() and path.suffix == ".json" else None


SERVER_TOKENIZER = "server"  # BenchConfig.tokenizer when prompts were cut with the server's /tokenize


class ServerTokenizer:
    """The server's own tokenizer through its ``/tokenize`` and ``/detokenize`` (tidal's, vLLM's), in the
    shape :func:`make_prompts` uses of a ``tokenizers.Tokenizer``: for a model with no local
    tokenizer.json (a GGUF file, a hub name). Blocking calls: run it on a thread."""

    def __init__(self, config: BenchConfig, model: str):
        self._model = model
        self._client = httpx.Client(base_url=config.base_url, headers=_auth_headers(config.api_key), timeout=60.0)

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special_tokens}
        answer = self._post("/tokenize", body)
        return _Encoding(answer["tokens"])

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"model": self._model, "tokens": list(ids)})["prompt"]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._client.post(path, json=body)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._client.close()


@dataclass(frozen=True)
class _Encoding:
    ids: list[int]


def normalize_base_url(url: str) -> str:
    """The server root: ``http://host:port``, ``.../`` and ``.../v1`` (the SDK's form) all work."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _describe(exc: BaseException) -> str:
    """An exception on one line (httpx's messages have newlines in them)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _load_tokenizer(tokenizer_dir: str) -> Any:
    from tokenizers import Tokenizer  # only needed with --tokenizer

    path = Path(tokenizer_dir)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def _cut_to_tokens(tokenizer: Any, text: str, length: int) -> Prompt:
    """Cut ``text`` to ``length`` tokens. Decoding then re-encoding can merge or split tokens at the
    cut, so adjust the cut until the re-encoded text has exactly ``length`` tokens (or give up close)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cut, best = length, None
    for _ in range(8):
        candidate = tokenizer.decode(ids[: max(cut, 0)])
        got = len(tokenizer.encode(candidate, add_special_tokens=False).ids)
        if best is None or abs(got - length) < abs(best.tokens - length):
            best = Prompt(candidate, got)
        if got == length:
            break
        cut += length - got
    return best


# -- SSE ------------------------------------------------------------------------------------------


class SSEParser:
    """Incremental Server-Sent Events parser: feed raw bytes, get the ``data`` of each complete event.

    Network reads split lines (and UTF-8 characters) anywhere, so partial input is kept until the
    blank line that ends an event. Multi-line data is joined with newlines; comments and other
    fields (``event:``, ``id:``) are ignored. Lines end in LF or CRLF.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data: list[str] = []

    def feed(self, raw: bytes) -> list[str]:
        """Consume ``raw``; return the data of every event it completed, in order."""
        self._pending += self._decoder.decode(raw)
        events = []
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            event = self._line(line.removesuffix("\r"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """End of stream: flush an event the server did not terminate with a blank line."""
        tail = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        events = []
        if tail:
            event = self._line(tail.removesuffix("\r"))
            if event is not None:
                events.append(event)
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


# -- requests -----------------------------------------------------------------------------------


def build_body(config: BenchConfig, model: str, prompt: str, *, for_ws: bool = False) -> dict[str, Any]:
    """The OpenAI request body for one prompt (the WebSocket protocol implies streaming)."""
    body: dict[str, Any] = {"model": model, "max_tokens": config.output_len, "temperature": 0}
    if config.endpoint in ("chat", "ws"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if not for_ws:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension that tidal and SGLang accept too
    return body


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_text(body: bytes) -> str:
    text = body.decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


async def _send_http(client: httpx.AsyncClient, config: BenchConfig, model: str, prompt: Prompt) -> RequestRecord:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    body = build_body(config, model, prompt.text)
    observer = StreamObserver(time.perf_counter(), prompt.tokens)
    status = None
    try:
        async with client.stream("POST", path, json=body) as response:
            status = response.status_code
            if status != 200:
                return observer.fail(status=status, message=_error_text(await response.aread()))
            parser, finished_at = SSEParser(), None
            async for raw in response.aiter_bytes():
                now = time.perf_counter()
                for event in parser.feed(raw):
                    if finished_at is not None:
                        continue
                    if event.strip() == "[DONE]":
                        finished_at = now  # keep draining so the connection is reused
                        continue
                    data = json.loads(event)
                    if "error" in data or data.get("object") == "error":
                        return _stream_error(observer, data)
                    observer.on_chunk(data, now)
            for event in parser.close():
                if event.strip() == "[DONE]" and finished_at is None:
                    finished_at = time.perf_counter()
            if finished_at is None:
                return observer.fail(status=status, error_type="IncompleteStream", message="no [DONE]")
            return observer.succeed(finished_at, status)
    except Exception as exc:  # every transport or parse failure is one failed request, not a crash
        return observer.fail(status=status, error_type=type(exc).__name__, message=str(exc)[:500])


def _stream_error(observer: StreamObserver, data: dict[str, Any]) -> RequestRecord:
    """An error object sent inside a 200 stream (vLLM and tidal do this for mid-generation errors)."""
    error = data.get("error") if isinstance(data.get("error"), dict) else data
    code = error.get("code")
    message = str(error.get("message"))
    if isinstance(code, int):
        return observer.fail(status=code, message=message)
    return observer.fail(status=200, error_type="StreamError", message=message)


async def _send_ws(client: TidalWSClient, config: BenchConfig, model: str, prompt: Prompt) -> RequestRecord:
    body = build_body(config, model, prompt.text, for_ws=True)
    observer = StreamObserver(time.perf_counter(), prompt.tokens)
    try:
        async with client.stream("chat.completions", body) as stream:
            async for data in stream:
                observer.on_chunk(data, time.perf_counter())
        finished_at = time.perf_counter()
        if stream.usage:
            observer.on_usage(stream.usage)
        return observer.succeed(finished_at)
    except TidalWSError as exc:
        if exc.status is not None:
            return observer.fail(status=exc.status, message=str(exc.error.get("message")))
        return observer.fail(error_type=type(exc).__name__, message=str(exc))
    except Exception as exc:
        return observer.fail(error_type=type(exc).__name__, message=str(exc)[:500])


def _ws_url(base_url: str) -> str:
    scheme, rest = base_url.rstrip("/").split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/v1/ws"


@asynccontextmanager
async def _open_sender(
    config: BenchConfig, model: str
) -> AsyncIterator[Callable[[Prompt], Awaitable[RequestRecord]]]:
    """A function sending one prompt over the configured transport, valid inside the block."""
    if config.endpoint == "ws":
        # One connection carries every request: that is what the protocol is for.
        async with open_tidal_ws(_ws_url(config.base_url), config.api_key) as ws_client:
            yield lambda prompt: _send_ws(ws_client, config, model, prompt)
        return
    clients = _HTTPClients(config, model)
    try:
        yield clients.send
    finally:
        with trio.CancelScope(shield=True):  # close sockets even when the run was cancelled
            await clients.aclose()


class _HTTPClients:
    """One single-connection httpx client per request in flight, reused by the next request.

    httpcore's shared pool rescans all its connections (quadratically, with a socket poll each)
    whenever a request starts or ends; at a few hundred connections that costs this process more
    CPU than the streams themselves and would show up as server latency. A free list of
    one-connection clients keeps the per-request cost constant.
    """

    def __init__(self, config: BenchConfig, model: str) -> None:
        self._config = config
        self._model = model
        self._ssl_context = httpx.create_ssl_context()  # built once: ~30 ms each otherwise
        self._free: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []

    def _new_client(self) -> httpx.AsyncClient:
        client = httpx.AsyncClient(
            base_url=self._config.base_url,
            headers=_auth_headers(self._config.api_key),
            verify=self._ssl_context,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            # A generation may take arbitrarily long: never time out reading the stream.
            timeout=httpx.Timeout(connect=60.0, read=None, write=60.0, pool=None),
        )
        self._all.append(client)
        return client

    async def send(self, prompt: Prompt) -> RequestRecord:
        client = self._free.pop() if self._free else self._new_client()
        try:
            return await _send_http(client, self._config, self._model, prompt)
        finally:
            self._free.append(client)

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()


async def prompt_overhead(config: BenchConfig, model: str) -> int | None:
    """Tokens the server adds around a prompt's own, asked of its ``/tokenize`` (tidal's and vLLM's):
    the chat template's for ``chat`` and ``ws``, a BOS for ``completions``. The server counts a prompt's
    tokens as its own plus these; None when the server has no ``/tokenize`` (SGLang) or refuses it."""
    sample = " ".join(_WORDS[:8])
    own = {"model": model, "prompt": sample, "add_special_tokens": False}
    if config.endpoint == "completions":
        served = {"model": model, "prompt": sample}
    else:
        served = {"model": model, "messages": [{"role": "user", "content": sample}]}
    try:
        async with httpx.AsyncClient(base_url=config.base_url, headers=_auth_headers(config.api_key)) as client:
            counts = []
            for body in (own, served):
                response = await client.post("/tokenize", json=body, timeout=30.0)
                if response.status_code != 200:
                    return None
                counts.append(int(response.json()["count"]))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return max(counts[1] - counts[0], 0)


async def fetch_model(config: BenchConfig) -> str:
    """The first model the server lists at ``GET /v1/models``."""
    async with httpx.AsyncClient(base_url=config.base_url, headers=_auth_headers(config.api_key)) as client:
        response = await client.get("/v1/models", timeout=30.0)
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{config.base_url}/v1/models lists no models")
    return models[0]["id"]


async def run_benchmark(
    config: BenchConfig,
    prompts: list[Prompt],
    model: str,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every prompt on the Poisson schedule; return the records (in prompt order) and duration."""
    offsets = arrival_offsets(len(prompts), config.request_rate, config.seed)
    limiter = trio.CapacityLimiter(config.concurrency) if config.concurrency else None
    records: list[RequestRecord | None] = [None] * len(prompts)

    async with _open_sender(config, model) as send:

        async def timed(prompt: Prompt) -> RequestRecord:
            sent = time.perf_counter()
            record = await send(prompt)
            record.elapsed_s = time.perf_counter() - sent
            return record

        async def one(index: int, prompt: Prompt) -> None:
            if limiter is None:
                records[index] = await timed(prompt)
            else:
                async with limiter:
                    records[index] = await timed(prompt)
            if on_done is not None:
                on_done(records[index])

        started = time.perf_counter()
        schedule_start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for index, (offset, prompt) in enumerate(zip(offsets, prompts)):
                await trio.sleep_until(schedule_start + offset)
                nursery.start_soon(one, index, prompt)
        duration = time.perf_counter() - started
    return [r for r in records if r is not None], duration


async def scrape_hops(config: BenchConfig) -> HopSnapshot | None:
    """The server's hop histograms now (GET /metrics); None if it has none (not tidal, or unreachable)."""
    try:
        async with httpx.AsyncClient(base_url=config.base_url) as client:
            response = await client.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    snapshot = HopSnapshot(response.text) if response.status_code == 200 else None
    return None if snapshot is None or snapshot.empty and "tidal:request_hop_seconds" not in response.text \
        else snapshot


async def _scrape_hops_after(config: BenchConfig, before: HopSnapshot | None, num_requests: int) -> HopSnapshot | None:
    """The hop histograms once the run's requests are all in them (a request is observed as its
    connection's handler ends, a moment after its client read the last byte), or after 2 s."""
    if before is None:
        return None
    deadline = trio.current_time() + 2.0
    while True:
        after = await scrape_hops(config)
        if after is None or trio.current_time() > deadline or \
                after.counts.get("parse", 0.0) - before.counts.get("parse", 0.0) >= num_requests:
            return after
        await trio.sleep(0.05)


# -- output -------------------------------------------------------------------------------------


def build_report(config: BenchConfig, model: str, records: list[RequestRecord], duration_s: float,
                 prompt_overhead: int | None = None) -> dict[str, Any]:
    """The full result, as written by ``--json``: config, aggregates, and one entry per request.
    ``prompt_overhead``: the tokens the server adds to each prompt (chat template, BOS), if known."""
    return {
        "config": config.to_json(),
        "model": model,
        "prompt_overhead_tokens": prompt_overhead,
        **summarize(records, duration_s),
        "requests": [record.to_json() for record in records],
    }


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table printed to stdout."""

    def num(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    config = report["config"]
    rate = "inf" if config["request_rate"] is None else config["request_rate"]
    rows = [
        ("Endpoint", f"{config['endpoint']} @ {config['base_url']}"),
        ("Model", report["model"]),
        ("Request rate (req/s) / concurrency", f"{rate} / {config['concurrency'] or 'unlimited'}"),
        ("Successful requests", str(report["completed"])),
        ("Failed requests", str(report["failed"])),
        ("Duration (s)", num(report["duration_s"])),
        ("Total input tokens", "-" if report["total_input_tokens"] is None else str(report["total_input_tokens"])),
        ("Input tokens per request", _input_per_request(report)),
        ("Total output tokens", str(report["total_output_tokens"])),
        ("Request throughput (req/s)", num(report["request_throughput"])),
        ("Output token throughput (tok/s)", num(report["output_throughput"])),
        ("Total token throughput (tok/s)", num(report["total_token_throughput"])),
    ]
    speculation = report.get("speculation")
    if speculation:
        rows.append(("Spec decode acceptance (accepted/proposed)",
                     f"{speculation['accepted_tokens']:.0f}/{speculation['draft_tokens']:.0f} = "
                     f"{speculation['acceptance_rate']:.2f}"))
    width = 60

    def row(label: str, value: str) -> str:
        # Right-align values to the table edge; a long value (a URL) just pushes past it.
        return f"{label}:{value:>{max(width - len(label) - 1, len(value) + 1)}}"

    lines = [" tidal bench ".center(width, "=")]
    lines += [row(label, value) for label, value in rows]
    lines.append("-" * width)
    lines.append(f"{'(ms)':<12}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        stats = report[key]
        lines.append(f"{label:<12}" + "".join(f"{num(stats[k]):>12}" for k in ("mean", "p50", "p90", "p99")))
    errors = report["errors"]
    if errors["by_status"] or errors["by_exception"]:
        lines.append("-" * width)
        lines += [row(f"Errors with status {status}", str(n)) for status, n in errors["by_status"].items()]
        lines += [row(f"Errors by {name}", str(n)) for name, n in errors["by_exception"].items()]
    lines.append("=" * width)
    return "\n".join(lines)


def _input_per_request(report: dict[str, Any]) -> str:
    """The prompt tokens one request had as the server counted them (its usage), and what of that the
    server added (the chat template, BOS), when it said."""
    counts = [r["prompt_tokens"] for r in report["requests"] if r["success"] and r["prompt_tokens"] is not None]
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    text = str(low) if low == high else f"{low}-{high}"
    added = report.get("prompt_overhead_tokens")
    return text if added is None else f"{text} (template/BOS: {added})"


def write_plot(report: dict[str, Any], path: str) -> None:
    """Save TTFT and ITL histograms (one subplot each) to a PNG. The ITL axis ends at the p99: a few
    gaps of a second (a preemption, a long prefill) would otherwise squeeze every usual gap into one bar."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark box
    import matplotlib.pyplot as plt

    done = [r for r in report["requests"] if r["success"]]
    ttft = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None]
    itl, itl_label = clip_at_p99([gap for r in done for gap in r["itl_ms"]], report["itl_ms"]["p99"], "ITL (ms)")
    series = {"TTFT (ms)": (ttft, "ttft_ms"), itl_label: (itl, "itl_ms")}
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (label, (values, key)) in zip(axes, series.items()):
        if values:
            axis.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            stats = report[key]
            for name, style in (("p50", "--"), ("p99", ":")):
                axis.axvline(stats[name], color="black", linestyle=style, label=f"{name} {stats[name]:.1f}")
            axis.legend()
        else:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
        axis.set_xlabel(label)
        axis.set_ylabel("count")
    figure.suptitle(f"tidal bench: {report['model']} ({report['config']['endpoint']})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def clip_at_p99(values: list[float], p99: float | None, label: str) -> tuple[list[float], str]:
    """(values with those above ``p99`` drawn at it, the axis label saying so). Unchanged when none is above."""
    above = 0 if p99 is None else sum(value > p99 for value in values)
    if not above:
        return values, label
    clipped = [min(value, p99) for value in values]
    return clipped, f"{label}, axis clipped at p99 = {p99:.1f} ms ({above} above, in the last bar)"


# -- CLI ----------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ``tidal bench`` flags."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root, with or without /v1 (default: %(default)s)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="chat",
                        help="chat: /v1/chat/completions, completions: /v1/completions, ws: chat over tidal's /v1/ws")
    parser.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-prompts", type=_positive_int, default=100, help="requests to send (default: 100)")
    parser.add_argument("--concurrency", type=_positive_int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--request-rate", type=_positive_float, default=math.inf,
                        help="mean requests per second, Poisson arrivals; inf sends all at once (default)")
    parser.add_argument("--input-len", type=_positive_int, default=256,
                        help="prompt length in tokens as the server counts them, chat template and BOS "
                             "included (asked of its /tokenize); in tokens of the model's tokenizer, or "
                             "words if none is found (default: 256)")
    parser.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens per request (default: 128)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer for exact --input-len prompts: a folder with tokenizer.json, the file, or "
                             "tidal-tiny (default: the served model's, when it is a built-in model or a local "
                             "folder; else the server's own, through its /tokenize)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default: 0)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write aggregates and per-request records")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw TTFT and ITL histograms (needs matplotlib: pip install 'tidal[bench]')")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def main(args: argparse.Namespace) -> int:
    """Run ``tidal bench``. Exit status 0 when at least one request completed, 1 if none, 2 on bad flags."""
    if args.plot:  # fail now, not after the whole run
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("tidal bench: --plot needs matplotlib: pip install 'tidal[bench]'", file=sys.stderr)
            return 2
    tokenizer = None
    if args.tokenizer is not None:
        tokenizer = resolve_tokenizer(args.tokenizer)
        if tokenizer is None:
            print(f"tidal bench: --tokenizer {args.tokenizer}: no such .json file, and no folder holding "
                  "tokenizer.json "
                  "(give a folder with tokenizer.json, the file itself, or tidal-tiny)", file=sys.stderr)
            return 2
    config = BenchConfig(
        base_url=normalize_base_url(args.base_url),
        endpoint=args.endpoint,
        model=args.model,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        input_len=args.input_len,
        output_len=args.output_len,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        seed=args.seed,
        tokenizer=str(tokenizer) if tokenizer else None,
    )
    return trio.run(_main, config, args)


async def _main(config: BenchConfig, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    model = config.model
    if model is None:
        try:
            model = await fetch_model(config)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
            print(f"tidal bench: cannot list models at {config.base_url}/v1/models: {_describe(exc)}",
                  file=sys.stderr)
            return 1
    # --input-len is the prompt as the server counts it, chat template and BOS included: ask the
    # server how many tokens it adds and make each prompt's own text that many tokens shorter
    overhead = await prompt_overhead(config, model)
    if config.tokenizer is None:  # the model's local tokenizer.json, else the server's own, else words
        found = resolve_tokenizer(model)
        if found is not None:
            config = replace(config, tokenizer=str(found))
        elif overhead is not None:
            config = replace(config, tokenizer=SERVER_TOKENIZER)
        else:
            print(f"tidal bench: no tokenizer found for model {model!r}: --input-len counts words "
                  "(pass --tokenizer DIR for exact token counts)", file=sys.stderr)
    if overhead is None:
        print("tidal bench: the server has no /tokenize to say what its chat template adds: prompts are "
              "--input-len tokens before it (the report's input tokens are the server's count)", file=sys.stderr)
    elif overhead >= config.input_len:
        print(f"tidal bench: the server adds {overhead} tokens to every prompt (chat template, BOS): "
              f"--input-len {config.input_len} is too short to hold them; each prompt is "
              f"{overhead + 1} tokens", file=sys.stderr)
    own_len = max(config.input_len - (overhead or 0), 1)
    if config.tokenizer == SERVER_TOKENIZER:
        server_tokenizer = ServerTokenizer(config, model)
        try:
            prompts = await trio.to_thread.run_sync(
                lambda: make_prompts(config.num_prompts, own_len, config.seed, tokenizer=server_tokenizer))
        except httpx.HTTPError as exc:
            print(f"tidal bench: cannot cut prompts with the server's /tokenize: {_describe(exc)}", file=sys.stderr)
            return 1
        finally:
            server_tokenizer.close()
    else:
        prompts = make_prompts(config.num_prompts, own_len, config.seed, config.tokenizer)
    hops_before = await scrape_hops(config)
    with tqdm(total=len(prompts), file=sys.stderr, disable=args.no_progress, unit="req") as progress:
        try:
            records, duration = await run_benchmark(config, prompts, model, on_done=lambda _: progress.update(1))
        except (OSError, trio_websocket.HandshakeError) as exc:
            # Per-request failures are recorded; only failing to open the WebSocket lands here.
            reason = exc.__cause__ or exc.__context__ or exc  # HandshakeError hides the OSError
            print(f"tidal bench: cannot connect to {_ws_url(config.base_url)}: {_describe(reason)}", file=sys.stderr)
            return 1
    report = build_report(config, model, records, duration, overhead)
    hops_after = await _scrape_hops_after(config, hops_before, len(records))
    if hops_before is not None and hops_after is not None:
        # each request's time as the report gives it (E2E), or until it failed: no hop of it lasted longer
        spans = [r.e2e_s if r.success else r.elapsed_s for r in records]
        report["hops"] = breakdown(hops_before, hops_after, [t for t in spans if t is not None])
        drafted = hops_after.spec["draft_tokens"] - hops_before.spec["draft_tokens"]
        if drafted > 0:  # speculative decoding on: its acceptance over this run
            accepted = hops_after.spec["accepted_tokens"] - hops_before.spec["accepted_tokens"]
            report["speculation"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                     "acceptance_rate": accepted / drafted}
    print(format_report(report))
    if report.get("hops"):
        print(format_breakdown(report["hops"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"tidal bench: results written to {Path(args.json).resolve()}", file=sys.stderr)
    if args.plot:
        write_plot(report, args.plot)
        print(f"tidal bench: plot written to {Path(args.plot).resolve()}", file=sys.stderr)
    return 0 if report["completed"] else 1
