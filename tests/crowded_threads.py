"""Run a CPU kernel alone and then crowded: for the tests of csrc/claims.h (threads that take over work)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def alone_and_crowded(call: Callable[[], torch.Tensor], repeats: int = 20) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``call()`` on one thread, then ``repeats`` times on four times more threads than cores: threads are
    preempted mid-call and the others take over the rest of their shares. Restores the thread count."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = call()
        torch.set_num_threads(4 * max(2, os.cpu_count() or 2))
        return alone, [call() for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
