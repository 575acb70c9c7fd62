"""``tidal-test``: a model with no network, for timing and frontend-cost tests.

It has tidal-tiny's config and tokenizer, real KV-cache accounting (blocks are allocated
and freed exactly as for a real model), and a forward pass that costs nothing: the next
token is a fixed function of the current one, so output is deterministic at any batch
size and any temperature. With ``--min-step-time`` every step lasts exactly that long,
whatever the batch, which is what the frontend benchmark and the cancellation tests need.
"""

from __future__ import annotations

import torch

from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.config import ModelConfig

SYNTHETIC_MODEL_NAME = "tidal-test"
_FIRST_PLAIN_TOKEN = 64  # skip specials and single bytes so every token decodes to visible text


class SyntheticModel:
    def __init__(self, config: ModelConfig, device: torch.device):
        self.config = config
        self.device = device
        self._span = config.vocab_size - _FIRST_PLAIN_TOKEN
        # logits rows reused across steps: a fresh [N, V] tensor each step costs more in page
        # faults than the whole step's engine work (the sampler treats logits as scratch anyway)
        self._logits = torch.zeros(0, config.vocab_size, dtype=torch.float32, device=device)

    def __call__(self, batch: ForwardBatch, kv_caches) -> torch.Tensor:
        return batch.input_ids  # "hidden state": the input token of each row

    def decode_logits(self, batch: ForwardBatch, kv_caches) -> None:
        return None  # the runner calls compute_logits(self(batch)): nothing to fuse

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        next_ids = (rows * 7919 + 17) % self._span + _FIRST_PLAIN_TOKEN
        if self._logits.shape[0] < rows.shape[0]:
            self._logits = torch.zeros(rows.shape[0], self.config.vocab_size, dtype=torch.float32, device=self.device)
        logits = self._logits[: rows.shape[0]].zero_()
        logits.scatter_(1, next_ids[:, None], 100.0)  # a sure winner even at temperature 2
        return logits
