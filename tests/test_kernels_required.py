"""With TIDAL_REQUIRE_KERNELS=1 (set by .ci/run) a CPU kernel build that fails stops the suite with the
compiler's own message, instead of turning the kernel tests into skips (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# gcc itself, failing every compile on a forced include that does not exist: the message is the compiler's
BROKEN_COMPILER = """#!/bin/sh
case " $* " in *" -c "*) exec g++ "$@" -include /nonexistent/tidal_broken_on_purpose.h ;; esac
exec g++ "$@"
"""


def test_a_failed_kernel_build_fails_the_suite_with_the_compilers_message(tmp_path):
    compiler = tmp_path / "broken-g++"
    compiler.write_text(BROKEN_COMPILER)
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), "TIDAL_REQUIRE_KERNELS": "1",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}  # an empty cache: the build must run
    env.pop("TIDAL_CPU_KERNELS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "tests/test_boundaries.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "TIDAL_REQUIRE_KERNELS=1 but the CPU kernels did not build" in output
    assert "fatal error: /nonexistent/tidal_broken_on_purpose.h: No such file or directory" in output
