"""Which dtype the model runs in: ``--dtype``, and what ``auto`` means on the device at hand.

``auto`` is bfloat16 on CUDA, and on CPUs with native bf16 instructions (AVX512-BF16 or AMX),
where oneDNN's bf16 GEMMs on prepacked weights read half the bytes of float32 and decode runs
faster. Everywhere else it is float32: without those units bf16 is emulated and slower than
float32 (measured in docs/performance.md).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("tidal.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """(dtype, why) for ``--dtype name`` on ``device``; raises ``ValueError`` for an unknown name."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, float16 or bfloat16")
        return DTYPES[name], f"--dtype {name}"
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on CUDA"
    bf16_units = cpu_native_bf16()
    if bf16_units is None:
        return torch.float32, "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16), float32 is faster"
    if not torch.backends.mkldnn.is_available():
        return torch.float32, f"auto: the CPU has {bf16_units} but this torch has no oneDNN, float32 is faster"
    return torch.bfloat16, f"auto: the CPU has native bf16 ({bf16_units})"


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
