"""Checkpoints quantized in the compressed-tensors format (what llm-compressor writes; most quantized Hub models).

config.json's ``quantization_config`` (``quant_method: compressed-tensors``) names the scheme. What loads:

* weight-only int8 (W8A16) and int4 (W4A16), per output channel or per group, symmetric or with zero points,
  stored ``pack-quantized`` (integers packed into int32 words) or ``int-quantized``/``naive-quantized``
  (one int8 per weight): the integers and scales are kept and run on the int kernel (quantization.py);
* FP8 weights (W8A8-FP8 or W8A16-FP8, per tensor or per channel, ``float-quantized``/``naive-quantized``):
  on a CUDA GPU with FP8 (``keep_fp8``, set by the loader) kept as FP8 with per-channel scales and run with
  per-token FP8 activations (quantized_linear.Fp8Linear); elsewhere dequantized to the compute dtype at load
  (CPUs have no FP8 arithmetic) and the activations are not quantized.

Anything else (int8 activations, 2:4 sparsity, NVFP4/MXFP4, block-wise FP8, 2/3-bit) is refused with one
line naming the scheme, and a checkpoint whose scales, zero points or packed sizes do not fit its weights'
shapes is refused naming the tensor: never a wrong answer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Annotated

import msgspec
import torch

from tidal.gpu.model.quantization import QuantizedWeight
from tidal.gpu.model.quantized_linear import Fp8Weight

_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "input_scale", "weight_global_scale",
          "input_global_scale")
_INT_FORMATS = {"pack-quantized", "int-quantized", "naive-quantized"}
_FP8_FORMATS = {"float-quantized", "naive-quantized"}
_FP8 = getattr(torch, "float8_e4m3fn", None)


class _Scheme(msgspec.Struct):
    """What a config group's ``weights`` (and ``input_activations``) may say, typed: a value of the
    wrong type or out of range (``group_size`` 2^40 or 64.0, ``num_bits`` null) is one line, never a
    traceback or an allocation sized by it."""

    num_bits: Annotated[int, msgspec.Meta(ge=1, le=64)] = 0
    type: str = "int"
    strategy: str | None = "tensor"
    group_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    symmetric: bool = True


def _scheme(value: object, where: str) -> dict:
    try:
        msgspec.convert(value, _Scheme, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad compressed-tensors config: {where}: {exc}") from None
    return value  # type: ignore[return-value]


class CompressedCheckpoint:
    """The quantization scheme of a compressed-tensors checkpoint, and its weights turned into tidal's."""

    def __init__(self, weights: dict, activations: dict | None, fmt: str) -> None:
        self.bits = int(weights.get("num_bits", 0))
        self.kind = weights.get("type", "int")
        self.strategy = weights.get("strategy", "tensor")
        self.group_size = weights.get("group_size")
        self.symmetric = bool(weights.get("symmetric", True))
        self.format = fmt
        self.activations = activations
        self.kept: dict[str, QuantizedWeight | Fp8Weight] = {}  # module name -> its kept quantized weight
        self.keep_fp8 = False  # FP8 weights stay FP8 (a GPU with FP8) instead of being dequantized

    @property
    def keeps_fp8(self) -> bool:
        return self.kind == "float" and self.keep_fp8

    @property
    def keeps_integers(self) -> bool:
        return self.kind == "int"

    def describe(self) -> str:
        """The scheme in one phrase, e.g. "int4 W4A16 group 128 (pack-quantized)"."""
        name = f"int{self.bits}" if self.kind == "int" else f"FP{self.bits}" if self.kind == "float" else str(self.kind)
        acts = 16 if self.activations is None else self.activations.get("num_bits")
        fp8_acts = self.activations is not None and self.activations.get("type") == "float"
        per = f"{self.strategy} {self.group_size}" if self.group_size else f"per {self.strategy}"
        return (f"{name} W{self.bits}A{acts}{'-FP8' if fp8_acts else ''} {per}"
                f"{'' if self.symmetric else ' asymmetric'} ({self.format})")

    @classmethod
    def read(cls, model_dir: str) -> CompressedCheckpoint | None:
        """The scheme in ``model_dir/config.json``, None for an unquantized checkpoint; ``ValueError`` for one
        tidal cannot load."""
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                config = json.load(f).get("quantization_config")
        except FileNotFoundError:
            return None
        if not config:
            return None
        method = config.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"unsupported quantization method {method!r}: tidal loads compressed-tensors checkpoints")
        if config.get("sparsity_config"):
            raise ValueError("unsupported compressed-tensors scheme: sparse weights "
                             f"({config['sparsity_config'].get('format', 'sparsity')})")
        config_groups = config.get("config_groups") or {}
        if not isinstance(config_groups, dict) or not all(isinstance(g, dict) for g in config_groups.values()):
            raise ValueError("bad compressed-tensors config: config_groups must map names to groups (objects)")
        groups = list(config_groups.values())
        if not groups:
            raise ValueError("compressed-tensors checkpoint without config_groups: no scheme to load")
        schemes = {json.dumps([g.get("weights"), g.get("input_activations")], sort_keys=True) for g in groups}
        if len(schemes) > 1:
            raise ValueError("unsupported compressed-tensors checkpoint: several schemes in one model")
        group = groups[0]
        activations = group.get("input_activations")
        checkpoint = cls(_scheme(group.get("weights") or {}, "weights"),
                         None if activations is None else _scheme(activations, "input_activations"),
                         group.get("format") or config.get("format", "pack-quantized"))
        checkpoint._check_supported()
        return checkpoint

    def _check_supported(self) -> None:
        refuse = f"unsupported compressed-tensors scheme: {self.describe()}"
        if self.kind == "int":
            if self.activations is not None:
                raise ValueError(refuse + "; tidal loads weight-only int (W8A16, W4A16)")
            if self.bits not in (4, 8) or self.strategy not in ("channel", "group") or self.format not in _INT_FORMATS:
                raise ValueError(refuse)
            if self.format != "pack-quantized" and self.bits != 8:
                raise ValueError(refuse)
            if self.strategy == "group" and (not self.group_size or self.group_size % 2):
                raise ValueError(refuse + f"; group_size {self.group_size!r}")
        elif self.kind == "float":
            if self.bits != 8 or self.strategy not in ("tensor", "channel") or self.format not in _FP8_FORMATS:
                raise ValueError(refuse)
            if _FP8 is None:
                raise ValueError(refuse + "; this torch has no float8_e4m3fn")
        else:
            raise ValueError(refuse)

    def decompress(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized module's parts replaced by its dense ``.weight``
        (float32); for int schemes (and FP8 with ``keep_fp8``) the quantized weights are kept in ``kept``
        for ``attach``."""
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            prefix, _, part = name.rpartition(".")
            if part in _PARTS or (part == "weight" and tensor.dtype in (torch.int8, _FP8)):
                modules.setdefault(prefix, {})[part] = tensor
            else:
                yield name, tensor
        for prefix, parts in modules.items():
            yield prefix + ".weight", self._dense(prefix, parts)

    def _dense(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        scale = parts.get("weight_scale")
        if scale is None:
            raise ValueError(f"checkpoint module {prefix!r} has quantized weights but no weight_scale")
        if self.kind == "float":
            weight = _need(parts, prefix, "weight")
            n = weight.shape[0]
            expected = {(), (1,), (1, 1)} if self.strategy == "tensor" else {(n, 1)}
            if tuple(scale.shape) not in expected:
                raise ValueError(f"checkpoint tensor {prefix}.weight_scale has shape {tuple(scale.shape)}, expected "
                                 f"{' or '.join(str(s) for s in sorted(expected))} ({self.describe()})")
            scales = scale.float().reshape(-1, 1)
            if self.keep_fp8:
                self.kept[prefix] = Fp8Weight(weight.to(_FP8), scales.expand(n, 1).reshape(n).contiguous())
            return weight.float() * scales
        q = self._integers(prefix, parts)
        n, k = q.shape
        group = self.group_size if self.strategy == "group" else k
        groups = -(-k // group)
        if tuple(scale.shape) != (n, groups):
            raise ValueError(f"checkpoint tensor {prefix}.weight_scale has shape {tuple(scale.shape)}, expected "
                             f"{(n, groups)} for a weight of {(n, k)} ({self.describe()})")
        zero_points = None
        if not self.symmetric:
            zero_points = self._zero_points(prefix, _need(parts, prefix, "weight_zero_point"), n, groups)
        weight = QuantizedWeight(q, scale.float(), zero_points, self.bits, group)
        self.kept[prefix] = weight
        return weight.dequantize()

    def _integers(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weight's integers [N, K] as int8 (signed values)."""
        if self.format != "pack-quantized":
            weight = _need(parts, prefix, "weight")
            if weight.dtype != torch.int8 or weight.dim() != 2:
                raise ValueError(f"checkpoint tensor {prefix}.weight is {weight.dtype} {tuple(weight.shape)}, "
                                 f"expected a 2-D int8 tensor ({self.describe()})")
            return weight
        packed, shape = _need(parts, prefix, "weight_packed"), _need(parts, prefix, "weight_shape")
        if shape.numel() != 2 or packed.dim() != 2 or packed.dtype != torch.int32:
            raise ValueError(f"checkpoint tensors {prefix}.weight_packed/weight_shape do not describe a 2-D "
                             f"int32-packed weight ({self.describe()})")
        n, k = (int(v) for v in shape.tolist())
        if tuple(packed.shape) != (n, -(-k * self.bits // 32)):
            raise ValueError(f"checkpoint tensor {prefix}.weight_packed has shape {tuple(packed.shape)}, expected "
                             f"{(n, -(-k * self.bits // 32))} for a weight of {(n, k)} ({self.describe()})")
        return unpack_int32(packed, self.bits)[:, :k].contiguous()

    def _zero_points(self, prefix: str, zero_point: torch.Tensor, n: int, groups: int) -> torch.Tensor:
        if self.format == "pack-quantized" and zero_point.dtype == torch.int32:  # packed along the output dim
            rows = -(-n * self.bits // 32)
            if tuple(zero_point.shape) != (rows, groups):
                raise ValueError(f"checkpoint tensor {prefix}.weight_zero_point has shape {tuple(zero_point.shape)}, "
                                 f"expected {(rows, groups)} ({self.describe()})")
            return unpack_int32(zero_point.T.contiguous(), self.bits).T[:n].contiguous()
        if tuple(zero_point.shape) != (n, groups):
            raise ValueError(f"checkpoint tensor {prefix}.weight_zero_point has shape {tuple(zero_point.shape)}, "
                             f"expected {(n, groups)} ({self.describe()})")
        return zero_point.to(torch.int8)

    def attach(self, modules: dict) -> None:
        """Give each of tidal's Linears (``modules``: name -> module) the quantized weights of its checkpoint
        modules (a fused q/k/v or gate/up Linear gets its parts stacked in order). A tensor-parallel shard takes
        its slice of each part as of the dense weight (its ``shard``), scales and zero points with it."""
        from tidal.gpu.model.llama import _target

        fused: dict[str, dict[int, QuantizedWeight | Fp8Weight]] = {}
        for prefix, weight in self.kept.items():
            target, part = _target(prefix + ".weight")
            fused.setdefault(target.removesuffix(".weight"), {})[part or 0] = weight
        for name, parts in fused.items():
            expected = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
            if sorted(parts) != list(range(expected)):
                raise ValueError(f"checkpoint quantizes only some parts of {name!r}: tidal fuses them into one linear")
            module = modules[name]
            shard = getattr(module, "shard", None)
            if shard is not None:  # int weights only: FP8 ones are kept on one process (the loader)
                try:
                    parts = {i: shard("weight", parts[i], i if expected > 1 else None) for i in range(expected)}
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
            ordered = [parts[i] for i in range(expected)]
            module.quantized = type(ordered[0]).cat(ordered)


def _need(parts: dict[str, torch.Tensor], prefix: str, part: str) -> torch.Tensor:
    if part not in parts:
        raise ValueError(f"checkpoint module {prefix!r} lacks {part}")
    return parts[part]


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words holding 32 // bits values each, first value in the lowest bits, stored with an
    offset of 2^(bits-1) (compressed-tensors' pack_to_int32) -> [R, C * 32 // bits] signed int8."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (values.reshape(packed.shape[0], -1) - (1 << (bits - 1))).to(torch.int8)
