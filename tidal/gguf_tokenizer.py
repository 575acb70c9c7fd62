"""The tokenizer of a GGUF file as a Hugging Face tokenizer directory: ``python -m tidal.gguf_tokenizer FILE OUT``.

Run in a child process by ``gguf_model.prepare`` (transformers' GGUF reader imports torch, which the frontend
never does). transformers converts the file's vocabulary, merges, special tokens and chat template; its
conversion knows the split regexes of some ``tokenizer.ggml.pre`` types (llama-bpe, qwen2, ...) but not of
the ones llama.cpp splits digits off first (SmolLM2's ``smollm``, StarCoder's), for which it keeps plain GPT-2
byte-level splitting: "  2024" then becomes other ids than llama.cpp's. ``restore_pre_tokenizer`` puts
llama.cpp's split back. ``--tokenizer DIR`` takes DIR's tokenizer instead, as vLLM's flag does.
"""

from __future__ import annotations

import argparse
import os
import sys

# llama.cpp's pre-tokenizer types (llama-vocab.cpp) whose first split is each digit on its own ("\p{N}"),
# followed by GPT-2's regex: what the vocabularies' original tokenizer.json do with Digits + ByteLevel
DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})


def restore_pre_tokenizer(backend, pre_type: str | None) -> bool:
    """Give ``backend`` (a ``tokenizers.Tokenizer``) llama.cpp's pre-tokenizer for ``pre_type`` where transformers'
    conversion lacks it; True when it changed anything."""
    from tokenizers import Regex, pre_tokenizers

    if pre_type not in DIGITS_FIRST:
        return False
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return True


def pre_tokenizer_type(gguf_path: str) -> str | None:
    import gguf

    field = gguf.GGUFReader(gguf_path).fields.get("tokenizer.ggml.pre")
    return None if field is None else field.contents()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.gguf_tokenizer")
    parser.add_argument("gguf_file")
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", default=None, help="a model directory whose tokenizer to use instead")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    try:
        if args.tokenizer is not None:
            tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.tokenizer))
        else:
            tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(args.gguf_file)),
                                                      gguf_file=os.path.basename(args.gguf_file))
            restore_pre_tokenizer(tokenizer.backend_tokenizer, pre_tokenizer_type(args.gguf_file))
        tokenizer.save_pretrained(args.out_dir)
    except Exception as exc:  # one line for the operator, in the parent's error
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
