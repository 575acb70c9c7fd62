"""Quantized linears on CPU: int8 (per output channel) and int4 (per group of inputs) weights.

A decode step at small batch reads every linear weight once, so its time is the bytes of the weights:
int8 reads half of bf16, int4 a quarter (plus their scales). The weights are held as integers with
float32 scales: w = (q - zero_point) * scale. Weight-only schemes dequantize them inside the kernel against
float activations (csrc/linear_int.cpp); with int8 activations (w8a8 / w4a8, what int8 / int4 run as under
``--dtype auto``: ``resolve_on_the_fly``) the kernel multiplies integers (csrc/linear_int_a8.cpp).

They come from two places: ``--quantization int8|int4`` rounds a full-precision checkpoint's weights
to the nearest step at load (``quantize``), and a compressed-tensors checkpoint carries them already
(tidal/gpu/model/compressed.py). Either way each Linear gets a ``QuantizedWeight`` before packing, and
``Linear.pack`` turns it into ``PackedInt`` (the kernel's layout) in place of the dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 16  # output columns per packed block (kBlock in csrc/linear_int.cpp)
BLOCK_A8 = 8  # with int8 activations (kCols in csrc/linear_int_a8.cpp)


@dataclass(frozen=True)
class Scheme:
    """How weights are quantized: ``bits`` (8 or 4), inputs per scale (``group_size``; None: one scale per
    output channel), and whether a zero point shifts the range (``symmetric=False``)."""

    bits: int
    group_size: int | None
    symmetric: bool = True
    activation_bits: int = 16  # 16: x stays float (weight-only); 8: x quantized to int8 blocks of 32 per step

    def describe(self) -> str:
        per = "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"int{self.bits} W{self.bits}A{self.activation_bits} {per}{'' if self.symmetric else ' asymmetric'}"


# --quantization: round-to-nearest at load (symmetric). int8: one scale per output channel; int4: one per 32 inputs,
# rounded as llama.cpp's Q4_0 (quantize). On SmolLM2-135M groups of 128 cost 5x Q4_0's perplexity loss and 32 match
# it (docs/performance.md, "Quality"). w8a8 and w4a8 also round each step's activations to int8 (blocks of 32 inputs,
# llama.cpp's Q8_0/Q4_0 arithmetic), so the kernel multiplies integers: on AVX2 CPUs that is 2-3x faster than
# widening each weight to float, at a perplexity cost within a tenth of a percent of bf16 activations.
ON_THE_FLY = {"int8": Scheme(8, None), "int4": Scheme(4, 32),
              "w8a8": Scheme(8, None, activation_bits=8), "w4a8": Scheme(4, 32, activation_bits=8)}
# Every on-the-fly scheme also rounds the LM head, as llama.cpp quantizes its output layer: int8 per vocabulary row
# (finer than Q4_0's Q6_K head), with int8 activations under w8a8 / w4a8 and exact ones under int8 / int4. At batch
# 1 a bf16 head is a seventh of the small model's bf16 bytes and a quarter of its int4 ones.
LM_HEAD = {16: Scheme(8, None), 8: Scheme(8, None, activation_bits=8)}  # by the scheme's activation bits
# --quantization int8|int4 under --dtype auto on a CPU: the same weights with int8 activations, which made every step
# faster on every CPU measured (AVX2: 1.5-2x; AVX512-BF16: 1.1-1.5x, docs/performance.md) at the agreement bf16
# activations cost. A --dtype the user names keeps the activations in it (W8A16 / W4A16 exactly).
INT8_ACTIVATIONS = {"int8": "w8a8", "int4": "w4a8"}


def resolve_on_the_fly(name: str | None, dtype_name: str, device: torch.device) -> tuple[str | None, str]:
    """(the ``ON_THE_FLY`` scheme ``--quantization name`` runs with ``--dtype dtype_name`` on ``device``, why; "" when
    it runs as asked)."""
    if name not in INT8_ACTIVATIONS or dtype_name != "auto" or device.type != "cpu":
        return name, ""
    scheme = INT8_ACTIVATIONS[name]
    return scheme, (f"--quantization {name} runs as {scheme} (--dtype auto on a CPU: each step's activations rounded "
                    f"to int8 per 32 inputs, the faster kernel; a named --dtype keeps them exact)")


def gguf_activation_bits(dtype_name: str, device: torch.device) -> tuple[int, str]:
    """(the activation bits a GGUF file's integer linears run with under ``--dtype dtype_name`` on ``device``, why).

    llama.cpp multiplies Q8_0 / Q4_0 / Q4_1 weights against activations rounded to Q8_0 blocks of 32; so does tidal
    under ``--dtype auto`` on a CPU (the integer kernel: at 16 rows about twice the speed of widening each weight to
    float on SmolLM2-135M, docs/performance.md). A named ``--dtype`` keeps the activations exact."""
    if dtype_name != "auto" or device.type != "cpu":
        return 16, ""
    return 8, ("a GGUF file's integer weights multiply int8 activations (per 32 inputs, as llama.cpp's do; "
               "--dtype auto on a CPU; a named --dtype keeps them exact)")


@dataclass
class QuantizedWeight:
    """A [N, K] weight as integers ``q`` (int8 tensor holding values in [-2^(bits-1), 2^(bits-1) - 1]) with
    float32 ``scales`` [N, groups], optional integer ``zero_points`` [N, groups] and optional float32 ``mins``
    [N, groups] (llama.cpp's Q4_1 keeps a minimum per group): w = (q - zp) * scale + min."""

    q: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    bits: int
    group_size: int  # inputs per scale; K for one scale per channel
    activation_bits: int = 16  # 8: the kernel rounds x to int8 blocks of 32 (Scheme.activation_bits)
    mins: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these integers stand for."""
        n, k = self.q.shape
        if k % self.group_size == 0:  # whole groups: broadcast each group's numbers over its inputs, no copies
            groups = (n, k // self.group_size, 1)
            q = self.q.view(n, -1, self.group_size).float()
            if self.zero_points is not None:
                q -= self.zero_points.float().view(groups)
            w = q.mul_(self.scales.float().view(groups))
            return (w if self.mins is None else w.add_(self.mins.float().view(groups))).view(n, k)
        q = self.q.float()
        if self.zero_points is not None:
            q = q - self.zero_points.float().repeat_interleave(self.group_size, dim=1)[:, :k]
        w = q * self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        return w if self.mins is None else w + self.mins.repeat_interleave(self.group_size, dim=1)[:, :k]

    def __getitem__(self, index) -> QuantizedWeight:
        """A tensor-parallel shard, indexed as the dense weight is: output channels ``w[a:b]`` (with their scales
        and zero points) or inputs ``w[:, a:b]``. An input slice keeps a per-channel scale whole (each rank's
        partial sum is scaled by it, and the sums add up exactly) and otherwise must be whole groups
        (``check_whole_groups``): the kernel's groups start at the first input."""
        rows, inputs = index if isinstance(index, tuple) else (index, slice(None))
        q, scales, zero_points = self.q[rows], self.scales[rows], None if self.zero_points is None else self.zero_points[rows]
        mins = None if self.mins is None else self.mins[rows]
        k = self.q.shape[1]
        start, stop, step = inputs.indices(k)
        if (start, stop, step) == (0, k, 1):
            return QuantizedWeight(q, scales, zero_points, self.bits, self.group_size, self.activation_bits, mins)
        if step != 1:
            raise ValueError("a quantized weight is sharded by contiguous inputs only")
        if mins is not None:  # a row-parallel shard's partial sums would each add the minimum
            raise ValueError("weights with a minimum per group (Q4_1) are sharded by output channels only")
        if self.group_size >= k:  # one scale per output channel
            return QuantizedWeight(q[:, start:stop], scales, zero_points, self.bits, stop - start, self.activation_bits)
        check_whole_groups(start, stop, k, self.bits, self.group_size)
        groups = slice(start // self.group_size, -(-stop // self.group_size))
        return QuantizedWeight(q[:, start:stop], scales[:, groups],
                               None if zero_points is None else zero_points[:, groups], self.bits, self.group_size,
                               self.activation_bits)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts stacked along the output dimension (a fused q/k/v or gate/up weight)."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size or p.activation_bits != first.activation_bits
               for p in parts):
            raise ValueError("parts of one fused linear are quantized differently")
        zero_points = None
        if any(p.zero_points is not None for p in parts):
            zero_points = torch.cat([p.zero_points if p.zero_points is not None else torch.zeros_like(p.scales, dtype=torch.int8)
                                     for p in parts])
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), zero_points,
                               first.bits, first.group_size, first.activation_bits, mins)


