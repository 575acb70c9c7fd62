"""C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension`` and cached.

One library (ops under ``torch.ops.tidal_cpu``) from these sources:

* ``csrc/paged_decode.cpp``: paged decode attention: one query token per sequence, reading K/V
  straight from the paged cache through the block table. On a CPU it replaces a gather of every
  block into a padded buffer plus a batch of tiny GEMMs, which cost several times the arithmetic.
  A bf16 cache on a CPU with AVX512-BF16 runs ``csrc/paged_decode_bf16.cpp`` (both products on
  ``vdpbf16ps``).
* ``csrc/layer_ops.cpp``: the per-layer elementwise work (RMSNorm with the residual add, rotary,
  SiLU-and-mul), one op each instead of three to eight torch ops. At decode the tensors are a few
  KB, so every torch op costs its dispatch and thread start-up, not its arithmetic.
* ``csrc/sampling.cpp``: one categorical draw per row by the inverse CDF (tidal/gpu/sampler.py),
  one uniform per row where torch's exponential race draws one per vocabulary entry.
* ``csrc/linear_bf16.cpp``: the bf16 linear for CPUs with AVX512-BF16 (tidal/gpu/model/layers.py), which
  streams a prepacked weight at close to the read bandwidth at decode.
* ``csrc/linear_avx2.cpp``: the linear for float32 models whose linear weights are stored in bf16
  (CPUs with AVX2+FMA and no native bf16; tidal/gpu/model/precision.py says when).
* ``csrc/linear_int.cpp``: the int8/int4 weight-only linear (tidal/gpu/model/quantization.py), its loops
  (``csrc/linear_int_tile.h``) compiled for AVX-512 and for AVX2 and chosen by the CPU at run time; with int8
  activations (w8a8, w4a8) ``csrc/linear_int_a8.cpp``: x quantized to int8 blocks, integer dot products
  (``csrc/linear_int_a8_tile.h``, on AVX512-VNNI's ``vpdpbusd`` where the CPU has it, else AVX2).
* ``csrc/lora.cpp``: each row's own LoRA adapter product added to a linear's output (tidal/gpu/model/lora.py),
  reading only the row's slot's A and B, where torch's small bf16 matmuls cost as much as the base linear.
* ``csrc/decoder_stack.cpp``: a model's decoder layers as one call (``torch.classes.tidal_cpu.DecoderStack``)
  over the kernels above, for a forward whose every row attends on the paged kernel: at decode the
  Python layers' dispatch cost as much as a tenth of the step (tidal/gpu/model/llama.py says when it runs).

The linears and the attention kernels split their work with ``csrc/claims.h``: each thread walks its
own share in order and takes over the back of another's once done, so a thread preempted by the
frontend or the client (they wake at every token, on the same cores) does not hold the step back.

The build takes about a minute the first time (logging its progress every 15 s) and is cached in torch's extensions directory
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), so later processes only
load the shared library. ``TIDAL_CPU_KERNELS=0`` turns the kernels off; so does any failure to
build, after one logged warning: callers then use their plain-torch path. ``tidal build-kernels``
(tidal/gpu/cpu/build.py) builds them ahead of the first start. tidal/gpu/cpu/build_lock.py keeps a build
killed half-way from blocking every later start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tidal.gpu.cpu import build_lock, features

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_decode.cpp", _CSRC / "paged_decode_bf16.cpp", _CSRC / "layer_ops.cpp",
            _CSRC / "linear_bf16.cpp", _CSRC / "linear_avx2.cpp", _CSRC / "linear_int.cpp", _CSRC / "linear_int_a8.cpp",
            _CSRC / "sampling.cpp", _CSRC / "lora.cpp",
            _CSRC / "decoder_stack.cpp"]
_HEADERS = [_CSRC / name for name in ("vec8.h", "linear_int_tile.h", "linear_int_a8_tile.h", "paged_decode_bf16.h",
                                        "claims.h", "isa.h", "ops.h")]
_lock = threading.Lock()
_loaded = False  # whether a load was attempted (its result, possibly None, is in _ops)
_ops = None  # torch.ops.tidal_cpu once loaded
_failure: str | None = None  # why the load gave None: the full build output, for load_failure()

# The signature of the loaded kernel, for readers (torch.ops objects carry no annotations).
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def load_cpu_ops():
    """``torch.ops.tidal_cpu`` with every kernel built, or None when disabled or unbuildable.

    Builds (or loads the cached build) once per process; later calls return the same object.
    Raises nothing: a failure logs one warning with the reason and returns None.
    """
    global _loaded, _ops
    if _loaded:
        return _ops
    with _lock:
        if not _loaded:
            _ops = _load()
            _loaded = True
    return _ops


def load_failure() -> str | None:
    """Why ``load_cpu_ops`` returned None, in full (the compiler's whole output for a failed build), or
    None if it has not failed. The engine only logs the first error line; a test suite that requires the
    kernels (``TIDAL_REQUIRE_KERNELS=1``, tests/conftest.py) fails with all of it."""
    return _failure


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled paged decode attention, or None when disabled or unbuildable.

    ``kernel(query [B, Hq, D], k_cache, v_cache [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks]
    int32, seq_lens [B] int32, scale) -> [B, Hq, D]``, for float32 or bfloat16 (query and caches alike)
    CPU tensors.
    """
    ops = load_cpu_ops()
    return None if ops is None else ops.paged_decode_attention


def _load():
    global _failure
    if os.environ.get("TIDAL_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels disabled by TIDAL_CPU_KERNELS=0")
        _failure = "disabled by TIDAL_CPU_KERNELS=0"
        return None
    started = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        name, flags = _library()
        directory = _build_directory(cpp_extension, name)
        building = not _is_built(cpp_extension, name)
        if building:  # progress, not a fault: the start is silent for this long otherwise
            log.info("building the CPU kernels (first start only: about a minute on two idle cores, several on a "
                     "busy host; later starts load the cached build): %s from %s with %s, into %s", name,
                     ", ".join(path.name for path in _SOURCES), " ".join(flags), directory or "torch's extension cache")
        with (build_lock.exclusive_build(directory) if directory else contextlib.nullcontext(),
              build_lock.progress(f"the CPU kernels ({name})") if building else contextlib.nullcontext()):
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=[flag for flag in flags if flag == "-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        ops = torch.ops.tidal_cpu
        ops.paged_decode_attention  # noqa: B018 - resolves the op now: a missing one fails here, not mid-forward
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use the torch path"
        log.warning("CPU kernels unavailable, using the torch path: %s: %s", type(exc).__name__, _reason(str(exc)))
        _failure = f"{type(exc).__name__}: {exc}"
        return None
    if building:
        log.info("CPU kernels built in %.1f s", time.perf_counter() - started)
    else:
        log.debug("CPU kernels ready in %.1f s", time.perf_counter() - started)  # quiet: the usual start
    return ops


def cache_directory() -> str | None:
    """Where this checkout's build for this CPU lives (or will) in torch's extension cache."""
    from torch.utils import cpp_extension

    return _build_directory(cpp_extension, _library()[0])


def _library() -> tuple[str, list[str]]:
    """(library name, compiler flags). The ISA is in the name so machines sharing a cache directory never
    load each other's build; the sources' hash (headers included: torch's own check skips them) so an edit
    always rebuilds; the checkout's path so two checkouts (whose build files name different source paths)
    do not rebuild over each other in torch's shared extension cache."""
    isa, flags = _compile_flags()
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
                            + str(_CSRC).encode() + " ".join(flags).encode()).hexdigest()[:10]
    return f"tidal_cpu_{isa}_{digest}", flags


def _build_directory(cpp_extension, name: str) -> str | None:
    try:
        return cpp_extension._get_build_directory(name, verbose=False)
    except Exception:  # noqa: BLE001 - a private helper: if it moves, we cannot say where
        return None


def _is_built(cpp_extension, name: str) -> bool:
    """Whether torch's extension cache already holds this build (then loading takes ~0.15 s)."""
    directory = _build_directory(cpp_extension, name)
    return directory is not None and os.path.exists(os.path.join(directory, f"{name}.so"))


def _reason(message: str) -> str:
    """The telling line of a build failure: the first compiler error, not ninja's closing summary."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]  # gcc/clang: "file:line:col: error: ..."
    return errors[0] if errors else (lines[-1] if lines else "(no message)")


def _compile_flags() -> tuple[str, list[str]]:
    """(ISA tag, flags): the widest of AVX512 with BF16, AVX512, AVX2+FMA this CPU has (AVX2+FMA at most when
    ``TIDAL_CPU_ISA=avx2`` holds it there, see features.py), else the compiler's portable default; on Linux
    with OpenMP, whose pragma ``at::parallel_for`` needs (without ``-fopenmp`` every kernel's
    ``at::parallel_for`` ran on one thread: its header falls back to a plain call)."""
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        cpu_flags = set()
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    avx512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    if features.held_to_avx2():
        cpu_flags = {flag for flag in cpu_flags if not flag.startswith("avx512")}
    if {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= cpu_flags:
        # vec8.h rounds to bf16 with one instruction here instead of eight
        return "avx512bf16", ["-O3", "-mavx2", "-mfma", *avx512, "-mavx512bf16", *openmp]
    if {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags:
        return "avx512", ["-O3", "-mavx2", "-mfma", *avx512, *openmp]
    if {"avx2", "fma"} <= cpu_flags:
        return "avx2", ["-O3", "-mavx2", "-mfma", *openmp]
    return "generic", ["-O3", *openmp]
