"""bf16 activations against float32 on a GGUF file served natively: top-1 agreement over decode steps.

    python benchmarks/gguf_dtype_agreement.py FILE.gguf [--steps 250] [--prompts 4] [--threads 2] [--int8-activations]

The file is loaded as ``tidal serve --model FILE.gguf`` loads it (Q8_0 / Q4_0 / Q4_1 linears native on the int
kernels) twice: ``--dtype float32`` and ``--dtype bfloat16`` (``--int8-activations``: the bf16 one with its integer
linears against int8 activations, as ``--dtype auto`` serves it on a CPU with native bf16). For each prompt (SmolLM2's chat template around a
short question or text to continue) the float32 model greedy-decodes ``--steps`` tokens; the bf16 model is fed
the same tokens, one decode step each (teacher-forced through the decode path), and at every step its argmax is
compared with float32's: top-1 agreement, mean KL(float32 || bf16) and the largest |logit difference|. Free
running: the bf16 model decodes greedily on its own; the steps before its first token that differs, per prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from quantized_agreement import Runner, compare  # noqa: E402
from tidal import gguf_model  # noqa: E402
from tidal.gpu.model.attention import TorchPagedAttention  # noqa: E402
from tidal.gpu.model.loader import load_model, quantized_weights_note  # noqa: E402

QUESTIONS = (
    "What is the capital of France, and what is it known for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in a few sentences why the sky is blue.",
    "Continue the story: The old lighthouse keeper climbed the stairs one last time.",
    "List five uses of a paperclip.",
    "Summarize the causes of the French Revolution.",
)


def prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in (QUESTIONS * count)[:count]]


def teacher_forced(runner: Runner, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab]: the prompt's last position, then one decode step per token but the last."""
    logits = [runner.prefill(prompt, slice(-1, None))[0]]
    for i, token in enumerate(tokens[:-1]):
        logits.append(runner.decode(token, len(prompt) + i))
    return torch.stack(logits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--steps", type=int, default=250, help="decode steps per prompt")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true",
                    help="the bf16 model's integer linears against int8 activations, as --dtype auto serves the file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = gguf_model.prepare(args.file)
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512_bf16", "amx_bf16")})
    started = time.perf_counter()
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        bits = 8 if args.int8_activations and dtype == torch.bfloat16 else 16
        model, config = load_model(model_dir, dtype, torch.device("cpu"), TorchPagedAttention("cpu"),
                                   gguf_activation_bits=bits)
        models[dtype] = model
    print(f"host flags: {' '.join(flags)}; torch threads {args.threads}; {os.path.basename(args.file)}"
          f"{quantized_weights_note(models[torch.float32])}\n")
    asked = prompts(model_dir, args.prompts)
    length = max(map(len, asked)) + args.steps
    reference = Runner(models[torch.float32], config, torch.float32, length)
    other = Runner(models[torch.bfloat16], config, torch.bfloat16, length)
    agree = positions = 0
    kl_sum, max_diff, free, distinct = 0.0, 0.0, [], set()
    for prompt in asked:
        tokens, ref_logits = reference.greedy(prompt, args.steps)
        distinct.update(tokens)
        a, kl, diff = compare(ref_logits, teacher_forced(other, prompt, tokens))
        agree, positions, kl_sum, max_diff = agree + a, positions + len(tokens), kl_sum + kl, max(max_diff, diff)
        free.append(len(other.greedy(prompt, args.steps, follow=tokens)[0]))
    free_text = ", ".join(f">={n}" if n == args.steps else str(n) for n in free)
    print("| file | activations vs float32 | decode steps (prompts x steps) | distinct float32 tokens | "
          "top-1 agreement | mean KL(float32 ‖ bf16) | max abs logit diff | free-running: steps before divergence |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    label = "bf16, int8 into the integer linears (`--dtype auto`)" if args.int8_activations else "bf16"
    print(f"| {os.path.basename(args.file)} | {label} | {positions} ({len(asked)} x {args.steps}) | {len(distinct)} | "
          f"{agree / positions:.3f} | {kl_sum / positions:.3g} | {max_diff:.3g} | {free_text} |")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
