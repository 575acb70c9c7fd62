"""Structured output: grammars compiled off the step loop, token masks applied batched.

xgrammar does the work (chosen by measurement, docs/performance.md: its precomputed token
masks fill a row in microseconds where llguidance took ~0.1-0.2 ms at an 8k vocabulary).

Life of a constrained request:

1. ``Grammars.submit`` starts compiling its constraint on a thread of its own (one compile per
   distinct constraint, compiled grammars cached by (kind, the spec's digest) up to ``cache_bytes`` of
   xgrammar's own count); the sequence waits in the scheduler's COMPILING place, so it holds no
   KV blocks and no batch slot meanwhile. The tokenizer info the compiler needs is built on the
   first compile's thread, never in the step loop.
2. At each schedule the scheduler asks ``is_compiled`` and, once it is, ``start_matcher``:
   a fresh matcher for the request, or why it is refused: the constraint did not compile, did
   not compile within ``compile_timeout`` seconds, or ``MAX_COMPILES`` compiles are under way.
   A compile that every requester has left is abandoned (xgrammar cannot interrupt one: its
   thread finishes and the result is dropped; it counts against ``MAX_COMPILES`` until then).
3. ``Grammars.apply_mask`` fills one bitmask row per constrained sampling row and masks the
   logits in place; unconstrained rows are untouched and a step without constrained rows costs
   one dict lookup per row. A row that allows no token at all (the constraint's only
   continuations are tokens the model cannot produce) or whose fill took more than
   ``STEP_BUDGET`` of CPU ends its request with an error instead of a token.
4. ``Grammars.accept`` (the scheduler's commit) advances the matcher by the sampled token; once
   the grammar is complete only the stop tokens stay allowed, so the request ends with ``"stop"``.
5. ``Grammars.release`` forgets a request that ended, however it ended.

A constraint with ``after`` (a reasoning model's ``</think>``) is gated: its rows are left
unmasked and its matcher untouched until the output ends with those ids; the grammar starts
at the next token.

JSON is compact (no free whitespace, ``,`` and ``:`` separators): with any whitespace a
random-weight model can emit whitespace forever, never closing the object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal.wire import StructuredOutput

if TYPE_CHECKING:
    from tidal.gpu.sequence import Sequence

log = logging.getLogger("tidal.grammar")

DEFAULT_COMPILE_TIMEOUT = 10.0  # seconds a request waits for its grammar before a 400
DEFAULT_CACHE_BYTES = 512 << 20  # compiled grammars kept, by xgrammar's memory_size_bytes
MAX_COMPILES = 8  # compile threads alive at once (abandoned ones included); beyond: refused
# CPU seconds one request's grammar may take in one step (its mask fill, or its accept): an
# ambiguous grammar's matcher grows with the output, and its cost would stall every neighbour
STEP_BUDGET = 0.02
_COMPACT = (",", ":")
_Key = tuple[str, bytes]  # (kind, the spec's SHA-256): the cache keeps no constraint's text


def _without_control_bytes(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token whose bytes hold no control character (< 0x20)."""
    allowed = np.ones(((vocab_size + 31) // 32) * 32, dtype=bool)
    for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in raw):
            allowed[token_id] = False
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())


def cache_key(spec: StructuredOutput) -> _Key:
    """What the cache and the compiles in flight know a constraint by: its kind and a digest of its
    text, so a megabyte schema kept for its compiled grammar keeps 32 bytes of key, not the megabyte."""
    return spec.kind, hashlib.sha256(spec.spec.encode()).digest()


def _compile_error(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] file.cc:line: "
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()


class _Compile:
    """One distinct constraint compiling on its own thread, and the requests waiting for it."""

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.future: Future = Future()
        self.requesters: set[int] = set()
        self.thread: threading.Thread | None = None
        self.started_at: float | None = None  # once the compiler is set up and this compile begins

    def out_of_time(self, timeout: float) -> bool:
        return self.started_at is not None and time.monotonic() - self.started_at >= timeout


