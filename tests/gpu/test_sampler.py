"""Sampler: greedy, filtering, seeded reproducibility and penalties."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tidal.gpu import sampler as sampler_module
from tidal.gpu.sampler import ARGMAX_BLOCK, Sampler, SamplingBatch, apply_penalties, make_generator, row_argmax
from tidal.wire import SamplingParams

SAMPLER = Sampler()


def sample(logits, params, outputs=None, prompts=None, generators=None):
    """Sample from a copy (the sampler works in place) with sensible defaults."""
    n = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * n
    return SAMPLER.sample_tokens(logits.clone(), SamplingBatch(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
    )).tolist()


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kwargs)


def kept_by_hf(logits_row: torch.Tensor, *warpers) -> set[int]:
    """The tokens transformers' warpers, applied in order, leave possible."""
    scores = logits_row.unsqueeze(0).clone()
    for warper in warpers:
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


# ------------------------------------------------------------------ greedy


def test_greedy_is_argmax_including_ties():
    logits = random_logits(16, 1000)
    logits[3, [7, 9]] = 100.0  # a tie: the first index wins, as in transformers' greedy search
    assert sample(logits, params(temperature=0.0)) == logits.argmax(dim=-1).tolist()
    assert sample(logits, params(temperature=0.0))[3] == 7


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.sampled_from([2 * ARGMAX_BLOCK, 8192, 1000, 4 * ARGMAX_BLOCK + 1]),
       seed=st.integers(0, 2**31), alphabet=st.sampled_from(["ties", "nan", "wide"]), largest=st.booleans())
def test_row_argmax_is_torchs_argmax(rows, vocab, seed, alphabet, largest):
    """The blocked search gives torch's indices: the first of equal values (ties within a block,
    across blocks, between the blocks and the partial last one), NaN as the extreme, +-inf."""
    generator = torch.Generator().manual_seed(seed)
    values = {"ties": [-1.0, 0.0, -0.0, 2.0, 3.0], "nan": [0.0, 1.0, float("nan"), float("inf")],
              "wide": [float("-inf"), -5.0, 1.0, 7.0, float("inf")]}[alphabet]
    table = torch.tensor(values)
    x = table[torch.randint(len(values), (rows, vocab), generator=generator)]
    expected = x.argmax(dim=-1) if largest else x.argmin(dim=-1)
    with mock.patch.object(sampler_module, "BLOCKED_ARGMAX_MIN_ELEMENTS", 0):  # small inputs take the blocked path too
        assert torch.equal(row_argmax(x, largest=largest), expected)


def test_row_argmax_when_the_partial_last_block_holds_the_max():
    x = torch.zeros(64, 1000)  # 1000 = 7 blocks of 128 + 104
    x[:, 5] = 1.0
    x[1, 990] = 2.0  # strictly larger in the tail: it wins
    x[2, 990] = 1.0  # a tie with the head: the first index wins
    x[3, 999] = float("nan")
    assert row_argmax(x)[:5].tolist() == [5, 990, 5, 999, 5]
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = random_logits(32, 500)
    torch.manual_seed(0)
    greedy = logits.argmax(dim=-1).tolist()
    assert sample(logits, params(temperature=1.5, top_k=1)) == greedy
    assert sample(logits, params(temperature=1.5, top_p=1e-6)) == greedy


def test_greedy_rows_stay_greedy_in_a_mixed_batch():
    logits = random_logits(8, 300, scale=0.1)  # flat: sampled rows rarely hit the argmax
    mixed = [params(temperature=0.0) if i % 2 else params(temperature=1.0, top_p=0.9) for i in range(8)]
    tokens = sample(logits, mixed)
    greedy = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in range(1, 8, 2)] == [greedy[i] for i in range(1, 8, 2)]
    assert [tokens[i] for i in range(0, 8, 2)] != [greedy[i] for i in range(0, 8, 2)]


# ------------------------------------------------------------------ filtering


def draws(row: torch.Tensor, p: SamplingParams, n: int = 4000) -> Counter:
    """n unseeded draws from one row, in one vectorised call."""
    torch.manual_seed(1)
    return Counter(sample(row.unsqueeze(0).repeat(n, 1), p))


