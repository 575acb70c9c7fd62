import os
import sys

# Without a GPU, Triton kernels can only run in its interpreter, and TRITON_INTERPRET must be
# set before triton is first imported (transformers may import it early).
try:
    import torch  # noqa: F401

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# tests import helpers (tests/live_server.py, tests/hf_models.py) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))
from real_model import smollm2_dir, smollm2_gguf  # noqa: E402,F401  (the real model: session fixtures)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    """Build the CPU kernels once, before any engine process needs them.

    Engine processes started by the tests load the cached build in ~0.15 s instead of each
    waiting ~15-25 s for the first compile under a test's timeout. A failed build is no error by
    default (the engine falls back to the torch path and the kernel tests skip), unless
    TIDAL_REQUIRE_KERNELS=1 (set by .ci/run): then the suite stops here with the compiler's output,
    so a CI machine that cannot build them is red instead of green with the default CPU path untested.
    """
    required = os.environ.get("TIDAL_REQUIRE_KERNELS") == "1"
    try:
        from tidal.gpu.cpu import kernels
    except ImportError:  # no torch: nothing of the engine can be tested, and its tests say so
        if required:
            raise
        return
    if kernels.load_cpu_ops() is None and required:
        import pytest

        pytest.exit(f"TIDAL_REQUIRE_KERNELS=1 but the CPU kernels did not build:\n{kernels.load_failure()}",
                    returncode=1)
