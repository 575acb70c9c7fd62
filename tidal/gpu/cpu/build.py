"""``tidal build-kernels``: build the C++ CPU kernels now, so the first ``tidal serve`` does not.

Run as ``python -m tidal.gpu.cpu.build`` (the CLI starts it as a child: the frontend never imports
torch). Prints where the build is cached and how long it took; exits 1, with the reason logged, when
the kernels cannot be built here (the server then uses its plain-torch path).
"""

from __future__ import annotations

import logging
import sys
import time


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the build's progress lines
    from tidal.gpu.cpu import kernels

    started = time.perf_counter()
    ops = kernels.load_cpu_ops()
    elapsed = time.perf_counter() - started
    if ops is None:
        print("tidal build-kernels: the CPU kernels are not available here (the reason is above); "
              "tidal serve will use the plain torch path", file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {elapsed:.1f} s, cached in {kernels.cache_directory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
