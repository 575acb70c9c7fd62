"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, returns logits.

The only engine module that touches torch tensors on the hot path besides the model and
the sampler. The attention backend (torch on CPU, Triton kernels on CUDA) is chosen once,
in ``tidal.gpu.model.attention.select_attention_backend``. On CUDA with the Triton kernels, decode-only
steps replay CUDA graphs captured here at start (``tidal.gpu.cuda_graphs``; ``--enforce-eager``
turns them off).
"""

from __future__ import annotations

import array
import itertools
import logging

import msgspec
import torch

from tidal.gpu.cpu import huge_pages
from tidal.gpu.model.attention import select_attention_backend
from tidal.gpu.cuda_graphs import CudaGraphs, capture_sizes
from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.config import ModelConfig
from tidal.gpu.model.lora import LoraSlots
from tidal.gpu.model.loader import checkpoint_weight_dtype, load_model, quantized_weights_note, resolve_model_dir
from tidal.gpu.model.precision import resolve_precision
from tidal.gpu.model.quantization import gguf_activation_bits, resolve_on_the_fly
from tidal.gpu.sequence import Sequence
from tidal.gpu.model.synthetic_model import SYNTHETIC_MODEL_NAME, SyntheticModel
from tidal.wire import EngineConfig

log = logging.getLogger("tidal.engine")

# A CPU step whose linears multiply fewer than this many weights (rows x the weights one row reads) runs on one
# thread: a second one's fork, join and spin cost more than it saves, and its spinning holds a core the frontend
# and the client need (served tiny w4a8 c=1, ~4.9 M: 3-13% more tok/s, the engine's CPU per token 920 -> 590 us).
ONE_THREAD_MACS = 8_000_000


def resolve_device(name: str, data_parallel_rank: int = 0) -> torch.device:
    """``auto`` and ``cuda`` give data-parallel replica k the k-th GPU (wrapping); ``cuda:N`` is as given."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", data_parallel_rank % torch.cuda.device_count())
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return device


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0, extra_kv_bytes_per_block: int = 0):
        """``extra_kv_bytes_per_block``: what another cache indexed by the same blocks costs per block (a
        draft model's, ``speculative.draft``): --kv-cache-memory pays for both."""
        self.config = config
        per_node = config.tensor_parallel_size // config.nnodes  # 1 without tensor parallelism
        self.device = resolve_device(config.device, config.data_parallel_rank * per_node + tp_rank % per_node)
        self.model_dir = resolve_model_dir(config.model)
        # a decode-only batch's prefill fields (query starts [0], no lengths, no tables), shared by every such batch
        self._no_prefills = (torch.zeros(1, dtype=torch.int32, device=self.device),
                             torch.empty(0, dtype=torch.int32, device=self.device),
                             torch.empty((0, 0), dtype=torch.int32, device=self.device))
        # linear weights in bf16 with float32 activations: the AVX2 path on a bf16 checkpoint (precision.py)
        precision = resolve_precision(config.dtype, self.device, checkpoint_weight_dtype(self.model_dir))
        self.dtype, self.linear_weights, self.dtype_reason = precision.dtype, precision.linear_weights, precision.reason
        quantize, why = resolve_on_the_fly(config.quantization, config.dtype, self.device)
        if why:
            config = self.config = msgspec.structs.replace(config, quantization=quantize)
            self.dtype_reason += "; " + why
        self.tp = None  # this rank's parallel.TensorParallel, with --tensor-parallel-size > 1
        if config.tensor_parallel_size > 1:
            from tidal.gpu.parallel.group import join_group

            self.tp = join_group(config, tp_rank, self.model_dir, self.dtype, self.device)
            self.dtype, config = self.tp.dtype, self.tp.config  # rank 0's: every rank computes alike
            self.linear_weights = self.dtype  # and plain weights: ranks' hosts may differ (no AVX2 path under TP)
            self.config = config
        log.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), self.dtype_reason)
        self.attention = select_attention_backend(config.attention_backend, self.device)
        if config.model == SYNTHETIC_MODEL_NAME:
            self.model_config = ModelConfig.from_dir(self.model_dir)
            self.model = SyntheticModel(self.model_config, self.device)
        else:
            activation_bits, why = gguf_activation_bits(config.dtype, self.device)
            self.model, self.model_config = load_model(self.model_dir, self.dtype, self.device, self.attention,
                                                       self.tp, self.linear_weights, config.quantization,
                                                       activation_bits)
            if why and getattr(self.model, "gguf_note", None) and any(  # a GGUF whose integers stayed integers
                    getattr(m, "int_packed", None) is not None and m.int_packed.activation_bits == 8
                    for m in self.model.modules()):
                self.dtype_reason += "; " + why
            self.dtype_reason += quantized_weights_note(self.model)
        mc = self.model_config
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if config.max_model_len and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        # each rank caches only its own KV heads; --kv-cache-memory is per rank
        num_kv_heads = mc.num_kv_heads if self.tp is None else self.model.model.layers[0].self_attn.num_kv_heads
        bytes_per_block = 2 * mc.num_layers * self.block_size * num_kv_heads * mc.head_dim * self.dtype.itemsize
        self.kv_bytes_per_block = bytes_per_block
        self.num_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_bytes // (bytes_per_block + extra_kv_bytes_per_block))
        if self.tp is not None:
            self.num_blocks = self.tp.broadcast_int(self.num_blocks)  # rank 0 decides; all ranks agree
            if self.tp.rank == 0:  # each batch goes to the other ranks as it is built
                self._prepare = self.tp.broadcasting(self._prepare)
        if self.num_blocks * self.block_size < self.max_model_len:
            # a request longer than the whole cache could never run: cap the length instead
            log.warning("KV cache holds %d tokens: max_model_len lowered from %d",
                        self.num_blocks * self.block_size, self.max_model_len)
            self.max_model_len = self.num_blocks * self.block_size
        shape = (self.num_blocks, self.block_size, num_kv_heads, mc.head_dim)
        if self.device.type == "cpu":  # in huge pages, like the weights: a step reads its blocks wherever they are
            caches = huge_pages.zeros(shape, self.dtype, 2 * mc.num_layers)
        else:
            caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * mc.num_layers)]
        self.kv_caches = list(zip(caches[::2], caches[1::2], strict=True))
        self.cuda_graphs = self._capture_cuda_graphs()
        # LoRA: every decoder Linear gets max_loras slots of adapters (model/lora.py)
        self.lora_slots = self._lora_slots()
        # the weights one row multiplies, for ONE_THREAD_MACS (None: the step's size never changes the threads)
        self.row_macs = _row_macs(mc) if self.device.type == "cpu" and self.tp is None else None

    def _lora_slots(self) -> LoraSlots | None:
        if not self.config.max_loras:
            return None
        if self.tp is not None or isinstance(self.model, SyntheticModel):
            raise ValueError("LoRA adapters run on a real model in one process (no tensor parallelism, not tidal-test)")
        return LoraSlots(self.model, self.config.max_loras, self.config.max_lora_rank)

    def _capture_cuda_graphs(self) -> CudaGraphs | None:
        """Decode graphs on CUDA with the Triton kernels (the torch backend's decode plan reads
        lengths on the host, so it cannot be captured), unless ``--enforce-eager``.

        Not with tensor parallelism (a ``tp`` group, tidal/gpu/parallel/group.py): every rank would have
        to replay the same padded size for the collectives to match, and that is untested on GPUs.
        """
        if (self.device.type != "cuda" or self.config.enforce_eager or self.attention.name != "triton"
                or isinstance(self.model, SyntheticModel) or getattr(self, "tp", None) is not None):
            return None
        graphs = CudaGraphs(self.model, self.kv_caches, capture_sizes(self.config.max_num_seqs),
                            -(-self.max_model_len // self.block_size), self.block_size, self.device)
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def execute(self, entries: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one forward pass; return the logits of the sequences that sample this step
        (those whose chunk reaches their last token, in entry order; a sequence with a speculative
        proposal has one row per token it verifies)."""
        batch = self._prepare(entries)
        threads = torch.get_num_threads()
        if self.row_macs is None or threads == 1 or batch.input_ids.shape[0] * self.row_macs >= ONE_THREAD_MACS:
            return self._forward(batch)
        torch.set_num_threads(1)  # ~0.1 us each way; set back after, so an in-process caller keeps its threads
        try:
            return self._forward(batch)
        finally:
            torch.set_num_threads(threads)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.cuda_graphs is not None and batch.lora is None:  # graphs are captured without adapters
            logits = self.cuda_graphs.run(batch)
            if logits is not None:
                return logits
        if batch.logits_indices.shape[0] == batch.input_ids.shape[0]:  # every row samples (all decodes): rows in order
            logits = self.model.decode_logits(batch, self.kv_caches)
            return logits if logits is not None else self.model.compute_logits(self.model(batch, self.kv_caches))
        return self.model.compute_logits(self.model(batch, self.kv_caches)[batch.logits_indices])

    def _prepare(self, entries: list[tuple[Sequence, int]]) -> ForwardBatch:
        bs = self.block_size
        num_decodes = 0
        for _, num_new in entries:  # the leading one-token entries are the decodes
            if num_new != 1:
                break
            num_decodes += 1
        decodes, prefills = entries[:num_decodes], entries[num_decodes:]
        # decodes, one row each (the sequence's one uncomputed token), in flat loops
        positions = [seq.num_computed_tokens for seq, _ in decodes]
        input_ids = [seq.token_ids[p] for (seq, _), p in zip(decodes, positions)]
        decode_tables = [seq.block_table for seq, _ in decodes]
        slots = [table[p // bs] * bs + p % bs for table, p in zip(decode_tables, positions)]
        decode_lens = [p + 1 for p in positions]
        # the chunk reaches the end: sample the next token
        logits_rows = [i for i, ((seq, _), n) in enumerate(zip(decodes, decode_lens)) if n == len(seq.token_ids)]
        prefill_tables: list[list[int]] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        for seq, num_new in prefills:
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            draft = seq.draft_token_ids
            if draft:  # the last token and a speculative proposal: every row's logits verify one token
                input_ids.append(seq.token_ids[start])
                input_ids.extend(draft)
                logits_rows.extend(range(len(input_ids) - num_new, len(input_ids)))
            else:
                input_ids.extend(seq.token_ids[start:end])
                if end == seq.num_tokens:
                    logits_rows.append(len(input_ids) - 1)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            prefill_tables.append(table)
            q_lens.append(num_new)
            seq_lens.append(end)
        # Two tensors per pass (one per dtype), the fields are views of them: at batch 1 each
        # tensor built from a list costs about as much as the step's scheduling.
        num_rows, num_sampled = len(input_ids), len(logits_rows)
        rows = _tensor("q", input_ids + positions + slots + logits_rows, self.device)
        decode_width = max(map(len, decode_tables), default=0)
        ints = list(itertools.chain.from_iterable(t + [0] * (decode_width - len(t)) for t in decode_tables))
        ints += decode_lens
        if not prefills:  # the steady state: the prefill fields are shared empty tensors, not views to make
            ints = _tensor("i", ints, self.device)
            tables, lens = ints[:num_decodes * decode_width], ints[num_decodes * decode_width:]
            starts, prefill_lens, prefill_tables_2d = self._no_prefills
        else:
            q_start = list(itertools.accumulate(q_lens, initial=0))
            prefill_width = max(map(len, prefill_tables))
            ints += q_start
            ints += seq_lens
            ints.extend(itertools.chain.from_iterable(t + [0] * (prefill_width - len(t)) for t in prefill_tables))
            ints = _tensor("i", ints, self.device)
            ints_at = itertools.accumulate((num_decodes * decode_width, num_decodes, len(q_start), len(seq_lens),
                                            len(prefill_tables) * prefill_width), initial=0)
            tables, lens, starts, prefill_lens, prefill_tables_flat = (
                ints[a:b] for a, b in itertools.pairwise(ints_at))
            prefill_tables_2d = prefill_tables_flat.view(len(prefill_tables), prefill_width)
        return ForwardBatch(
            input_ids=rows[:num_rows],
            positions=rows[num_rows:2 * num_rows],
            slot_mapping=rows[2 * num_rows:3 * num_rows],
            num_decodes=num_decodes,
            decode_block_tables=tables.view(num_decodes, decode_width),
            decode_seq_lens=lens,
            decode_max_seq_len=max(decode_lens, default=0),
            prefill_query_lens=q_lens,
            prefill_seq_lens=seq_lens,
            prefill_query_start_loc=starts,
            prefill_seq_lens_tensor=prefill_lens,
            prefill_block_tables=prefill_tables_2d,
            logits_indices=rows[3 * num_rows:3 * num_rows + num_sampled],
            lora=None if self.lora_slots is None else self.lora_slots.rows(
                [(self.lora_slots.slot_of.get(seq.adapter_id), n) for seq, n in entries], num_rows),
        )


def _row_macs(mc: ModelConfig) -> int:
    """Multiply-adds of one token through the decoder's linears and the LM head."""
    attention = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)  # q, k, v, o
    return mc.num_layers * (attention + 3 * mc.hidden_size * mc.intermediate_size) + mc.hidden_size * mc.vocab_size


def _tensor(typecode: str, values: list[int], device: torch.device) -> torch.Tensor:
    """A 1-D int64 ("q") or int32 ("i") tensor of ``values``: through array.array, which converts
    a list of ints several times faster than torch.tensor(list)."""
    dtype = torch.int64 if typecode == "q" else torch.int32
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    tensor = torch.frombuffer(array.array(typecode, values), dtype=dtype)
    return tensor if device.type == "cpu" else tensor.to(device)
