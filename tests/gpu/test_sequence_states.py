"""Where a sequence is: one table (tidal.gpu.sequence.TRANSITIONS), one writer (Sequence.move_to),
called only by the scheduler, which owns every place a sequence waits. Pure Python, no model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tidal.gpu.block_manager import BlockManager
from tidal.gpu.scheduler import Scheduler
from tidal.gpu.sequence import IllegalTransition, Sequence, SequenceStatus
from tidal.wire import SamplingParams, StructuredOutput

GPU = Path(__file__).resolve().parents[2] / "tidal" / "gpu"
S = SequenceStatus


def make_seq(rid: int, structured: StructuredOutput | None = None) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[1, 2, 3, 4, 5], params=SamplingParams(
        max_tokens=2, structured=structured), priority=0, arrival_time=float(rid),
        detokenizer=None)  # type: ignore[arg-type]


class FakeGrammars:
    """Compiles finish when told to; remembers what it was asked to forget."""

    def __init__(self) -> None:
        self.compiled: set[int] = set()
        self.released: list[int] = []

    def submit(self, request_id, spec):
        pass

    def is_compiled(self, request_id):
        return request_id in self.compiled

    def start_matcher(self, request_id):
        return None

    def release(self, request_id):
        self.released.append(request_id)

    def accept(self, request_id, token_id):
        return False


def test_an_illegal_transition_raises():
    seq = make_seq(1)
    with pytest.raises(IllegalTransition, match="new -> running"):
        seq.move_to(S.RUNNING)  # never scheduled from outside the queue
    seq.move_to(S.WAITING)
    seq.move_to(S.FINISHED)
    for status in S:
        with pytest.raises(IllegalTransition):
            seq.move_to(status)  # FINISHED is final
    assert seq.status is S.FINISHED


def test_status_has_one_writer_and_the_scheduler_is_its_only_caller():
    writers, movers = [], []
    for path in GPU.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Attribute) and sub.attr == "status":
                            writers.append(path.name)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "move_to":
                movers.append(path.name)
    assert set(writers) == {"sequence.py"}
    assert set(movers) == {"scheduler.py"}


def test_finishing_asks_one_owner_wherever_the_sequence_waits():
    blocks = BlockManager(32, 4)
    grammars = FakeGrammars()
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, grammars=grammars)  # type: ignore[arg-type]
    compiling = make_seq(1, StructuredOutput("regex", "a+"))
    parent, fork, queued = make_seq(2), make_seq(3), make_seq(4)
    scheduler.add(compiling)
    scheduler.add(parent)
    scheduler.add(fork, parent=parent)
    assert (compiling.status, parent.status, fork.status) == (S.COMPILING, S.WAITING, S.FORKED)
    assert scheduler.has_work()
    scheduler.schedule()  # the parent runs; the grammar is still compiling
    scheduler.add(queued)
    assert (parent.status, queued.status) == (S.RUNNING, S.WAITING)
    for seq in (compiling, fork, queued, parent):
        scheduler.finish(seq, "abort")
        assert seq.status is S.FINISHED and seq.finish_reason == "abort"
    assert grammars.released == [1]
    assert not scheduler.compiling and not scheduler.waiting and not scheduler.running
    assert not any(scheduler.forks.values())
    assert blocks.num_used_blocks == 0 and not scheduler.has_work()


def test_a_fork_waits_for_its_parents_first_token_and_a_grammar_for_its_compile():
    grammars = FakeGrammars()
    scheduler = Scheduler(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64,
                          grammars=grammars)  # type: ignore[arg-type]
    constrained = make_seq(1, StructuredOutput("regex", "a+"))
    parent, fork = make_seq(2), make_seq(3)
    for seq in (constrained, parent):
        scheduler.add(seq)
    scheduler.add(fork, parent=parent)
    batch = scheduler.schedule()
    assert [seq for seq, _ in batch.entries] == [parent]
    grammars.compiled.add(1)
    scheduler.commit(batch, [7])  # the parent's first token releases its fork
    assert fork.status is S.WAITING and 2 not in scheduler.forks
    batch = scheduler.schedule()
    assert {seq.request_id for seq, _ in batch.entries} == {1, 2, 3}
    assert constrained.status is S.RUNNING and not scheduler.compiling


def test_one_token_list_the_prompt_and_output_read_it_back_live():
    import torch

    from tidal.gpu.sampler import apply_penalties

    seq = make_seq(1)
    output = seq.output_token_ids  # held across steps, as the sampler's batch holds it
    assert seq.prompt_token_ids == [1, 2, 3, 4, 5] and output == [] and not output
    seq.append_token(7)
    seq.token_ids.append(8)  # any append to the one list, however it came
    assert output == [7, 8] and output[-1] == 8 and output[1:] == [8] and len(output) == 2
    assert seq.prompt_token_ids[-2:] == [4, 5] and seq.num_tokens == 7 and output + [9] == [7, 8, 9]
    with pytest.raises(IndexError):
        output[2]
    # the penalties read the views exactly as they read lists
    params = [SamplingParams(max_tokens=2, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    by_view, by_list = torch.ones(1, 10), torch.ones(1, 10)
    apply_penalties(by_view, params, [output], [seq.prompt_token_ids])
    apply_penalties(by_list, params, [[7, 8]], [[1, 2, 3, 4, 5]])
    assert torch.equal(by_view, by_list) and by_view[0, 7] < 1.0
