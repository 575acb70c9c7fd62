"""What this CPU can do natively, asked once by whoever picks a kernel (precision, layers)."""

from __future__ import annotations

import torch


def cpu_native_bf16() -> str | None:
    """The CPU's native bf16 instruction set ("amx_bf16" or "avx512_bf16"), or None without one.

    Asks torch's cpuinfo (any OS), then /proc/cpuinfo (Linux) when this torch cannot say.
    """
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
