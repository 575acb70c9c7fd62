"""Cost of the OpenAI-surface features per step / per token (issue 12), side by side.

    python benchmarks/openai_surface.py logprobs [--vocab 8192,151936]
    python benchmarks/openai_surface.py grammar  [--batches 1,16,64] [--output-len 32]
    python benchmarks/openai_surface.py grammar-engines  (needs llguidance installed)
    python benchmarks/openai_surface.py n [--prompt-len 1000] [--output-len 32]

``logprobs``: engine cost of capturing logprobs (log-softmax of the asking rows, top-k on the
device, the sampled token's value) next to the sampler's own cost for the same batch, and the
frontend cost of formatting one token's logprobs into OpenAI JSON.
``grammar``: per-step cost of the batched grammar mask (fill the bitmask of every constrained
row, apply it to the logits) inside tidal-tiny engine steps, next to the same batch unconstrained.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_logprobs(vocabs: list[int], batches: list[int], repeat: int) -> None:
    from tidal.gpu.logprobs import CapturedLogprobs
    from tidal.gpu.sampler import Sampler, SamplingBatch
    from tidal.wire import SamplingParams

    sampler = Sampler()
    print("engine: ms per step (float32 logits, all rows asking for top 5 vs none asking)")
    print(f"{'vocab':>7} {'batch':>5} {'sample':>8} {'+logprobs':>10} {'per token us':>12} {'share':>6}")
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab) * 3
            plain = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(batch)]
            asking = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, logprobs=5) for i in range(batch)]
            gens = [None] * batch
            empty = [[] for _ in range(batch)]

            def step(params):
                scratch = logits.clone()
                captured = CapturedLogprobs.capture(scratch, params)
                tokens = sampler.sample_tokens(scratch, SamplingBatch(params, empty, empty, gens)).tolist()
                if captured is not None:
                    captured.for_tokens(tokens)

            base = _median_ms(lambda: step(plain), repeat)
            with_lp = _median_ms(lambda: step(asking), repeat)
            extra = with_lp - base
            print(f"{vocab:>7} {batch:>5} {base:>8.3f} {with_lp:>10.3f} {extra / batch * 1e3:>12.1f} "
                  f"{extra / base:>6.0%}")

    import msgspec
    from tokenizers import Tokenizer

    from tidal.gpu.model import tiny_model
    from tidal.openai.token_logprobs import LogprobsFormatter, TokenTexts
    from tidal.wire import Logprobs

    tok = Tokenizer.from_file(tiny_model.asset_dir() + "/tokenizer.json")
    texts = TokenTexts(tok)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tok.get_vocab_size(), (256, 21), generator=gen).tolist()
    print("frontend: us per token to format (and JSON-encode) one token's logprobs, warm token cache")
    for kind, top in (("chat", 0), ("chat", 5), ("chat", 20), ("completions", 5)):
        formatter = LogprobsFormatter(kind, texts, False)
        lp = Logprobs([-1.0] * 256, [row[1:1 + top] for row in ids], [[-2.0] * top for _ in ids])
        tokens = [row[0] for row in ids]
        ms = _median_ms(lambda: msgspec.json.encode(formatter.format(tokens, lp)), repeat)
        print(f"  {kind:<12} top {top:>2}: {ms / 256 * 1e3:6.1f} us/token")


# the string cannot close within the run, so every constrained row stays in the batch throughout
GRAMMAR_SCHEMA = '{"type":"object","properties":{"text":{"type":"string","minLength":1000}},"required":["text"]}'


def bench_grammar(batches: list[int], output_len: int) -> None:
    """tidal-tiny engine in-process: batches of constrained vs unconstrained requests."""
    from tidal.gpu.engine import Engine
    from tidal.wire import AddRequest, EngineConfig, SamplingParams, StructuredOutput

    engine = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=2048, max_num_seqs=max(batches)))
    grammars = engine.grammars
    spent = {"mask": 0.0}
    apply_mask = grammars.apply_mask

    def timed_mask(logits, sampling):
        start = time.perf_counter()
        apply_mask(logits, sampling)
        spent["mask"] += time.perf_counter() - start

    grammars.apply_mask = timed_mask  # type: ignore[method-assign]
    constraint = StructuredOutput("json_schema", GRAMMAR_SCHEMA)
    ids = iter(range(1, 1 << 30))

    def run(batch: int, constrained: bool) -> tuple[float, float, int]:
        for i in range(batch):
            params = SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True,
                                    structured=constraint if constrained else None)
            engine.add_request(AddRequest(next(ids), [5 + i, 6, 7, 8], params))
        engine.step()  # the prefill step (a constrained batch also waits for its grammar here)
        while engine.grammars.num_waiting:
            engine.step()
        engine.take_report()
        spent["mask"] = 0.0
        steps = 0
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
            engine.take_report()
            steps += 1
        return (time.perf_counter() - start) / steps * 1e3, spent["mask"] / steps * 1e3, steps

    run(4, True)  # warm up: tokenizer info, first compile
    print(f"grammar mask per step, tidal-tiny, {output_len} tokens per request (ms per step)")
    print(f"{'batch':>5} {'plain step':>10} {'constrained step':>16} {'mask':>7} {'mask share':>10}")
    for batch in batches:
        # alternate and keep the best of three: the host is shared and noisy
        runs = [(run(batch, False), run(batch, True)) for _ in range(3)]
        plain = min(p[0] for p, _ in runs)
        constrained, mask, _ = min((c for _, c in runs), key=lambda c: c[0])
        print(f"{batch:>5} {plain:>10.2f} {constrained:>16.2f} {mask:>7.2f} {mask / constrained:>10.0%}")


def bench_grammar_engines(batches: list[int], steps: int = 12) -> None:
    """xgrammar against llguidance (pip install llguidance; not a dependency) on tidal-tiny's
    tokenizer: compile time of one schema, and the time to fill the token bitmask of B rows per
    step (steady state: the first step is skipped; greedy walks under the mask)."""
    import json

    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from tidal.gpu.model import tiny_model

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model.asset_dir())
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age", "color"],
        "additionalProperties": False})
    logits = torch.randn(max(batches), vocab, generator=torch.Generator().manual_seed(0))

    def walk(fill, advance, matchers, bitmask) -> float:
        spent = 0.0
        for step in range(steps):
            start = time.perf_counter()
            fill(matchers, bitmask)
            if step:
                spent += time.perf_counter() - start
            rows = logits[:len(matchers)].clone()
            xgr.apply_token_bitmask_inplace(rows, bitmask[:len(matchers)])
            for matcher, token in zip(matchers, rows.argmax(dim=-1).tolist()):
                advance(matcher, token)
        return spent / (steps - 1) * 1e3

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
    xgr_compile = (time.perf_counter() - start) * 1e3
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    llguidance.LLMatcher(lltok, grammar)
    llg_compile = (time.perf_counter() - start) * 1e3
    print(f"compile one schema: xgrammar {xgr_compile:.2f} ms, llguidance {llg_compile:.2f} ms")
    batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
    executor = llguidance.LLExecutor()
    print(f"{'batch':>5} {'xgrammar fill ms':>16} {'llguidance fill ms':>18}")
    for batch in batches:
        bitmask = xgr.allocate_token_bitmask(batch, vocab)
        xgr_ms = walk(lambda ms, bm: batch_matcher.batch_fill_next_token_bitmask(ms, bm),
                      lambda m, t: m.is_terminated() or m.accept_token(t),
                      [xgr.GrammarMatcher(compiled) for _ in range(batch)], bitmask)
        llg_ms = walk(lambda ms, bm: llg_torch.fill_next_token_bitmask_par(executor, list(zip(ms, range(len(ms)))), bm),
                      lambda m, t: m.is_stopped() or m.consume_token(t),
                      [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)], bitmask)
        print(f"{batch:>5} {xgr_ms:>16.3f} {llg_ms:>18.3f}")


def bench_n(prompt_len: int, output_len: int, n: int = 4) -> None:
    """n choices as forks of one request vs n separate requests of the same prompt, all arriving
    together: prompt tokens computed (the prefill work) and wall time, tidal-tiny in-process."""
    from tidal.gpu.engine import Engine
    from tidal.wire import AddRequest, EngineConfig, SamplingParams

    def run(forked: bool, base: int) -> tuple[int, float]:
        engine = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=4096, max_num_batched_tokens=8192))
        prompt = [(base * 7919 + i) % 8000 + 100 for i in range(prompt_len)]
        for i in range(n):
            engine.add_request(AddRequest(base + i, prompt, SamplingParams(max_tokens=output_len, temperature=1.0,
                                                                           seed=i, ignore_eos=True),
                                          fork_of=base if forked and i else None))
        computed = 0
        execute = engine.runner.execute

        def counting(entries):
            nonlocal computed
            computed += sum(num for seq, num in entries if seq.num_computed_tokens < seq.num_prompt_tokens)
            return execute(entries)

        engine.runner.execute = counting  # type: ignore[method-assign]
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
            engine.take_report()
        return computed, time.perf_counter() - start

    run(True, 1)  # warm-up
    print(f"n={n}, prompt {prompt_len} tokens, {output_len} output tokens each, tidal-tiny")
    for label, forked, base in (("4 separate requests", False, 1000), (f"one request, n={n}", True, 2000),
                                ("4 separate requests", False, 3000), (f"one request, n={n}", True, 4000)):
        computed, seconds = run(forked, base)
        print(f"  {label:<22} prompt tokens computed {computed:>6}   wall {seconds * 1e3:8.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["logprobs", "grammar", "grammar-engines", "n"])
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--vocab", default="8192,151936")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    if args.what == "logprobs":
        bench_logprobs([int(v) for v in args.vocab.split(",")], batches, args.repeat)
    elif args.what == "n":
        bench_n(args.prompt_len, args.output_len)
    elif args.what == "grammar":
        bench_grammar(batches, args.output_len)
    else:
        bench_grammar_engines(batches)


if __name__ == "__main__":
    main()
