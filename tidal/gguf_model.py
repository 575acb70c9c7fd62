"""GGUF files (llama.cpp's format; what Ollama and LM Studio keep) as a model directory tidal serves.

``--model`` may name a ``.gguf`` file, a directory holding exactly one, or ``ollama:NAME[:TAG]`` (a model
Ollama pulled: its manifest's ``application/vnd.ollama.image.model`` layer is the GGUF blob). Like a Hub
id (``hub.py``), it is resolved here in the frontend, once, before any engine starts: ``prepare`` writes a
small directory beside nothing else, in tidal's cache, holding what every other part of tidal reads from
a model directory:

* ``config.json``, built from the file's metadata (``general.architecture`` and its keys);
* the tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with the chat template), converted from the
  file by transformers in a child process (``gguf_tokenizer.py``, which also restores the pre-tokenizer the
  conversion drops), or taken from ``--tokenizer``;
* ``generation_config.json`` from ``--generation-config DIR`` when given;
* ``gguf.json``, pointing at the GGUF itself: the engine reads the weights from it, memory-mapped
  (``tidal/gpu/model/gguf_checkpoint.py``); nothing of the weights is copied.

The directory is keyed by the file's path, size and modification time (and the tokenizer and generation
config sources), so a second start reuses it at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tidal.wire import GGUF_POINTER as POINTER

log = logging.getLogger("tidal.gguf")

OLLAMA_PREFIX = "ollama:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
FORMAT = 1  # bump when what ``prepare`` writes changes: old cache entries are then rebuilt

# general.architecture -> (the transformers architecture tidal runs, whether llama.cpp's converter permuted the
# rows of attn_q / attn_k for its interleaved rotary: Llama and Mistral yes, Qwen's NEOX rotary no)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class GgufModelError(Exception):
    """The GGUF model cannot be found or read; the message is one line for the operator."""


def is_gguf_model(name: str) -> bool:
    """``ollama:...``, a ``.gguf`` file, or a directory with a ``.gguf`` and no ``config.json``."""
    if name.startswith(OLLAMA_PREFIX):
        return True
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return path.endswith(".gguf")
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
            and any(f.endswith(".gguf") for f in os.listdir(path)))


def find_gguf(name: str) -> str:
    """The GGUF file ``--model name`` stands for (see the module docstring); ``GgufModelError`` otherwise."""
    if name.startswith(OLLAMA_PREFIX):
        return ollama_blob(name[len(OLLAMA_PREFIX):])
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) != 1:
            raise GgufModelError(f"{name}: a GGUF model directory must hold exactly one .gguf file, found "
                                 f"{len(found)}{': ' + ', '.join(found) if found else ''}; name the file instead")
        path = os.path.join(path, found[0])
    if not os.path.isfile(path):
        raise GgufModelError(f"no GGUF file {name!r}")
    return path


def ollama_models_dir() -> str:
    return os.environ.get("OLLAMA_MODELS") or os.path.join(os.path.expanduser("~"), ".ollama", "models")


def ollama_blob(spec: str) -> str:
    """The GGUF blob of Ollama's ``NAME[:TAG]`` (tag ``latest`` by default; NAME may be ``namespace/name`` or
    ``host/namespace/name``), from the manifest store under ``OLLAMA_MODELS`` or ``~/.ollama/models``."""
    if not spec or spec.startswith(":"):
        raise GgufModelError("ollama: needs a model name, e.g. ollama:smollm2:135m")
    name, _, tag = spec.partition(":")
    tag = tag or "latest"
    parts = name.split("/")
    # Ollama's default registry and namespace fill what the name leaves out
    prefix = {1: ["registry.ollama.ai", "library"], 2: ["registry.ollama.ai"], 3: []}.get(len(parts))
    if prefix is None or any(p in ("", ".", "..") for p in parts + [tag]) or "/" in tag:
        raise GgufModelError(f"ollama:{spec} is not an Ollama model name (NAME[:TAG])")
    store = ollama_models_dir()
    manifest_path = os.path.join(store, "manifests", *prefix, *parts, tag)
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise GgufModelError(f"Ollama has no model {name}:{tag} in {store} (no {manifest_path}); pull it with "
                             f"'ollama pull {name}:{tag}' or set OLLAMA_MODELS") from None
    except (OSError, ValueError) as exc:
        raise GgufModelError(f"cannot read Ollama's manifest {manifest_path}: {exc}") from None
    layers = [layer for layer in manifest.get("layers") or [] if isinstance(layer, dict)
              and layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    if len(layers) != 1 or not str(layers[0].get("digest", "")).startswith("sha256:"):
        raise GgufModelError(f"Ollama's manifest {manifest_path} has no single {OLLAMA_MODEL_LAYER} layer")
    blob = os.path.join(store, "blobs", layers[0]["digest"].replace(":", "-"))
    if not os.path.isfile(blob):
        raise GgufModelError(f"Ollama's model {name}:{tag} lacks its weights blob {blob}")
    return blob


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("TIDAL_GGUF_CACHE") or os.path.join(base, "tidal", "gguf")


def prepare(gguf_path: str, tokenizer: str | None = None, generation_config: str | None = None) -> str:
    """The model directory for ``gguf_path`` (see the module docstring), built once and cached.

    ``tokenizer``: a Hugging Face model directory whose tokenizer replaces the file's (vLLM's ``--tokenizer``).
    ``generation_config``: a directory whose ``generation_config.json`` gives the sampling defaults.
    Raises ``GgufModelError`` (one line) for a file tidal cannot serve."""
    stat = os.stat(gguf_path)
    key = json.dumps([FORMAT, os.path.realpath(gguf_path), stat.st_size, stat.st_mtime_ns,
                      _source_key(tokenizer), _source_key(generation_config)])
    stem = os.path.basename(gguf_path).removesuffix(".gguf")[:64]
    target = os.path.join(cache_root(), f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if os.path.isfile(os.path.join(target, POINTER)):
        log.info("GGUF %s: using its converted config and tokenizer in %s", gguf_path, target)
        return target
    os.makedirs(cache_root(), exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".partial-") as partial:
        log.info("GGUF %s: reading its metadata (%.1f MB file)", gguf_path, stat.st_size / 1e6)
        config = config_from_metadata(gguf_path)
        if generation_config is not None:
            shutil.copy(_generation_config_file(generation_config), os.path.join(partial, "generation_config.json"))
        log.info("GGUF %s: %s, %d layers; converting its tokenizer%s (once: it is cached)", gguf_path,
                 config["architectures"][0], config["num_hidden_layers"],
                 f" (from {tokenizer})" if tokenizer else " with transformers")
        _convert_tokenizer(gguf_path, partial, tokenizer)
        write_model_files(gguf_path, partial, config)  # the pointer last: it marks the directory complete
        try:
            os.rename(partial, target)
        except OSError:  # another server prepared it meanwhile
            if not os.path.isfile(os.path.join(target, POINTER)):
                raise
        os.makedirs(partial, exist_ok=True)  # for TemporaryDirectory's cleanup
    log.info("GGUF %s: prepared in %.1f s -> %s", gguf_path, time.monotonic() - started, target)
    return target


def write_model_files(gguf_path: str, out_dir: str, config: dict | None = None) -> None:
    """``config.json`` (from the metadata unless given) and the pointer to the file: what the engine's loader
    reads (the tokenizer is ``prepare``'s other part)."""
    config = config_from_metadata(gguf_path) if config is None else config
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, POINTER), "w", encoding="utf-8") as f:
        json.dump({"gguf": os.path.realpath(gguf_path)}, f)


