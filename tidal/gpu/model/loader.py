"""Find a model directory and load it into tidal's model classes.

The engine loads local Hugging Face directories only (``config.json`` + ``model.safetensors`` or
a sharded ``model.safetensors.index.json``): a Hub id was already turned into its local snapshot by
the frontend (``tidal/hub.py``) before this process started, so the engine never downloads. The name
``tidal-tiny`` is the packaged default model, whose weights are generated on load.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import torch

from tidal.gpu.model import compressed, gguf_cache, gguf_checkpoint, quantization, quantized_linear, tiny_model
from tidal.gpu.model.layers import Linear, packs_weights
from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.registry import LlamaForCausalLM, model_class

TINY_MODEL_NAME = "tidal-tiny"


def resolve_model_dir(name: str) -> str:
    """Map ``EngineConfig.model`` to a directory: ``tidal-tiny`` or a path to an existing directory."""
    if name in (TINY_MODEL_NAME, "tidal-test"):  # tidal-test: tidal-tiny without a network
        return tiny_model.asset_dir()
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    raise FileNotFoundError(
        f"no model directory {name!r}; give a local Hugging Face directory, a Hub id ORG/NAME "
        f"or the built-in {TINY_MODEL_NAME!r}"
    )


def load_model(
    model_dir: str, dtype: torch.dtype, device: torch.device, attention, tp=None,
    linear_weights: torch.dtype | None = None, quantize: str | None = None, gguf_activation_bits: int = 16,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model of ``model_dir`` on ``device`` in ``dtype`` and load its weights.

    With ``tp`` (tensor parallelism) the model is this rank's shard, and only its slices of the
    checkpoint are read (``lazy`` safetensors slices). ``linear_weights=torch.bfloat16`` with a float32
    ``dtype``: the linear weights are stored in bf16 once loaded (``precision.Precision``, the AVX2 path).
    ``quantize`` ("int8"/"int4"/"w8a8"/"w4a8", ``quantization.ON_THE_FLY``; "fp8" on a CUDA GPU with FP8) rounds the decoder's
    linear weights at load; a compressed-tensors checkpoint (``compressed.py``) brings its own integers and scales.
    A GGUF file's Q8_0 / Q4_0 / Q4_1 linears stay integers on the CPU kernel, against int8 activations with
    ``gguf_activation_bits=8`` (``quantization.gguf_activation_bits``).
    Each quantized Linear runs on its device's kernel (``quantized_linear.pack``: C++ on CPU, Triton or
    ``torch._scaled_mm`` on CUDA).
    """
    config = ModelConfig.from_dir(model_dir)
    gguf_path = gguf_checkpoint.gguf_file(model_dir)
    if gguf_path is not None and (quantize is not None or tp is not None):
        raise ValueError("a GGUF model brings its own tensor types and runs on one process: drop "
                         + ("--quantization" if quantize is not None else "--tensor-parallel-size"))
    checkpoint = compressed.CompressedCheckpoint.read(model_dir)
    if quantize is not None and checkpoint is not None:
        raise ValueError(f"--quantization {quantize}: the checkpoint is already quantized ({checkpoint.describe()})")
    if quantize == "fp8" and not quantized_linear.fp8_runs_on(device):
        raise ValueError(quantized_linear.FP8_REFUSAL)
    if quantize == "fp8" and tp is not None:
        raise ValueError("--quantization fp8 runs on one process (no tensor parallelism)")
    if (quantize in quantization.ON_THE_FLY or checkpoint is not None and checkpoint.keeps_integers) and (
            quantized_linear.int_kernel(device) is None):
        raise ValueError("int8/int4 weights run on a CPU with the C++ kernels built (AVX2+FMA) or a CUDA GPU with "
                         "triton: " + (f"--quantization {quantize}" if quantize else checkpoint.describe()))
    if checkpoint is not None and tp is None and quantized_linear.fp8_runs_on(device):
        checkpoint.keep_fp8 = True  # FP8 weights stay FP8 on a GPU that multiplies them
    model = model_class(config)(config, attention, dtype=dtype, device=device, tp=tp)
    gguf = gguf_state = tied_head = None
    restored = False
    # Q8_0 / Q4_0 / Q4_1 stay integers on the C++ kernel only (Q4_1's minimum); their packed form is cached on disk
    native = gguf_path is not None and quantized_linear.int_kernel(device) == "cpu"
    cached = gguf_cache.cache_path(model_dir, gguf_path, dtype, gguf_activation_bits) if native and gguf_cache.enabled() else None
    if cached is not None:
        try:
            tied_head, restored = gguf_cache.restore(cached, model, quantization.int_linear_ops(device)), True
        except gguf_cache.Miss:
            pass
    if restored:
        pass  # the file was read, checked and packed by an earlier start
    elif tiny_model.has_generated_weights(model_dir, config):
        weights = tiny_model.generate_weights(config, tiny_model.special_token_ids(model_dir), config.init_seed)
        model.load_weights(weights.items())
    elif gguf_path is not None:
        gguf = gguf_checkpoint.GgufCheckpoint(gguf_path, config)
        gguf.native = native
        gguf.activation_bits = gguf_activation_bits
        model.load_weights(gguf.weights())
    elif checkpoint is not None:
        model.load_weights(checkpoint.decompress(iter_safetensors(model_dir)))
    else:
        model.load_weights(iter_safetensors(model_dir, lazy=tp is not None))
    model.eval()
    named_linears = [(f"model.layers.{name}", m) for name, m in model.model.layers.named_modules() if isinstance(m, Linear)]
    decoder_linears = [m for _, m in named_linears]
    lm_head_scheme = None
    if quantize == "fp8":
        quantized_linear.quantize_fp8_linears(decoder_linears)
    elif quantize is not None:  # tensor-parallel: each rank rounds its own shard (Linear.quantize)
        quantization.quantize_linears(named_linears, quantization.ON_THE_FLY[quantize])
        if quantized_linear.int_kernel(device) == "cpu":  # per vocabulary row: a vocabulary shard rounds alike
            lm_head_scheme = quantization.LM_HEAD[quantization.ON_THE_FLY[quantize].activation_bits]
    elif checkpoint is not None and (checkpoint.keeps_integers or checkpoint.keeps_fp8):
        checkpoint.attach(dict(model.named_modules()))
    elif gguf is not None:
        gguf.attach(dict(model.named_modules()))
        model.gguf_note = gguf.describe()
        # what a dense file's cache would save is small against its size on disk: cached when something was repacked
        tied_head = gguf.tied_head
        gguf_state = gguf_cache.dense_state(model, tied_head) if cached is not None and gguf.kept else None
    if (any(linear.quantized is not None or linear.int_packed is not None for linear in decoder_linears)
            or lm_head_scheme is not None
            or packs_weights(dtype, device, linear_weights)):
        started = time.monotonic()
        model.pack_weights(linear_weights if linear_weights != dtype else None, lm_head_scheme, tied_head)
        if gguf is not None:
            gguf_checkpoint.log.info("GGUF: linears packed for the kernels in %.1f s", time.monotonic() - started)
    if gguf_state is not None:
        gguf_cache.write(cached, gguf_state, model)
    return model, config


