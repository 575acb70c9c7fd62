"""Small building blocks of Llama-family models: RMSNorm, rotary embedding, gated MLP.

Parameters are created with ``torch.empty`` (no random init): every weight is loaded
from a checkpoint right after construction, and initialising a multi-GB model only to
overwrite it would cost seconds on CPU.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from tidal.gpu.cpu import huge_pages
from tidal.gpu.cpu import features
from tidal.gpu.model import lora, quantization, quantized_linear
from tidal.gpu.model.lora import add_lora


def _empty_parameter(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def packs_weights(dtype: torch.dtype, device: torch.device | str, linear_weights: torch.dtype | None = None) -> bool:
    """Whether linear weights should be packed after loading: bfloat16 on a CPU oneDNN runs in bf16, or
    a float32 model whose linear weights are stored in bf16 (``linear_weights``, see ``precision.py``).

    float32 weights stay plain: MKL's GEMV on a plain weight is as fast as a packed one at batch 1.
    """
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.float32:
        return linear_weights == torch.bfloat16
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's blocked layout, for ``packed_linear``.

    A plain bf16 weight is reordered by oneDNN on every call; prepacked, a decode GEMV runs 2-3x
    faster and the whole step reads little more than the weights (benchmarks/decode_step.py).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` over a weight from ``pack_weight`` (any number of rows, same result)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Whether linears may use the hand-written kernels (csrc/linear_bf16.cpp, csrc/linear_avx2.cpp); read when
# a Linear is packed. TIDAL_CPU_GEMV=0 keeps oneDNN/MKL everywhere (benchmarks compare the two);
# TIDAL_CPU_GEMV=avx2 forces the AVX2 path (float32 arithmetic on bf16-stored linear weights) on any CPU
# with AVX2+FMA, whatever the checkpoint's dtype (tidal/gpu/model/precision.py reads it).
USE_GEMV = os.environ.get("TIDAL_CPU_GEMV", "1") != "0"
# On a CPU with AMX, rows up to which the kernel runs; above, oneDNN's AMX GEMM on its own packed copy
# (AMX's tiles do several times the arithmetic of AVX512-BF16 per cycle, so they win prefill). Without
# AMX the kernel matches or beats oneDNN at every row count (docs/performance-history.md) and runs every call.
AMX_GEMV_MAX_ROWS = 16
GEMV_GROUP = 4  # blocks of 16 columns the kernel walks together (kMaxBlocks in csrc/linear_bf16.cpp)


def gemv_ops(dtype: torch.dtype, device: torch.device | str):
    """``torch.ops.tidal_cpu`` when its bf16 linear can run here (a bf16 model on a CPU with AVX512-BF16
    and the kernels built, unless ``USE_GEMV`` is off), else None."""
    if not USE_GEMV or torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    if features.cpu_native_bf16() is None:  # amx_bf16 CPUs have avx512_bf16 too
        return None
    ops = cpu_layer_ops(dtype, device)
    return ops if ops is not None and ops.linear_bf16_supported() else None


def gemv_max_rows() -> int | None:
    """Rows up to which a packed bf16 Linear runs the kernel, or None for every call (then no oneDNN copy)."""
    return AMX_GEMV_MAX_ROWS if features.cpu_native_bf16() == "amx_bf16" else None


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 repacked for ``torch.ops.tidal_cpu.linear_bf16``: ``[ceil(N/16), ceil(K/2), 32]``.

    A block of 16 output columns at one pair of inputs (2i, 2i+1) is 32 values, the 16 columns' two
    weights side by side (w[c, 2i], w[c, 2i+1]): the operand of one ``_mm512_dpbf16_ps``. The kernel
    walks 4 blocks (64 columns) at a time, so each group of 4 blocks is stored pair by pair, its 4
    blocks interleaved: the group is one sequential stream of K/2 x 256 bytes (the last group holds
    the 1-3 blocks left). N and K are zero-padded to whole blocks and pairs.
    """
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, k % 2, 0, -n % 16))
    blocks, pairs = padded.shape[0] // 16, padded.shape[1] // 2
    # a pair of inputs moves as one 32-bit word, and all whole groups in one permute: a 49k-row head packs in a
    # fraction of a second, where a copy per group took seconds on a busy host
    words = padded.contiguous().view(torch.int32).view(blocks, 16, pairs)
    whole = blocks // GEMV_GROUP * GEMV_GROUP
    parts = [words[:whole].view(-1, GEMV_GROUP, 16, pairs).permute(0, 3, 1, 2).reshape(-1)]
    if whole < blocks:  # the last group's 1-3 blocks
        parts.append(words[whole:].permute(2, 0, 1).reshape(-1))
    return torch.cat(parts).view(torch.bfloat16).view(blocks, pairs, 32)


