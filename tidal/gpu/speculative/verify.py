"""Verification: which proposed tokens the target model accepts, and the token that follows them.

Each sampling sequence owns 1 + k consecutive rows of logits (k: its proposal's length; 0 for a
sequence without one), already penalised and masked as the sampler would see them at that
position (row j: after the proposal's first j tokens). A proposal is deterministic (q is one-hot
at the proposed token t), so rejection sampling is exact with this rule, position by position:

* accept t with probability p(t), p the target's distribution after temperature, top-k, top-p and
  min-p; on the first rejection draw the next token from p with t removed (renormalised) and stop;
* when every proposed token is accepted, draw one more token from the last row's p.

The emitted tokens are then distributed exactly as tokens drawn one by one from p. A greedy
sequence's p is one-hot at the argmax, so it accepts t exactly when t is the argmax and its output
is token for token what it is without speculation. Seeded sequences take every uniform from their
own generator, in row order.
"""

from __future__ import annotations

import torch

from tidal.gpu.sampler import draw_from, filtered_probs, is_greedy, row_argmax
from tidal.gpu.sequence import Sequence


class Verdict:
    """Per sampling sequence: the proposed tokens accepted and the token after them (None when the
    grammar cannot go on there: the step ends with the accepted ones); per row, the token it emits."""

    __slots__ = ("accepted", "final", "row_tokens")

    def __init__(self, num_seqs: int, num_rows: int) -> None:
        self.accepted = [0] * num_seqs
        self.final: list[int | None] = [None] * num_seqs
        self.row_tokens = [0] * num_rows


def verify(logits: torch.Tensor, sampling: list[Sequence], stops_at: dict[int, int]) -> Verdict:
    """Verify every sequence's proposal on ``logits`` ([rows, V], edited in place). ``stops_at``:
    request id -> the first of its rows the grammar cannot continue from (>= 1): nothing is accepted
    past it."""
    offsets = []
    offset = 0
    for seq in sampling:
        offsets.append(offset)
        offset += 1 + len(seq.draft_token_ids)
    verdict = Verdict(len(sampling), offset)
    greedy = [i for i, seq in enumerate(sampling) if is_greedy(seq.params)]
    sampled = [i for i, seq in enumerate(sampling) if not is_greedy(seq.params)]
    if greedy:
        _verify_greedy(logits, sampling, offsets, greedy, stops_at, verdict)
    if sampled:
        _verify_sampled(logits, sampling, offsets, sampled, stops_at, verdict)
    return verdict


def _verify_greedy(logits, sampling, offsets, indices, stops_at, verdict: Verdict) -> None:
    rows = [offsets[i] + j for i in indices for j in range(1 + len(sampling[i].draft_token_ids))]
    whole = len(rows) == logits.shape[0]
    best = row_argmax(logits if whole else logits[torch.tensor(rows)]).tolist()
    at = 0
    for i in indices:
        seq = sampling[i]
        draft = seq.draft_token_ids
        targets = best[at:at + 1 + len(draft)]
        at += 1 + len(draft)
        limit = stops_at.get(seq.request_id, len(draft) + 1)
        accepted = 0
        while accepted < len(draft) and accepted < limit and draft[accepted] == targets[accepted]:
            accepted += 1
        verdict.accepted[i] = accepted
        verdict.final[i] = targets[accepted] if accepted < limit else None
        base = offsets[i]
        verdict.row_tokens[base:base + len(targets)] = targets


def _verify_sampled(logits, sampling, offsets, indices, stops_at, verdict: Verdict) -> None:
    row_params, row_index, counts = [], [], []
    for i in indices:
        seq = sampling[i]
        n = 1 + len(seq.draft_token_ids)
        row_params += [seq.params] * n
        row_index += range(offsets[i], offsets[i] + n)
        counts.append(n)
    whole = len(row_index) == logits.shape[0]
    probs = filtered_probs(logits if whole else logits[torch.tensor(row_index)], row_params)
    probs /= probs.sum(dim=-1, keepdim=True)
    # p(t) of each proposed token at its row, and one uniform per proposed token
    draft_rows, draft_tokens = [], []
    at = 0
    for i, n in zip(indices, counts):
        draft_rows += range(at, at + n - 1)
        draft_tokens += sampling[i].draft_token_ids
        at += n
    p_draft = probs[draft_rows, draft_tokens].tolist() if draft_rows else []
    final_rows, final_generators = [], []
    at = d = 0
    for i, n in zip(indices, counts):
        seq = sampling[i]
        draft = seq.draft_token_ids
        limit = stops_at.get(seq.request_id, len(draft) + 1)
        uniforms = _uniforms(len(draft), seq.generator)
        accepted = 0
        while accepted < len(draft) and accepted < limit and uniforms[accepted] < p_draft[d + accepted]:
            accepted += 1
        verdict.accepted[i] = accepted
        base = offsets[i]
        verdict.row_tokens[base:base + accepted] = draft[:accepted]
        if accepted < limit:
            row = probs[at + accepted]
            if accepted < len(draft):  # rejected: draw from p without the proposed token
                row = row.clone()
                row[draft[accepted]] = 0.0
            final_rows.append((i, base + accepted, row))
            final_generators.append(seq.generator)
        at += n
        d += len(draft)
    if final_rows:
        tokens = draw_from(torch.stack([row for _, _, row in final_rows]), final_generators).tolist()
        for (i, row_at, _), token in zip(final_rows, tokens):
            verdict.final[i] = token
            verdict.row_tokens[row_at] = token


def _uniforms(count: int, generator: torch.Generator | None) -> list[float]:
    if not count:
        return []
    if generator is None:
        return torch.rand(count, dtype=torch.float64).tolist()
    return torch.rand(count, dtype=torch.float64, generator=generator, device=generator.device).tolist()
