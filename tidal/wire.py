"""The messages that cross the process boundary between the frontend and the engine.

This is the only module both sides import. Frames are length-prefixed msgpack
(4-byte big-endian length, then one msgspec-encoded message). Structs are
``array_like`` so a frame carries values, not field names.

Frontend -> engine: ``EngineConfig`` (first frame), then ``AddRequest``, ``AbortRequests``,
``Ping``, ``Shutdown``.
Engine -> frontend: ``Ready`` (once the model is loaded), then ``StepReport`` (one per
engine step that produced anything, merged when the pipe is behind), ``Pong``, and
``EngineFailed`` if the engine hits an unrecoverable error.

Both sides also share the prefix hash (``hash_block``, ``prefix_hashes``): the engine's prefix
cache keys its full KV blocks by it and the router's prefix affinity by the same chain. Whoever starts an
engine process (the frontend, or a headless node's tensor-parallel ranks) gives it ``engine_process_env``.

Stamps (``received_at``, ``sent_at``, ``EngineTiming``) are ``time.monotonic()`` readings: one
clock for both processes of a host (CLOCK_MONOTONIC on Linux), so the frontend can lay the
engine's stamps on a request's timeline (tidal/observe/timeline.py) next to its own.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

# What a frame and the engine can hold. msgpack carries integers in [-2^63, 2^64); the engine
# keeps counts and token ids in 32 bits; seeds are 64-bit signed (msgspec bounds no wider). The
# request types (tidal/openai/requests.py) declare their fields with these or narrower bounds,
# so a value that was accepted always encodes and always fits.
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Meta(ge=-(2**31), le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT32_MAX)]
PositiveCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Count
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]

FinishReason = Literal["stop", "length", "abort"]
SchedulingPolicy = Literal["fcfs", "priority"]


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the output, compiled into a grammar by the engine (tidal.gpu.grammar).

    ``kind`` "json_schema": ``spec`` is the schema as canonical JSON text (also the cache key);
    "json_object": any JSON object (``spec`` empty); "regex": a regular expression;
    "choice": a JSON list of the allowed strings; "grammar": an EBNF (GBNF) grammar.
    ``after``: token ids (a reasoning model's ``</think>``) the output must end with before the
    constraint applies; the text before them is free (empty: from the first token).
    """

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    after: tuple[int, ...] = ()


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What the sampler and the stop checker need. Validated by the frontend."""

    max_tokens: PositiveCount
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: PositiveCount | None = None
    min_p: float = 0.0
    seed: Seed | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # number of top alternatives to report with each token's logprob; None: no logprobs (free)
    logprobs: Count | None = None
    structured: StructuredOutput | None = None  # None: unconstrained (no grammar work at all)


class AdapterSpec(msgspec.Struct, frozen=True, array_like=True):
    """A LoRA adapter as the frontend registered it: ``adapter_id`` is new for every load (a name
    loaded again gets a new id), so an id always means the same weights."""

    adapter_id: int
    name: str
    path: str


SpeculativeMethod = Literal["ngram", "draft_model"]


class SpeculativeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding (``--speculative-config``, vLLM's JSON; docs/engine.md). ``ngram``: each
    step proposes up to ``num_speculative_tokens`` tokens that followed the latest earlier occurrence
    of the sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in its
    own prompt and output; ``draft_model``: a smaller ``model`` with the same vocabulary proposes them,
    greedily, with its own KV cache in the target's blocks. One forward pass verifies them all."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model: the draft's model directory (the CLI resolves a GGUF or Hub id to one)
    quantization: str | None = None  # draft_model: quantize the draft's linears at load, as --quantization does


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the engine process needs to start. Sent as the first frame."""

    model: str
    dtype: str = "auto"
    quantization: str | None = None  # "int8" / "int4" (CPU or CUDA), "fp8" (CUDA with FP8): quantize linears at load
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # CUDA: run every step eagerly instead of replaying captured decode graphs
    enforce_eager: bool = False
    seed: int = 0
    num_threads: int | None = None
    # which data-parallel replica this engine is (0..N-1): on CUDA it picks the replica's device
    data_parallel_rank: int = 0
    # tensor parallelism (docs/scaling.md): ranks per replica, split over nnodes nodes that meet at
    # master_addr:master_port + data_parallel_rank (None: a free port on one node, 29500 on several)
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # structured output (docs/admission.md): a request's wait for its grammar before a 400, and the
    # compiled grammars kept, in bytes
    grammar_compile_timeout: float = 10.0
    grammar_cache_bytes: int = 512 << 20
    # LoRA adapters (docs/lora.md): max_loras adapters in one step (0: no adapters), each of rank up to
    # max_lora_rank; max_cpu_loras adapters kept loaded (0: max_loras); lora_modules load at start
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    lora_modules: tuple[AdapterSpec, ...] = ()
    speculative: SpeculativeConfig | None = None  # None: one token per sequence per step
    # Test model knob: every forward pass lasts at least this long (seconds). Lets the
    # cancellation tests put an abort "mid-forward" deterministically.
    min_step_time: float = 0.0


