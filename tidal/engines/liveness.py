"""How the frontend tells a slow engine from a dead one (docs/architecture.md, liveness).

Two questions, asked at every heartbeat:

* *Is the process alive?* The engine's pipe reader thread answers each Ping at once, beside the
  step (tidal/gpu/process.py), so an answer that does not come within the heartbeat timeout means
  the process is stopped, dead or wedged whole. The timeout counts only time the frontend itself
  ran on time (``wait_on_time``): an event loop that stalled for a while has not been waiting for
  the engine, and never blames it.
* *Is its step loop moving?* The answer carries the step in flight's age and size, and the
  slowest seconds per token of the finished steps. A step is stuck only when it has run past the
  step timeout and far past what its size explains (``StepBound``): a long prefill of a big model
  on a slow host is a live engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from tidal.wire import StepProgress

# How often a wait for the engine's answer looks at the clock. A wake-up later than two ticks is the
# frontend's own stall, counted as two ticks (``wait_on_time``).
TICK = 0.1


async def wait_on_time(event: trio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or the frontend has waited ``timeout`` seconds on time; True if set.

    Each tick counts at most twice its length, however late the event loop woke from it: the
    time it stalled (a long synchronous call, a loaded host) is the frontend's, not the engine's,
    and after a stall the reader task gets its turn before the wait can end. Cancellation leaves
    ``event`` untouched.
    """
    tick = min(TICK, timeout)
    waited = 0.0
    while not event.is_set():
        if waited >= timeout:
            return False
        started = trio.current_time()
        with trio.move_on_after(tick):
            await event.wait()
        waited += min(trio.current_time() - started, 2 * tick)
    return True


@dataclass(frozen=True)
class StepBound:
    """How long a step may run before the engine is declared hung.

    ``timeout``: the least any step is allowed (``--engine-step-timeout``). ``slack``: how many
    times its size at the slowest rate seen a step may take on top (a step's time grows with its
    tokens; a loaded host makes every step slower).
    """

    timeout: float
    slack: float = 10.0

    def allowed(self, progress: StepProgress) -> float:
        explained = self.slack * progress.slowest_token_seconds * progress.step_num_tokens
        return max(self.timeout, explained)

    def why_stuck(self, progress: StepProgress) -> str | None:
        """Why the step in flight counts as hung, or None while it may still be working."""
        allowed = self.allowed(progress)
        if progress.step_age <= allowed:
            return None
        return (f"engine step {progress.steps_done + 1} ({progress.step_num_tokens} tokens) made no progress "
                f"in {progress.step_age:.0f} s, past the {allowed:.0f} s its size explains "
                f"(--engine-step-timeout)")
