"""The engine: requests in, one step at a time, outputs out. No I/O here.

One step is::

    apply_late_aborts()                        # last call: no pass starts with an aborted request
    batch  = scheduler.schedule()              # who runs, how many tokens each
    tokens = forward(batch)                    # one pass over the paged cache, one token per sampler
                                               # (logprobs captured and grammar masks applied here)
    apply_late_aborts()                        # the abort window: aborts that arrived mid-forward
    scheduler.commit(batch, tokens)            # append, advance grammars, release forks, check
                                               # stops, free what finished
    emit(...)                                  # detokenize, one RequestOutput per new token

``step()`` launches the next step's forward right after the commit, before emitting.

An abort is applied at whichever of the two abort calls comes first after it arrived, so a request
is in no pass launched after its abort arrived, and its blocks are free when the pass in flight at
its arrival ends: at most one step later by the step count (``stats().aborts_freed`` counts each
abort by that distance, docs/cancellation.md). Where
the device computes on its own (CUDA, tidal-test) the pass runs on a thread, so building and
sending one step's outputs overlaps the next step's pass, and only abort window + commit +
schedule run between two passes. On a CPU the pass is deferred to the step loop's own thread
and runs when the next ``step()`` asks for it: the same order, without thread hand-offs.

Outputs, first-schedule events and finished ids collect in a pending report that the
process loop sends after each step (``take_report``).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar
import torch
from tokenizers import Tokenizer

from tidal.gpu.adapters import Adapters
from tidal.gpu.block_manager import BlockManager
from tidal.gpu.model.lora import AdapterError
from tidal.gpu.detokenizer import IncrementalDetokenizer
from tidal.gpu.grammar import Grammars
from tidal.gpu.logprobs import CapturedLogprobs
from tidal.gpu.model_runner import ModelRunner
from tidal.gpu.sampler import Sampler, SamplingBatch, apply_penalties, is_penalised, make_generator
from tidal.gpu.speculative.draft import DraftProposer, draft_kv_bytes
from tidal.gpu.speculative.speculator import Speculator
from tidal.gpu.speculative.verify import Verdict, verify
from tidal.gpu.scheduler import ScheduledBatch, Scheduler
from tidal.gpu.sequence import Sequence
from tidal.gpu.model.synthetic_model import SyntheticModel
from tidal.gpu.sequence import SequenceStatus
from tidal.wire import (ABORT_STEP_BUCKETS, AbortRequests, AdapterLoaded, AddRequest, EngineConfig, EngineStats,
                        EngineTiming, FinishReason, LoadAdapter, Logprobs, Ready, RequestOutput, StepProgress,
                        StepReport, UnloadAdapter)

log = logging.getLogger("tidal.engine")


class Engine:
    def __init__(self, config: EngineConfig, passes: str | None = None):
        """``passes``: where forward passes run, a key of ``PASSES`` ("thread", "deferred" or
        "launched"); None picks by device (``_default_passes``). Tests and benchmarks compare them."""
        self.config = config
        torch.manual_seed(config.seed)  # unseeded requests draw from the global generator
        drafting = config.speculative is not None and config.speculative.method == "draft_model"
        # a draft model's KV cache shares the target's blocks: the cache's memory pays for both per block
        self.runner = ModelRunner(config, extra_kv_bytes_per_block=draft_kv_bytes(config) if drafting else 0)
        tokenizer_file = os.path.join(self.runner.model_dir, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):  # tokenizers' own error names no file
            raise FileNotFoundError(f"{self.runner.model_dir} has no tokenizer.json (the tokenizer): a model "
                                    "directory needs config.json, the *.safetensors weights and tokenizer.json, "
                                    "as save_pretrained writes them")
        self.tokenizer = Tokenizer.from_file(tokenizer_file)
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.grammars = Grammars(self.runner.model_dir, self.runner.model_config.vocab_size,
                                 sorted(self.eos_token_ids), config.grammar_compile_timeout,
                                 config.grammar_cache_bytes)
        self.grammars.warm_up()  # beside the rest of the start, not on the first constrained request's time
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, self.grammars, DraftProposer(config, self.runner.num_blocks) if drafting else None)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            by_priority=config.scheduling_policy == "priority",
            grammars=self.grammars,
            max_loras=config.max_loras,
            speculator=self.speculator,
        )
        # LoRA adapters (None: off); the --lora-modules are read and checked before the engine is ready
        self.adapters = None
        if self.runner.lora_slots is not None:
            self.adapters = Adapters(self.runner.model_config, self.runner.lora_slots, config.max_lora_rank,
                                     config.max_cpu_loras or config.max_loras)
            for spec in config.lora_modules:
                self.adapters.register(spec)
        self.sampler = Sampler()
        self.sequences: dict[int, Sequence] = {}  # the live ones; where each waits is the scheduler's
        self.num_steps = 0
        self._started: list[int] = []
        self._outputs: list[RequestOutput] = []
        self._finished: list[int] = []
        self._dirty = False
        # aborts not yet applied, as they arrive: the pipe reader thread appends them
        # (``abort_arrived``; deque appends are thread-safe) and the step applies them in its abort
        # calls, mid-step, without waiting for the process loop's next drain
        self.late_aborts: collections.deque[AbortRequests] = collections.deque()
        # the step count at the arrival of each abort applied since the last report, and the
        # cumulative count of aborts by steps from arrival to the report showing them free
        self._aborts_applied: list[int] = []
        self.aborts_freed = [0] * ABORT_STEP_BUCKETS
        # Where forward passes run (at most one is in flight). On CUDA kernel launches return at
        # once: the step loop launches the pass itself and waits on the device only when it wants
        # the tokens, so emitting the last step overlaps the pass with no thread and no GIL hand-off.
        # tidal-test's pass is a clock: a thread computes it beside the step loop, which then sleeps
        # until the pass's end (``ThreadPass``). On a CPU the pass is host
        # work on every core: a thread there only adds two thread hand-offs per step and a GIL
        # tug-of-war with the step loop, so the pass runs on the step loop's thread when its result
        # is first wanted (docs/engine.md).
        if passes is None:
            passes = self._default_passes()
        self._passes = PASSES[passes]()
        self._in_flight: InFlight | None = None
        self.slowest_token_seconds = 0.0  # of the finished steps (``progress``)
        self.min_step_time = config.min_step_time
        self._sampling_rows: list[int] = []  # the forward thread's persistent sampling batch
        self._sampling = SamplingBatch([], [], [], [])

    def ready_message(self) -> Ready:
        mc = self.runner.model_config
        return Ready(
            model=self.runner.model_dir,
            max_model_len=self.max_model_len,
            block_size=self.config.block_size,
            num_total_blocks=self.block_manager.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            device=str(self.runner.device),
            dtype=str(self.runner.dtype).removeprefix("torch."),
            vocab_size=mc.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            pid=os.getpid(),
            dtype_reason=self.runner.dtype_reason,
        )

    # ------------------------------------------------------------------ requests

    def add_request(self, msg: AddRequest) -> None:
        if msg.request_id in self.sequences:
            log.warning("duplicate request id %d ignored", msg.request_id)
            return
        params = msg.params
        seq = Sequence(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            params=params,
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, msg.prompt_token_ids, params.stop, params.skip_special_tokens),
            generator=make_generator(params.seed, self.runner.device),
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            timing=EngineTiming(msg.received_at),
            adapter_id=msg.adapter_id,
        )
        if msg.adapter_id is not None:
            error = self._acquire_adapter(msg.adapter_id)
            if error is not None:  # refused before it holds anything
                self._outputs.append(RequestOutput(request_id=msg.request_id, token_ids=[], text="",
                                                   finish_reason="abort", error=error))
                self._finished.append(msg.request_id)
                self._dirty = True
                return
        self.sequences[seq.request_id] = seq
        if not seq.prompt_token_ids or seq.num_tokens >= self.max_model_len:
            # the frontend validates this; the engine still never runs an impossible request
            self._finish(seq, "length")
            return
        self.scheduler.add(seq, parent=self.sequences.get(msg.fork_of) if msg.fork_of is not None else None)
        self._dirty = True

    def _acquire_adapter(self, adapter_id: int) -> str | None:
        """Hold the adapter for a new sequence; why not, if it cannot be."""
        if self.adapters is None:
            return "LoRA adapters are off in this engine (--enable-lora)"
        try:
            self.adapters.acquire(adapter_id)
        except AdapterError as exc:
            return str(exc)
        return None

    def load_adapter(self, message: LoadAdapter) -> AdapterLoaded:
        """Read and check an adapter the frontend registers; the answer says why not, if it cannot be used."""
        if self.adapters is None:
            return AdapterLoaded(message.spec.adapter_id, "LoRA adapters are off in this engine (--enable-lora)")
        try:
            self.adapters.register(message.spec)
        except AdapterError as exc:
            return AdapterLoaded(message.spec.adapter_id, str(exc))
        return AdapterLoaded(message.spec.adapter_id)

    def unload_adapter(self, message: UnloadAdapter) -> None:
        if self.adapters is not None:
            self.adapters.unregister(message.adapter_id)

    def abort_arrived(self, message: AbortRequests) -> None:
        """The pipe reader thread decoded an abort: stamp its arrival step, hand it to the step in flight."""
        message.received_step = self.num_steps
        self.late_aborts.append(message)

    def abort(self, request_ids: list[int], received_step: int = -1) -> None:
        """Free the requests' KV blocks now. Unknown or finished ids are a no-op.

        A forward pass in flight may still write the blocks: wait for it to end first (its
        tokens for the aborted requests are then dropped by the commit). ``received_step``: the
        step count when the abort arrived (``abort_arrived``), to count how long it took; -1: not counted.
        """
        if self._in_flight is not None:
            self._in_flight.tokens.result()
        for request_id in request_ids:
            seq = self.sequences.get(request_id)
            # FINISHED and still here: it ended in this step's commit; its final output goes out as is
            if seq is not None and seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, "abort", emit_output=False)
                if received_step >= 0:
                    self._aborts_applied.append(received_step)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    # ------------------------------------------------------------------ the step

    def step(self) -> bool:
        """Commit the forward pass in flight and launch the next one. False if none could start.

        One step is schedule -> forward -> abort window -> commit; the next step's schedule
        and launch come right after the commit, so its forward pass runs while this step's
        outputs are detokenized and reported (and while the process loop sends them).
        """
        if self._in_flight is None:
            self._in_flight = self._launch()  # schedule -> forward
        in_flight = self._in_flight
        if in_flight is None:
            return False  # nothing fits right now (waiting for blocks)
        tokens, logprobs, failures, accepted = in_flight.tokens.result()
        sampled_at = time.monotonic()  # one stamp per step: the first-token stamp of who got theirs now
        token_seconds = (sampled_at - in_flight.launched_at) / max(in_flight.batch.num_tokens, 1)
        self.slowest_token_seconds = max(self.slowest_token_seconds, token_seconds)
        self._apply_late_aborts()  # the abort window: the pass is over, its outputs not yet booked
        appended = self.scheduler.commit(in_flight.batch, tokens, failures, accepted)  # commit
        self.num_steps += 1  # an abort arriving from here on is applied by the launch, else by the next step
        self._in_flight = self._launch()  # the next step's forward starts now ...
        self._emit_step(appended, logprobs, sampled_at)  # ... and runs while this one's outputs are built
        return True

    def _launch(self) -> InFlight | None:
        """Schedule a batch and launch its forward pass (``self._passes`` decides where it runs)."""
        # aborts that arrived since the abort window (during the commit) are applied now, so the
        # pass about to start never carries a request whose abort is here
        self._apply_late_aborts()
        batch = self.scheduler.schedule()
        for seq in batch.refused:
            self._emit(seq)
        self._started.extend(seq.request_id for seq in batch.started)
        if batch.started:
            self._dirty = True
        if not batch:
            return None
        if self.adapters is not None:
            self.adapters.place(batch)  # the previous pass is over: the slots are free to write
        launched_at = time.monotonic()
        _stamp_prefills(batch, launched_at)
        # with min_step_time (tidal-test) the pass lasts that long from its launch, like a device's
        ends_at = launched_at + self.min_step_time if self.min_step_time else 0.0
        return InFlight(batch, self._passes.submit(self._start_pass, self._finish_pass, ends_at, batch), launched_at)

    def _default_passes(self) -> str:
        if isinstance(self.runner.model, SyntheticModel):
            return "thread"  # its pass is a sleep: only a thread overlaps it
        return "launched" if self.runner.device.type == "cuda" else "deferred"

    @torch.inference_mode()
    def _start_pass(self, batch: ScheduledBatch) -> StartedPass:
        """The device's share of a step, launched: one forward pass, one sampled token per
        ``batch.sampling`` (a device tensor, not yet read back), and the log-softmax of the rows
        that asked for logprobs, taken before the grammar mask and the sampler edit the logits.

        Reads the batch's sequences, changes nothing the step loop reads. On CUDA it returns as
        soon as the kernels are queued.
        """
        logits = self.runner.execute(batch.entries)
        if batch.num_draft_tokens:
            return self._start_verification(batch, logits)
        sampling = self._sampling_batch(batch.sampling)
        captured = CapturedLogprobs.capture(logits, sampling.params)  # None when no row asks
        failures = self.grammars.apply_mask(logits, batch.sampling)  # constrained rows only
        return StartedPass(batch, self.sampler.sample_tokens(logits, sampling), captured, failures)

    def _start_verification(self, batch: ScheduledBatch, logits: torch.Tensor) -> StartedPass:
        """``_start_pass`` for a pass that carries speculative proposals: each sampling sequence has
        1 + len(proposal) rows, each penalised and masked as if the proposal's tokens before it had
        been sampled, then verified (``speculative.verify``). Logprobs are the rows' raw ones, as ever."""
        row_params = []
        for seq in batch.sampling:
            row_params += [seq.params] * (1 + len(seq.draft_token_ids))
        captured = CapturedLogprobs.capture(logits, row_params)
        if any(is_penalised(seq.params) for seq in batch.sampling):
            row_outputs, row_prompts = [], []
            for seq in batch.sampling:
                draft = seq.draft_token_ids
                row_prompts += [seq.prompt_token_ids] * (1 + len(draft))
                row_outputs += [seq.output_token_ids + draft[:j] for j in range(1 + len(draft))]
            apply_penalties(logits, row_params, row_outputs, row_prompts)
        failures, stops_at = {}, {}
        for request_id, (row, why) in self.grammars.apply_draft_masks(logits, batch.sampling).items():
            if row == 0:
                failures[request_id] = why
            else:
                stops_at[request_id] = row
        return StartedPass(batch, None, captured, failures, verify(logits, batch.sampling, stops_at))

    def _finish_pass(self, started: StartedPass) -> PassResult:
        """The tokens of a launched pass (waits for the device), the logprobs of the rows that
        asked (request id -> one token's) and the constrained rows that cannot go on (id -> why);
        with proposals, also how many of each sequence's were accepted (``PassResult``)."""
        captured, sampling = started.captured, started.batch.sampling
        verdict = started.verdict
        if verdict is not None:
            return verdict.final, self._verified_logprobs(captured, sampling, verdict), started.failures, \
                verdict.accepted
        tokens = started.tokens.tolist()
        logprobs = {} if captured is None else {
            sampling[i].request_id: lp for i, lp in captured.for_tokens(tokens).items()}
        return tokens, logprobs, started.failures, None

    @staticmethod
    def _verified_logprobs(captured: CapturedLogprobs | None, sampling: list[Sequence],
                           verdict: Verdict) -> dict[int, Logprobs]:
        """Request id -> the logprobs of every token a verification pass gives it (one per row used)."""
        if captured is None:
            return {}
        by_row = captured.for_tokens(verdict.row_tokens)
        out: dict[int, Logprobs] = {}
        offset = 0
        for i, seq in enumerate(sampling):
            rows = 1 + len(seq.draft_token_ids)
            used = verdict.accepted[i] + (verdict.final[i] is not None)
            if offset in by_row:
                logprobs = by_row[offset]
                for row in range(offset + 1, offset + used):
                    logprobs.extend(by_row[row])
                out[seq.request_id] = logprobs
            offset += rows
        return out

    def _sampling_batch(self, sampling: list[Sequence]) -> SamplingBatch:
        """The sampler's per-row inputs, rebuilt only when the sampling sequences change."""
        rows = [seq.request_id for seq in sampling]
        if rows != self._sampling_rows:
            self._sampling_rows = rows
            self._sampling = SamplingBatch(
                [seq.params for seq in sampling],
                [seq.output_token_ids for seq in sampling],
                [seq.prompt_token_ids for seq in sampling],
                [seq.generator for seq in sampling],
            )
        return self._sampling

    def _apply_late_aborts(self) -> None:
        """Abort the requests whose abort arrived since the last call (mid-forward, or during the commit).

        An id the engine does not know yet (its AddRequest is still in the inbox) is left to
        the in-order path: the process loop handles that abort after the add.
        """
        while self.late_aborts:
            message = self.late_aborts.popleft()
            self.abort(message.request_ids, message.received_step)

    def _emit_step(self, appended: list[Sequence], logprobs: dict[int, Logprobs], sampled_at: float = 0.0) -> None:
        """The outputs of a committed step (``sampled_at``: when its tokens were read back). A sequence
        aborted since the commit (by the launch's abort call) is gone: its token is dropped."""
        sequences = self.sequences
        for seq in appended:
            if seq.request_id in sequences:
                self._emit(seq, logprobs.get(seq.request_id), sampled_at)
        self._dirty = True

    def _emit(self, seq: Sequence, logprobs: Logprobs | None = None, sampled_at: float = 0.0) -> None:
        """The output of a sequence that got a token this step, or ended with an error (a request's
        first output carries the engine's stamps)."""
        if seq.error is not None:
            self._outputs.append(RequestOutput(
                request_id=seq.request_id, token_ids=[], text="", finish_reason=seq.finish_reason,
                error=seq.error))
            self._forget(seq)
            return
        timing = seq.timing
        if timing is not None:
            timing.sampled_at = sampled_at
            seq.timing = None
        count = seq.num_new_outputs
        if count > 1 or (logprobs is not None and len(logprobs.token_logprobs) > 1):
            # accepted speculative tokens: one output each, as if sampled one per step
            self._emit_run(seq, count, logprobs, timing)
            return
        self._outputs.append(RequestOutput(
            request_id=seq.request_id,
            token_ids=[seq.output_token_ids[-1]],
            text=seq.take_text(),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            timing=timing,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
        ))
        if seq.finish_reason is not None:
            self._forget(seq)

    def _emit_run(self, seq: Sequence, count: int, logprobs: Logprobs | None, timing: EngineTiming | None) -> None:
        """The outputs of the ``count`` tokens one commit appended, in order; the last one ends the
        request if it ended."""
        token_ids = seq.output_token_ids[-count:]
        texts = seq.take_texts(count)
        last = count - 1
        for j, (token_id, text) in enumerate(zip(token_ids, texts)):
            self._outputs.append(RequestOutput(
                request_id=seq.request_id,
                token_ids=[token_id],
                text=text,
                finish_reason=seq.finish_reason if j == last else None,
                stop_reason=seq.stop_reason if j == last else None,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=None if logprobs is None else Logprobs(
                    logprobs.token_logprobs[j:j + 1], logprobs.top_token_ids[j:j + 1], logprobs.top_logprobs[j:j + 1]),
                timing=timing if j == 0 else None,
                num_draft_tokens=seq.num_draft_tokens,
                num_accepted_tokens=seq.num_accepted_tokens,
            ))
        if seq.finish_reason is not None:
            self._forget(seq)

    def _finish(self, seq: Sequence, reason: FinishReason, emit_output: bool = True) -> None:
        self.scheduler.finish(seq, reason)  # wherever it waits or runs
        if emit_output:
            self._outputs.append(RequestOutput(
                request_id=seq.request_id, token_ids=[], text="", finish_reason=reason))
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        del self.sequences[seq.request_id]
        if seq.adapter_id is not None:
            self.adapters.release(seq.adapter_id)
        self._finished.append(seq.request_id)
        self._dirty = True

    # ------------------------------------------------------------------ reporting

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            step=self.num_steps,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_total_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            aborts_freed=list(self.aborts_freed),
            **self._speculation_stats(),
        )

    def progress(self) -> StepProgress:
        """How far the step loop has come. Safe from another thread (the pipe reader answering a
        Ping): it reads each attribute once and changes nothing."""
        in_flight = self._in_flight
        if in_flight is None:
            return StepProgress(self.num_steps, 0.0, 0, self.slowest_token_seconds)
        return StepProgress(self.num_steps, time.monotonic() - in_flight.launched_at, in_flight.batch.num_tokens,
                            self.slowest_token_seconds)

    def _speculation_stats(self) -> dict:
        spec = self.speculator
        if spec is None:
            return {}
        return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_pos": list(spec.accepted_per_pos)}

    def take_report(self) -> StepReport | None:
        """Everything that changed since the last report, or None."""
        if not self._dirty:
            return None
        # this report is the first to show the blocks of the aborts applied since the last one free
        last = ABORT_STEP_BUCKETS - 1
        for received_step in self._aborts_applied:
            self.aborts_freed[min(self.num_steps - received_step, last)] += 1
        self._aborts_applied.clear()
        report = StepReport(self._started, self._outputs, self._finished, self.stats())
        self._started, self._outputs, self._finished = [], [], []
        self._dirty = False
        return report

    def abort_all(self) -> None:
        self.abort(list(self.sequences))
        self._in_flight = None  # its sequences are all gone


