"""A replica's tensor-parallel group: joining it, the collectives the layers use, each step's batch.

With ``--tensor-parallel-size N`` a replica is N rank processes. Rank 0 is the engine process: it
owns the scheduler, the sampler and the pipes, starts the other ranks of its node
(``tidal.gpu.parallel.worker``) and, once per step, broadcasts the batch the model runner built. Ranks on
other nodes are started by a headless ``tidal serve --node-rank K``. All of them meet through
torch.distributed's env:// rendezvous at ``MASTER_ADDR:MASTER_PORT`` (+ the replica's index).

Two groups, because waiting and computing need different timeouts:

* the default group (gloo, ``CONTROL_TIMEOUT``): the start handshake and each step's batch as flat
  int64 tensors: one fixed-size broadcast (a header, and the payload when it fits, as a decode
  batch's does), a second for a longer payload. Ranks > 0 wait in it while the engine is idle,
  however long that is;
* ``group`` (gloo on CPU, NCCL on CUDA, ``COLLECTIVE_TIMEOUT``): the forward's all-reduces and the
  logits gather. A rank that dies mid-step makes the others' collective fail: at once on gloo (its
  sockets close), within the timeout otherwise. Rank 0 also watches its child ranks and fails the
  engine as soon as one exits, busy or idle.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.loader import quantization_groups
from tidal.gpu.parallel.layers import check_quantized_split, check_tensor_parallel
from tidal.gpu.model.synthetic_model import SYNTHETIC_MODEL_NAME
from tidal.gpu.parallel.launch import rendezvous_port, start_rank
from tidal.wire import EngineConfig, decode_config

log = logging.getLogger("tidal.engine")

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # one all-reduce waiting for a lagging (or dead) rank
CONTROL_TIMEOUT = timedelta(days=365)  # an idle engine sends nothing; its ranks wait for the next step

_HEADER = 8  # op, tokens, decodes, decode table width, prefills, prefill table width, sampled rows, max len
_INLINE = 1016  # payload ints that ride in the header's broadcast (a decode batch of ~100): one round trip
_SHUTDOWN, _STEP = 0, 1


def ranks_per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def check_config(config: EngineConfig, model_dir: str, device: torch.device) -> None:
    """Raise ``ValueError`` (one line) unless this model splits over ``config``'s ranks, nodes and devices."""
    size = config.tensor_parallel_size
    if config.model == SYNTHETIC_MODEL_NAME:
        raise ValueError(f"--tensor-parallel-size needs a model with weights; {SYNTHETIC_MODEL_NAME} has none")
    if size % config.nnodes:
        raise ValueError(f"--nnodes {config.nnodes} does not divide --tensor-parallel-size {size}")
    model_config = ModelConfig.from_dir(model_dir)
    check_tensor_parallel(model_config, size)
    groups = quantization_groups(model_dir, config.quantization)
    if groups is not None:
        check_quantized_split(model_config, size, *groups)
    if device.type == "cuda":  # NCCL needs a GPU per rank
        per_node, gpus = ranks_per_node(config), torch.cuda.device_count()
        if config.device.startswith("cuda:"):
            raise ValueError(f"--device {config.device} puts every rank on one GPU; give --device cuda "
                             f"(rank r of replica k takes GPU k x {per_node} + r)")
        if gpus < per_node:
            raise ValueError(f"--tensor-parallel-size {size} needs {per_node} GPUs per node; torch sees {gpus}")


class TensorParallel:
    """One rank's handle on its replica's group: what the parallel layers and the model runner call."""

    def __init__(self, rank: int, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                 processes: dict[int, object]) -> None:
        self.rank = rank
        self.size = config.tensor_parallel_size
        self.config = config  # rank 0's settings (ranks > 0 keep their own model path, device, threads)
        self.dtype = dtype
        self.device = device
        self.group = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
        self.processes = processes  # rank -> Popen: the ranks this process started (rank 0 only)
        self.on_rank_death = _exit_now  # process.py replaces it once it can tell the frontend why
        self._closed = False
        for r, process in processes.items():
            threading.Thread(target=self._watch, args=(r, process), name=f"tidal-tp-watch-{r}", daemon=True).start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ the layers' collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest over the ranks (at load: a row shard's per-channel quantization scale)."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Every rank's [rows, vocab slice] logits side by side on rank 0 (padding cut); None elsewhere."""
        if logits.shape[0] == 0:  # every rank knows the batch: all skip the gather alike
            return logits.new_empty((0, vocab_size)) if self.rank == 0 else None
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    # ------------------------------------------------------------------ the step's batch

    def broadcasting(self, prepare):
        """``prepare`` (entries -> ForwardBatch) that also sends each batch to the other ranks."""
        def prepare_and_send(entries):
            batch = prepare(entries)
            self.send_batch(batch)
            return batch
        return prepare_and_send

    def send_batch(self, batch: ForwardBatch) -> None:
        header, payload = pack_batch(batch)
        first = torch.zeros(_HEADER + _INLINE, dtype=torch.int64)
        first[:_HEADER] = header
        if payload.shape[0] <= _INLINE:
            first[_HEADER:_HEADER + payload.shape[0]] = payload
            dist.broadcast(first, 0)
        else:  # a long prefill: the payload follows on its own
            dist.broadcast(first, 0)
            dist.broadcast(payload, 0)

    def receive_batch(self) -> ForwardBatch | None:
        """The next step's batch from rank 0; None when rank 0 says shut down."""
        first = torch.empty(_HEADER + _INLINE, dtype=torch.int64)
        dist.broadcast(first, 0)
        header = first[:_HEADER]
        if header[0].item() == _SHUTDOWN:
            return None
        size = batch_payload_size(header)
        if size <= _INLINE:
            payload = first[_HEADER:_HEADER + size]
        else:
            payload = torch.empty(size, dtype=torch.int64)
            dist.broadcast(payload, 0)
        return unpack_batch(header, payload, self.device)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (what rank 0 decides, e.g. the number of KV blocks)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, 0)
        return int(tensor.item())

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Rank 0: tell every rank to exit and reap the ones it started. Any rank: leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.rank == 0:
            try:
                dist.broadcast(torch.zeros(_HEADER + _INLINE, dtype=torch.int64), 0)  # op 0: shut down
            except Exception:  # a rank is gone already: the ones left die with their stdin
                pass
            for process in self.processes.values():
                try:
                    process.stdin.close()
                    process.wait(timeout=5)
                except Exception:
                    process.kill()
                    process.wait()
        dist.destroy_process_group()

    def dead_rank(self, wait: float = 1.0) -> str | None:
        """Which rank this process started has exited, if one has or does within ``wait`` seconds.

        A failed collective is most often a dead peer, and its exit says more than the socket error.
        (``returncode`` is set by the watch thread: ``poll()`` cannot see past its ``wait()``.)
        """
        deadline = time.monotonic() + wait
        while True:
            for r, process in self.processes.items():
                if process.returncode is not None:
                    return f"tensor-parallel rank {r} (pid {process.pid}) exited with {_describe(process.returncode)}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def _watch(self, rank: int, process) -> None:
        code = process.wait()
        if not self._closed:
            self.on_rank_death(f"tensor-parallel rank {rank} (pid {process.pid}) exited with {_describe(code)}")


