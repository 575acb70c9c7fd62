"""Which dtype the model runs in: ``--dtype``, and what ``auto`` means on the device at hand.

``auto`` is bfloat16 on CUDA, and on CPUs with native bf16 instructions (AVX512-BF16 or AMX),
where bf16 linears on prepacked weights read half the bytes of float32 and decode runs faster.
Elsewhere it is float32: without those units bf16 arithmetic is emulated and slower than float32
(measured in docs/performance-history.md). But the bytes still matter: on a CPU with AVX2+FMA and no native
bf16, a checkpoint stored in bf16 keeps its linear weights in bf16 and the model computes in float32
(csrc/linear_avx2.cpp widens each weight by a 16-bit shift): the float32 model's math exactly (a bf16
value is a float32 with its low 16 bits zero), reading half the bytes per decode step. A float32
checkpoint stays float32 there, and an explicit ``--dtype float32`` always keeps float32 weights.

``TIDAL_CPU_GEMV=avx2`` forces that path for a float32 model on any CPU with AVX2+FMA (also one with
native bf16, where ``auto`` then means float32; and a float32 checkpoint, whose weights are then
rounded to bf16: the user asked); ``TIDAL_CPU_GEMV=0`` turns every hand-written linear off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tidal.gpu.cpu import features

log = logging.getLogger("tidal.engine")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """How the model computes: ``dtype`` for activations and every weight, except the linear weights
    where ``linear_weights`` is bfloat16 with a float32 ``dtype`` (the AVX2 path); ``reason`` for the log."""

    dtype: torch.dtype
    linear_weights: torch.dtype
    reason: str


def resolve_precision(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None = None) -> Precision:
    """The precision of ``--dtype name`` on ``device`` for a checkpoint whose linear weights are stored in
    ``checkpoint_dtype`` (None: unknown, treated as float32); raises ``ValueError`` for an unknown name."""
    forced = avx2_forced() and device.type == "cpu"
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, float32, float16 or bfloat16")
        dtype = DTYPES[name]
        if forced and dtype == torch.float32 and _avx2_kernel_ready():
            return Precision(dtype, torch.bfloat16, f"--dtype {name}, linear weights stored in bf16 "
                             f"(TIDAL_CPU_GEMV=avx2{_rounding(checkpoint_dtype)})")
        return Precision(dtype, dtype, f"--dtype {name}")
    if device.type == "cuda":
        return _plain(torch.bfloat16, "auto: bfloat16 on CUDA")
    if forced and _avx2_kernel_ready():
        return Precision(torch.float32, torch.bfloat16, "auto: float32 with linear weights stored in bf16, forced by "
                         f"TIDAL_CPU_GEMV=avx2{_rounding(checkpoint_dtype)}")
    bf16_units = features.cpu_native_bf16()
    if bf16_units is None:
        why = ("auto: held to AVX2 by TIDAL_CPU_ISA=avx2, as a CPU without native bf16, float32 is faster"
               if features.held_to_avx2() else
               "auto: this CPU has no native bf16 (no avx512_bf16 or amx_bf16), float32 is faster")
        if checkpoint_dtype != torch.bfloat16:
            return _plain(torch.float32, why)
        if not _avx2_kernel_ready():
            return _plain(torch.float32, why + "; the bf16 checkpoint's weights are widened to float32 (no AVX2+FMA "
                          "kernel here: see the CPU kernels' warning)")
        return Precision(torch.float32, torch.bfloat16, why + "; the checkpoint is bf16, so its linear weights stay "
                         "bf16 (lossless: float32 math, half the bytes of float32 per step; AVX2 kernel)")
    if not torch.backends.mkldnn.is_available():
        return _plain(torch.float32, f"auto: the CPU has {bf16_units} but this torch has no oneDNN, float32 is faster")
    return _plain(torch.bfloat16, f"auto: the CPU has native bf16 ({bf16_units})")


def _plain(dtype: torch.dtype, reason: str) -> Precision:
    return Precision(dtype, dtype, reason)


def _rounding(checkpoint_dtype: torch.dtype | None) -> str:
    return "" if checkpoint_dtype == torch.bfloat16 else "; the checkpoint is not bf16: its weights are rounded to bf16"


def avx2_forced() -> bool:
    """Whether ``TIDAL_CPU_GEMV=avx2`` asks for the AVX2 path (float32 on bf16-stored linear weights)."""
    return os.environ.get("TIDAL_CPU_GEMV", "1") == "avx2"


def _avx2_kernel_ready() -> bool:
    """Whether the AVX2 bf16-weight linear can run here (AVX2+FMA, the kernels built and not turned off)."""
    from tidal.gpu.model.layers import avx2_linear_ops

    return avx2_linear_ops("cpu") is not None
