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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_sessionstart(session):
    """Build the CPU decode-attention kernel once, before any engine process needs it.

    Engine processes started by the tests load the cached build in ~0.15 s instead of each
    waiting ~15-25 s for the first compile under a test's timeout.
    """
    try:
        from tidal.gpu.cpu.kernels import load_decode_kernel

        load_decode_kernel()
    except Exception:  # the engine falls back to the torch path; its own tests report why
        pass
