"""Structured output: grammars compiled off the step loop, token masks applied batched.

xgrammar does the work (chosen by measurement, docs/performance-history.md: its precomputed token
masks fill a row in microseconds where llguidance took ~0.1-0.2 ms at an 8k vocabulary).

Life of a constrained request:

1. ``Grammars.submit`` starts compiling its constraint on a worker thread (one compile per
   distinct constraint: compiled grammars are cached by (kind, spec)); the sequence waits in
   the scheduler's COMPILING place, so it holds no KV blocks and no batch slot meanwhile.
2. At each schedule the scheduler asks ``is_compiled`` and, once it is, ``start_matcher``:
   a fresh matcher for the request, or the compile error that refuses it.
3. ``Grammars.apply_mask`` fills one bitmask row per constrained sampling row (one batched
   call) and masks the logits in place; unconstrained rows are untouched and a step without
   constrained rows costs one dict lookup per row.
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

import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal.wire import StructuredOutput

if TYPE_CHECKING:
    from tidal.gpu.sequence import Sequence

log = logging.getLogger("tidal.grammar")

MAX_CACHED_GRAMMARS = 256
_COMPACT = (",", ":")


def _without_control_bytes(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """A bitmask row allowing every token whose bytes hold no control character (< 0x20)."""
    allowed = np.ones(((vocab_size + 31) // 32) * 32, dtype=bool)
    for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in raw):
            allowed[token_id] = False
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())


def _compile_error(exc: Exception) -> str:
    # xgrammar prefixes its messages with "[time] file.cc:line: "
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc)).strip()


class Grammars:
    """The engine's structured-output state: compiles in flight, one matcher per live request."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None  # built on first use: plain requests never import xgrammar
        self._batch: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._compiled: dict[tuple[str, str], Future] = {}  # insertion order = age (small LRU)
        self._waiting: dict[int, tuple[tuple[str, str], Future]] = {}  # request id -> (key, its compile)
        self._matchers: dict[int, Any] = {}  # request id -> xgrammar.GrammarMatcher
        self._gates: dict[int, tuple[int, ...]] = {}  # request id -> the ids that open its grammar
        self._bitmask: torch.Tensor | None = None

    # ------------------------------------------------------------------ compiling

    def _start(self) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._json_tokens = _without_control_bytes(info.decoded_vocab, self.vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-grammar")

    def submit(self, request_id: int, spec: StructuredOutput) -> None:
        """Start compiling a request's constraint (or reuse a compiled one)."""
        if self._compiler is None:
            self._start()
        key = (spec.kind, spec.spec)
        future = self._compiled.pop(key, None)
        if future is None:
            future = self._pool.submit(self._compile, spec)  # type: ignore[union-attr]
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
        self._compiled[key] = future  # most recently used last
        self._waiting[request_id] = (key, future)
        if spec.after:
            self._gates[request_id] = spec.after

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.spec, any_whitespace=False, separators=_COMPACT)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=_COMPACT)
        if spec.kind == "regex":
            return c.compile_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(choice) for choice in choices))
        return c.compile_grammar(spec.spec)

    @property
    def num_waiting(self) -> int:
        """Requests whose compile has not been taken yet."""
        return len(self._waiting)

    def is_compiled(self, request_id: int) -> bool:
        """The request's compile has finished, or failed."""
        return self._waiting[request_id][1].done()

    def start_matcher(self, request_id: int) -> str | None:
        """Take a finished compile: None once the request has its matcher, else why it is refused
        (the caller then ends it; ``release`` forgets it)."""
        import xgrammar as xgr

        key, future = self._waiting[request_id]
        try:
            compiled = future.result()
        except Exception as exc:  # noqa: BLE001 - any compile failure refuses the request
            self._compiled.pop(key, None)
            return f"The output constraint could not be compiled: {_compile_error(exc)}"
        del self._waiting[request_id]
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)
        return None

    def release(self, request_id: int) -> None:
        """Forget a request (finished or aborted), whether it was compiling or matching."""
        self._matchers.pop(request_id, None)
        self._gates.pop(request_id, None)
        self._waiting.pop(request_id, None)

    # ------------------------------------------------------------------ the step

    def apply_mask(self, logits: torch.Tensor, sampling: list["Sequence"]) -> None:
        """Mask each constrained row of ``logits`` ([N, V] float32) to its grammar's next tokens."""
        if not self._matchers:
            return
        rows = [(i, self._matchers[seq.request_id]) for i, seq in enumerate(sampling)
                if seq.request_id in self._matchers and seq.request_id not in self._gates]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = self._bitmask_rows(len(rows))
        self._batch.batch_fill_next_token_bitmask([m for _, m in rows], bitmask)
        json_rows = [j for j, (i, _) in enumerate(rows) if sampling[i].params.structured.kind.startswith("json")]
        if json_rows:
            # compact JSON never holds a raw control character (JSON forbids them inside strings,
            # and there is no free whitespace); xgrammar's string rule would let them in
            if len(json_rows) == len(rows):
                bitmask &= self._json_tokens
            else:
                bitmask[json_rows] &= self._json_tokens
        if len(rows) == logits.shape[0]:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
        else:
            index = torch.tensor([i for i, _ in rows], device=logits.device)
            picked = logits[index]
            xgr.apply_token_bitmask_inplace(picked, bitmask.to(logits.device, non_blocking=True))
            logits[index] = picked

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask[:num_rows]

    def accept(self, seq: "Sequence", token_id: int) -> bool:
        """Advance the request's matcher by its sampled token. True once the grammar is complete."""
        request_id = seq.request_id
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        gate = self._gates.get(request_id)
        if gate is not None:  # still free (thinking): the grammar starts after the gate's last id
            if tuple(seq.output_token_ids[-len(gate):]) == gate:
                del self._gates[request_id]
            return False
        if not matcher.accept_token(token_id):
            log.error("request %d: sampled token %d is outside its grammar", request_id, token_id)
            return True
        return matcher.is_terminated()