@pytest.mark.parametrize(
    ("p", "warper"),
    [
        (params(top_k=5), TopKLogitsWarper(top_k=5)),
        (params(top_p=0.6), TopPLogitsWarper(top_p=0.6)),
        (params(min_p=0.1), MinPLogitsWarper(min_p=0.1)),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_filters_keep_the_same_tokens_as_transformers(p, warper):
    row = random_logits(1, 64, seed=3, scale=1.5)[0]
    kept = kept_by_hf(row, warper)
    assert 1 < len(kept) < 20
    assert set(draws(row, p)) == kept


def test_filters_combine_and_every_row_uses_its_own_settings():
    logits = random_logits(4, 64, seed=5, scale=1.5)
    row_params = [params(top_k=8, top_p=0.7), params(top_k=3), params(), params(top_p=0.5, min_p=0.3)]
    torch.manual_seed(2)
    n = 3000
    batch = logits.repeat_interleave(n, dim=0)
    tokens = sample(batch, [p for p in row_params for _ in range(n)])
    expected = [
        kept_by_hf(logits[0], TopKLogitsWarper(8), TopPLogitsWarper(0.7)),
        kept_by_hf(logits[1], TopKLogitsWarper(3)),
        None,
        kept_by_hf(logits[3], TopPLogitsWarper(0.5), MinPLogitsWarper(0.3)),
    ]
    for i, kept in enumerate(expected):
        got = set(tokens[i * n:(i + 1) * n])
        if kept is None:
            assert len(got) > 40  # unfiltered row: most of the vocabulary shows up
        else:
            assert got == kept


def test_top_p_nucleus_wider_than_the_first_candidate_search():
    # ~300 near-equal tokens hold half the mass: more than the sampler's first topk width
    vocab, n = 4096, 2000
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    row = torch.full((vocab,), -5.0)
    row[order[:600]] = 5.0 - 0.0002 * torch.arange(600)
    kept = kept_by_hf(row, TopPLogitsWarper(0.5))
    assert 280 < len(kept) < 320
    torch.manual_seed(3)
    batch = row.repeat(n + 1, 1)
    tokens = sample(batch, [params(top_k=20)] + [params(top_p=0.5)] * n)
    assert tokens[0] in set(order[:20].tolist())
    got = set(tokens[1:])
    assert got <= kept
    rank = {token: r for r, token in enumerate(order.tolist())}
    assert max(rank[t] for t in got) > 270  # the tail of the nucleus is reachable


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draws(row, params(min_p=0.2))) == {0, 1, 2}  # 0.05 < 0.2 * 0.5
    assert set(draws(row, params(min_p=0.5))) == {0, 1}
    assert set(draws(row, params())) == {0, 1, 2, 3}


@pytest.fixture(params=["cpu kernel", "exponential race"])
def draw_path(request, monkeypatch):
    """Both ways a draw is made: the C++ inverse CDF (CPU float32 rows) and torch's exponential race
    (CUDA, or the kernels off)."""
    if request.param == "cpu kernel":
        if sampler_module._cpu_draw(torch.zeros(1, 4)) is None:
            pytest.skip("the C++ kernels could not be built here")
    else:
        monkeypatch.setattr(sampler_module, "_cpu_draw", lambda logits: None)
    return request.param


@pytest.mark.parametrize("p", [params(temperature=0.5), params(), params(temperature=2.0),
                               params(top_p=0.999), params(top_k=5, temperature=1.5)])
def test_draw_frequencies_follow_the_tempered_softmax(p, draw_path):
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    counts = draws(row, p, n)
    kept = row.clone()
    if p.top_k is not None:
        kept[p.top_k:] = float("-inf")  # the row is sorted: top-k keeps its first k
    expected = (kept / p.temperature).softmax(dim=-1) * n
    assert all(counts[i] == 0 for i, e in enumerate(expected.tolist()) if e == 0)
    chi2 = sum((counts[i] - e) ** 2 / e for i, e in enumerate(expected.tolist()) if e > 0)
    # at most 5 degrees of freedom: p = 0.001 at chi2 = 20.5
    assert chi2 < 20.5


def test_masked_tokens_are_never_drawn(draw_path):
    # a grammar mask sets logits to -inf: those tokens must have probability 0, not exp(-87)
    row = torch.full((4096,), float("-inf"))
    allowed = [3, 1000, 4095]
    row[allowed] = torch.tensor([-50.0, -40.0, -45.0])
    assert set(draws(row, params(temperature=2.0), 3000)) <= set(allowed)
    assert set(draws(row, params(temperature=1e-3), 200)) == {1000}


def test_plain_scales_are_decided_once_per_composition_and_vocabulary():
    # the one-pass draw's 1/temperature of the sampled rows (greedy rows take argmax), None when a row filters;
    # whether top-k cuts anything depends on the vocabulary, so the decision is made again for another size
    batch = SamplingBatch([params(temperature=0.5), params(temperature=0.0), params(temperature=2.0, top_k=5)],
                          [[], [], []], [[], [], []], [None] * 3)
    assert batch.plain_scales(100) is None
    assert batch.plain_scales(4).tolist() == [2.0, 0.5]
    assert batch.plain_scales(4) is batch.plain_scales(4)  # built once
    assert SamplingBatch([params(min_p=0.1)], [[]], [[]], [None]).plain_scales(4) is None
    assert SamplingBatch([params(top_p=0.9)], [[]], [[]], [None]).plain_scales(4) is None


def test_inverse_cdf_draw_edges():
    ops = sampler_module._cpu_draw(torch.zeros(1, 4))
    if ops is None:
        pytest.skip("the C++ kernels could not be built here")
    weights = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]).repeat(4, 1)
    uniforms = torch.tensor([0.0, 0.2499, 0.2501, 1.0 - 2**-53], dtype=torch.float64)
    # cumulative weights 1 at index 2, 3 at index 4, 4 at index 9 (total 4): zero weights are skipped
    assert ops(weights.clone(), None, uniforms).tolist() == [2, 2, 4, 9]
    # logits: exp((x - max) / T); the row's token does not depend on the batch or the thread count
    logits = torch.randn(300, 8192, generator=torch.Generator().manual_seed(0)) * 4
    inv_t, u = torch.full((300,), 0.8), torch.rand(300, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ops(logits.clone(), inv_t, u)
        torch.set_num_threads(2)
        multi = ops(logits.clone(), inv_t, u)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)
    assert torch.equal(ops(logits[7:8].clone(), inv_t[7:8], u[7:8]), single[7:8])


