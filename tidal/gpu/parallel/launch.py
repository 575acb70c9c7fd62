"""Starting a tensor-parallel rank process: where a replica's ranks meet, and the ``Popen`` of one rank.

Used by rank 0 (tidal/gpu/parallel/group.py) and by a headless node's launcher
(tidal/gpu/parallel/worker.py); imports nothing of the model, so neither pulls the other in.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tidal.wire import EngineConfig, encode_frame, engine_process_env

DEFAULT_MASTER_PORT = 29500  # torch.distributed's


def rendezvous_port(config: EngineConfig) -> int:
    """Replica k meets at ``--master-port`` + k; on one node without a port, at a free one."""
    if config.master_port is not None:
        return config.master_port + config.data_parallel_rank
    if config.nnodes > 1:
        return DEFAULT_MASTER_PORT + config.data_parallel_rank
    with socket.socket() as s:
        s.bind((config.master_addr, 0))
        return s.getsockname()[1]


def start_rank(config: EngineConfig, rank: int, master_port: int | str) -> subprocess.Popen:
    """Start rank ``rank`` of ``config``'s replica; its stdin stays open for as long as this process lives."""
    per_node = config.tensor_parallel_size // config.nnodes
    # a headless node's ranks get the engine's OpenMP wait here, not from a frontend
    env = engine_process_env(dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % per_node),
                                  WORLD_SIZE=str(config.tensor_parallel_size), MASTER_ADDR=config.master_addr,
                                  MASTER_PORT=str(master_port), TIDAL_TP_PARENT=str(os.getpid())))
    process = subprocess.Popen([sys.executable, "-m", "tidal.gpu.parallel.worker"], stdin=subprocess.PIPE, env=env)
    process.stdin.write(encode_frame(config))
    process.stdin.flush()
    return process
