"""Engine process entry point: ``python -m tidal.gpu`` (started by the frontend).

stdin carries frames from the frontend (the first one is the EngineConfig); frames to the
frontend go to the original stdout. Anything else that prints (libraries, warnings) is
sent to stderr so it can never corrupt the frame stream.
"""

import os
import sys


def main() -> int:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr
    sys.stdout = sys.stderr
    from tidal.gpu.process import run_engine_process

    return run_engine_process(in_fd=0, out_fd=out_fd)


if __name__ == "__main__":
    sys.exit(main())