T = TypeVar("T")
# per sampling sequence its token (None: a verification the grammar ended early), the logprobs of the rows
# that asked, the constrained rows that cannot go on, and with proposals how many each accepted
PassResult = tuple[list[int | None], dict[int, Logprobs], dict[int, str], list[int] | None]


class PendingResult(Protocol[T]):
    def result(self) -> T: ...


@dataclass
class InFlight:
    """A scheduled batch whose forward pass has been launched."""

    batch: ScheduledBatch
    tokens: PendingResult[PassResult]  # and the logprobs of the rows that asked, and grammar failures
    launched_at: float = 0.0


@dataclass
class StartedPass:
    """A forward pass whose kernels are launched and whose tokens are not read back yet."""

    batch: ScheduledBatch
    tokens: torch.Tensor | None  # [len(batch.sampling)] int64, on the device (None: verified, in ``verdict``)
    captured: CapturedLogprobs | None
    failures: dict[int, str]  # constrained rows that cannot go on (Grammars.apply_mask)
    verdict: Verdict | None = None  # a pass with speculative proposals: what it accepted

Start = Callable[..., StartedPass]
Finish = Callable[[StartedPass], T]


def _stamp_prefills(batch: ScheduledBatch, launched_at: float) -> None:
    """Stamp the first schedule and each prefill chunk of the requests still on their way to a first
    token. Prefill entries come after the decodes, so this walks back over them only (per request,
    not per token)."""
    for seq, num_tokens in reversed(batch.entries):
        timing = seq.timing
        if timing is None or seq.output_token_ids:  # has its first token (reported or about to be)
            if num_tokens == 1:
                break  # a decode: the prefills are behind us
            continue  # a recompute after preemption
        if not timing.scheduled_at:
            timing.scheduled_at = launched_at
        timing.prefill_chunks.append(launched_at)


