"""Logprobs of the sampled tokens and their top alternatives, for the rows that ask.

Values are the log-softmax of the model's float32 logits as the model produced them: before
penalties, temperature, top-k/top-p/min-p or a grammar mask (vLLM's default, "raw"
logprobs). So they are captured before the sampler, which edits the logits in place.

Only rows whose request asked pay: their rows are copied out, log-softmaxed and searched with
``topk`` on the device; a step where no row asks costs one pass over the params.
"""

from __future__ import annotations

import torch

from tidal.wire import Logprobs, SamplingParams


class CapturedLogprobs:
    """The log-softmax rows of one step's asking requests, until their tokens are known."""

    def __init__(self, rows: list[int], counts: list[int], logprobs: torch.Tensor):
        self.rows = rows  # indices into the step's sampling rows
        self.counts = counts  # top alternatives wanted per captured row
        self.logprobs = logprobs  # [len(rows), V] float32

    @classmethod
    def capture(cls, logits: torch.Tensor, params: list[SamplingParams]) -> "CapturedLogprobs | None":
        """Log-softmax the rows that ask (a copy), or None when none does."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        counts = [params[i].logprobs for i in rows]  # type: ignore[misc]
        if len(rows) == logits.shape[0]:
            picked = logits.float()
        else:
            picked = logits[torch.tensor(rows, device=logits.device)].float()
        return cls(rows, counts, torch.log_softmax(picked, dim=-1))

    def for_tokens(self, tokens: list[int]) -> dict[int, Logprobs]:
        """Row index -> the one-token Logprobs of that row, given every row's sampled token."""
        lp = self.logprobs
        device = lp.device
        sampled_ids = torch.tensor([tokens[i] for i in self.rows], device=device)
        sampled = lp.gather(1, sampled_ids.unsqueeze(1)).squeeze(1).tolist()
        width = max(self.counts)
        if width:
            values, ids = lp.topk(min(width, lp.shape[1]), dim=-1)  # sorted, most likely first
            values, ids = values.tolist(), ids.tolist()
        out = {}
        for j, (row, count) in enumerate(zip(self.rows, self.counts)):
            if count:
                out[row] = Logprobs([sampled[j]], [ids[j][:count]], [values[j][:count]])
            else:
                out[row] = Logprobs([sampled[j]], [[]], [[]])
        return out
