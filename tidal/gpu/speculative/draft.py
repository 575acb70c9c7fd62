"""The ``draft_model`` method: a smaller model with the target's vocabulary proposes each sequence's next
tokens, greedily, one batched pass per proposed token.

The draft is a second ``ModelRunner`` (its own weights, its own config) whose paged KV cache has as many
blocks as the target's and is indexed by the same block tables: the target's block manager allocates and
frees them, so an abort or a finish frees the draft's cache with the target's, and a rejected proposal's
slots are written over later, as the target's are. The scheduler allocates a proposal's slots before the
draft writes them (``Speculator.plan``'s ``reserve``).

Per sequence the proposer keeps how many of its tokens the draft's cache holds (``DraftState``). Each
step a sequence proposes, the draft first catches up on the tokens it has not seen (the whole prompt the
first time, from position 0: a prefix-cache hit holds the target's KV, not necessarily the draft's;
afterwards the tokens the last verification added), in one pass for every sequence, and that pass's last
row gives the first proposed token; each further token is one more batched decode pass. The catch-up is
chunked: a pass takes at most ``max_num_batched_tokens`` tokens, and a sequence whose catch-up does not
fit proposes nothing this step (it goes on next time).

A greedy draft's proposal is deterministic (a point mass), which is what ``verify`` assumes: the output
is distributed exactly as without speculation, and greedy output is token for token the same.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import msgspec
import torch
from tokenizers import Tokenizer

from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.loader import checkpoint_weight_dtype, resolve_model_dir
from tidal.gpu.model.precision import resolve_precision
from tidal.gpu.model_runner import ModelRunner, resolve_device
from tidal.wire import EngineConfig

if TYPE_CHECKING:
    from tidal.gpu.sequence import Sequence

log = logging.getLogger("tidal.engine")


class DraftState:
    """What of one sequence the draft's cache holds: its first ``num_computed`` tokens, and the proposal
    written after them at the last step (``written`` from position ``written_at``), valid only as far as the
    verification accepted it."""

    __slots__ = ("num_computed", "written_at", "written")

    def __init__(self) -> None:
        self.num_computed = 0
        self.written_at = 0
        self.written: list[int] = []

    def settle(self, token_ids: list[int]) -> None:
        """Keep the written proposal's KV up to its first token the sequence did not take."""
        if self.written:
            at, taken = self.written_at, 0
            for token in self.written:
                if at + taken >= len(token_ids) or token_ids[at + taken] != token:
                    break
                taken += 1
            self.num_computed = min(self.num_computed, at + taken)
            self.written = []


class _Row:
    """What ``ModelRunner`` reads of a sequence, as the draft's cache sees it (its own computed count, the
    tokens to run: the sequence's and the proposal so far)."""

    __slots__ = ("token_ids", "num_computed_tokens", "block_table")
    draft_token_ids = ()  # the draft's passes verify nothing
    adapter_id = None  # the draft runs without LoRA: its proposals are verified by the adapter's target

    def __init__(self, token_ids: list[int], num_computed: int, block_table: list[int]) -> None:
        self.token_ids, self.num_computed_tokens, self.block_table = token_ids, num_computed, block_table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def draft_model_dir(config: EngineConfig) -> str:
    return resolve_model_dir(config.speculative.model)  # type: ignore[union-attr, arg-type]


def draft_kv_bytes(config: EngineConfig) -> int:
    """Refuse a draft whose vocabulary is not the target's (one ``ValueError`` line); return what the draft's
    KV cache costs per block, so the target's cache size can pay for both. Reads configs only: it runs
    before either model's weights are loaded."""
    if config.tensor_parallel_size > 1:
        raise ValueError("--speculative-config: method 'draft_model' runs without tensor parallelism")
    draft_dir, target_dir = draft_model_dir(config), resolve_model_dir(config.model)
    draft, target = ModelConfig.from_dir(draft_dir), ModelConfig.from_dir(target_dir)
    name = config.speculative.model  # type: ignore[union-attr]
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-config: the draft model {name} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft must share the target's tokenizer")
    draft_vocab, target_vocab = _vocabulary(draft_dir), _vocabulary(target_dir)
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])[0]
        raise ValueError(f"--speculative-config: the draft model {name} has another tokenizer than the target "
                         f"(token {differ[0]!r} is id {differ[1]} in one only): a draft must share the "
                         "target's tokenizer")
    dtype = resolve_precision(config.dtype, resolve_device(config.device), checkpoint_weight_dtype(draft_dir)).dtype
    return 2 * draft.num_layers * config.block_size * draft.num_kv_heads * draft.head_dim * dtype.itemsize