def check_whole_groups(start: int, stop: int, k: int, bits: int, group_size: int) -> None:
    """Raise ``ValueError`` unless inputs [start, stop) of a ``k``-input weight quantized in groups of
    ``group_size`` are whole groups (the last one may end at ``k``), as a row-parallel shard must be."""
    if start % group_size or (stop % group_size and stop != k):
        raise ValueError(f"int{bits} group {group_size} weights do not split here: a shard's K is {stop - start} "
                         f"(inputs {start}..{stop} of {k}), not whole groups of {group_size}")


def quantize(weight: torch.Tensor, scheme: Scheme, amax: torch.Tensor | None = None) -> QuantizedWeight:
    """``weight`` [N, K] rounded to the nearest of 2^bits steps per output channel or per group (symmetric:
    the step is the largest magnitude / (2^(bits-1) - 1)). ``amax`` [N, groups] replaces the weight's own
    largest magnitudes: a row-parallel shard's per-channel scale is the whole row's."""
    if not scheme.symmetric:
        raise ValueError("on-the-fly quantization is symmetric only")
    n, k = weight.shape
    group = scheme.group_size or k
    qmax = 2 ** (scheme.bits - 1) - 1
    w = F.pad(weight.detach().float(), (0, -k % group)).view(n, -1, group)
    if scheme.bits == 4 and amax is None:
        # llama.cpp's Q4_0 rule: the group's largest magnitude, with its sign, maps to -8 (the scale may be negative),
        # so the group uses all 16 steps, each 7/8 of amax / 7: a quarter less squared error than 15 steps
        extreme = w.gather(2, w.abs().argmax(dim=2, keepdim=True)).squeeze(2)
        scales = extreme / -(qmax + 1)
    else:
        scales = (w.abs().amax(dim=2) if amax is None else amax.float()) / qmax
    scales = torch.where(scales != 0, scales, torch.ones_like(scales))  # an all-zero group: any scale
    q = torch.clamp(torch.round(w / scales[:, :, None]), -qmax - 1, qmax).to(torch.int8)
    return QuantizedWeight(q.view(n, -1)[:, :k].contiguous(), scales, None, scheme.bits, group, scheme.activation_bits)


