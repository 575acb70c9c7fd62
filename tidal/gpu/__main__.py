"""Engine process entry point: ``python -m tidal.gpu`` (started by the frontend).

stdin carries frames from the frontend (the first one is the EngineConfig); frames to the
frontend go to the original stdout. Anything else that prints (libraries, warnings) is
sent to stderr so it can never corrupt the frame stream.
"""

import atexit
import os
import sys


def main() -> int:
    out_fd = os.dup(1)
    os.dup2(2, 1)  # stray prints go to stderr
    sys.stdout = sys.stderr
    from tidal.gpu.process import run_engine_process

    return run_engine_process(in_fd=0, out_fd=out_fd)


def exit_now(rc: int) -> None:
    """Leave without the interpreter's finalization: the exit handlers (a tensor-parallel group's
    teardown), the streams flushed, then ``os._exit``.

    A daemon thread may still be inside native code when the step loop ends (xgrammar building
    its tokenizer info at start, an abandoned grammar compile). Finalization runs C++ static
    destructors under it, and one that meets a live ``std::thread`` aborts the process
    ("terminate called without an active exception", exit -6) after a clean shutdown.
    """
    atexit._run_exitfuncs()
    sys.stderr.flush()
    sys.__stderr__.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_now(main())
