"""Turns one row of logits per sequence into one token per sequence.

Order of operations (the same as the OpenAI / Hugging Face conventions):
penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.

Everything is vectorised across rows; the only per-row Python work is drawing the noise of
seeded requests from their own generator, which is what makes a seeded request's tokens
depend on nothing but its own logits and seed (not on what else shares the batch).
"""

from __future__ import annotations

import array
import functools
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


# Below this, dividing by the temperature could overflow; the draw is the argmax anyway.
MIN_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    # top_k == 1 keeps exactly the argmax, so it is greedy (and ties resolve the same way)
    return params.temperature < MIN_TEMPERATURE or params.top_k == 1


def is_penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class SamplingBatch:
    """The per-row inputs of one batch composition, sorted once, reused while the rows stay the same.

    The engine keeps one for as long as the same sequences sample in the same order (a
    steady decode batch); token lists are held by reference, so they stay current.
    """

    def __init__(
        self,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ):
        self.params = params
        self.output_token_ids = output_token_ids
        self.prompt_token_ids = prompt_token_ids
        self.generators = generators
        self.sampled_rows = [i for i, p in enumerate(params) if not is_greedy(p)]  # the rest: argmax
        self.sampled_params = [params[i] for i in self.sampled_rows]
        self.sampled_generators = [generators[i] for i in self.sampled_rows]
        self.penalised = any(map(is_penalised, params))
        self._plain_scales: torch.Tensor | None = None
        self._plain_scales_vocab = -1  # the vocabulary size _plain_scales was decided for

    def plain_scales(self, vocab_size: int) -> torch.Tensor | None:
        """1 / temperature of each sampled row when none of them filters (top-k, top-p or min-p cuts
        nothing), the one-pass draw's input; None when one does. Decided once per composition: at one
        row, building it every step cost about as much as the draw itself."""
        if self._plain_scales_vocab != vocab_size:
            params = self.sampled_params
            filters = any(_cuts_top_k_or_p(p, vocab_size) or p.min_p > 0.0 for p in params)
            self._plain_scales = None if filters else torch.tensor(
                [1.0 / p.temperature for p in params], dtype=torch.float32)
            self._plain_scales_vocab = vocab_size
        return self._plain_scales

    def __len__(self) -> int:
        return len(self.params)


class Sampler:
    """Stateless: every per-request input arrives with each call."""

    def sample_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The one place logits become tokens: one int64 token id per row, left on the logits'
        device (reading it back is the caller's choice of when to wait for the device)."""
        num_rows = logits.shape[0]
        if num_rows == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        sampled = batch.sampled_rows
        if batch.penalised:
            apply_penalties(logits, batch.params, batch.output_token_ids, batch.prompt_token_ids)
        if not sampled:
            return row_argmax(logits)
        scales = batch.plain_scales(logits.shape[1])
        if len(sampled) == num_rows:
            return _sample_rows(logits, batch.sampled_params, batch.sampled_generators, scales)

        tokens = row_argmax(logits)
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], batch.sampled_params, batch.sampled_generators, scales)
        return tokens


# ------------------------------------------------------------------ argmax

# torch's CPU argmax along a row is a scalar loop (~0.9 ns per element here), its amax a
# vectorised one (~15x faster): on a CPU, large rows are searched block by block instead.
ARGMAX_BLOCK = 128
BLOCKED_ARGMAX_MIN_ELEMENTS = 32768  # below this (one row of a small vocabulary) argmax is as fast