# ---------------------------------------------------------------- frontend -> engine


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: int
    prompt_token_ids: list[TokenId]
    params: SamplingParams
    priority: Int32 = 0
    arrival_time: float = 0.0  # admitted at, on the frontend's clock (ActiveRequest.arrival_time): the engine orders by it
    # another choice of the same request (n > 1): the engine schedules this one once that one's
    # prompt is prefilled, so the prompt's full KV blocks come from the prefix cache, not a prefill
    fork_of: int | None = None
    adapter_id: int | None = None  # the LoRA adapter it runs through (AdapterSpec.adapter_id); None: the base model
    received_at: float = 0.0  # the engine's reader thread decoded it (set there, not sent)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """Abort these requests. Unknown or already-finished ids are a no-op."""

    request_ids: list[int]
    received_step: int = -1  # the engine's step count when its reader thread decoded it (set there)


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Answered by the engine's pipe reader thread, beside the step loop: a long step does not
    delay the answer, a stopped or dead process gives none. The answer says how far the step
    loop has come (``StepProgress``), so the frontend can also tell a step stuck past its size."""

    nonce: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class LoadAdapter(msgspec.Struct, tag="load_adapter", array_like=True):
    """Read and check an adapter; answered by ``AdapterLoaded`` with the same id."""

    spec: AdapterSpec


class UnloadAdapter(msgspec.Struct, tag="unload_adapter", array_like=True):
    """Forget an adapter no live request uses (the frontend checks; the engine keeps one still held)."""

    adapter_id: int


ToEngine = Union[AddRequest, AbortRequests, Ping, Shutdown, LoadAdapter, UnloadAdapter]

# ---------------------------------------------------------------- engine -> frontend


# In a model directory prepared from a GGUF file (tidal/gguf_model.py, in the frontend): {"gguf": the file's path},
# which the engine's loader reads the weights from (tidal/gpu/model/gguf_checkpoint.py)
GGUF_POINTER = "gguf.json"

ABORT_STEP_BUCKETS = 4  # EngineStats.aborts_freed: 0, 1, 2, 3 or more steps


class EngineStats(msgspec.Struct, array_like=True):
    step: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_total_blocks: int = 0
    num_used_blocks: int = 0  # held by live requests; cached-but-unreferenced blocks count as free
    num_cached_blocks: int = 0  # blocks holding a reusable prefix (free or not)
    num_prefix_hit_tokens: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    # cumulative: aborts that freed a live request, by engine steps from the abort's arrival to the
    # report that showed its blocks free ([0, 1, 2, 3 or more]); the guarantee is that only the
    # first two ever grow (docs/cancellation.md)
    aborts_freed: list[int] = msgspec.field(default_factory=lambda: [0] * ABORT_STEP_BUCKETS)
    # speculative decoding, cumulative: verification passes that carried a proposal (one per sequence
    # and step), proposed tokens, accepted ones, and accepted ones by position in the proposal (0 first)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = msgspec.field(default_factory=list)


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of consecutive output tokens, as compact parallel arrays (one entry per token)."""

    token_logprobs: list[float]  # of the token that was sampled
    top_token_ids: list[list[int]]  # the most likely tokens, most likely first
    top_logprobs: list[list[float]]

    def extend(self, later: "Logprobs") -> None:
        self.token_logprobs.extend(later.token_logprobs)
        self.top_token_ids.extend(later.top_token_ids)
        self.top_logprobs.extend(later.top_logprobs)


class EngineTiming(msgspec.Struct, array_like=True):
    """The engine's stamps of one request's way to its first token, sent once, with its first output.

    Per request, never per token: the step loop fills it while the request waits and prefills.
    0.0: not reached (e.g. a request that ended before it was scheduled).
    """

    received_at: float  # the engine's reader thread decoded its AddRequest
    scheduled_at: float = 0.0  # its first step was launched (it left the engine's queue)
    prefill_chunks: list[float] = msgspec.field(default_factory=list)  # launch of each prefill chunk's pass
    sampled_at: float = 0.0  # its first token was read back from the pass


class RequestOutput(msgspec.Struct, array_like=True):
    """New output of one request since the last one sent. Merged, never dropped."""

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    # the stop string or stop token id that ended the request, if any
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: Logprobs | None = None  # only for requests that asked, one entry per token id
    # set on the last output of a request the engine ended for what it asked (a schema its grammar
    # engine cannot compile, a constraint that cannot be met); the frontend answers it with a 400,
    # or, once the stream has begun, ends the stream with that error
    error: str | None = None
    timing: EngineTiming | None = None  # on a request's first output only
    # speculative decoding, on a request's final output: its proposed tokens and those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def merge(self, later: "RequestOutput") -> None:
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = later.logprobs
            else:
                self.logprobs.extend(later.logprobs)
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_cached_tokens = later.num_cached_tokens
        if self.timing is None:
            self.timing = later.timing
        self.error = later.error
        self.num_draft_tokens = later.num_draft_tokens
        self.num_accepted_tokens = later.num_accepted_tokens


