"""Cost of a prefix-cache block key: the chained BLAKE2b-128 digest against Python's hash() of a
tuple (what it replaced), per full block, side by side in one run.

    python benchmarks/prefix_hash.py [--block-size 16] [--prompt-tokens 4096]
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tidal.wire import ROOT_HASH, hash_block  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    args = parser.parse_args()
    tokens = [random.randrange(150_000) for _ in range(args.block_size)]
    parent = hash_block(ROOT_HASH, tokens)
    number = 50_000
    rounds = {"hash(tuple)": lambda: hash((12345, tuple(tokens))), "blake2b-128": lambda: hash_block(parent, tokens)}
    best = {name: min(timeit.repeat(fn, number=number, repeat=5)) / number for name, fn in rounds.items()}
    blocks = args.prompt_tokens // args.block_size
    for name, seconds in best.items():
        print(f"{name:12s} {seconds * 1e6:6.2f} us per {args.block_size}-token block, "
              f"{seconds * blocks * 1e3:6.3f} ms per {args.prompt_tokens}-token prompt")
    print(f"ratio {best['blake2b-128'] / best['hash(tuple)']:.1f}x")


if __name__ == "__main__":
    main()