def row_argmax(x: torch.Tensor, largest: bool = True) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (or ``argmin`` with ``largest=False``) of a 2-D tensor, the same
    indices (the first of equal values; NaN counts as the extreme, as in torch), faster on a CPU.

    The row's blocks of ARGMAX_BLOCK are reduced with amax; the first block holding the row's
    extreme holds its first occurrence, so only that block is searched element by element.
    """
    n, v = x.shape
    if x.device.type != "cpu" or x.numel() < BLOCKED_ARGMAX_MIN_ELEMENTS or v < 2 * ARGMAX_BLOCK \
            or x.stride(1) != 1:
        return x.argmax(dim=-1) if largest else x.argmin(dim=-1)
    main = v - v % ARGMAX_BLOCK
    blocks = x[:, :main].view(n, main // ARGMAX_BLOCK, ARGMAX_BLOCK)
    if largest:
        best = blocks.amax(dim=-1).argmax(dim=-1)
        within = blocks[torch.arange(n), best].argmax(dim=-1)
    else:
        best = blocks.amin(dim=-1).argmin(dim=-1)
        within = blocks[torch.arange(n), best].argmin(dim=-1)
    index = best * ARGMAX_BLOCK + within
    if main == v:
        return index
    tail = x[:, main:]  # the last, partial block: it wins only if strictly more extreme
    tail_index = tail.argmax(dim=-1) if largest else tail.argmin(dim=-1)
    head_value = x.gather(1, index.unsqueeze(1)).squeeze(1)
    tail_value = tail.gather(1, tail_index.unsqueeze(1)).squeeze(1)
    beats = tail_value > head_value if largest else tail_value < head_value
    beats |= tail_value.isnan() & ~head_value.isnan()
    return torch.where(beats, tail_index + main, index)


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
    A token that occurs several times is simply written several times with the same value
    (idempotent), except for the frequency penalty, which accumulates once per occurrence.
    """
    repetition = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    additive = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not repetition and not additive:
        return
    device = logits.device

    if repetition:
        rows, tokens = _pairs(repetition, device, prompt_token_ids, output_token_ids)
        penalty = _per_row(params, "repetition_penalty", logits)[rows]
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)

    if additive:
        rows, tokens = _pairs(additive, device, output_token_ids)
        presence = _per_row(params, "presence_penalty", logits)[rows]
        logits[rows, tokens] = logits[rows, tokens] - presence
        frequency = _per_row(params, "frequency_penalty", logits)[rows]
        logits.index_put_((rows, tokens), -frequency, accumulate=True)


