"""How often quantized weights pick the dense model's next token: top-1 agreement over 1,000 decode steps.

    python benchmarks/quantized_agreement.py [--models anchor-small,tidal-tiny] [--modes dense,int8,int4]
                                             [--dtypes bfloat16,float32] [--steps 1000] [--prompts 3]
                                             [--threads 2] [--anchors ../shared/anchors]

For each model and activation dtype the dense model greedy-decodes ``--steps`` tokens from each prompt. That
token sequence is then run through every ``--modes`` model (dense or quantized at load, same dtype) as one
teacher-forced prefill per prompt, and its logits at the ``--steps`` positions are compared with the dense
model's from the same prefill: top-1 agreement (the fraction of positions whose argmax is the dense argmax),
mean KL(dense || mode) and the largest |logit difference|. Each mode also decodes greedily on its own
("free-running") until its first token that differs from the dense sequence: the steps before it, per prompt.

A row ``dense, decode steps`` compares the dense model's own decode-step logits with its prefill logits:
the same weights through a different kernel path, the floor of what rounding alone changes.

Models: ``anchor-tiny`` / ``anchor-small`` (``../shared/anchors/make_tiny_model.py DIR --size SIZE`` into
the temp directory unless it is there, bf16 random weights: near-uniform next-token distributions, so tiny
logit differences flip the argmax and agreement is pessimistic), ``tidal-tiny`` (the built-in model, random
weights shaped so the best token stands out: peaked distributions), or a model directory. The mean max p
column says which kind each model is.

Modes: ``dense`` or a name of ``quantization.ON_THE_FLY`` (``--quantization``'s choices), so a new scheme is
a new row by name; ``NAME+VAR=VALUE[+...]`` also sets environment variables while that row loads and runs
(a kernel path chosen by the environment).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model import quantization
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import checkpoint_weight_dtype, load_model, resolve_model_dir
from tidal.gpu.model.precision import Precision, resolve_precision

BLOCK_SIZE = 16
PROMPTS = ("The history of the city begins with", "def parse_args(argv):\n    parser = ",
           "Once upon a time, in a small village,", "import os\nimport sys\n\n", "The results of the experiment")
HOST_FLAGS = ("avx2", "avx512_bf16", "amx_bf16")


def model_dir_for(name: str, anchors: str) -> str:
    """``anchor-SIZE`` (made once into the temp directory), ``tidal-tiny`` or a model directory."""
    if name.startswith("anchor-"):
        size = name.removeprefix("anchor-")
        out = os.path.join(tempfile.gettempdir(), f"tidal-anchor-{size}")
        if not os.path.exists(os.path.join(out, "config.json")):
            subprocess.run([sys.executable, os.path.join(anchors, "make_tiny_model.py"), out, "--size", size],
                           check=True)
        return out
    return resolve_model_dir(name)


def parse_mode(spec: str) -> tuple[str | None, dict[str, str]]:
    """``int8+VAR=1`` -> ("int8", {"VAR": "1"}); ``dense`` -> None (no quantization)."""
    name, *settings = spec.split("+")
    if name != "dense" and name not in quantization.ON_THE_FLY:
        raise SystemExit(f"unknown mode {name!r}: dense or one of {', '.join(quantization.ON_THE_FLY)}")
    env = dict(setting.split("=", 1) for setting in settings)
    return (None if name == "dense" else name), env


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prompts_for(model_dir: str, count: int, vocab: int) -> list[list[int]]:
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(path):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
        return [tokenizer.encode(text).ids for text in (PROMPTS * count)[:count]]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (12,), generator=generator).tolist() for _ in range(count)]


class Runner:
    """One sequence at a time over a KV cache in contiguous blocks (slot = position)."""

    def __init__(self, model, config, dtype: torch.dtype, max_len: int) -> None:
        self.model = model
        blocks = -(-max_len // BLOCK_SIZE)
        shape = (blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(config.num_layers)]
        self.table = torch.arange(blocks, dtype=torch.int32)

    def prefill(self, tokens: list[int], logit_rows: slice) -> torch.Tensor:
        """float32 logits of rows ``logit_rows`` of ``tokens`` run as one prompt."""
        n = len(tokens)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens), positions=torch.arange(n), slot_mapping=torch.arange(n), num_decodes=0,
            decode_block_tables=torch.zeros(0, len(self.table), dtype=torch.int32),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32), decode_max_seq_len=0,
            prefill_query_lens=[n], prefill_seq_lens=[n],
            prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            prefill_seq_lens_tensor=torch.tensor([n], dtype=torch.int32), prefill_block_tables=self.table[None],
            logits_indices=torch.arange(n)[logit_rows])
        with torch.inference_mode():
            return self.model.compute_logits(self.model(batch, self.caches)[batch.logits_indices])

    def decode(self, token: int, position: int) -> torch.Tensor:
        """float32 logits [vocab] of ``token`` at ``position``, its context already cached."""
        batch = ForwardBatch(
            input_ids=torch.tensor([token]), positions=torch.tensor([position]),
            slot_mapping=torch.tensor([position]), num_decodes=1, decode_block_tables=self.table[None],
            decode_seq_lens=torch.tensor([position + 1], dtype=torch.int32), decode_max_seq_len=position + 1,
            prefill_query_lens=[], prefill_seq_lens=[], prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
            prefill_seq_lens_tensor=torch.zeros(0, dtype=torch.int32),
            prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32), logits_indices=torch.tensor([0]))
        with torch.inference_mode():
            return self.model.compute_logits(self.model(batch, self.caches))[0]

    def greedy(self, prompt: list[int], steps: int, follow: list[int] | None = None):
        """(tokens, their logits [steps, vocab]) of greedy decoding; with ``follow``, stop at the first token
        that differs from it (the tokens so far are the steps before the divergence)."""
        logits = [self.prefill(prompt, slice(-1, None))[0]]
        tokens: list[int] = []
        while True:
            tokens.append(int(logits[-1].argmax()))
            if follow is not None and tokens[-1] != follow[len(tokens) - 1]:
                return tokens[:-1], None
            if len(tokens) == steps:
                return tokens, None if follow is not None else torch.stack(logits)
            logits.append(self.decode(tokens[-1], len(prompt) + len(tokens) - 1))


def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[int, float, float]:
    """(positions with the reference's argmax, summed KL(reference || logits), max |difference|)."""
    agree = int((logits.argmax(-1) == reference.argmax(-1)).sum())
    ref_log, log = F.log_softmax(reference.double(), -1), F.log_softmax(logits.double(), -1)
    kl = float((ref_log.exp() * (ref_log - log)).sum(-1).clamp(min=0).sum())  # >= 0 but for rounding
    return agree, kl, float((reference - logits).abs().max())


def dtype_label(precision: Precision) -> str:
    name = str(precision.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    if precision.linear_weights != precision.dtype:
        name += f" ({str(precision.linear_weights).removeprefix('torch.').replace('bfloat16', 'bf16')} linear weights)"
    return name


def rows_for(model_name: str, model_dir: str, dtype_name: str, args) -> Iterator[str]:
    """The table's rows of one model in one activation dtype, each as soon as it is measured."""
    precision = resolve_precision(dtype_name, torch.device("cpu"), checkpoint_weight_dtype(model_dir))

    def load(quantize: str | None):
        return load_model(model_dir, precision.dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                          linear_weights=precision.linear_weights, quantize=quantize)

    dense, config = load(None)
    prompts = prompts_for(model_dir, args.prompts, config.vocab_size)
    runner = Runner(dense, config, precision.dtype, max(map(len, prompts)) + args.steps)
    sequences, references, decode_logits = [], [], []
    for prompt in prompts:
        tokens, logits = runner.greedy(prompt, args.steps)
        sequences.append(tokens)
        decode_logits.append(logits)
        references.append(runner.prefill(prompt + tokens[:-1], slice(len(prompt) - 1, None)))
    del dense, runner
    positions = args.steps * len(prompts)
    max_p = statistics.fmean(float(F.softmax(r, -1).max(-1).values.mean()) for r in references)
    distinct = len({token for tokens in sequences for token in tokens})  # 1: the model repeats one token
    label = dtype_label(precision)

    def row(weights: str, logits: list[torch.Tensor], free_running: str) -> str:
        agree, kl, diff = zip(*(compare(r, x) for r, x in zip(references, logits)))
        return (f"| {model_name} | {max_p:.3g} | {distinct} | {label} | {weights} | {sum(agree) / positions:.3f} | "
                f"{sum(kl) / positions:.3g} | {max(diff):.3g} | {free_running} |")

    yield row("dense, decode steps", decode_logits, "(reference)")
    for spec in args.modes.split(","):
        quantize, env = parse_mode(spec)
        with environment(env):
            model, _ = load(quantize)
            runner = Runner(model, config, precision.dtype, max(map(len, prompts)) + args.steps)
            logits = [runner.prefill(p + s[:-1], slice(len(p) - 1, None)) for p, s in zip(prompts, sequences)]
            steps = [len(runner.greedy(p, args.steps, follow=s)[0]) for p, s in zip(prompts, sequences)]
        free = ", ".join(f">={n}" if n == args.steps else str(n) for n in steps)
        yield row(spec, logits, free)
        del model, runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="anchor-small",
                    help="anchor-tiny, anchor-small, tidal-tiny or model directories, comma-separated")
    ap.add_argument("--modes", default="dense,int8,int4",
                    help=f"dense or {'/'.join(quantization.ON_THE_FLY)}, each optionally +VAR=VALUE...")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="activation dtypes (--dtype's choices, or auto)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--anchors", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "anchors"),
                    help="the directory of make_tiny_model.py (default: ../shared/anchors from the checkout)")
    args = ap.parse_args()
    for spec in args.modes.split(","):
        parse_mode(spec)  # an unknown mode stops the run before any model loads
    torch.set_num_threads(args.threads)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in HOST_FLAGS})
    ops = quantization.int_linear_ops("cpu")
    print(f"host flags: {' '.join(flags) or 'none of ' + '/'.join(HOST_FLAGS)}; int kernel ISA "
          f"{ops.linear_int_isa() if ops is not None else 'none'}; torch threads {args.threads}; "
          f"{args.steps} greedy steps from each of {args.prompts} prompts\n")
    header = ("| model | dense mean max p | distinct dense tokens | activations | weights | top-1 agreement (teacher-forced) | "
              "mean KL(dense ‖ weights) | max abs logit diff | free-running greedy: steps before divergence |")
    print(header)
    print("|---|---:|---:|---|---|---:|---:|---:|---|", flush=True)
    start = time.perf_counter()
    for name in args.models.split(","):
        model_dir = model_dir_for(name, args.anchors)
        for dtype_name in args.dtypes.split(","):
            for row in rows_for(name, model_dir, dtype_name, args):
                print(row, flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
