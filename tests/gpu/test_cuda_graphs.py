"""CUDA graphs for decode steps (tidal/gpu/cuda_graphs.py).

On CPU: the captured sizes, the padding of a batch up to one, and a whole engine run through the
graph runner's static buffers (the graph replay swapped for running the model on those same
buffers, with the Triton kernels in the interpreter): the padding rows and the wide block table
must change no token. On CUDA: real capture and replay against eager, logits and greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from tidal.gpu.cuda_graphs import CudaGraphs, DecodeInputs, capture_sizes, padded_size
from tidal.gpu.engine import Engine
from tidal.gpu.forward_batch import ForwardBatch
from tidal.kernels import HAS_TRITON
from tidal.wire import AddRequest, EngineConfig, SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # above: eager


def test_a_batch_runs_the_next_captured_size_up():
    sizes = capture_sizes(100)
    assert [padded_size(sizes, n) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert padded_size(sizes, 101) is None


def _decode_batch(ids, positions, slots, tables, seq_lens) -> ForwardBatch:
    width = max(len(t) for t in tables)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        num_decodes=len(ids),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32), decode_max_seq_len=max(seq_lens),
        prefill_query_lens=[], prefill_seq_lens=[], prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens_tensor=torch.zeros(0, dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32), logits_indices=torch.arange(len(ids)))


def test_a_smaller_batch_after_a_larger_one_leaves_only_padding_rows_behind():
    inputs = DecodeInputs(max_size=8, max_blocks_per_seq=6, block_size=16, device=torch.device("cpu"))
    inputs.load(_decode_batch([5] * 7, [40] * 7, list(range(100, 107)), [[1, 2, 3]] * 7, [41] * 7), 8)
    small = _decode_batch([11, 12, 13], [3, 20, 33], [3, 36, 81], [[0], [1, 2], [4, 5, 6]], [4, 21, 34])

    inputs.load(small, 4)

    batch = inputs.batch(4)
    assert batch.num_decodes == 4 and batch.decode_block_tables.shape == (4, 6)  # the fixed width
    assert batch.input_ids[:3].tolist() == [11, 12, 13] and batch.positions[:3].tolist() == [3, 20, 33]
    assert batch.slot_mapping.tolist() == [3, 36, 81, -1]  # the padding row writes no K/V
    assert batch.decode_seq_lens.tolist() == [4, 21, 34, 1]
    assert batch.decode_block_tables[:3, :3].tolist() == [[0, 0, 0], [1, 2, 0], [4, 5, 6]]


class EagerReplay(CudaGraphs):
    """The graph runner with each replay swapped for the model run on the same static buffers."""

    def __init__(self, runner, sizes):
        super().__init__(runner.model, runner.kv_caches, sizes, -(-runner.max_model_len // runner.block_size),
                         runner.block_size, runner.device)
        self.replayed: list[tuple[int, int]] = []  # (real rows, captured size)

    def run(self, batch):
        logits = super().run(batch)
        if logits is not None:
            self.replayed[-1] = (batch.num_decodes, self.replayed[-1][1])
        return logits

    def _replay(self, size):
        self.replayed.append((0, size))
        return self._step(self.inputs.batch(size))


def generate(engine: Engine, max_tokens: list[int]) -> dict[int, list[int]]:
    prompts = [list(range(100, 100 + n)) for n in (5, 21, 40)]  # ragged: different block counts
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(AddRequest(i, prompt, SamplingParams(max_tokens=n, temperature=0.0), 0, 0.0))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else []:
            tokens[out.request_id].extend(out.token_ids)
    return tokens


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter would take over every kernel in this process; the CUDA tests below run")
def test_padded_static_buffers_give_the_eager_tokens():
    config = EngineConfig(model="tidal-tiny", dtype="float32", attention_backend="triton", num_kv_blocks=32,
                          block_size=16)
    max_tokens = [2, 5, 3]  # the batch shrinks 3 -> 2 -> 1 as requests finish
    eager = generate(Engine(config), max_tokens)
    engine = Engine(config)
    engine.runner.cuda_graphs = graphs = EagerReplay(engine.runner, [1, 4])

    assert generate(engine, max_tokens) == eager
    assert (3, 4) in graphs.replayed and (2, 4) in graphs.replayed and (1, 1) in graphs.replayed


# ---------------------------------------------------------------- on a GPU


@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_graph_replay_gives_the_eager_greedy_tokens_on_cuda():
    # float32: a padded batch may pick another GEMM algorithm, and in bf16 that can flip a near tie
    config = EngineConfig(model="tidal-tiny", dtype="float32", device="cuda", num_kv_blocks=64, block_size=16,
                          max_num_seqs=8)
    max_tokens = [6, 12, 9]
    eager = generate(Engine(msgspec_replace(config, enforce_eager=True)), max_tokens)
    engine = Engine(config)
    assert engine.runner.cuda_graphs is not None and engine.runner.cuda_graphs.sizes == [1, 2, 4, 8]

    assert generate(engine, max_tokens) == eager


@needs_cuda
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
# bf16: 3 rows eager and 4 rows replayed may round differently in the GEMMs (seen on CPU: 0.07 on
# logits of std ~3); attending to the wrong context or row would be off by whole units
@pytest.mark.parametrize("dtype, atol, rtol", [("float32", 1e-3, 1e-3), ("bfloat16", 0.25, 5e-2)])
def test_graph_replay_gives_the_eager_logits_on_cuda(dtype, atol, rtol):
    engine = Engine(EngineConfig(model="tidal-tiny", dtype=dtype, device="cuda", num_kv_blocks=64,
                                 block_size=16, max_num_seqs=4))
    runner = engine.runner
    inputs = runner.cuda_graphs.inputs
    batch = _decode_batch([11, 12, 13], [3, 20, 33], [3, 36, 81], [[0], [1, 2], [4, 5, 6]], [4, 21, 34])
    batch = ForwardBatch(**{k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()})
    for cache in (c for pair in runner.kv_caches for c in pair):
        cache.normal_()  # a context to attend to, not zeros

    with torch.inference_mode():
        eager = runner.model.compute_logits(runner.model(batch, runner.kv_caches))
        replayed = runner.cuda_graphs.run(batch)

    assert inputs.slot_mapping[3].item() == -1
    assert replayed.shape == (3, engine.runner.model_config.vocab_size)
    torch.testing.assert_close(replayed, eager, atol=atol, rtol=rtol)


def msgspec_replace(config: EngineConfig, **changes) -> EngineConfig:
    import msgspec

    return msgspec.structs.replace(config, **changes)
