"""compressed-tensors checkpoints made offline from a dense Hugging Face model directory (tests/hf_models.py).

Round-to-nearest (min/max scales, as llm-compressor's QuantizationModifier without calibration data) through
compressed-tensors' own scale computation and compressors, so the files are the format llm-compressor writes.
Each writer also returns the reference: the same model with every quantized weight replaced by what
compressed-tensors decompresses it to, for transformers to run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == "channel":
        return weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    n, k = weight.shape
    groups = weight.view(n, k // args.group_size, args.group_size)
    return groups.amin(dim=2), groups.amax(dim=2)


def write_compressed(src_dir: str, out_dir: str | os.PathLike, preset: str, fmt: str, **weight_args) -> str:
    """Quantize ``src_dir``'s decoder linears with compressed-tensors ``preset`` ("W8A16", "W4A16", "FP8"),
    ``weight_args`` overriding the preset's weight arguments (e.g. ``strategy="channel"``, ``symmetric=False``),
    and save them in ``fmt`` ("pack-quantized", "int-quantized", "float-quantized") to ``out_dir``. Also writes
    ``out_dir/reference``: the dense model with the decompressed weights. Returns ``out_dir``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=weight_args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    dense = load_file(os.path.join(src_dir, "model.safetensors"))
    compressed, reference = {}, {}
    for name, weight in dense.items():
        if ".layers." not in name or not name.endswith("_proj.weight"):
            compressed[name] = reference[name] = weight
            continue
        prefix = name.removesuffix(".weight")
        scale, zero_point = calculate_qparams(*_min_max(weight, scheme.weights), scheme.weights)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
        packed = compressor.compress(state, scheme)
        compressed.update({f"{prefix}.{part}": tensor.contiguous() for part, tensor in packed.items()})
        reference[name] = compressor.decompress(packed, scheme)["weight"].to(weight.dtype)
    out = Path(out_dir)
    for directory, tensors in ((out, compressed), (out / "reference", reference)):
        directory.mkdir(parents=True, exist_ok=True)
        for entry in os.listdir(src_dir):
            if entry != "model.safetensors" and os.path.isfile(os.path.join(src_dir, entry)):
                shutil.copyfile(os.path.join(src_dir, entry), directory / entry)
        save_file(tensors, directory / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, quant_method="compressed-tensors", ignore=["lm_head"],
    ).model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


def with_zero_points(weight, seed: int):
    """``weight`` (a ``QuantizedWeight``) given random zero points of half its integer range, as an asymmetric
    checkpoint would bring them."""
    low = -(2 ** (weight.bits - 1))
    generator = torch.Generator().manual_seed(seed)
    weight.zero_points = torch.randint(low // 2, -low // 2, weight.scales.shape, generator=generator, dtype=torch.int8)
    return weight