def join_group(config: EngineConfig, rank: int, model_dir: str, dtype: torch.dtype,
               device: torch.device) -> TensorParallel:
    """Join (rank 0: start, then join) the replica's group; returns this rank's handle.

    Rank 0 checks that the model splits, starts its node's other ranks, and sends them its settings
    with the dtype resolved, so that every rank computes alike whatever its host would pick.
    """
    per_node = ranks_per_node(config)
    processes = {}
    if rank == 0:
        check_config(config, model_dir, device)
        threads = max(1, (config.num_threads or os.cpu_count() or 1) // per_node)
        torch.set_num_threads(threads)  # the node's ranks share its cores
        config = msgspec.structs.replace(config, num_threads=threads, dtype=str(dtype).removeprefix("torch."))
        os.environ["MASTER_ADDR"] = config.master_addr
        os.environ["MASTER_PORT"] = str(rendezvous_port(config))
        processes = {r: start_rank(config, r, os.environ["MASTER_PORT"]) for r in range(1, per_node)}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=config.tensor_parallel_size,
                            timeout=CONTROL_TIMEOUT)
    settings = [msgspec.msgpack.encode(config) if rank == 0 else None]
    dist.broadcast_object_list(settings, 0)
    if rank != 0:  # rank 0's settings; this node's own model path, device and threads
        own = config
        config = msgspec.structs.replace(decode_config(settings[0]), model=own.model, device=own.device,
                                         num_threads=own.num_threads, node_rank=own.node_rank)
        dtype = getattr(torch, config.dtype)
    return TensorParallel(rank, config, dtype, device, processes)


# ---------------------------------------------------------------------- the batch as flat int64


def pack_batch(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = (batch.input_ids, batch.positions, batch.slot_mapping, batch.decode_block_tables,
               batch.decode_seq_lens, batch.prefill_query_start_loc, batch.prefill_seq_lens_tensor,
               batch.prefill_block_tables, batch.logits_indices)
    header = torch.tensor([_STEP, batch.num_tokens, batch.num_decodes, batch.decode_block_tables.shape[1],
                           batch.num_prefills, batch.prefill_block_tables.shape[1], batch.logits_indices.shape[0],
                           batch.decode_max_seq_len], dtype=torch.int64)
    payload = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in tensors])
    return header, payload


def _payload_sizes(header: torch.Tensor) -> list[int]:
    _, tokens, decodes, decode_width, prefills, prefill_width, sampled, _ = header.tolist()
    return [tokens, tokens, tokens, decodes * decode_width, decodes, prefills + 1, prefills,
            prefills * prefill_width, sampled]


def batch_payload_size(header: torch.Tensor) -> int:
    return sum(_payload_sizes(header))


def unpack_batch(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> ForwardBatch:
    _, _, decodes, decode_width, prefills, prefill_width, _, max_len = header.tolist()
    (input_ids, positions, slots, decode_tables, decode_lens, query_start, prefill_lens, prefill_tables,
     logits_indices) = payload.to(device).split(_payload_sizes(header))
    starts = query_start.tolist()
    i32 = torch.int32
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        num_decodes=decodes,
        decode_block_tables=decode_tables.to(i32).reshape(decodes, decode_width),
        decode_seq_lens=decode_lens.to(i32),
        decode_max_seq_len=max_len,
        prefill_query_lens=[b - a for a, b in zip(starts, starts[1:])],
        prefill_seq_lens=prefill_lens.tolist(),
        prefill_query_start_loc=query_start.to(i32),
        prefill_seq_lens_tensor=prefill_lens.to(i32),
        prefill_block_tables=prefill_tables.to(i32).reshape(prefills, prefill_width),
        logits_indices=logits_indices,
    )


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _exit_now(why: str) -> None:
    print(f"tidal engine: {why}; the replica stops", file=sys.stderr, flush=True)
    os._exit(1)