def avx2_linear_ops(device: torch.device | str):
    """``torch.ops.tidal_cpu`` when its float32-on-bf16-weights linear can run here (a CPU with AVX2+FMA
    and the kernels built, unless ``TIDAL_CPU_GEMV=0``), else None."""
    if not USE_GEMV or torch.device(device).type != "cpu":
        return None
    ops = cpu_layer_ops(torch.float32, device)
    return ops if ops is not None and ops.linear_avx2_supported() else None


def pack_avx2_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 repacked for ``torch.ops.tidal_cpu.linear_avx2``: ``[ceil(N/32), K, 32]``.

    A group of 32 output columns at one input k is one 64-byte line of two blocks of 16 columns; in a
    block, 32-bit lane j holds column j (low half) and column 8 + j (high half), so the kernel widens a
    block to two float32 vectors by a shift and a mask. A group is one sequential stream of K lines.
    N is zero-padded to whole groups.
    """
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % 32))
    groups = padded.shape[0] // 32
    # column g*32 + b*16 + h*8 + j goes to line k of group g, at b*16 + 2*j + h
    return padded.view(groups, 2, 2, 8, k).permute(0, 4, 1, 3, 2).contiguous().view(groups, k, 32)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with uninitialised parameters (filled by ``load_weights``).

    After ``pack()`` the weight lives only in packed layouts and the ``weight`` parameter is gone:
    packing is the last step of loading. On a CPU with AVX512-BF16 a bf16 weight is packed for the
    hand-written kernel (``gemv_packed``), which runs every call; with AMX too, oneDNN keeps a second
    copy (``packed``) for the calls of more than ``AMX_GEMV_MAX_ROWS`` rows (prefill). Elsewhere
    ``packed`` is oneDNN's copy alone. A float32 weight packed with ``weight_dtype=torch.bfloat16`` is
    stored in bf16 for the AVX2 kernel (``avx2_packed``; float32 activations, bias and output).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = _empty_parameter((out_features, in_features), dtype, device)
        self.bias = _empty_parameter((out_features,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None
        self.gemv_packed: torch.Tensor | None = None
        self._gemv = None  # torch.ops.tidal_cpu once gemv_packed is set
        self._gemv_rows: int | None = None  # with a oneDNN copy too, calls of up to this many rows run the kernel
        self.avx2_packed: torch.Tensor | None = None  # float32 model, bf16-stored weight (pack_avx2_weight)
        self._avx2 = None  # torch.ops.tidal_cpu once avx2_packed is set
        # set before pack(): int8/int4 (quantization.QuantizedWeight) or FP8 (quantized_linear.Fp8Weight) weights
        self.quantized = None
        # once packed, the quantized weight in its device's kernel layout with .linear(x, bias): PackedInt on a
        # CPU, quantized_linear.TritonInt or Fp8Linear on a CUDA GPU (quantized_linear.pack)
        self.int_packed = None
        self.lora: lora.LoraWeights | None = None  # every LoRA slot's A and B (lora.LoraSlots), with adapters on

    @classmethod
    def packed_from(cls, weight: torch.Tensor, weight_dtype: torch.dtype | None = None,
                    scheme: quantization.Scheme | None = None,
                    quantized: quantization.QuantizedWeight | None = None) -> Linear:
        """A packed, bias-free Linear over a copy of ``weight`` [out, in] (a tied LM head), quantized to ``scheme``
        if given, or holding ``quantized`` (the same values as integers: a GGUF's Q8_0 embedding) if given."""
        linear = cls(weight.shape[1], weight.shape[0], False, weight.dtype, weight.device)
        if quantized is not None:
            linear.quantized = quantized
        else:
            with torch.no_grad():
                linear.weight.copy_(weight)
        if scheme is not None:
            linear.quantized = linear.quantize(scheme)
        linear.pack(weight_dtype)
        return linear

    def quantize(self, scheme: quantization.Scheme) -> quantization.QuantizedWeight:
        """This Linear's weight rounded to ``scheme`` (a row-parallel shard's scales span the whole rows)."""
        return quantization.quantize(self.weight, scheme)

    def pack(self, weight_dtype: torch.dtype | None = None) -> None:
        """Pack the weight for this CPU's fastest path. ``weight_dtype=torch.bfloat16`` on a float32 weight:
        store it in bf16 for the AVX2 kernel (exact where the values are bf16, as from a bf16 checkpoint);
        without the kernel the weight stays float32 (then a float32 weight is left plain). A Linear given
        ``quantized`` weights packs those for its device's int8/int4/FP8 kernel instead, whatever ``weight_dtype``;
        on a GPU any other weight stays plain."""
        if self.int_packed is not None:
            return  # packed before (restored from a cache of packed weights)
        if self.quantized is not None:
            self.int_packed = quantized_linear.pack(self.quantized, self.weight.device)
            self.quantized = self.weight = None
            return
        if self.weight.device.type != "cpu":
            return  # GPUs multiply the plain weight (cuBLAS)
        if self.weight.dtype == torch.float32:
            ops = avx2_linear_ops(self.weight.device) if weight_dtype == torch.bfloat16 else None
            if ops is not None:
                self.avx2_packed = pack_avx2_weight(self.weight.bfloat16())
                self._avx2 = ops
                self.weight = None
            return
        ops = gemv_ops(self.weight.dtype, self.weight.device)
        if ops is None and not packs_weights(self.weight.dtype, self.weight.device):
            return  # no oneDNN bf16 on this CPU (AVX2 only): F.linear on the plain weight, as in an unpacked model
        if ops is not None:
            self.gemv_packed = pack_gemv_weight(self.weight)
            self._gemv = ops
            self._gemv_rows = gemv_max_rows()
        if ops is None or self._gemv_rows is not None:
            self.packed = pack_weight(self.weight)
        self.weight = None  # the plain copy would double the memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int_packed is not None:
            return self.int_packed.linear(x, self.bias)
        if self._avx2 is not None:
            return self._avx2.linear_avx2(x, self.avx2_packed, self.out_features, self.bias)
        if self._gemv is not None and (self._gemv_rows is None or x.shape[0] <= self._gemv_rows):
            return self._gemv.linear_bf16(x, self.gemv_packed, self.out_features, self.bias)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def place_kernel_weights(linears: list[Linear]) -> None:
    """Move the weights packed for tidal's CPU kernels into huge pages (tidal/gpu/cpu/huge_pages.py): a
    decode step streams them all, and streams faster from 2 MiB pages."""
    owners = [(linear, name) for linear in linears for name in ("gemv_packed", "avx2_packed")
              if getattr(linear, name) is not None]
    huge_pages.place(owners + [(linear.int_packed, "packed") for linear in linears
                               if isinstance(linear.int_packed, quantization.PackedInt)])


def cpu_layer_ops(dtype: torch.dtype, device: torch.device | str):
    """``torch.ops.tidal_cpu`` (fused norm, rotary, SiLU-and-mul) for a CPU model in float32 or
    bfloat16 when the C++ kernels built, else None: the layers then run their torch ops."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    from tidal.gpu.cpu.kernels import load_cpu_ops

    return load_cpu_ops()


def cuda_layer_kernels(device: torch.device | str):
    """``tidal.kernels`` (the Triton fused add+RMSNorm and rotary) for a CUDA model when triton is
    installed, else None. One kernel each instead of five to eight elementwise launches: that is
    most of a CUDA-graph decode step's time at small batches besides the weights (docs/kernels.md)."""
    from tidal import kernels

    if torch.device(device).type != "cuda" or not kernels.HAS_TRITON:
        return None
    return kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (the Hugging Face convention).

    ``add_norm(residual, x)`` is the step between sublayers: ``residual += x`` in place, then
    the norm of the sum, in one fused op on CPU.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = _empty_parameter((size,), dtype, device)
        self.eps = eps
        self._ops = cpu_layer_ops(dtype, device)
        self._kernels = cuda_layer_kernels(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.rms_norm(x, self.weight, self.eps)
        if self._kernels is not None and x.dim() == 2 and x.stride(1) == 1:
            return self._kernels.rms_norm(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32:
            # one fused kernel instead of four elementwise passes; same math in float32
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.add_rms_norm_(residual, x, self.weight, self.eps)
        if self._kernels is not None and x.dim() == 2 and x.stride(1) == 1 and residual.stride(1) == 1:
            return self._kernels.rms_norm(x, self.weight, self.eps, residual, residual_out=residual)[0]
        return self(residual.add_(x))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)
        # the fused kernel works in whole 8-float vectors
        self._ops = cpu_layer_ops(dtype, device) if intermediate_size % 8 == 0 else None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``lora``: the pass's ``lora.LoraRows`` when a row runs through an adapter (each Linear adds its product)."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = add_lora(gate_up, x, self.gate_up_proj, lora)
        if self._ops is not None:
            hidden = self._ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate) * up
        if lora is not None:
            return add_lora(self.down_proj(hidden), hidden, self.down_proj, lora)
        return self.down_proj(hidden)


def rotary_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2] (float32), with linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        # dividing the frequency == dividing the position
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {scaling['rope_type']!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotary position embedding in the "rotate half" layout used by Hugging Face checkpoints.

    cos/sin are computed per forward pass from the batch's positions (once, shared by every
    layer) instead of from a [max_position_embeddings, head_dim] table, which for 128k-context
    models would cost hundreds of MB. On the CPU one op computes them (csrc/layer_ops.cpp's
    ``rotary_angles``, which the one-call decoder stack runs too): six torch ops cost ~30 us a step.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.head_dim = head_dim
        self._inv_freq_cpu = rotary_inv_freq(head_dim, theta, scaling)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._ops = cpu_layer_ops(dtype, device)
        self._kernels = cuda_layer_kernels(device)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The per-pair frequencies [head_dim // 2] (float32) on ``device``."""
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [T, head_dim] for ``positions`` [T]."""
        inv_freq = self.inv_freq(positions.device)
        if self._ops is not None and positions.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            return self._ops.rotary_angles(positions, inv_freq, dtype)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``q`` [T, Hq, D] and ``k`` [T, Hk, D] rotated by cos/sin [T, D] (in place with the CPU kernel)."""
        if self._ops is not None and q.dtype == cos.dtype:
            self._ops.rotary_(q, k, cos, sin)
            return q, k
        if self._kernels is not None:
            # cos/sin are cat(c, c) per token: the kernel takes the first half of each row
            half = self.head_dim // 2
            return self._kernels.rotary_embedding(None, q, k, cos[:, :half], sin[:, :half])
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by the angles in cos/sin [T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