def quantization_groups(model_dir: str, quantize: str | None) -> tuple[str, int] | None:
    """(the scheme in words, its inputs per scale) of the grouped int weights loading would make, from
    ``--quantization`` or the checkpoint; None for dense or per-channel weights (which split anywhere)."""
    if quantize is not None:
        scheme = quantization.ON_THE_FLY[quantize]
        return None if scheme.group_size is None else (f"--quantization {quantize} ({scheme.describe()})", scheme.group_size)
    checkpoint = compressed.CompressedCheckpoint.read(model_dir)
    if checkpoint is None or not checkpoint.keeps_integers or checkpoint.strategy != "group":
        return None
    return checkpoint.describe(), checkpoint.group_size


def quantized_weights_note(model) -> str:
    """For the ready line: "; int4+int8 weights (int8 activations): 48.8 MB quantized + 0.0 MB dense linear weights
    read per step" when any linear is quantized (int8: the LM head's format; activations named when rounded)."""
    gguf = f"; {model.gguf_note}" if getattr(model, "gguf_note", None) else ""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    packed = [m.int_packed for m in linears if m.int_packed is not None]
    if not packed:
        return gguf
    formats = "+".join(sorted({quantized_linear.weight_format(p) for p in packed}))
    activations = " (int8 activations)" if any(getattr(p, "activation_bits", 16) == 8 for p in packed) else ""
    quantized, dense = quantization.weight_bytes(linears)
    tp = getattr(model, "tp", None)
    return (f"{gguf}; {formats} weights{activations}: {quantized / 1e6:.1f} MB quantized + {dense / 1e6:.1f} MB dense "
            f"linear weights read per step{'' if tp is None else f' by each of {tp.size} ranks'}")


def checkpoint_weight_dtype(model_dir: str) -> torch.dtype | None:
    """The dtype the checkpoint stores its matrices in (every tensor of two or more dimensions), read
    from the safetensors headers only; None when they differ or there is no checkpoint. Generated
    weights (tidal-tiny) are float32."""
    config = ModelConfig.from_dir(model_dir)
    if tiny_model.has_generated_weights(model_dir, config):
        return torch.float32
    from safetensors import safe_open

    dtypes = set()
    try:
        for path in safetensors_files(model_dir):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    if len(tensor.get_shape()) >= 2:
                        dtypes.add(tensor.get_dtype())
    except FileNotFoundError:
        return None
    return _SAFETENSORS_DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files: the shards listed in the index, or the single ``model.safetensors``."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, shard) for shard in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no weights in {model_dir!r}: expected model.safetensors or model.safetensors.index.json"
    )


def iter_safetensors(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of every checkpoint tensor, one at a time (CPU, memory-mapped).

    ``lazy``: a safetensors slice instead of the tensor; indexing it reads only that part.
    """
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