def _source_key(path: str | None) -> str | None:
    return None if path is None else os.path.realpath(os.path.expanduser(path))


def _generation_config_file(directory: str) -> str:
    path = os.path.join(os.path.expanduser(directory), "generation_config.json")
    if not os.path.isfile(path):
        raise GgufModelError(f"--generation-config {directory}: no generation_config.json there")
    return path


def _convert_tokenizer(gguf_path: str, out_dir: str, tokenizer: str | None) -> None:
    """transformers builds the tokenizer in a child (it imports torch for the GGUF reader; the frontend never does)."""
    command = [sys.executable, "-m", "tidal.gguf_tokenizer", gguf_path, out_dir]
    if tokenizer is not None:
        command += ["--tokenizer", tokenizer]
    child = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise GgufModelError(f"cannot build the tokenizer of {gguf_path}: {last}")


# ------------------------------------------------------------------ config.json from the file's metadata


def read_fields(reader) -> dict:
    """The file's metadata as Python values (arrays of tokens and merges left out: long and not needed here)."""
    fields = {}
    for name, field in reader.fields.items():
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.scores"):
            fields[name] = len(field.data)
            continue
        try:
            fields[name] = field.contents()
        except Exception:  # an unreadable field tidal does not use
            continue
    return fields


def config_from_metadata(gguf_path: str) -> dict:
    """The Hugging Face ``config.json`` of the model in ``gguf_path``, from the file's metadata."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as exc:  # a truncated or foreign file: numpy and struct errors
        raise GgufModelError(f"{gguf_path} is not a readable GGUF file: {exc}") from None
    fields = read_fields(reader)
    tensor_names = {t.name for t in reader.tensors}
    return config_from_fields(fields, tensor_names, gguf_path)


def config_from_fields(fields: dict, tensor_names: set[str], source: str = "GGUF") -> dict:
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufModelError(f"{source}: GGUF architecture {arch!r} is not supported; tidal serves "
                             f"{', '.join(ARCHITECTURES)}")

    def need(key: str):
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise GgufModelError(f"{source}: the GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise GgufModelError(f"{source}: per-layer KV head counts are not supported")
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    vocab = fields.get(f"{arch}.vocab_size") or fields.get("tokenizer.ggml.tokens")
    if not vocab:
        raise GgufModelError(f"{source}: the GGUF metadata gives no vocabulary size")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    rope_dims = fields.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GgufModelError(f"{source}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GgufModelError(f"{source}: rope scaling {scaling!r} is not supported (tidal: linear, llama3)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    eos = [fields.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = [int(i) for i in dict.fromkeys(e for e in eos if e is not None)]
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if fields.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(fields["tokenizer.ggml.bos_token_id"])
    return config
