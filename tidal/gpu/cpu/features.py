"""What this CPU can do natively, asked once by whoever picks a kernel (precision, layers, the kernels' build).

``TIDAL_CPU_ISA=avx2`` holds tidal to what a CPU with AVX2 and no AVX-512 runs: no native bf16 here, the
kernels built without AVX-512 flags (kernels.py) and their run-time choices held to the AVX2 tiles
(csrc/isa.h). One host can then test and measure the other kind of host's path; torch's own kernels follow
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS`` and ``ATEN_CPU_CAPABILITY`` (benchmarks set all four).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)


def held_to_avx2() -> bool:
    """Whether ``TIDAL_CPU_ISA=avx2`` holds the CPU path to AVX2 (another value is ignored, with one warning)."""
    isa = os.environ.get("TIDAL_CPU_ISA", "")
    if isa not in ("", "avx2"):
        _ignored(isa)
    return isa == "avx2"


@functools.cache
def _ignored(isa: str) -> None:
    log.warning("TIDAL_CPU_ISA=%s ignored: the one value it takes is avx2", isa)


def cpu_native_bf16() -> str | None:
    """The CPU's native bf16 instruction set ("amx_bf16" or "avx512_bf16"), or None without one (or when
    held to AVX2).

    Asks torch's cpuinfo (any OS), then /proc/cpuinfo (Linux) when this torch cannot say.
    """
    if held_to_avx2():
        return None
    cpu = torch.cpu
    if hasattr(cpu, "_is_amx_tile_supported") and hasattr(cpu, "_is_avx512_bf16_supported"):
        if cpu._is_amx_tile_supported():
            return "amx_bf16"
        if cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
        return None
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)
