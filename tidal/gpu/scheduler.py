"""Continuous (iteration-level) batching with a token budget, chunked prefill and preemption.

Every step the scheduler picks which sequences run and how many of their tokens:

1. Running sequences, most urgent first: a decode takes one token, an unfinished prefill
   takes the next chunk that fits the budget. A sequence that cannot get a KV block
   preempts the least urgent running sequence (its blocks are freed and it goes back to
   the queue to be recomputed later, usually from the prefix cache); if it is itself the
   least urgent, it is the one preempted. Nothing is ever dropped.
2. Waiting sequences, in policy order (FCFS, or priority then arrival): each takes its
   cached prefix for free and a first chunk of its prompt, while the token budget, the
   ``max_num_seqs`` bound and the free blocks allow. Waiting is strictly in order: a
   request that does not fit blocks the ones behind it (no starvation of long prompts), and so does
   one whose LoRA adapter would make more than ``max_loras`` adapters run at once: the adapters of
   one step are bounded, and an adapter waiting its turn is never passed over.

After the forward pass, ``commit`` books its results: the computed tokens advance, full
blocks go to the prefix cache, each sampled token is appended, advances its grammar and is
checked against the stop conditions, a choice's first token releases the choices waiting for
its prefill, and finished sequences leave and free their blocks.

Every place a sequence waits is here, and its status says which (``SequenceStatus``, moved only
by this module): COMPILING (its grammar compiles on ``Grammars``' thread; no KV, no batch slot),
FORKED (a choice of n > 1 waiting for choice 0's prefill, to take the prompt's blocks from the
prefix cache), WAITING (the queue), RUNNING. ``finish`` takes a sequence out of whichever it is
in, so ending or aborting a sequence asks this one owner.

Pure Python over ``Sequence`` and ``BlockManager`` (the grammars are handed in); no torch.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.gpu.block_manager import BlockManager
from tidal.gpu.sequence import Sequence, SequenceStatus
from tidal.wire import FinishReason

if TYPE_CHECKING:
    from tidal.gpu.grammar import Grammars
    from tidal.gpu.speculative.speculator import Speculator

COMPLETE = "complete"  # Grammars.accept's word for a finished grammar (tidal.gpu.grammar.COMPLETE)


@dataclass
class ScheduledBatch:
    # (sequence, number of its tokens computed this step), decodes first
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # scheduled for the first time
    preempted: list[Sequence] = field(default_factory=list)
    # the sequences whose chunk reaches their last token: each samples one token, in entry order
    sampling: list[Sequence] = field(default_factory=list)
    refused: list[Sequence] = field(default_factory=list)  # finished with ``error`` before scheduling
    num_draft_tokens: int = 0  # speculative proposals riding this pass (their sequences' draft_token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        by_priority: bool = False,
        grammars: Grammars | None = None,
        max_loras: int = 0,
        speculator: Speculator | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = by_priority
        self.grammars = grammars  # None: no structured output (scheduler tests)
        self.speculator = speculator  # None: no speculative decoding
        self.compiling: dict[int, Sequence] = {}  # request id -> sequence waiting for its grammar
        self.forks: dict[int, list[Sequence]] = {}  # parent request id -> choices waiting for its prefill
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []  # kept sorted by sort_key
        self.num_preemptions = 0
        # LoRA: the adapters of the running sequences (id -> how many), at most max_loras of them
        self.max_loras = max_loras
        self.running_adapters: collections.Counter[int] = collections.Counter()

    # ------------------------------------------------------------------ membership

    def add(self, seq: Sequence, parent: Sequence | None = None) -> None:
        """Place a new sequence: its grammar compiles first, a choice whose ``parent`` (choice 0,
        live) has not prefilled yet waits for it, anything else joins the queue."""
        if seq.params.structured is not None and self.grammars is not None:
            seq.move_to(SequenceStatus.COMPILING)  # compiles off the step loop; queued once ready
            self.compiling[seq.request_id] = seq
            self.grammars.submit(seq.request_id, seq.params.structured)
        elif parent is not None and not parent.output_token_ids:
            # another choice of the same prompt (n > 1): wait for the parent's prefill, then take
            # the prompt's full blocks from the prefix cache instead of computing them again
            seq.move_to(SequenceStatus.FORKED)
            self.forks.setdefault(parent.request_id, []).append(seq)
        else:
            self._enqueue(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of wherever it waits or runs (finished or aborted) and free its blocks."""
        status = seq.status
        if status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._adapter_left(seq)
        elif status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif status is SequenceStatus.COMPILING:
            del self.compiling[seq.request_id]
        elif status is SequenceStatus.FORKED:
            for forks in self.forks.values():
                if seq in forks:
                    forks.remove(seq)
                    break
        if seq.params.structured is not None and self.grammars is not None:
            self.grammars.release(seq.request_id)
        self._release_forks(seq.request_id)  # a parent that ended before its first token
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.move_to(SequenceStatus.FINISHED)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self.remove(seq)
        seq.finish_reason, seq.error = reason, error

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.compiling)

    def _enqueue(self, seq: Sequence) -> None:
        seq.move_to(SequenceStatus.WAITING)
        self._insert(self.waiting, seq)

    def _release_forks(self, parent_id: int) -> None:
        for seq in self.forks.pop(parent_id, ()):
            self._enqueue(seq)

    def _admit_compiled(self, batch: ScheduledBatch) -> None:
        """Sequences whose grammar finished compiling join the queue, or end with its error."""
        grammars = self.grammars
        for request_id, seq in list(self.compiling.items()):
            if not grammars.is_compiled(request_id):  # type: ignore[union-attr]
                continue
            error = grammars.start_matcher(request_id)  # type: ignore[union-attr]
            if error is None:
                del self.compiling[request_id]
                self._enqueue(seq)
            else:
                self.finish(seq, "abort", error)
                batch.refused.append(seq)

    def _key(self, seq: Sequence) -> tuple:
        return seq.sort_key(self.by_priority)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.compiling:
            self._admit_compiled(batch)
        budget = self.max_num_batched_tokens
        blocks = self.block_manager
        decodes: list[tuple[Sequence, int]] = []  # one-token entries
        prefills: list[tuple[Sequence, int]] = []
        # the entries that reach their sequence's last token (and so sample), in entry order
        decodes_sampling: list[Sequence] = []
        prefills_sampling: list[Sequence] = []

        # 1. running sequences, most urgent first
        block_size = blocks.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            num_new = min(uncomputed, budget)
            if seq.num_computed_tokens + num_new > len(seq.block_table) * block_size:
                # not the common decode whose last block has room: allocate, or preempt
                while not blocks.can_allocate(seq, num_new):
                    victim = self.running[-1]
                    self._preempt(victim, batch)
                    if victim is seq:
                        break
                else:
                    blocks.allocate(seq, num_new)
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # seq itself was preempted; self.running shrank, do not advance i
            if uncomputed == 1:
                decodes.append((seq, 1))
                decodes_sampling.append(seq)
            else:
                prefills.append((seq, num_new))
                if num_new == uncomputed:
                    prefills_sampling.append(seq)
            budget -= num_new
            i += 1

        # 2. waiting sequences, in policy order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break  # in order, like the blocks: its adapter gets a place as soon as one's sequences end
            prefix = blocks.lookup_prefix(seq)
            num_new = min(seq.num_tokens - len(prefix) * blocks.block_size, budget)
            if not blocks.can_allocate(seq, num_new, prefix):
                break
            self.waiting.pop(0)
            blocks.allocate(seq, num_new, prefix)
            # its first schedule (or the first since a preemption): the prefix cache's tokens are computed
            seq.num_computed_tokens = seq.num_cached_tokens = len(prefix) * blocks.block_size
            seq.move_to(SequenceStatus.RUNNING)
            if seq.adapter_id is not None:
                self.running_adapters[seq.adapter_id] += 1
            self._insert(self.running, seq)
            if not seq.started:
                seq.started = True
                batch.started.append(seq)
            samples = seq.num_computed_tokens + num_new == seq.num_tokens
            if num_new == 1:
                decodes.append((seq, 1))
                if samples:
                    decodes_sampling.append(seq)
            else:
                prefills.append((seq, num_new))
                if samples:
                    prefills_sampling.append(seq)
            budget -= num_new

        # 3. speculative proposals for decodes, with what is left of the budget
        # (a batch with no spare row skips it all: K = 0 costs nothing over no speculation)
        if self.speculator is not None and decodes and self.speculator.spare_rows(len(decodes), budget) > 0:
            decodes, drafted = self._speculate(decodes, budget, batch)
            decodes_sampling = [seq for seq, _ in decodes if seq.num_computed_tokens + 1 == seq.num_tokens]
            decodes += drafted
            decodes_sampling += [seq for seq, _ in drafted]

        batch.entries = decodes + prefills
        batch.sampling = decodes_sampling + prefills_sampling
        return batch

    def _speculate(self, decodes: list[tuple[Sequence, int]], budget: int, batch: ScheduledBatch,
                   ) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """Give some decodes a proposal (``draft_token_ids``) and the KV slots to verify it; returns
        the plain decodes and the drafted entries (last token + proposal, computed like a prefill chunk)."""
        blocks = self.block_manager
        candidates = [seq for seq, _ in decodes if seq.output_token_ids]
        drafted: dict[int, tuple[Sequence, int]] = {}

        def reserve(seq: Sequence, n: int) -> int:
            """KV slots for the last token and n proposed ones (a draft model writes them before the pass);
            with no block for all of it, what the last block holds."""
            if not blocks.can_allocate(seq, 1 + n):
                n = min(n, max(0, len(seq.block_table) * blocks.block_size - seq.num_computed_tokens - 1))
            if n:
                blocks.allocate(seq, 1 + n)
            return n

        for seq, draft in self.speculator.plan(candidates, budget, reserve):  # type: ignore[union-attr]
            seq.draft_token_ids = draft
            batch.num_draft_tokens += len(draft)
            drafted[seq.request_id] = (seq, 1 + len(draft))
        if not drafted:
            return decodes, []
        return [e for e in decodes if e[0].request_id not in drafted], list(drafted.values())

    # ------------------------------------------------------------------ after the forward pass

    def commit(self, batch: ScheduledBatch, tokens: list[int | None],
               failures: dict[int, str] | None = None, accepted: list[int] | None = None) -> list[Sequence]:
        """Book a finished forward pass; ``tokens`` holds one sampled id per ``batch.sampling``.

        Sequences that finished since the batch was scheduled (aborted while the pass ran)
        are skipped: their work and token are dropped. Returns the sequences that got a
        token, in order; those that finished with it have ``finish_reason`` set and are out.
        ``failures`` (request id -> why, from the grammar masks) end their sequences with that
        ``error`` instead of a token; they are returned too. A constrained sequence's token advances its grammar (before the next schedule, whose
        masks need it); a choice's first token releases the choices waiting for its prefill
        (its prompt blocks are in the prefix cache now).

        A sequence that carried a proposal (``draft_token_ids``) takes ``accepted[i]`` of its tokens and
        then its sampled token (None: the grammar cannot go on there, the next step ends it), each
        checked in turn as if sampled alone: a stop cuts the run where it would have ended without
        speculation. Only those tokens' KV counts as computed; the rejected tail's slots stay in the
        sequence's blocks, to be written over.
        """
        blocks = self.block_manager
        block_size = blocks.block_size
        finished = SequenceStatus.FINISHED
        for seq, num_new in batch.entries:
            if seq.status is not finished and not seq.draft_token_ids:
                seq.num_computed_tokens += num_new
                if seq.num_computed_tokens // block_size > len(seq.block_hashes):  # a block filled up
                    blocks.register_full_blocks(seq)
        appended = []
        for i, (seq, token_id) in enumerate(zip(batch.sampling, tokens, strict=True)):
            draft = seq.draft_token_ids
            if seq.status is finished:
                continue
            appended.append(seq)
            if failures and seq.request_id in failures:
                self.finish(seq, "abort", failures[seq.request_id])  # its token is not the constraint's
                continue
            run = [token_id]
            if draft:
                num_accepted = accepted[i] if accepted is not None else 0
                seq.draft_token_ids = []
                seq.num_computed_tokens += num_accepted + (token_id is not None)
                self.speculator.observe(seq, len(draft), num_accepted)  # type: ignore[union-attr]
                run = draft[:num_accepted] + ([] if token_id is None else [token_id])
            seq.num_new_outputs = 0
            for token in run:
                seq.num_new_outputs += 1
                if self._take(seq, token):
                    break
            else:
                if draft and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                    blocks.register_full_blocks(seq)
        return appended

    def _take(self, seq: Sequence, token_id: int) -> bool:
        """Append one sampled (or accepted) token: release forks, advance the grammar, check the stops.
        True if the sequence ended with it."""
        reason = seq.append_token(token_id)
        if len(seq.output_token_ids) == 1 and seq.request_id in self.forks:
            self._release_forks(seq.request_id)
        if seq.params.structured is not None and self.grammars is not None:
            verdict = self.grammars.accept(seq, token_id)
            if verdict == COMPLETE:
                reason = reason or "stop"  # complete: it took a stop token under ignore_eos
            elif verdict is not None and reason is None:
                self.finish(seq, "abort", verdict)
                return True
        if reason is not None:
            self.finish(seq, reason)
            return True
        return False

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free a running sequence's blocks and requeue it for recomputation."""
        self.running.remove(seq)
        self._adapter_left(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0  # recomputed (or found in the prefix cache) when scheduled again
        seq.speculation = None  # a draft model's KV was in the freed blocks too: it starts over
        self._enqueue(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` may run beside the running sequences: its adapter already runs, or fewer than
        ``max_loras`` adapters do."""
        adapter_id = seq.adapter_id
        return (adapter_id is None or adapter_id in self.running_adapters
                or len(self.running_adapters) < self.max_loras)

    def _adapter_left(self, seq: Sequence) -> None:
        if seq.adapter_id is not None:
            self.running_adapters[seq.adapter_id] -= 1
            if not self.running_adapters[seq.adapter_id]:
                del self.running_adapters[seq.adapter_id]
