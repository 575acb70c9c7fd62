"""Speculative decoding (n-gram, or a draft model with --draft) against none, in-process, alternating: output
tokens per second of the engine's step loop on an input-grounded prompt set (repeat or edit a given text,
answer from a given document), at a given concurrency, with the acceptance rate.

    python benchmarks/speculative.py --model /path/to/SmolLM2-135M-Instruct --concurrency 1 --rounds 3
    python benchmarks/speculative.py --model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf --concurrency 16
    python benchmarks/speculative.py --model /path/to/SmolLM2-135M-Instruct --draft /path/to/its.Q4_1.gguf --k 3

Each round runs the whole prompt set (cycled up to --concurrency requests at once) without and then with
speculation, on two engines loaded once; the order of the two sides alternates between rounds (off first,
then on first) so a loaded host's drift hits both sides alike.
Greedy decoding: the two sides produce the same tokens (checked), so the ratio is the speed-up alone.
Besides wall-clock tokens per second it prints this process's CPU time per token (all its threads), and
at the end the ratio of each side's best round: on a host shared with other work, other work only ever
slows a round down, so the best rounds are the closest to what the two sides cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tidal.gguf_model import prepare
from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams, SpeculativeConfig

DOCUMENT = (
    "The Harbor Street library opens at 9 am on weekdays and at 10 am on Saturdays; it is closed on Sundays. "
    "Members may borrow up to six books for three weeks, and renew each book twice online. Late returns cost "
    "20 cents per book per day. The reading room on the second floor is quiet and has 40 desks with power "
    "outlets. Printing costs 10 cents a page in black and white and 50 cents in colour."
)
CODE = (
    "def load_config(path):\n    with open(path) as f:\n        data = json.load(f)\n    if 'name' not in data:\n"
    "        raise ValueError('missing name')\n    data.setdefault('port', 8000)\n    data.setdefault('debug', False)\n"
    "    return data\n"
)
TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{DOCUMENT}",
    f"Rewrite this function, renaming the variable data to config everywhere. Output only the code.\n\n{CODE}",
    f"Read the document and answer. How much does it cost to print in colour, and when does the library "
    f"open on Saturdays? Quote the sentences you use.\n\nDocument: {DOCUMENT}",
    f"Copy this list, then add one more item in the same style:\n- apples, 3 kg, 4.50 EUR\n- pears, 2 kg, 3.20 EUR"
    f"\n- plums, 1 kg, 2.10 EUR\n- grapes, 2 kg, 5.40 EUR",
]


def chat(text: str) -> str:
    """SmolLM2-Instruct's chat template."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, first_id: int) -> tuple[float, float, int, dict]:
    """(wall seconds, CPU seconds of this process, output tokens, tokens by request) of the decode."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(first_id + i, prompt, params))
    tokens: dict[int, list[int]] = {first_id + i: [] for i in range(len(prompts))}
    # time the decode only: the first step's prefill is the same work on both sides
    engine.step()
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else ():
            tokens[out.request_id] += out.token_ids
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return elapsed, cpu, sum(map(len, tokens.values())), {k - first_id: v for k, v in tokens.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft", default=None, help="a draft model (directory or .gguf): the draft_model method")
    parser.add_argument("--draft-quantization", default=None, help="the draft's quantization (int8, int4, ...)")
    args = parser.parse_args()
    if args.model.endswith(".gguf"):  # the directory ``tidal serve --model FILE.gguf`` prepares from it
        args.model = prepare(args.model)
    if args.draft is not None and args.draft.endswith(".gguf"):
        args.draft = prepare(args.draft)
    base = EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=2048, max_num_seqs=max(16, args.concurrency))
    fields = {name: getattr(base, name) for name in base.__struct_fields__}
    spec = SpeculativeConfig("ngram", args.k, 2, 5) if args.draft is None else SpeculativeConfig(
        "draft_model", args.k, model=args.draft, quantization=args.draft_quantization)
    off, on = Engine(base), Engine(EngineConfig(**{**fields, "speculative": spec}))
    prompts = [off.tokenizer.encode(chat(t)).ids for t in TASKS]
    # c=1 runs each task in turn; c>1 cycles the tasks over the concurrent requests
    batches = [[p] for p in prompts] if args.concurrency == 1 else \
        [[prompts[i % len(prompts)] for i in range(args.concurrency)]]
    ratios, best_off, best_on, next_id = [], 0.0, 0.0, 1
    for engine in (off, on):  # untimed: the first steps of an engine pay for warming its kernels and caches
        run(engine, batches[0], 8, next_id)
        next_id += 100_000
    for round_index in range(args.rounds):
        before = on.stats()
        t_off = cpu_off = n_off = t_on = cpu_on = n_on = 0.0
        for batch in batches:  # both sides per task, off first in odd rounds and on first in even ones
            if round_index % 2 == 0:
                t, cpu, n, out_off = run(off, batch, args.max_tokens, next_id)
                t2, cpu2, n2, out_on = run(on, batch, args.max_tokens, next_id + 10_000)
            else:
                t2, cpu2, n2, out_on = run(on, batch, args.max_tokens, next_id + 10_000)
                t, cpu, n, out_off = run(off, batch, args.max_tokens, next_id)
            t_off, cpu_off, n_off = t_off + t, cpu_off + cpu, n_off + n
            t_on, cpu_on, n_on = t_on + t2, cpu_on + cpu2, n_on + n2
            next_id += 100_000
            assert out_on == out_off, "greedy output differs with speculation"
        after = on.stats()
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        ratio = (n_on / t_on) / (n_off / t_off)
        ratios.append(ratio)
        best_off, best_on = max(best_off, n_off / t_off), max(best_on, n_on / t_on)
        print(f"round {round_index + 1}: c={args.concurrency} off {n_off / t_off:8.1f} tok/s  on {n_on / t_on:8.1f} "
              f"tok/s  ratio {ratio:.2f}x  acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.2f}  "
              f"CPU ms/token off {1e3 * cpu_off / n_off:.1f} on {1e3 * cpu_on / n_on:.1f} "
              f"({cpu_off / n_off / (cpu_on / n_on):.2f}x)", flush=True)
    print(f"median ratio {statistics.median(ratios):.2f}x over {args.rounds} rounds (min {min(ratios):.2f}x); "
          f"best round of each side: off {best_off:.1f} tok/s, on {best_on:.1f} tok/s, {best_on / best_off:.2f}x")


if __name__ == "__main__":
    main()
