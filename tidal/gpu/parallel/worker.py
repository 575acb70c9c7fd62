"""Tensor-parallel ranks other than rank 0: ``python -m tidal.gpu.parallel.worker``, and a headless node's launcher.

A rank process is started by rank 0 (the ranks of node 0) or by a node launcher (``--node``: the
ranks of a headless node, ``tidal serve --node-rank K``), with the EngineConfig frame on stdin and
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. It joins its replica's group,
loads its shard, allocates its KV cache, then repeats: receive the step's batch from rank 0, run
the same forward (its all-reduces and the logits gather), until rank 0 broadcasts shutdown.

A rank dies with its parent: PR_SET_PDEATHSIG on Linux, and EOF on its stdin, which the parent
holds open for its whole life, however it ends.

Nothing here imports torch at module level: the node launcher only starts and watches processes.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from tidal.gpu.pipe_io import read_config
from tidal.gpu.parallel.launch import rendezvous_port, start_rank
from tidal.wire import EngineConfig

STABLE_AFTER = 60.0  # seconds of life after which a replica's ranks' run of failures is forgotten


# ---------------------------------------------------------------------- one rank


def run_rank() -> int:
    _die_with_parent()
    config = read_config(0)
    threading.Thread(target=_exit_at_eof, args=(0,), name="tidal-tp-parent", daemon=True).start()
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=os.environ.get("TIDAL_ENGINE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    if "TIDAL_ENGINE_LOG_LEVEL" not in os.environ:  # the first start's kernel build is progress worth seeing
        logging.getLogger("tidal.gpu.cpu.kernels").setLevel(logging.INFO)
    import torch

    from tidal.gpu.model_runner import ModelRunner

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    try:
        runner = ModelRunner(config, tp_rank=rank)
    except (ValueError, OSError) as exc:  # a bad flag or path on this node needs no traceback
        logging.getLogger("tidal.engine").error("cannot start: %s: %s", type(exc).__name__, exc)
        return 1
    tp = runner.tp
    try:
        with torch.inference_mode():
            while (batch := tp.receive_batch()) is not None:
                hidden = runner.model(batch, runner.kv_caches)
                runner.model.compute_logits(hidden[batch.logits_indices])  # sends this rank's vocab slice
    except RuntimeError as exc:  # a peer is gone (gloo: its socket closed; NCCL: the timeout): one line
        logging.getLogger("tidal.engine").error("leaving: a collective failed: %s", str(exc).splitlines()[0])
        logging.shutdown()
        os._exit(1)  # the group is broken: its teardown (atexit) would only wait on the dead peer
    tp.close()
    return 0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != os.environ.get("TIDAL_TP_PARENT", str(os.getppid())):
        os._exit(1)  # the parent died before the line above


def _exit_at_eof(fd: int) -> None:
    while os.read(fd, 1 << 12):
        pass
    os._exit(1)



# ---------------------------------------------------------------------- a headless node


def run_node(config: EngineConfig, num_replicas: int, max_restarts: int) -> int:
    """Start this node's ranks of every replica and keep them up; exit when rank 0 shuts them down.

    A replica whose ranks fail (its rank 0 died, or one of ours did) has them stopped and, while
    ``max_restarts`` allows, started again after a backoff, to join the replica's next rendezvous.
    Returns 0 when every replica was shut down cleanly, 3 when one failed for good.
    """
    log = logging.getLogger("tidal.node")
    per_node = config.tensor_parallel_size // config.nnodes
    ranks = range(config.node_rank * per_node, (config.node_rank + 1) * per_node)
    # as on node 0: --engine-threads (or this node's share of its cores) per replica, split among its ranks
    threads = max(1, (config.num_threads or (os.cpu_count() or 1) // num_replicas) // per_node)
    configs = [msgspec.structs.replace(config, data_parallel_rank=k, num_threads=threads)
               for k in range(num_replicas)]
    running = {k: [start_rank(c, r, rendezvous_port(c)) for r in ranks] for k, c in enumerate(configs)}
    started = dict.fromkeys(running, time.monotonic())
    failures = dict.fromkeys(running, 0)  # in a row: a life of STABLE_AFTER seconds forgets them
    code = 0
    try:
        while running:
            time.sleep(0.2)
            for k, processes in list(running.items()):
                codes = [p.poll() for p in processes]
                if any(c not in (None, 0) for c in codes):
                    _stop(processes)
                    if time.monotonic() - started[k] > STABLE_AFTER:
                        failures[k] = 0
                    failures[k] += 1
                    if failures[k] > max_restarts:
                        log.error("replica %d: ranks %s failed and --engine-restarts %d is used up; giving up",
                                  k, list(ranks), max_restarts)
                        del running[k]
                        code = 3
                        continue
                    delay = min(30.0, 2.0 ** (failures[k] - 1))  # as the frontend's replicas: 1, 2, 4 ... s
                    log.warning("replica %d: a rank failed; restarting its ranks in %.0f s", k, delay)
                    time.sleep(delay)
                    running[k] = [start_rank(configs[k], r, rendezvous_port(configs[k])) for r in ranks]
                    started[k] = time.monotonic()
                elif all(c == 0 for c in codes):
                    del running[k]  # rank 0 shut the replica down
    finally:
        for processes in running.values():
            _stop(processes)
    return code


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.gpu.parallel.worker")
    parser.add_argument("--node", action="store_true", help="launch a headless node's ranks (config on stdin)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--restarts", type=int, default=0)
    args = parser.parse_args()
    if not args.node:
        return run_rank()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # through run_node's finally: its ranks stop too
    config = read_config(0)
    return run_node(config, args.replicas, args.restarts)


if __name__ == "__main__":
    sys.exit(main())