# ------------------------------------------------------------------ seeds


def run_alone_and_in_batches(seed: int, steps: int = 12) -> tuple[list[int], list[int]]:
    """The tokens one seeded request gets over several steps, alone and in varying batches."""
    vocab = 2000
    mine = params(temperature=1.0, top_p=0.95, seed=seed)
    alone_gen, batched_gen = make_generator(seed), make_generator(seed)
    others = [params(), params(temperature=0.0), params(top_k=50, seed=7), params(top_p=0.5, min_p=0.05)]
    alone, batched = [], []
    torch.manual_seed(123)
    for step in range(steps):
        row = random_logits(1, vocab, seed=1000 + step, scale=0.5)
        alone += sample(row, [mine], generators=[alone_gen])
        # a different batch every step: size, position and neighbours all change
        neighbours = others[: step % 5]
        position = step % (len(neighbours) + 1)
        batch_params = neighbours[:position] + [mine] + neighbours[position:]
        gens = [make_generator(p.seed) for p in batch_params]
        gens[position] = batched_gen
        batch = random_logits(len(batch_params), vocab, seed=step, scale=0.5)
        batch[position] = row[0]
        batched.append(sample(batch, batch_params, generators=gens)[position])
    return alone, batched


def test_seeded_request_does_not_depend_on_the_rest_of_the_batch():
    alone, batched = run_alone_and_in_batches(seed=42)
    assert alone == batched


def test_same_seed_same_tokens_different_seed_different_tokens():
    first, _ = run_alone_and_in_batches(seed=42)
    again, _ = run_alone_and_in_batches(seed=42)
    other, _ = run_alone_and_in_batches(seed=43)
    assert first == again
    assert first != other


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(9), make_generator(9)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


# ------------------------------------------------------------------ penalties


def reference_penalties(logits, p: SamplingParams, output: list[int], prompt: list[int]) -> torch.Tensor:
    row = logits.clone()
    for token in set(prompt) | set(output):
        value = row[token].item()
        row[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in Counter(output).items():
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def test_penalties_match_a_per_row_reference():
    vocab = 50
    logits = random_logits(5, vocab, seed=11)
    row_params = [
        params(repetition_penalty=1.3),
        params(frequency_penalty=0.5, presence_penalty=0.25),
        params(),
        params(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.0),
        params(presence_penalty=-0.7),
    ]
    gen = torch.Generator().manual_seed(0)
    # outputs drawn from a few tokens, so that counts above one occur
    outputs = [torch.randint(0, 8, (n,), generator=gen).tolist() for n in (6, 10, 4, 0, 12)]
    assert max(Counter(outputs[1]).values()) > 1
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 3, 7, 9, 1)]
    got = logits.clone()
    apply_penalties(got, row_params, outputs, prompts)
    for i, p in enumerate(row_params):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], p, outputs[i], prompts[i]))
    assert not torch.equal(got, logits)


def test_repetition_penalty_matches_transformers():
    logits = random_logits(1, 100, seed=4)
    prompt, output = [1, 5, 9, 5], [20, 1, 33]
    got = logits.clone()
    apply_penalties(got, [params(repetition_penalty=1.7)], [output], [prompt])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, hf)


def test_penalties_are_skipped_when_unused():
    logits = random_logits(3, 100)
    got = logits.clone()
    apply_penalties(got, [params()] * 3, [[1, 2, 3]] * 3, [[4, 5]] * 3)
    assert torch.equal(got, logits)


def test_repetition_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.5]])
    greedy = params(temperature=0.0)
    assert sample(logits, greedy, outputs=[[0]]) == [0]
    assert sample(logits, params(temperature=0.0, repetition_penalty=1.2), outputs=[[0]]) == [1]
    assert sample(logits, params(temperature=0.0, repetition_penalty=1.2), prompts=[[0]]) == [1]
    # presence and frequency penalties look at the output only
    assert sample(logits, params(temperature=0.0, presence_penalty=0.5), prompts=[[0]]) == [0]
    assert sample(logits, params(temperature=0.0, frequency_penalty=0.05), outputs=[[0, 0, 0]]) == [1]
