"""The form a quantized Linear weight runs in on each device: one object with ``.linear(x, bias)``.

``Linear.pack`` hands its ``quantized`` weight to ``pack``, which picks by device:

* int8/int4 (``quantization.QuantizedWeight``) on a CPU: ``quantization.PackedInt`` (csrc/linear_int.cpp);
* int8/int4 on a CUDA GPU: ``TritonInt``, the Triton weight-only GEMM of tidal/kernels/linear_int.py, which
  dequantizes in registers and accumulates in fp32;
* FP8 (``Fp8Weight``, CUDA GPUs with FP8 only): ``Fp8Linear``, float8_e4m3fn weights with one scale per
  output channel; each call quantizes the activations per token and multiplies through
  ``torch._scaled_mm`` (FP8 tensor cores, fp32 accumulate).

``Linear.int_packed`` holds the result whatever the scheme; ``nbytes`` is what a step reads of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.gpu.model import quantization

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_REFUSAL = "--quantization fp8 needs a CUDA GPU with FP8 (compute capability 8.9+)"


def int_kernel(device: torch.device | str) -> str | None:
    """Where int8/int4 linears run on ``device``: "cpu" (the C++ kernel, AVX2+FMA and built), "triton" (a CUDA
    GPU with triton installed), or None."""
    device = torch.device(device)
    if device.type == "cuda":
        from tidal import kernels

        return "triton" if kernels.HAS_TRITON else None
    return "cpu" if quantization.int_linear_ops(device) is not None else None


def fp8_runs_on(device: torch.device | str) -> bool:
    """A CUDA GPU with FP8 tensor cores (Ada / Hopper and later: compute capability 8.9+)."""
    device = torch.device(device)
    return FP8 is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def pack(weight, device: torch.device | str):
    """``weight`` (a ``QuantizedWeight`` or an ``Fp8Weight``) in the form that runs on ``device``."""
    if isinstance(weight, Fp8Weight):
        return Fp8Linear(weight.to(device))
    if int_kernel(device) == "triton":
        if weight.activation_bits == 8:
            raise ValueError("w8a8/w4a8 (int8 activations) run on CPUs only; on CUDA use int8, int4 or fp8")
        if weight.mins is not None:
            raise ValueError("int4 weights with a minimum per group (GGUF Q4_1) run on CPUs only")
        return TritonInt(weight, device)
    return quantization.PackedInt(weight, quantization.int_linear_ops(device))


def weight_format(packed) -> str:
    """"int8", "int4" or "fp8", for the ready line."""
    return "fp8" if isinstance(packed, Fp8Linear) else f"int{packed.bits}"


class TritonInt:
    """An int8/int4 weight in tidal/kernels/linear_int.py's tiled layout, run by its Triton kernel."""

    def __init__(self, weight: quantization.QuantizedWeight, device: torch.device | str) -> None:
        from tidal.kernels.linear_int import pack_int_weight

        zero_points = None if weight.zero_points is None else weight.zero_points.to(device)
        self.weight = pack_int_weight(weight.q.to(device), weight.scales.to(device), zero_points, weight.bits,
                                      weight.group_size)
        self.bits, self.group_size = weight.bits, weight.group_size

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from tidal.kernels.linear_int import linear_int

        return linear_int(x, self.weight, bias)


@dataclass
class Fp8Weight:
    """A [N, K] weight as float8_e4m3fn ``q`` with one float32 scale per output channel (``scales`` [N]):
    w = q * scale. A per-tensor checkpoint scale is repeated per channel."""

    q: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales[:, None]

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.q.to(device), self.scales.to(device))

    @staticmethod
    def cat(parts: list[Fp8Weight]) -> Fp8Weight:
        """The parts stacked along the output dimension (a fused q/k/v or gate/up weight)."""
        return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]))


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` [N, K] rounded to float8_e4m3fn with one scale per output channel (its largest magnitude
    maps to 448), as llm-compressor's FP8 channel scheme."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: any scale
    return Fp8Weight((w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales)


def quantize_fp8_linears(linears) -> None:
    """Give each Linear the FP8 form of its weight, for ``Linear.pack`` to pack."""
    for linear in linears:
        linear.quantized = quantize_fp8(linear.weight)


def quantize_per_token(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]): each row's largest magnitude
    maps to 448. Computed on the GPU each call, so a captured CUDA graph replays it."""
    rows = rows.float()
    scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (rows / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of ``Fp8Linear.linear``: the same per-token FP8 activations, multiplied in fp32."""
    rows = x.reshape(-1, x.shape[-1])
    q, scales = quantize_per_token(rows)
    out = F.linear(q.float() * scales, weight.dequantize(), None if bias is None else bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], -1)


class Fp8Linear:
    """An ``Fp8Weight`` padded for ``torch._scaled_mm`` (inputs and outputs multiples of 16), run with the
    activations quantized per token: y = (x_q @ w_q.T) * x_scale * w_scale, fp32 accumulate."""

    bits = 8

    def __init__(self, weight: Fp8Weight) -> None:
        n, k = weight.q.shape
        self.n, self.k = n, k
        self.q = F.pad(weight.q.view(torch.uint8), (0, -k % 16, 0, -n % 16)).view(FP8)  # pad has no fp8 kernel
        self.scales = F.pad(weight.scales.float(), (0, -n % 16)).view(1, -1)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.k)
        q, scales = quantize_per_token(rows)
        if self.q.shape[1] != self.k:
            q = F.pad(q.view(torch.uint8), (0, self.q.shape[1] - self.k)).view(FP8)
        # row-wise scales (one per token, one per channel) want a bf16 output on CUDA
        out = torch._scaled_mm(q, self.q.T, scale_a=scales, scale_b=self.scales, out_dtype=torch.bfloat16)
        out = (out if out.shape[1] == self.n else out[:, :self.n].contiguous()).to(x.dtype)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], self.n)
