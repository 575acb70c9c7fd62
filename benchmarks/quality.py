"""What each quantized mode loses on a real model: perplexity and teacher-forced top-1 agreement against bf16.

    python benchmarks/quality.py [--model /tmp/anchors/models/smol] [--modes bf16,int8,w8a8,int4,w4a8,q8_0,q4_0]
                                 [--tokens 12288] [--window 1024] [--threads 2]

The text: Python's own ``pydoc_data.topics`` (the language reference's topic pages that ship with every CPython, in
sorted topic order; English prose with code), its first ``--tokens`` tokens under the model's tokenizer, cut into
windows of ``--window`` tokens. Each window is one teacher-forced prefill; every position but a window's first is
scored (a window starts with no context, as llama.cpp's ``llama-perplexity`` chunks do). Per mode: perplexity
(exp of the mean negative log-likelihood of the text's next token) and top-1 agreement (the fraction of positions
whose argmax is the bf16 model's argmax at the same position).

Modes:
* ``bf16``, ``float32``: the dense model with those activations (``--dtype``); ``bf16`` is the reference.
* a name of ``quantization.ON_THE_FLY`` (``--quantization``'s choices: int8, int4 with bf16 activations, w8a8, w4a8
  with int8 ones, what ``--dtype auto`` runs int8/int4 as on a CPU), optionally ``@G`` for group size G in place of
  the default (``int4@128``; ``@0``: one scale per output channel): tidal's own kernels, LM head included.
* ``q8_0``, ``q4_0``, ``q4_1``: llama.cpp's formats, as a reference at the same bits: every decoder linear weight
  quantized and dequantized by the ``gguf`` package's own ``gguf.quants`` (llama.cpp's reference rounding), run dense
  in float32 (llama.cpp's activations). The LM head and the embeddings stay exact, where llama-quantize makes them
  Q6_K (a tied head) and rounds its activations to Q8_0 for the matmuls: the reference is, if anything, a little
  better than llama.cpp itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quantized_agreement import HOST_FLAGS, Runner  # noqa: E402

from tidal.gpu.model import quantization  # noqa: E402
from tidal.gpu.model.attention import TorchPagedAttention  # noqa: E402
from tidal.gpu.model.layers import Linear  # noqa: E402
from tidal.gpu.model.loader import load_model  # noqa: E402

GGUF_REFERENCES = ("q8_0", "q4_0", "q4_1")


def text_tokens(model_dir: str, count: int) -> list[int]:
    """The first ``count`` tokens of pydoc_data.topics in sorted topic order."""
    import pydoc_data.topics
    from tokenizers import Tokenizer

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(text).ids
    if len(ids) < count:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {count}")
    return ids[:count]


def gguf_round_trip(weight: torch.Tensor, name: str) -> torch.Tensor:
    """``weight`` [N, K] quantized to llama.cpp's ``name`` format and back, by gguf.quants."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[name.upper()]
    k = weight.shape[1]  # padded with zeros to whole blocks of 32 (llama.cpp refuses other sizes; a small test model)
    data = F.pad(weight.detach().float(), (0, -k % 32)).numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(data, qtype), qtype))[:, :k].to(weight.dtype)


def load(model_dir: str, mode: str):
    """(model, config) of ``mode`` (see the module's docstring)."""
    attention = TorchPagedAttention("cpu")
    if mode in ("bf16", "float32"):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        return load_model(model_dir, dtype, torch.device("cpu"), attention, linear_weights=dtype)
    if mode in GGUF_REFERENCES:  # float32 weights stay plain (no kernel layout): round them in place
        model, config = load_model(model_dir, torch.float32, torch.device("cpu"), attention,
                                   linear_weights=torch.float32)
        with torch.no_grad():
            for linear in model.model.layers.modules():
                if isinstance(linear, Linear):
                    linear.weight.copy_(gguf_round_trip(linear.weight, mode))
        return model, config
    return load_model(model_dir, torch.bfloat16, torch.device("cpu"), attention, quantize=with_group(mode))


def with_group(mode: str) -> str:
    """``NAME@G`` (an ``ON_THE_FLY`` scheme with group size G, 0: per output channel) made a name ``load_model``
    takes, for this process; a plain name as it is."""
    name, _, group = mode.partition("@")
    if name not in quantization.ON_THE_FLY:
        raise SystemExit(f"unknown mode {mode!r}: bf16, float32, {', '.join(GGUF_REFERENCES)} or one of "
                         f"{', '.join(quantization.ON_THE_FLY)} (optionally @GROUP)")
    if group:
        scheme = quantization.ON_THE_FLY[name]
        quantization.ON_THE_FLY[mode] = dataclasses.replace(scheme, group_size=int(group) or None)
    return mode


def score(model_dir: str, mode: str, tokens: list[int], window: int):
    """(summed negative log-likelihood, the argmax at each scored position [positions], seconds)."""
    model, config = load(model_dir, mode)
    runner = Runner(model, config, model.dtype, window)
    started = time.perf_counter()
    nll, argmax = 0.0, []
    for start in range(0, len(tokens), window):
        chunk = tokens[start:start + window]
        logits = runner.prefill(chunk, slice(0, len(chunk) - 1))
        targets = torch.tensor(chunk[1:])
        nll -= float(F.log_softmax(logits.double(), -1).gather(1, targets[:, None]).sum())
        argmax.append(logits.argmax(-1))
    return nll, torch.cat(argmax), time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/anchors/models/smol")
    ap.add_argument("--modes", default="bf16,int8,w8a8,int4,w4a8,q8_0,q4_0")
    ap.add_argument("--tokens", type=int, default=12288)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = text_tokens(args.model, args.tokens)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in HOST_FLAGS})
    ops = quantization.int_linear_ops("cpu")
    print(f"host flags: {' '.join(flags) or 'none of ' + '/'.join(HOST_FLAGS)}; int kernels "
          f"{ops.linear_int_isa() + ' / ' + ops.linear_int_a8_isa() if ops is not None else 'none'}; "
          f"TIDAL_CPU_ISA={os.environ.get('TIDAL_CPU_ISA', '')}; Python {sys.version.split()[0]}'s pydoc_data.topics, "
          f"{len(tokens)} tokens in windows of {args.window}; model {args.model}\n")
    print("| mode | perplexity | vs bf16 | top-1 agreement with bf16 | s |")
    print("|---|---:|---:|---:|---:|", flush=True)
    modes = args.modes.split(",")
    for mode in modes:  # an unknown mode stops the run before any model loads
        if mode not in ("bf16", "float32", *GGUF_REFERENCES):
            with_group(mode)
    if modes[0] != "bf16":
        modes.insert(0, "bf16")  # the reference every row is compared with
    reference_ppl = reference_argmax = None
    for mode in modes:
        nll, argmax, seconds = score(args.model, mode, tokens, args.window)
        ppl = math.exp(nll / len(argmax))
        if reference_argmax is None:
            reference_ppl, reference_argmax = ppl, argmax
        agreement = float((argmax == reference_argmax).float().mean())
        print(f"| {mode} | {ppl:.4f} | {100 * (ppl / reference_ppl - 1):+.2f}% | {agreement:.4f} | {seconds:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
