"""Turns one row of logits per sequence into one token per sequence.

Order of operations (the same as the OpenAI / Hugging Face conventions):
penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.

Everything is vectorised across rows; the only per-row Python work is drawing the noise of
seeded requests from their own generator, which is what makes a seeded request's tokens
depend on nothing but its own logits and seed (not on what else shares the batch).
"""

from __future__ import annotations

import itertools
import math

import torch

from tidal.wire import SamplingParams


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` for one request, or None when the request has no seed.

    A CPU generator also works for logits on an accelerator (its noise is drawn on the CPU
    and copied over); pass the logits' device to skip that copy.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Stateless: every per-request input arrives with each call."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """One token id per row of ``logits`` ([N, V] float32).

        ``logits`` is scratch: it is modified in place (penalties, temperature, filtering),
        which saves copying an [N, V] tensor on every step.
        """
        num_rows = logits.shape[0]
        if num_rows == 0:
            return []
        apply_penalties(logits, params, output_token_ids, prompt_token_ids)

        # top_k == 1 keeps exactly the argmax, so it is greedy (and ties resolve the same way)
        sampled = [i for i, p in enumerate(params) if not (p.greedy or p.top_k == 1)]
        if not sampled:
            return logits.argmax(dim=-1).tolist()
        if len(sampled) == num_rows:
            return _sample_rows(logits, params, generators).tolist()

        tokens = logits.argmax(dim=-1)
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = _sample_rows(
            logits[rows], [params[i] for i in sampled], [generators[i] for i in sampled])
        return tokens.tolist()


# ------------------------------------------------------------------ penalties


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
) -> None:
    """Repetition, frequency and presence penalties, in place. Free when no row uses them.

    repetition_penalty (Hugging Face semantics) acts on every token seen in the prompt or the
    output: a positive logit is divided by it, a negative one multiplied. frequency_penalty and
    presence_penalty (OpenAI semantics) act on output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.

    Works on the (row, token) pairs that occur rather than on dense [N, V] count tensors, so the
    cost follows the number of tokens in the penalised sequences, not batch x vocabulary.
    """
    rows = [
        i for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if not rows:
        return
    vocab_size = logits.shape[1]
    device = logits.device

    # output tokens as flat (row * V + token) keys, with their counts
    out_keys = _flat_keys(rows, output_token_ids, vocab_size)
    out_keys, out_counts = torch.unique(out_keys, return_counts=True)

    repetition = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repetition:
        seen = torch.unique(torch.cat([
            out_keys, _flat_keys(repetition, prompt_token_ids, vocab_size)]))
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)
        seen = seen.to(device)
        r, t = seen // vocab_size, seen % vocab_size
        values = logits[r, t]
        factor = penalty.to(device)[r]
        logits[r, t] = torch.where(values > 0, values / factor, values * factor)

    if any(params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0 for i in rows):
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)
        r, t = out_keys // vocab_size, out_keys % vocab_size
        delta = frequency[r] * out_counts.to(logits.dtype) + presence[r]
        r, t = r.to(device), t.to(device)
        logits[r, t] -= delta.to(device)


def _flat_keys(rows: list[int], token_ids: list[list[int]], vocab_size: int) -> torch.Tensor:
    """int64 ``row * vocab_size + token`` for every token of the given rows (CPU)."""
    lengths = torch.tensor([len(token_ids[i]) for i in rows], dtype=torch.int64)
    tokens = torch.tensor(
        list(itertools.chain.from_iterable(token_ids[i] for i in rows)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return row_of * vocab_size + tokens


# ------------------------------------------------------------------ random sampling


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then a draw; for rows that are not greedy."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits.div_(temperature.unsqueeze(1))
    logits = _top_k_top_p(logits, params)

    if any(p.min_p > 0.0 for p in params):
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params],
            dtype=logits.dtype, device=device)
        threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
        logits.masked_fill_(logits < threshold, -math.inf)

    probs = logits.softmax(dim=-1)
    return _exponential_race(probs, generators)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p set to -inf, with one sort at most.

    Only the rows that filter are sorted. Rows without top_k / top_p get k = V and p = inf so
    that sharing the sort with others leaves them exactly as they were.
    """
    vocab_size = logits.shape[1]
    filtered = [
        i for i, p in enumerate(params)
        if (p.top_k is not None and p.top_k < vocab_size) or p.top_p < 1.0
    ]
    if not filtered:
        return logits
    device = logits.device
    every_row = len(filtered) == len(params)
    sub = logits if every_row else logits[torch.tensor(filtered, device=device)]
    ks = [min(params[i].top_k or vocab_size, vocab_size) for i in filtered]
    max_k = max(ks)

    if max_k < vocab_size:
        # every filtered row has a top_k: only the largest k matter, no full sort needed
        values, indices = sub.topk(max_k, dim=-1, sorted=True)
    else:
        values, indices = sub.sort(dim=-1, descending=True, stable=True)

    positions = torch.arange(values.shape[1], device=device)
    k = torch.tensor(ks, device=device)
    values.masked_fill_(positions >= k.unsqueeze(1), -math.inf)

    if any(params[i].top_p < 1.0 for i in filtered):
        top_p = torch.tensor(
            [params[i].top_p if params[i].top_p < 1.0 else math.inf for i in filtered],
            dtype=values.dtype, device=device)
        probs = values.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass
        # *before* it already does (so the most likely token is always kept)
        mass_before = probs.cumsum(dim=-1) - probs
        values.masked_fill_(mass_before >= top_p.unsqueeze(1), -math.inf)

    sub = torch.full_like(sub, -math.inf).scatter_(1, indices, values)
    if every_row:
        return sub
    logits[torch.tensor(filtered, device=device)] = sub
    return logits


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row: argmax(p / E) with E ~ Exponential(1) is a draw from p.

    Seeded rows take their noise from their own generator, one row at a time; the others
    share one draw from the global generator.
    """
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    noise = torch.empty_like(probs)
    if len(seeded) < len(generators):
        noise.exponential_()
    for i, generator in seeded:
        if generator.device == probs.device:
            noise[i].exponential_(generator=generator)
        else:
            row = torch.empty(probs.shape[1], dtype=probs.dtype, device=generator.device)
            noise[i] = row.exponential_(generator=generator)
    # a zero draw would turn a masked (zero-probability) token into 0/0 = NaN, which argmax picks
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)
