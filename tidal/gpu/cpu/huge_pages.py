"""CPU memory in 2 MiB pages for what a decode step streams: the packed weights and the KV cache.

A decode step at small batch reads every weight once, front to back, and the CPU's hardware
prefetchers stop at each 4 KiB page boundary (and every page costs a TLB walk): on a Zen 4 host,
two threads streamed the "small" model's packed linears ~13-16% faster from 2 MiB pages than
from the 4 KiB pages torch's allocator returns where transparent huge pages are "madvise" (the
common default). So the tensors a step streams are placed in one private anonymous mapping advised
with MADV_HUGEPAGE and 2 MiB-aligned; where the kernel gives no huge pages (THP "never", or not
Linux) the same mapping is plain memory and nothing else changes. ``TIDAL_CPU_HUGE_PAGES=0`` keeps
torch's allocation (benchmarks compare the two).
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each tensor starts on its own page: none shares a line or a prefetch stream with another


def enabled() -> bool:
    return os.environ.get("TIDAL_CPU_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of ``nbytes`` starting on a 2 MiB boundary of a mapping advised for
    huge pages. The tensor holds the mapping: it is unmapped when the last view of it is freed."""
    # whole 2 MiB pages from the aligned start (the kernel backs only those), and the slack to align it
    whole_pages = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without THP refuses the advice: plain pages, as torch would give
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def place(owners: list[tuple[object, str]]) -> None:
    """Move each ``getattr(owner, name)`` (a CPU tensor) into one huge-page mapping, as a contiguous
    copy (nothing when disabled). One at a time, each original dropped as its copy takes its place,
    so loading peaks at one copy of the weights plus the largest tensor, not two copies."""
    if not owners or not enabled():
        return
    sizes = [_aligned(_nbytes(getattr(owner, name))) for owner, name in owners]
    arena, offset = huge_page_bytes(sum(sizes)), 0
    for (owner, name), size in zip(owners, sizes, strict=True):
        tensor = getattr(owner, name)
        copy = arena[offset:offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        setattr(owner, name, copy)
        offset += size


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """``count`` zeroed CPU tensors of ``shape`` and ``dtype`` in one huge-page mapping (torch.zeros
    when disabled), every page of it resident: the KV cache, whose blocks a step reads wherever the block
    tables point."""
    if not enabled():
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    each = _aligned(torch.Size(shape).numel() * dtype.itemsize)
    arena = huge_page_bytes(each * count)  # a fresh anonymous mapping reads as zeros
    populate(arena)
    return [arena[i * each:i * each + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for i in range(count)]


def populate(arena: torch.Tensor) -> None:
    """Fault in every page of ``arena`` (a uint8 tensor over a fresh mapping) now, one write a 4 KiB page.

    Untouched, a page of the mapping is allocated at its first write: for the KV cache, in the middle of a
    decode step, when a sequence first writes a block on it. The 2 MiB page is zeroed then, and on a VM whose
    memory the host backs at first touch (this project's hosts: ~7 ms a page) a served stream stalled 10-55 ms
    at every 16th token (a new block) until the pool had been walked through once. Touched here, that cost is
    paid before the engine is ready, and the memory the cache needs is known to be there then rather than
    failing later."""
    if arena.numel():
        arena[::4096].fill_(0)
