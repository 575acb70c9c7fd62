"""Triton kernels for the CUDA path, each beside a plain-torch reference with the same signature.

Nothing here is imported eagerly: the CPU engine imports ``tidal.kernels`` only to read
``HAS_TRITON``, and a kernel module (which imports triton) loads on first attribute access.
Loading lazily also matters for the CPU tests: ``TRITON_INTERPRET=1`` only takes effect for
kernels decorated after it is set, so importing a kernel here at package import would freeze it
in compiled mode.
"""

from __future__ import annotations

import importlib
import importlib.util

HAS_TRITON = importlib.util.find_spec("triton") is not None

# public name -> module that defines it (module names differ from the function names, so a
# loaded submodule never shadows the function of the same name on this package)
_EXPORTS = {
    "reshape_and_cache": "kv_cache_write",
    "reshape_and_cache_reference": "kv_cache_write",
    "paged_decode_attention": "decode_attention",
    "paged_decode_attention_reference": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "paged_prefill_attention_reference": "prefill_attention",
    "rms_norm": "norm",
    "rms_norm_reference": "norm",
    "rotary_embedding": "rotary",
    "rotary_embedding_reference": "rotary",
    "lora_add": "lora",
    "lora_add_reference": "lora",
}

__all__ = ["HAS_TRITON", *_EXPORTS]


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not HAS_TRITON:
        raise ImportError(f"tidal.kernels.{name} needs triton, which is not installed")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, name)