# The last stretch of a wait for a pass's deadline is spun, not slept: a sleep ends ~50-70 us late on
# this kind of host even with a 1 ns timer slack (the scheduler's wake-up), which a device's pass does
# not (a CUDA event synchronize spins too). Costs at most this much CPU per pass.
SPIN_BEFORE_DEADLINE = 1e-4


def wait_until(deadline: float) -> None:
    """Wait until ``time.monotonic()`` reaches ``deadline`` (0: no deadline): sleep, then spin the last
    ``SPIN_BEFORE_DEADLINE``."""
    remaining = deadline - time.monotonic()
    if remaining > SPIN_BEFORE_DEADLINE:
        time.sleep(remaining - SPIN_BEFORE_DEADLINE)
    while time.monotonic() < deadline:
        pass


class ForwardThread:
    """Runs each pass, launch and read-back, on the ``tidal-forward`` thread, overlapping the step loop.

    A pass with a deadline (``min_step_time``) is a clock, as a device is: the step loop sleeps
    until the deadline itself, and by then the thread has long handed its result over, so the
    step loop wakes once, on its own timer, not through a second thread's wake-up.
    """

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tidal-forward")

    def submit(self, start: Start, finish: Finish[T], ends_at: float, *args) -> ThreadPass[T]:
        return ThreadPass(self._thread.submit(lambda: finish(start(*args))), ends_at)