class Grammars:
    """The engine's structured-output state: compiles in flight, one matcher per live request."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int],
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compile_timeout = compile_timeout
        self.cache_bytes = cache_bytes
        # the compiler and the JSON token row, built on a thread of their own at engine start
        # (``warm_up``): its tokenizer info (1-4 s) is never built in the step loop, nor on the first
        # constrained request's time, which stalled its neighbours ~0.6 s
        self._setup: Future | None = None
        self._setup_lock = threading.Lock()
        self._json_tokens: torch.Tensor | None = None
        self._cache: OrderedDict[_Key, Any] = OrderedDict()  # key -> CompiledGrammar, LRU first
        self._cache_sizes: dict[_Key, int] = {}
        self.num_cached_bytes = 0
        self.num_compiles = 0  # compiles started (a cache hit starts none)
        self._compiles: dict[_Key, _Compile] = {}  # in flight, with someone waiting
        self._threads: list[threading.Thread] = []  # compile threads, abandoned ones included
        # request id -> what it waits for: its compile, a compiled grammar (a cache hit) or a refusal
        self._waiting: dict[int, _Compile | Any | str] = {}
        self._matchers: dict[int, Any] = {}  # request id -> xgrammar.GrammarMatcher
        self._gates: dict[int, tuple[int, ...]] = {}  # request id -> the ids that open its grammar
        self._bitmask: torch.Tensor | None = None

    # ------------------------------------------------------------------ compiling

    def warm_up(self) -> None:
        """Build the compiler now, on a thread of its own (the engine's start calls this)."""
        threading.Thread(target=self._set_up_quietly, name="tidal-grammar-setup", daemon=True).start()

    def _set_up_quietly(self) -> None:
        try:
            self._set_up()
        except Exception:  # noqa: BLE001 - kept in the future: every compile reports it
            pass

    def _set_up(self) -> Any:
        """The compiler (on a compile thread; the first one builds it, the others wait for it)."""
        with self._setup_lock:
            if self._setup is None:
                self._setup = Future()
                try:
                    self._setup.set_result(self._build_compiler())
                except Exception as exc:  # noqa: BLE001 - every compile then reports it
                    self._setup.set_exception(exc)
        return self._setup.result()

    def _build_compiler(self) -> Any:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._json_tokens = _without_control_bytes(info.decoded_vocab, self.vocab_size)
        # xgrammar's own cache off: ours (bounded in bytes) is the only one
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def submit(self, request_id: int, spec: StructuredOutput) -> None:
        """Start compiling a request's constraint, or join its compile, or take it from the cache."""
        key = cache_key(spec)
        if spec.after:
            self._gates[request_id] = spec.after
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)  # most recently used last
            self._waiting[request_id] = compiled
            return
        job = self._compiles.get(key)
        if job is None:
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= MAX_COMPILES:
                self._waiting[request_id] = (
                    f"Too many output constraints are compiling at once ({MAX_COMPILES}); try again later.")
                return
            job = self._compiles[key] = _Compile(key)
            job.thread = threading.Thread(target=self._run, args=(job, spec), name="tidal-grammar", daemon=True)
            self._threads.append(job.thread)
            self.num_compiles += 1
            job.thread.start()
        job.requesters.add(request_id)
        self._waiting[request_id] = job

    def _run(self, job: _Compile, spec: StructuredOutput) -> None:
        try:
            compiler = self._set_up()
            job.started_at = time.monotonic()  # the bound is on the compile, not on the one-time set-up
            job.future.set_result(self._compile(compiler, spec))
        except BaseException as exc:  # noqa: BLE001 - handed to the requesters
            job.future.set_exception(exc)

    @staticmethod
    def _compile(c: Any, spec: StructuredOutput) -> Any:
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.spec, any_whitespace=False, separators=_COMPACT)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=_COMPACT)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            # each choice as an EBNF string literal; ensure_ascii=False: an escaped character outside
            # the BMP would be a surrogate pair, which the grammar reads as two code points
            choices = json.loads(spec.spec)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False)
                                                              for choice in choices))
        return c.compile_grammar(spec.spec)

    @property
    def num_waiting(self) -> int:
        """Requests whose compile has not been taken yet."""
        return len(self._waiting)

    @property
    def num_compiling(self) -> int:
        """Compile threads still running, abandoned ones included."""
        return sum(t.is_alive() for t in self._threads)

    def is_compiled(self, request_id: int) -> bool:
        """The request's grammar is ready, or refused, or out of time."""
        waits_for = self._waiting[request_id]
        return (not isinstance(waits_for, _Compile) or waits_for.future.done()
                or waits_for.out_of_time(self.compile_timeout))

    def start_matcher(self, request_id: int) -> str | None:
        """Take a finished compile: None once the request has its matcher, else why it is refused
        (the caller then ends it; ``release`` forgets it)."""
        import xgrammar as xgr

        waits_for = self._waiting[request_id]
        if isinstance(waits_for, str):
            return waits_for
        if isinstance(waits_for, _Compile):
            if not waits_for.future.done():
                return (f"The output constraint did not compile within {self.compile_timeout:g} s "
                        "(--grammar-compile-timeout).")
            try:
                compiled = waits_for.future.result()
            except Exception as exc:  # noqa: BLE001 - any compile failure refuses the request
                return f"The output constraint could not be compiled: {_compile_error(exc)}"
            self._compiles.pop(waits_for.key, None)
            self._remember(waits_for.key, compiled)
        else:
            compiled = waits_for
        del self._waiting[request_id]
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        return None

    def _remember(self, key: _Key, compiled: Any) -> None:
        """Cache a compiled grammar, least recently used out first, within ``cache_bytes``."""
        if key in self._cache:
            return
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return  # its requesters use it; the next one compiles it again
        while self.num_cached_bytes + size > self.cache_bytes:
            old, _ = self._cache.popitem(last=False)
            self.num_cached_bytes -= self._cache_sizes.pop(old)
        self._cache[key] = compiled
        self._cache_sizes[key] = size
        self.num_cached_bytes += size

    def release(self, request_id: int) -> None:
        """Forget a request (finished or aborted), whether it was compiling or matching. A compile
        with no requester left is abandoned."""
        self._matchers.pop(request_id, None)
        self._gates.pop(request_id, None)
        waits_for = self._waiting.pop(request_id, None)
        if isinstance(waits_for, _Compile):
            waits_for.requesters.discard(request_id)
            if not waits_for.requesters and self._compiles.get(waits_for.key) is waits_for:
                del self._compiles[waits_for.key]  # its thread finishes on its own; the result is dropped

    # ------------------------------------------------------------------ the step

    def check_draft(self, seq: "Sequence", draft: list[int]) -> list[int]:
        """A speculative proposal cut at its first token the grammar forbids (the matcher is left as it was).

        Tokens before the reasoning gate opens (the gate's own last id included) are free; the
        grammar applies from the token after it, as it does to sampled tokens."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is None:
            return draft
        start = _gate_opening(seq, draft, self._gates.get(seq.request_id))
        if start is None:
            return draft
        accepted = 0
        for token_id in draft[start:]:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return draft[:start + accepted]

    def apply_mask(self, logits: torch.Tensor, sampling: list["Sequence"]) -> dict[int, str]:
        """Mask each constrained row of ``logits`` ([N, V] float32) to its grammar's next tokens.

        Returns the requests that cannot go on (request id -> why): their row allows no token, or
        its fill took more than ``STEP_BUDGET`` of CPU. Runs where the forward pass runs; changes
        nothing the step loop reads.
        """
        if not self._matchers:
            return {}
        rows = [(i, self._matchers[seq.request_id]) for i, seq in enumerate(sampling)
                if seq.request_id in self._matchers and seq.request_id not in self._gates]
        if not rows:
            return {}
        import xgrammar as xgr

        bitmask = self._bitmask_rows(len(rows))
        failures: dict[int, str] = {}
        for j, (i, matcher) in enumerate(rows):
            started = time.thread_time()  # CPU, not wall: a busy host must not fail a request
            matcher.fill_next_token_bitmask(bitmask, j)
            if time.thread_time() - started > STEP_BUDGET:
                failures[sampling[i].request_id] = _too_costly()
        json_rows = [j for j, (i, _) in enumerate(rows) if sampling[i].params.structured.kind.startswith("json")]
        if json_rows:
            # compact JSON never holds a raw control character (JSON forbids them inside strings,
            # and there is no free whitespace); xgrammar's string rule would let them in
            if len(json_rows) == len(rows):
                bitmask &= self._json_tokens
            else:
                bitmask[json_rows] &= self._json_tokens
        for j in (~bitmask.any(dim=1)).nonzero().flatten().tolist():  # rows that allow nothing
            failures[sampling[rows[j][0]].request_id] = (
                "The output constraint cannot be met: no token this model can produce continues it.")
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        else:
            index = torch.tensor([i for i, _ in rows], device=logits.device)
            picked = logits[index]
            xgr.apply_token_bitmask_inplace(picked, bitmask.to(logits.device, non_blocking=True))
            logits[index] = picked
        return failures

    def apply_draft_masks(self, logits: torch.Tensor, sampling: list["Sequence"]) -> dict[int, tuple[int, str]]:
        """``apply_mask`` for a verification pass: each sampling sequence owns 1 + len(its proposal)
        consecutive rows, and row j is masked to what the grammar allows after the proposal's first j
        tokens (the matcher steps through the proposal, then rolls back: it advances only at the commit).

        Returns the requests whose rows cannot go on: request id -> (the first such row, within the
        sequence's rows, and why)."""
        if not self._matchers:
            return {}
        import xgrammar as xgr

        failures: dict[int, tuple[int, str]] = {}
        offset = 0
        for seq in sampling:
            rows = 1 + len(seq.draft_token_ids)
            matcher = self._matchers.get(seq.request_id)
            if matcher is not None:
                self._mask_draft_rows(xgr, logits, offset, seq, matcher, failures)
            offset += rows
        return failures

    def _mask_draft_rows(self, xgr: Any, logits: torch.Tensor, offset: int, seq: "Sequence", matcher: Any,
                         failures: dict[int, tuple[int, str]]) -> None:
        draft = seq.draft_token_ids
        start = _gate_opening(seq, draft, self._gates.get(seq.request_id))
        if start is None:
            return  # the gate stays closed through the proposal: every row is free
        num_rows = 1 + len(draft) - start
        bitmask = self._bitmask_rows(num_rows)
        accepted = 0
        started = time.thread_time()
        for j in range(num_rows):
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == num_rows - 1 or not matcher.accept_token(draft[start + j]):
                num_rows = j + 1  # later rows follow a token the grammar forbids: verification stops here
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        bitmask = bitmask[:num_rows]
        if seq.params.structured.kind.startswith("json"):
            bitmask &= self._json_tokens
        request_id = seq.request_id
        if time.thread_time() - started > STEP_BUDGET * num_rows:
            failures[request_id] = (0, _too_costly())
        for j in (~bitmask.any(dim=1)).nonzero().flatten().tolist():
            failures.setdefault(request_id, (start + j, (
                "The output constraint cannot be met: no token this model can produce continues it.")))
            break
        rows = logits[offset + start:offset + start + num_rows]
        xgr.apply_token_bitmask_inplace(rows, bitmask.to(logits.device, non_blocking=True))

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask[:num_rows]

    def accept(self, seq: "Sequence", token_id: int) -> str | None:
        """Advance the request's matcher by its sampled token: None to go on, ``COMPLETE`` once the
        grammar is complete, else why the request cannot go on."""
        request_id = seq.request_id
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        gate = self._gates.get(request_id)
        if gate is not None:  # still free (thinking): the grammar starts after the gate's last id
            if tuple(seq.output_token_ids[-len(gate):]) == gate:
                del self._gates[request_id]
            return None
        started = time.thread_time()
        if not matcher.accept_token(token_id):
            return "The output constraint cannot be met: the sampled token does not continue it."
        if time.thread_time() - started > STEP_BUDGET:
            return _too_costly()
        return COMPLETE if matcher.is_terminated() else None


COMPLETE = "complete"


def _gate_opening(seq: "Sequence", draft: list[int], gate: tuple[int, ...] | None) -> int | None:
    """Where the grammar starts within ``draft``: 0 with no gate (or one already open), the index after
    the token that completes the gate, or None when the gate stays closed through the whole draft."""
    if gate is None:
        return 0
    tail = seq.output_token_ids[len(seq.output_token_ids) - len(gate) + 1:] if len(gate) > 1 else []
    window = list(tail) + list(draft)
    for j in range(len(draft)):
        end = len(tail) + j + 1
        if end >= len(gate) and tuple(window[end - len(gate):end]) == gate:
            return j + 1
    return None


def _too_costly() -> str:
    return (f"The output constraint is too costly to follow: its grammar took more than "
            f"{STEP_BUDGET * 1e3:g} ms of CPU in one step (an ambiguous grammar grows with the output).")
