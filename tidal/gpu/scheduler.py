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
   request that does not fit blocks the ones behind it (no starvation of long prompts).

After the forward pass, ``commit`` books its results: the computed tokens advance, full
blocks go to the prefix cache, each sampled token is appended and checked against the stop
conditions, and finished sequences leave and free their blocks.

Pure Python over ``Sequence`` and ``BlockManager``; no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tidal.gpu.block_manager import BlockManager
from tidal.gpu.sequence import Sequence, SequenceStatus
from tidal.wire import FinishReason


@dataclass
class ScheduledBatch:
    # (sequence, number of its tokens computed this step), decodes first
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # scheduled for the first time
    preempted: list[Sequence] = field(default_factory=list)
    # the sequences whose chunk reaches their last token: each samples one token, in entry order
    sampling: list[Sequence] = field(default_factory=list)

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
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = by_priority
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []  # kept sorted by sort_key
        self.num_preemptions = 0

    # ------------------------------------------------------------------ membership

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._insert(self.waiting, seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:  # else: never added
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.remove(seq)
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _key(self, seq: Sequence) -> tuple:
        return seq.sort_key(self.by_priority)

    def _insert(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._key)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
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
            prefix = blocks.lookup_prefix(seq)
            num_new = min(seq.num_tokens - len(prefix) * blocks.block_size, budget)
            if not blocks.can_allocate(seq, num_new, prefix):
                break
            self.waiting.pop(0)
            blocks.allocate(seq, num_new, prefix)
            seq.status = SequenceStatus.RUNNING
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

        batch.entries = decodes + prefills
        batch.sampling = decodes_sampling + prefills_sampling
        return batch

    # ------------------------------------------------------------------ after the forward pass

    def commit(self, batch: ScheduledBatch, tokens: list[int]) -> list[Sequence]:
        """Book a finished forward pass; ``tokens`` holds one sampled id per ``batch.sampling``.

        Sequences that finished since the batch was scheduled (aborted while the pass ran)
        are skipped: their work and token are dropped. Returns the sequences that got a
        token, in order; those that finished with it have ``finish_reason`` set and are out.
        """
        blocks = self.block_manager
        block_size = blocks.block_size
        finished = SequenceStatus.FINISHED
        for seq, num_new in batch.entries:
            if seq.status is not finished:
                seq.num_computed_tokens += num_new
                if seq.num_computed_tokens // block_size > len(seq.block_hashes):  # a block filled up
                    blocks.register_full_blocks(seq)
        appended = []
        for seq, token_id in zip(batch.sampling, tokens, strict=True):
            if seq.status is finished:
                continue
            reason = seq.append_token(token_id)
            if reason is not None:
                self.finish(seq, reason)
            appended.append(seq)
        return appended

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Free a running sequence's blocks and requeue it for recomputation."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_cached_tokens = 0
        self.add(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1