def _vocabulary(model_dir: str) -> dict[str, int]:
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-config: {model_dir} has no tokenizer.json to compare with the target's")
    return Tokenizer.from_file(path).get_vocab(with_added_tokens=True)


class DraftProposer:
    """The ``draft_model`` method's proposal source (``speculator.ProposalSource``)."""

    batched = True

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        spec = config.speculative
        assert spec is not None and spec.model is not None
        draft_config = msgspec.structs.replace(
            config, model=draft_model_dir(config), quantization=spec.quantization, num_kv_blocks=num_blocks,
            max_model_len=None, max_loras=0, lora_modules=(), speculative=None, min_step_time=0.0)
        self.runner = ModelRunner(draft_config)
        self.max_model_len = self.runner.max_model_len  # the draft writes no position at or past it
        self.max_chunk = config.max_num_batched_tokens  # catch-up tokens per step, all sequences together
        log.info("speculative draft model %s: %d layers, %s", spec.model, self.runner.model_config.num_layers,
                 self.runner.dtype_reason)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in wants]
        # the catch-up pass: each sequence's unseen tokens; those that reach their last token propose
        decodes, prefills = [], []  # (entry, (index in wants, tokens so far, tokens to propose) or None)
        budget = self.max_chunk
        for i, (seq, n) in enumerate(wants):
            state = seq.speculation.source  # type: ignore[union-attr]
            if state is None:
                state = seq.speculation.source = DraftState()  # type: ignore[union-attr]
            state.settle(seq.token_ids)
            total = seq.num_tokens
            state.num_computed = min(state.num_computed, total - 1)  # the last token runs: its row proposes
            n = min(n, self.max_model_len - total + 1)  # the draft writes positions up to total + n - 2
            if n <= 0 or budget <= 0:
                continue
            take = min(total - state.num_computed, budget)
            budget -= take
            row = _Row(seq.token_ids, state.num_computed, seq.block_table)
            state.num_computed += take
            # the runner takes one-token entries (decodes) first
            (decodes if take == 1 else prefills).append(
                ((row, take), (i, list(seq.token_ids), n) if state.num_computed == total else None))
        catch_up = decodes + prefills
        if not catch_up:
            return proposals
        going = [g for _, g in catch_up if g is not None]
        order = [i for i, _, _ in going]
        next_tokens = self._greedy([entry for entry, _ in catch_up])
        while going:
            for (i, tokens, _), token in zip(going, next_tokens):
                proposals[i].append(token)
                tokens.append(token)
            going = [g for g in going if len(proposals[g[0]]) < g[2]]
            if not going:
                break
            # one decode pass: each feeds the token it proposed last, at the position after its tokens so far
            next_tokens = self._greedy([(_Row(tokens, len(tokens) - 1, wants[i][0].block_table), 1)
                                        for i, tokens, _ in going])
        for i in order:
            seq, proposal = wants[i][0], proposals[i]
            state = seq.speculation.source  # type: ignore[union-attr]
            # the KV of every proposed token but the last is in the draft's cache now
            state.written_at, state.written = seq.num_tokens, proposal[:-1]
            state.num_computed += len(proposal) - 1
        return proposals

    def _greedy(self, entries: list[tuple[_Row, int]]) -> list[int]:
        """One draft pass; the argmax token of each entry that reaches its last token, in entry order."""
        logits = self.runner.execute(entries)  # type: ignore[arg-type]
        return torch.argmax(logits, dim=-1).tolist() if logits.shape[0] else []
