"""A GGUF model's weights as tidal runs them, kept on disk so the next start skips reading and repacking the file.

Loading a GGUF file parses its metadata (the tokenizer's ~100k strings), unpacks every Q8_0 / Q4_0 / Q4_1 block
and repacks it into the int kernels' layout: tens of seconds on a busy two-core host for a 100 MB file. The
first start writes what that produces to ``weights-KEY.safetensors`` in the prepared model directory (beside
``config.json``): the int kernels' tensors of every Linear kept native, and every other parameter (embeddings,
norms, biases, dense linears) in the compute dtype, before the dense ones are packed. A later start with the
same key maps that file instead and packs only the dense linears.

The key holds what decides those bytes: the GGUF file's real path, size and modification time, tidal's
version, a hash of the code that unpacks and packs (this module, ``gguf_checkpoint.py``, ``quantization.py``),
the kernel build (its ISA) and the compute dtype. Any change is a miss: the file is rebuilt and replaces the
stale one. ``TIDAL_GGUF_WEIGHT_CACHE=0`` turns the cache off (the load then reads the file every time).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import tempfile
import time

import torch

import tidal
from tidal.gpu.cpu import kernels
from tidal.gpu.model import gguf_checkpoint, quantization
from tidal.gpu.model.layers import Linear

log = logging.getLogger("tidal.gguf")

FORMAT = 1


def enabled() -> bool:
    return os.environ.get("TIDAL_GGUF_WEIGHT_CACHE", "1") != "0"


@functools.cache
def _code_hash() -> str:
    digest = hashlib.sha256()
    for module in (gguf_checkpoint, quantization):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    with open(__file__, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()


def cache_path(model_dir: str, gguf_path: str, dtype: torch.dtype, activation_bits: int = 16) -> str:
    """Where this file's packed weights for this build, ``dtype`` and activation rounding live (whether or not
    they exist yet)."""

    stat = os.stat(gguf_path)
    build = os.path.basename(kernels.cache_directory() or "no-kernels")
    key = json.dumps([FORMAT, tidal.__version__, _code_hash(), build, str(dtype), activation_bits, os.path.realpath(gguf_path),
                      stat.st_size, stat.st_mtime_ns])
    return os.path.join(model_dir, f"weights-{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors")


HEAD_PARTS = ("q", "scales", "zero_points", "mins")


def dense_state(model: torch.nn.Module, tied_head: quantization.QuantizedWeight | None = None) -> tuple:
    """(every parameter that stays dense, the Linears given integers, the tied head's integers), taken before
    packing drops the plain copies of the dense linears."""
    native = [name for name, m in model.named_modules() if isinstance(m, Linear) and m.quantized is not None]
    replaced = {f"{name}.weight" for name in native}
    return {name: p.detach() for name, p in model.named_parameters() if name not in replaced}, native, tied_head


def write(path: str, state: tuple, model: torch.nn.Module) -> None:
    """Save ``state`` (``dense_state``) with those Linears' packed integers to ``path`` (atomically; other keys'
    files in the directory are removed: they belong to an older file or build). A failure only logs."""
    from safetensors.torch import save_file

    started = time.monotonic()
    dense, native, head = state
    tensors = {f"dense.{name}": t.contiguous() for name, t in dense.items()}
    if head is not None:  # as integers: packing it for the kernel is a transpose
        tensors.update({f"head.{part}": getattr(head, part) for part in HEAD_PARTS if getattr(head, part) is not None})
    layouts = {}
    modules = dict(model.named_modules())
    for name in native:
        packed = modules[name].int_packed
        if isinstance(packed, quantization.PackedInt):
            layouts[name] = packed.layout()
            tensors[f"int.{name}.packed"] = packed.packed
            tensors[f"int.{name}.scales"] = packed.scales
            if packed.offsets is not None:
                tensors[f"int.{name}.offsets"] = packed.offsets
    directory = os.path.dirname(path)
    try:
        fd, partial = tempfile.mkstemp(dir=directory, prefix=".weights-", suffix=".partial")
        os.close(fd)
        try:
            save_file(tensors, partial, metadata={
                "layouts": json.dumps(layouts), "note": getattr(model, "gguf_note", "") or "",
                "head": json.dumps(None if head is None else [head.bits, head.group_size])})
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        for stale in glob.glob(os.path.join(directory, "weights-*.safetensors")):
            if stale != path:
                os.remove(stale)
    except OSError as exc:
        log.warning("GGUF: packed weights not cached (%s): the next start reads the file again", exc)
        return
    log.info("GGUF: packed weights cached for the next start in %s (%.0f MB, %.1f s)", path,
             os.path.getsize(path) / 1e6, time.monotonic() - started)


class Miss(Exception):
    """No usable cache: the model is loaded from the file."""


def restore(path: str, model: torch.nn.Module, ops) -> quantization.QuantizedWeight | None:
    """Fill ``model`` from the cache at ``path``: the dense parameters, and each native Linear's ``int_packed``
    (``ops``: the int kernels); returns the tied head's integers, if the file had them. ``Miss``, with ``model``
    untouched, when there is no usable cache there."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise Miss
    started = time.monotonic()
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        layouts, head_layout = json.loads(metadata["layouts"]), json.loads(metadata["head"])
        tensors = load_file(path)
    except Exception as exc:  # a truncated or foreign file: rebuilt from the GGUF
        log.warning("GGUF: ignoring the unreadable packed-weight cache %s (%s)", path, exc)
        raise Miss from None
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    dense = {name.removeprefix("dense."): t for name, t in tensors.items() if name.startswith("dense.")}
    replaced = {f"{name}.weight" for name in layouts}
    if (any(not isinstance(modules.get(name), Linear) for name in layouts) or set(dense) != set(params) - replaced
            or any(tuple(params[name].shape) != tuple(t.shape) for name, t in dense.items())):
        log.warning("GGUF: the packed-weight cache %s does not fit this model: rebuilding it", path)
        raise Miss
    with torch.no_grad():
        for name, tensor in dense.items():
            params[name].copy_(tensor)
    for name, layout in layouts.items():
        linear = modules[name]
        linear.int_packed = quantization.PackedInt.restore(
            tensors[f"int.{name}.packed"], tensors[f"int.{name}.scales"], tensors.get(f"int.{name}.offsets"),
            layout, ops)
        linear.weight = None
    model.gguf_note = metadata.get("note") or None
    log.info("GGUF: weights from the packed cache %s (%.1f s; the file itself is not read)", path,
             time.monotonic() - started)
    if head_layout is None:
        return None
    parts = {part: tensors.get(f"head.{part}") for part in HEAD_PARTS}
    return quantization.QuantizedWeight(parts["q"], parts["scales"], parts["zero_points"], *head_layout,
                                        mins=parts["mins"])