class StepReport(msgspec.Struct, tag="step", array_like=True):
    """What changed during one or more engine steps."""

    started: list[int]  # requests scheduled for the first time (they left the queue)
    outputs: list[RequestOutput]
    finished: list[int]  # requests whose engine state (and KV blocks) are gone, incl. aborted
    stats: EngineStats
    sent_at: float = 0.0  # the engine wrote it to the pipe (stamped when it is encoded)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model: str
    max_model_len: int
    block_size: int
    num_total_blocks: int
    max_num_seqs: int
    device: str
    dtype: str
    vocab_size: int
    eos_token_ids: list[int]
    pid: int
    dtype_reason: str = ""  # why this dtype, e.g. "auto: the CPU has native bf16 (avx512_bf16)"


class StepProgress(msgspec.Struct, array_like=True):
    """How far the engine's step loop has come, as of a Pong (docs/architecture.md, liveness)."""

    steps_done: int = 0
    step_age: float = 0.0  # seconds the step in flight has run so far (0.0: none in flight)
    step_num_tokens: int = 0  # the size of the step in flight, in tokens
    # the slowest finished step's seconds per token: what a step's size explains of its time
    slowest_token_seconds: float = 0.0


class Pong(msgspec.Struct, tag="pong", array_like=True):
    nonce: int
    stats: EngineStats
    progress: StepProgress = msgspec.field(default_factory=StepProgress)


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class AdapterLoaded(msgspec.Struct, tag="adapter_loaded", array_like=True):
    adapter_id: int
    error: str | None = None  # why the adapter cannot be used; None: loaded


FromEngine = Union[Ready, StepReport, Pong, EngineFailed, AdapterLoaded]

# ---------------------------------------------------------------- framing

_LEN = struct.Struct(">I")
HEADER_SIZE = _LEN.size
_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)
_config = msgspec.msgpack.Decoder(EngineConfig)


def encode_frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    return _LEN.unpack(header)[0]


def decode_to_engine(body: bytes) -> ToEngine:
    return _to_engine.decode(body)


def decode_from_engine(body: bytes) -> FromEngine:
    return _from_engine.decode(body)


def decode_config(body: bytes) -> EngineConfig:
    return _config.decode(body)


class FrameSplitter:
    """Turns a byte stream into frame bodies (for a reader that gets arbitrary chunks)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        bodies = []
        start = 0
        buffer = self._buffer
        while len(buffer) - start >= HEADER_SIZE:
            size = _LEN.unpack_from(buffer, start)[0]
            end = start + HEADER_SIZE + size
            if len(buffer) < end:
                break
            bodies.append(bytes(buffer[start + HEADER_SIZE : end]))
            start = end
        if start:
            del buffer[:start]
        return bodies


# ---------------------------------------------------------------- the engine process's environment

# The engine process's OpenMP threads wait at each parallel region's end: libgomp spins
# GOMP_SPINCOUNT times (one `pause` each: 31 ns on this project's AMD EPYC, so 10000 spins are
# ~310 us there), then sleeps on a futex. Sleeping at once costs a wake-up per region of a
# decode step; libgomp's default 300000 stalls a busy host (docs/engine.md, "OpenMP waits").
OMP_SPIN_COUNT = "10000"


def engine_process_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for an engine process: the short OpenMP spin unless the user set a wait of their own."""
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        return dict(env, GOMP_SPINCOUNT=OMP_SPIN_COUNT)
    return env


# ---------------------------------------------------------------- the prefix hash

ROOT_HASH = b""  # the "parent" of a prompt's first block
HASH_BYTES = 16


def adapter_root_hash(adapter_id: int | None) -> bytes:
    """The "parent" of the first block of a prompt run through LoRA adapter ``adapter_id`` (None: the base
    model's ``ROOT_HASH``): the same tokens through two adapters chain to different digests, so they never
    share KV blocks."""
    if adapter_id is None:
        return ROOT_HASH
    return hashlib.blake2b(b"lora-adapter:%d" % adapter_id, digest_size=HASH_BYTES).digest()


def hash_block(parent_hash: bytes, tokens: Sequence[int]) -> bytes:
    """Digest of a full block: BLAKE2b-128 over the parent's digest and the tokens as int32.

    The parent digest has a fixed length (none for the first block) and a block always holds
    ``block_size`` tokens, so distinct (parent, tokens) pairs never hash the same input. A hit in
    the engine's prefix cache is trusted without comparing tokens, so the hash must resist
    collisions (Python's ``hash()`` of a tuple is 64 bits and does not).
    """
    return hashlib.blake2b(parent_hash + array("i", tokens).tobytes(), digest_size=HASH_BYTES).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None,
                  root: bytes = ROOT_HASH) -> list[bytes]:
    """The chained digests of the full leading blocks of ``token_ids``, at most ``limit`` of them:
    entry *k* covers blocks 0..k, and equals the engine's ``Sequence.block_hashes[k]``."""
    num_blocks = len(token_ids) // block_size
    if limit is not None:
        num_blocks = min(num_blocks, limit)
    hashes = []
    parent = root
    for start in range(0, num_blocks * block_size, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
