"""Which data-parallel replica serves a request: least loaded, with prefix affinity. Pure Python.

Called once per admitted request (``route``), synchronously, on the event loop. The policy:

1. **Load** of a replica = the requests routed to it that its reports have not yet listed as
   finished (its running and waiting sequences plus those still in the pipe: exact, where the
   reported counts alone lag by a step), plus a full batch (``max_num_seqs``) when its last report
   shows too few free KV blocks for this prompt: such a replica would make the request wait for
   blocks, or preempt.
2. **Prefix affinity.** The router remembers, per replica, the hashes of the block-aligned prompt
   prefixes it sent there (``tidal.wire.prefix_hashes``: the engine's own prefix-cache chain, so a
   hit on block *k* means blocks 0..k all match and are the blocks the engine would look up), at most as many as the replica's KV cache has blocks, least recently
   used first out. The replica holding the longest cached prefix of this prompt wins if its load
   is within ``affinity_slack`` of the least loaded replica's ("when its load allows").
3. Otherwise the least loaded replica wins; ties go to more free KV blocks, then the lower index.

This mirrors SGLang's cache-aware router (prefix match unless the load is out of balance by more
than a threshold, else shortest queue) but runs in-process, and the load it sees is exact rather
than polled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tidal.wire import EngineStats
from tidal.wire import prefix_hashes as _chain

MAX_AFFINITY_BLOCKS = 256  # hash at most this many leading blocks of a prompt (bounds the cost)
DEFAULT_AFFINITY_SLACK = 32  # requests; SGLang's router balances beyond an imbalance of 32 as well


def prefix_hashes(token_ids: Sequence[int], block_size: int, limit: int = MAX_AFFINITY_BLOCKS) -> list[bytes]:
    """The engine's chained block hashes of the full leading blocks of ``token_ids`` (block *k*
    covers blocks 0..k), the first ``limit`` of them."""
    return _chain(token_ids, block_size, limit)


@dataclass(eq=False)
class ReplicaView:
    """What the router knows about one replica."""

    index: int
    max_num_seqs: int = 0
    num_total_blocks: int = 0
    stats: Callable[[], EngineStats] = field(default=EngineStats)  # its latest report
    serving: Callable[[], bool] = lambda: False  # whether it serves: asked of its owner, never copied
    generation: int = 0  # bumped by every start: releases from an earlier life are not counted
    num_assigned: int = 0  # routed here and not yet reported finished
    prefixes: OrderedDict = field(default_factory=OrderedDict)  # prefix hash -> None, LRU order

    @property
    def up(self) -> bool:
        return self.serving()

    def load(self, num_blocks_needed: int) -> int:
        stats = self.stats()
        load = self.num_assigned
        if stats.num_total_blocks and stats.num_total_blocks - stats.num_used_blocks < num_blocks_needed:
            load += self.max_num_seqs  # it would wait for KV blocks (or preempt) before serving this one
        return load

    def free_blocks(self) -> int:
        stats = self.stats()
        return stats.num_total_blocks - stats.num_used_blocks

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt were sent here before (and may still be cached)."""
        count = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            count += 1
        return count

    def remember(self, hashes: list[bytes]) -> None:
        prefixes = self.prefixes
        for h in hashes:
            prefixes[h] = None
            prefixes.move_to_end(h)
        while len(prefixes) > self.num_total_blocks:
            prefixes.popitem(last=False)


@dataclass(frozen=True)
class Decision:
    index: int
    generation: int  # hand back to ``release``
    reason: str  # "prefix" (affinity won) or "load" (least loaded)
    num_cached_blocks: int  # leading prompt blocks the chosen replica was sent before


class NoReplica(Exception):
    """No replica is up."""


class Router:
    def __init__(self, num_replicas: int, block_size: int, *, prefix_affinity: bool = True,
                 affinity_slack: int = DEFAULT_AFFINITY_SLACK):
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.affinity_slack = affinity_slack
        self.replicas = [ReplicaView(i) for i in range(num_replicas)]

    # ------------------------------------------------------------------ replica lifetime

    def replica_up(self, index: int, max_num_seqs: int, num_total_blocks: int, stats: Callable[[], EngineStats],
                   serving: Callable[[], bool] = lambda: True) -> int:
        """A (re)started replica is ready: a new life, its counts and cache empty. Returns the life's
        ``generation``, which its finishes are released under (``release``).

        ``serving``: whether the replica serves, asked at every route; its owner's state table answers
        (``ReplicaSet``: SERVING), so the router never keeps a copy. The default, a replica that never
        goes down, is for a router used on its own."""
        view = self.replicas[index]
        view.max_num_seqs, view.num_total_blocks, view.stats = max_num_seqs, num_total_blocks, stats
        view.serving, view.num_assigned = serving, 0
        view.generation += 1
        view.prefixes.clear()
        return view.generation

    @property
    def num_up(self) -> int:
        return sum(view.up for view in self.replicas)

    # ------------------------------------------------------------------ requests

    def route(self, prompt_token_ids: Sequence[int]) -> Decision:
        """Pick the replica for a new request and count it there. Raises ``NoReplica``."""
        live = [view for view in self.replicas if view.up]
        if not live:
            raise NoReplica()
        hashes = prefix_hashes(prompt_token_ids, self.block_size) if self.prefix_affinity else []
        num_blocks = -(-(len(prompt_token_ids) + 1) // self.block_size)
        cached = {view.index: view.cached_blocks(hashes) for view in live} if hashes else {}
        loads = {view.index: view.load(num_blocks - cached.get(view.index, 0)) for view in live}
        least = min(live, key=lambda v: (loads[v.index], -v.free_blocks(), v.index))
        chosen, reason = least, "load"
        if cached:
            holder = max(live, key=lambda v: (cached[v.index], -loads[v.index], -v.index))
            if cached[holder.index] > 0 and loads[holder.index] <= loads[least.index] + self.affinity_slack:
                chosen, reason = holder, "prefix"
        chosen.num_assigned += 1
        if hashes:
            chosen.remember(hashes)
        return Decision(chosen.index, chosen.generation, reason, cached.get(chosen.index, 0))

    def release(self, index: int, generation: int, count: int = 1) -> None:
        """The replica reported a request routed to it in its life ``generation`` finished (or aborted);
        a report from an earlier life (a late one from a dead engine) changes nothing."""
        view = self.replicas[index]
        if view.generation == generation:
            view.num_assigned = max(0, view.num_assigned - count)