def _pairs(
    rows: list[int], device: torch.device, *token_lists: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of the given rows in each of ``token_lists``."""
    lengths = torch.tensor([sum(len(ids[i]) for ids in token_lists) for i in rows], dtype=torch.int64)
    # array + frombuffer converts a long list of ints ~10x faster than torch.tensor(list)
    flat = array.array("q", itertools.chain.from_iterable(ids[i] for i in rows for ids in token_lists))
    tokens = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    return row_of.to(device), tokens.to(device)


def _per_row(params: list[SamplingParams], name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([getattr(p, name) for p in params], dtype=like.dtype, device=like.device)


# ------------------------------------------------------------------ random sampling

# Top-p first looks for its tokens among this many candidates, widening by WIDEN_FACTOR for the
# rows whose nucleus is larger: peaked distributions never pay for sorting the vocabulary.
TOP_P_FIRST_WIDTH = 256
WIDEN_FACTOR = 8


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    plain_scales: torch.Tensor | None,
) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then a draw; for rows that are not greedy.
    ``plain_scales``: ``SamplingBatch.plain_scales`` of these rows (None: some row filters).

    Filters work on probabilities and leave them unnormalised (masked tokens get 0): the
    draw only compares ratios, so renormalising would change nothing.
    """
    draw = _cpu_draw(logits)
    if draw is not None and plain_scales is not None:  # softmax, temperature and draw in one pass per row
        return draw(logits, plain_scales, _uniforms(generators))
    return draw_from(filtered_probs(logits, params), generators)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row draws from: temperature, softmax, then top-k, top-p and min-p
    (unnormalised: filtered tokens are 0). Edits ``logits`` in place."""
    if any(p.temperature != 1.0 for p in params):
        logits.div_(_per_row(params, "temperature", logits).unsqueeze(1))
    probs = logits.softmax(dim=-1)
    _top_k_top_p(probs, params)
    if any(p.min_p > 0.0 for p in params):
        # the most likely token always survives top-k/top-p, so the row max is the true max
        threshold = probs.amax(dim=-1, keepdim=True) * _per_row(params, "min_p", probs).unsqueeze(1)
        probs.masked_fill_(probs < threshold, 0.0)
    return probs


def draw_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of unnormalised probabilities, seeded rows from their own generator."""
    draw = _cpu_draw(probs)
    if draw is not None:
        return draw(probs, None, _uniforms(generators))
    return _exponential_race(probs, generators)


def _cuts_top_k_or_p(p: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k or top-p can remove a token of this row."""
    return (p.top_k is not None and p.top_k < vocab_size) or p.top_p < 1.0


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> None:
    """Zero every probability outside its row's top-k and then top-p set, in place.

    Only the rows that filter are touched; each is searched with ``topk`` over a candidate
    width that covers its top-k and, for top-p, widens until the candidates hold enough mass.
    """
    vocab_size = probs.shape[1]
    filtered = [i for i, p in enumerate(params) if _cuts_top_k_or_p(p, vocab_size)]
    if not filtered:
        return
    device = probs.device
    ks = [min(params[i].top_k or vocab_size, vocab_size) for i in filtered]
    ps = [params[i].top_p if params[i].top_p < 1.0 else math.inf for i in filtered]
    # a row is settled within `width` candidates if its top_k fits, or if their mass reaches top_p
    width = max([k for k in ks if k < vocab_size], default=0)
    if any(k == vocab_size for k in ks):
        width = min(vocab_size, max(width, TOP_P_FIRST_WIDTH))

    pending = torch.tensor(filtered, device=device)
    k_all = torch.tensor(ks, device=device)
    p_all = torch.tensor(ps, dtype=probs.dtype, device=device)
    # the common case (every row filters, one round) works on probs itself: no [N, V] copies
    whole = len(filtered) == probs.shape[0]
    while pending.numel():
        rows = probs if whole else probs[pending]
        if width < vocab_size:
            values, indices = rows.topk(width, dim=-1, sorted=True)
        else:
            values, indices = rows.sort(dim=-1, descending=True, stable=True)
        k, top_p = k_all.unsqueeze(1), p_all.unsqueeze(1)
        positions = torch.arange(width, device=device)
        values.masked_fill_(positions >= k, 0.0)
        # top-p applies to the distribution left by top-k: full mass 1, or the top-k mass
        mass = torch.where(k <= width, values.sum(dim=-1, keepdim=True), torch.ones_like(top_p))
        mass_before = values.cumsum(dim=-1) - values
        # keep the smallest prefix whose mass reaches top_p (the most likely token always)
        values.masked_fill_(mass_before >= top_p * mass, 0.0)
        settled = (k <= width) | (values.sum(dim=-1, keepdim=True) >= top_p * mass)
        settled = settled.squeeze(1) | (width == vocab_size)
        if whole and bool(settled.all()):
            probs.zero_().scatter_(1, indices, values)
            return
        whole = False
        probs[pending[settled]] = torch.zeros_like(rows[settled]).scatter_(1, indices[settled], values[settled])
        pending, k_all, p_all = pending[~settled], k_all[~settled], p_all[~settled]
        width = min(vocab_size, width * WIDEN_FACTOR)


def _cpu_draw(logits: torch.Tensor):
    """The C++ inverse-CDF draw (``csrc/sampling.cpp``) for contiguous float32 CPU rows, or None (CUDA,
    kernels off or unbuilt): one uniform per row where the exponential race draws one per token, ~30x
    less CPU at 8192 tokens per row."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous():
        return None
    return _draw_op()


@functools.cache
def _draw_op():
    """``categorical_sample``, or None without the kernels: looked up once (an import and two attribute
    lookups a step cost ~2 us at one row)."""
    from tidal.gpu.cpu.kernels import load_cpu_ops

    ops = load_cpu_ops()
    return None if ops is None else ops.categorical_sample


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64: seeded rows from their own generator, the others from
    one draw of the global generator."""
    uniforms = torch.rand(len(generators), dtype=torch.float64) if None in generators \
        else torch.empty(len(generators), dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device).item()
    return uniforms


def _exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row: argmax(p / E) with E ~ Exponential(1) is a draw from p.

    E = -log(U), U uniform: argmax(p / E) = argmin(p / log U), and drawing uniforms then one
    log is ~3x cheaper than ``exponential_``. U >= tiny keeps log U finite and negative, so a
    token with p > 0 always beats a masked one (p / log U = -0.0).

    Seeded rows take their noise from their own generator, one row at a time; the others
    share one draw from the global generator.
    """
    tiny = torch.finfo(probs.dtype).tiny
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    noise = torch.empty_like(probs)
    if len(seeded) < len(generators):
        noise.uniform_(tiny, 1.0)
    for i, generator in seeded:
        if generator.device == probs.device:
            noise[i].uniform_(tiny, 1.0, generator=generator)
        else:
            row = torch.empty(probs.shape[1], dtype=probs.dtype, device=generator.device)
            noise[i] = row.uniform_(tiny, 1.0, generator=generator)
    noise.log_()
    return row_argmax(probs.div_(noise), largest=False)
