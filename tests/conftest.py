import os
import sys

import pytest

# The suite runs on two xdist workers (pyproject's addopts). Each gets one OpenMP thread, set before torch is
# imported and inherited by the servers it starts: two workers each running two-thread kernels on two cores
# spend their time in OpenMP barriers waiting for a preempted thread (measured: 35 minutes against 20 serial).
# Tests about threading set their own counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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
from real_model import smollm2_dir, smollm2_gguf, smollm2_hf_dir  # noqa: E402,F401  (the real model: session fixtures)

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
    if kernels.load_cpu_ops() is None:
        if required:
            pytest.exit(f"TIDAL_REQUIRE_KERNELS=1 but the CPU kernels did not build:\n{kernels.load_failure()}",
                        returncode=1)
        return
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # once per run, in the process that deals the tests
        _start_avx2_build()


_background_builds: list = []


def _start_avx2_build() -> None:
    """Start compiling the TIDAL_CPU_ISA=avx2 library now, in the background: the tests that run as an AVX2-only
    CPU load it (tests/gpu/cpu/test_*: ~30-50 s of compiling on two cores), and the build lock makes them wait for
    this build instead of compiling it again. Begun here it overlaps the suite's waiting instead of stalling a test."""
    import subprocess

    _background_builds.append(subprocess.Popen(
        [sys.executable, "-m", "tidal", "build-kernels"], env={**os.environ, "TIDAL_CPU_ISA": "avx2"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session, exitstatus):
    for build in _background_builds:  # nothing outlives the run (a failed build is each avx2 test's own failure)
        if build.poll() is None:
            build.terminate()
        build.wait()


# The longest files (20 s to 2 minutes each, measured), handed to the workers first: files are dealt in collection
# order, and a long one dealt last would leave one worker busy while the other idles. The AVX2 kernel tests stay
# in their place, by when the background build (_start_avx2_build) is done.
RUN_FIRST = ("smollm2/test_smollm2_parity.py", "ui/test_ui_browser.py", "gpu/parallel/test_tensor_parallel.py",
             "smollm2/test_smollm2_speculative.py", "engines/test_liveness.py", "smollm2/test_readme_real_model.py",
             "smollm2/test_smollm2_draft_model.py", "smollm2/test_smollm2_served.py", "engines/test_data_parallel.py",
             "api/test_api_quantized.py", "api/test_api_first_constraint.py")


def pytest_collection_modifyitems(session, config, items):
    tests_dir = os.path.dirname(__file__)
    for item in items:
        # schemathesis' per-operation items are named "test[POST /v1/...]" but, under pytest 9.2, all get the bare
        # function's node id (pytest's structured NodeId, built before the name's suffix); xdist deals tests by
        # node id and ran none of the duplicates (the OpenAPI fuzz silently shrank to its two plain tests), so
        # each gets its name back in its id
        if item.nodeid.rsplit("::", 1)[-1] != item.name:
            item._id = type(item._id).parse(f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}")

    def rank(item) -> int:
        path = os.path.relpath(str(item.path), tests_dir)
        return RUN_FIRST.index(path) if path in RUN_FIRST else len(RUN_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_unconfigure(config):
    """Wait for in-process engines' grammar threads (xgrammar's set-up, compiles) before the interpreter exits.

    A thread still in xgrammar's native code when finalization runs the C++ static destructors aborts the
    process ("terminate called without an active exception"): the engine process avoids it with ``os._exit``
    (tidal/gpu/__main__.py), and a test process that built engines in-process waits here instead."""
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith("tidal-grammar"):
            thread.join(timeout=60)


@pytest.fixture(scope="session")
def server_pool():
    """Live ``tidal serve`` processes shared by name across the run (tests/live_server.py's ServerPool)."""
    from live_server import ServerPool

    pool = ServerPool()
    yield pool
    pool.stop_all()


SERVERS_AHEAD = 2  # modules whose servers start while the current module runs


@pytest.fixture(scope="session")
def _module_servers(request, server_pool):
    """The modules that declare ``SERVER_ARGS`` and use ``server``, in the order they run."""
    order: list = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "SERVER_ARGS") and "server" in item.fixturenames \
                and module not in order:
            order.append(module)
    return order


@pytest.fixture(scope="module")
def server(request, server_pool, _module_servers):
    """The module's own live server, started from its ``SERVER_ARGS`` and stopped after the module.

    The next modules' servers start meanwhile (through the pool's start slots), so a module rarely
    waits for its server to start.
    """
    module = request.module
    if not hasattr(module, "SERVER_ARGS"):
        pytest.fail(f"{module.__name__} uses the server fixture but declares no SERVER_ARGS")
    if module in _module_servers:
        at = _module_servers.index(module)
        for upcoming in _module_servers[at + 1:at + 1 + SERVERS_AHEAD]:
            server_pool.start(upcoming.__name__, *upcoming.SERVER_ARGS)
    live = server_pool.get(module.__name__, *module.SERVER_ARGS)
    yield live
    server_pool.release(module.__name__)