class ThreadPass(Generic[T]):
    """A pass on the forward thread; ``result()`` sleeps until its end, then takes its tokens."""

    def __init__(self, future: Future[T], ends_at: float) -> None:
        self._future = future
        self._ends_at = ends_at

    def result(self) -> T:
        wait_until(self._ends_at)
        return self._future.result()


class DeferredPasses:
    """Runs each pass on the caller's thread, the first time its result is asked for.

    The step loop asks at its next ``step()`` (or in ``abort()``), after it has emitted and
    reported the previous step, so the order of a step is the same as with the thread.
    """

    def submit(self, start: Start, finish: Finish[T], ends_at: float, *args) -> DeferredPass[T]:
        return DeferredPass(lambda: finish(start(*args)), ends_at)


class LaunchedPasses:
    """Launches each pass on the caller's thread now and reads its tokens back when asked.

    For a device that computes on its own (CUDA): the launch only queues kernels, the step
    loop goes on to emit the previous step while they run, and the read-back waits for them.
    """

    def submit(self, start: Start, finish: Finish[T], ends_at: float, *args) -> DeferredPass[T]:
        started = start(*args)
        return DeferredPass(lambda: finish(started), ends_at)


class DeferredPass(Generic[T]):
    def __init__(self, call: Callable[[], T], ends_at: float) -> None:
        self._call: Callable[[], T] | None = call
        self._ends_at = ends_at
        self._value: T

    def result(self) -> T:
        if self._call is not None:
            self._value = self._call()
            self._call = None
            wait_until(self._ends_at)
        return self._value


PASSES: dict[str, Callable[[], ForwardThread | DeferredPasses | LaunchedPasses]] = {
    "thread": ForwardThread, "deferred": DeferredPasses, "launched": LaunchedPasses}