def quantize_linears(named_linears, scheme: Scheme) -> None:
    """Give each Linear ((name, Linear) pairs) the quantized form of its weight, for ``Linear.pack`` to pack
    (``Linear.quantize``: a tensor-parallel shard quantizes its own slice)."""
    for name, linear in named_linears:
        try:
            linear.quantized = linear.quantize(scheme)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


def weight_bytes(linears) -> tuple[int, int]:
    """(bytes of quantized weights with their scales, bytes of the other linear weights) a step reads."""
    quantized = dense = 0
    for linear in linears:
        if linear.int_packed is not None:
            quantized += linear.int_packed.nbytes
            continue
        for name in ("weight", "packed", "gemv_packed", "avx2_packed"):
            tensor = getattr(linear, name)
            if tensor is not None:
                dense += tensor.numel() * tensor.element_size()
                break
    return quantized, dense


class PackedInt:
    """A ``QuantizedWeight`` in the kernel's layout. Float activations (csrc/linear_int.cpp): ``packed`` [blocks of
    16 columns, K, 16] (int8) or [blocks, chunks of 8 inputs, 64] (int4, ``_pack_int4``); int8 activations
    (csrc/linear_int_a8.cpp): [blocks of 8 columns, K/4 or K/8, 32], 4 consecutive inputs of 8 columns per 32 bytes
    (int4: a byte holds inputs 8t + j and 8t + 4 + j). ``scales`` and ``offsets`` float32 [blocks, groups, columns
    per block] (offset = zero point * scale, plus 8 * scale for int4, which is stored unsigned, minus the group's
    minimum), or no offsets for symmetric int8 per channel and for symmetric int4 with int8 activations."""

    def __init__(self, weight: QuantizedWeight, ops) -> None:
        n, k = weight.q.shape
        if weight.bits == 4 and (k % 2 or weight.group_size % 2):
            raise ValueError(f"int4 weights need an even input size and group size (K={k}, group {weight.group_size})")
        if weight.activation_bits == 8 and weight.group_size < k and weight.group_size % 32:
            raise ValueError(f"int8 activations need a group size that is a multiple of 32 (group {weight.group_size})")
        self.n, self.k, self.bits, self.group_size = n, k, weight.bits, weight.group_size
        self.activation_bits = weight.activation_bits
        self._ops = ops
        columns = BLOCK if weight.activation_bits == 16 else BLOCK_A8
        blocks = -(-n // columns)
        q = F.pad(weight.q, (0, 0, 0, blocks * columns - n))
        if weight.activation_bits == 8:  # K padded with zero weights to whole blocks of 32 activations
            self.packed = self._pack_a8(F.pad(q, (0, -k % 32)), weight.bits, blocks)
        elif weight.bits == 8:
            self.packed = q.view(blocks, BLOCK, k).transpose(1, 2).contiguous()
        else:
            self.packed = self._pack_int4(q, weight.group_size, blocks)
        scales = weight.scales.float()
        offsets = None
        if weight.zero_points is not None:
            offsets = weight.zero_points.float() * scales
        # symmetric int4 against int8 activations needs no offsets: the kernel takes the 8 off in integers
        symmetric = weight.zero_points is None and weight.mins is None
        if weight.bits == 4 and not (symmetric and weight.activation_bits == 8):
            offsets = (offsets if offsets is not None else 0) + 8 * scales
        if weight.mins is not None:
            offsets = (offsets if offsets is not None else torch.zeros_like(scales)) - weight.mins.float()
        elif offsets is None and scales.shape[1] != 1 and weight.activation_bits == 16:
            offsets = torch.zeros_like(scales)
        self.scales = self._blocked(scales, blocks, columns)
        self.offsets = None if offsets is None else self._blocked(offsets, blocks, columns)

    @classmethod
    def restore(cls, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, shape: list[int],
                ops) -> PackedInt:
        """A weight packed before, from its tensors and ``shape`` = ``layout()`` (a cache of packed weights)."""
        self = cls.__new__(cls)
        self.n, self.k, self.bits, self.group_size, self.activation_bits = shape
        self.packed, self.scales, self.offsets, self._ops = packed, scales, offsets, ops
        return self

    def layout(self) -> list[int]:
        """What ``restore`` needs besides the tensors."""
        return [self.n, self.k, self.bits, self.group_size, self.activation_bits]

    @staticmethod
    def _pack_int4(q: torch.Tensor, group_size: int, blocks: int) -> torch.Tensor:
        """[N padded, K] int4 -> [blocks, groups * chunks, 64] (csrc/linear_int.cpp's layout): each group's inputs
        in chunks of 8 (the last zero-padded), a chunk's 16-bit word 2j + h holding column j's inputs 2t + h in its
        nibbles t = 0..3, stored unsigned (q + 8)."""
        k = q.shape[1]
        size = min(group_size, k)
        groups, chunks = -(-k // size), -(-size // 8)
        u = F.pad((q.to(torch.int16) + 8).to(torch.int32), (0, groups * size - k)).view(-1, groups, size)
        u = F.pad(u, (0, chunks * 8 - size)).view(blocks * BLOCK, groups, chunks, 4, 2)  # input 8c + 2t + h
        words = sum(u[:, :, :, t, :] << (4 * t) for t in range(4))  # [N, groups, chunks, 2 (h)]
        chunk_bytes = torch.stack((words & 0xFF, words >> 8), dim=-1).to(torch.uint8)  # little-endian words
        return (chunk_bytes.view(blocks, BLOCK, groups * chunks, 4).transpose(1, 2)
                .reshape(blocks, groups * chunks, 64).contiguous())

    @staticmethod
    def _pack_a8(q: torch.Tensor, bits: int, blocks: int) -> torch.Tensor:
        """[N padded, K] integers -> [blocks, K/4 (int8) or K/8 (int4), 32] (csrc/linear_int_a8.cpp's layout)."""
        k = q.shape[1]
        if bits == 8:  # [blocks, 8 columns, K/4, 4 inputs] -> [blocks, K/4, 8, 4]
            return q.view(blocks, BLOCK_A8, k // 4, 4).permute(0, 2, 1, 3).reshape(blocks, k // 4, 32).contiguous()
        u = (q.to(torch.int16) + 8).to(torch.uint8).view(blocks, BLOCK_A8, k // 8, 2, 4)  # inputs 8t + 4h + j
        nibbles = u[:, :, :, 0, :] | (u[:, :, :, 1, :] << 4)  # [blocks, 8, K/8, 4]
        return nibbles.permute(0, 2, 1, 3).reshape(blocks, k // 8, 32).contiguous()

    @staticmethod
    def _blocked(per_column: torch.Tensor, blocks: int, columns: int) -> torch.Tensor:
        """[N, groups] -> [blocks, groups, columns], padding columns 0."""
        padded = F.pad(per_column, (0, 0, 0, blocks * columns - per_column.shape[0]))
        return padded.view(blocks, columns, -1).transpose(1, 2).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: the integers, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.offsets) if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._ops.linear_int(x, self.packed, self.scales, self.offsets, self.n, self.bits, self.group_size,
                                    self.activation_bits, bias)


def int_linear_ops(device: torch.device | str):
    """``torch.ops.tidal_cpu`` when its int8/int4 linear can run here (a CPU with AVX2+FMA or AVX-512 and the
    kernels built), else None."""
    if torch.device(device).type != "cpu":
        return None
    from tidal.gpu.cpu.kernels import load_cpu_ops

    ops = load_cpu_ops()
    return ops if ops is not None and ops.linear_int_isa() else None
