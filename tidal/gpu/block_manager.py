"""Paged KV-cache blocks: a free list, reference counts and a prefix cache.

Pure Python over plain data (no torch), so it is tested on its own.

A block holds ``block_size`` consecutive tokens of one sequence. A *full* block is
registered in the prefix cache under a hash of its tokens chained with the hash of the
block before it, so equal prefixes (a shared system prompt) map to the same blocks and
are not recomputed. The chain of a sequence run through a LoRA adapter starts from that adapter's
root (``Sequence.root_hash``): its KV differs from the base model's for the same tokens. The hash is ``tidal.wire.hash_block``, a 128-bit BLAKE2b digest shared
with the router's prefix affinity: a hit is trusted without comparing tokens, so a collision
would hand one request another's KV (a wrong answer, and across users a leak). Blocks are reference counted: a prefix block shared by several
sequences is freed when the last one lets go. A freed block that holds a cached prefix
stays reusable until the allocator needs it for something else (least recently freed
first); a freed block without a hash is reused before any cached one.

The engine frees blocks only between model executions (the step loop is synchronous
and the sampler waits for the forward pass), so no in-flight step can still write a
freed block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from tidal.gpu.sequence import Sequence
from tidal.wire import ROOT_HASH, hash_block

__all__ = ["ROOT_HASH", "BlockManager", "hash_block"]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[bytes | None] = [None] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.num_prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one live sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the start of ``seq``'s tokens.

        At least one token is always left to compute, because the step that computes it
        is the one that produces the next token's logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        parent = seq.root_hash  # per adapter: two adapters never share a block
        tokens = seq.token_ids
        for i in range(max_blocks):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._block_of_hash.get(parent)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int] = ()) -> int:
        """Free blocks that ``allocate(seq, num_new_tokens, prefix)`` would take."""
        computed = len(prefix) * self.block_size if prefix else seq.num_computed_tokens
        held = len(seq.block_table) + len(prefix)
        fresh = max(0, self.blocks_for(computed + num_new_tokens) - held)
        revived = sum(1 for b in prefix if self._ref_counts[b] == 0)  # cached but free
        return fresh + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, prefix) <= self.num_free_blocks

    # ------------------------------------------------------------------ changes

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: Seq[int] = ()) -> None:
        """Give ``seq`` slots for ``num_new_tokens`` more tokens, first taking ``prefix`` (whose tokens the
        caller then counts as computed and cached: ``num_computed_tokens`` is the scheduler's alone)."""
        if not self.can_allocate(seq, num_new_tokens, prefix):
            raise MemoryError("not enough free KV blocks (check can_allocate first)")
        if prefix:
            for block_id in prefix:
                if self._ref_counts[block_id] == 0:
                    del self._free_cached[block_id]
                self._ref_counts[block_id] += 1
                seq.block_hashes.append(self._hash_of_block[block_id])  # type: ignore[arg-type]
            seq.block_table.extend(prefix)
            self.num_prefix_hit_tokens += len(prefix) * self.block_size
        computed = len(prefix) * self.block_size if prefix else seq.num_computed_tokens
        needed = self.blocks_for(computed + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish ``seq``'s newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        tokens = seq.token_ids
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.root_hash
            h = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            if h not in self._block_of_hash and self._hash_of_block[block_id] is None:
                self._block_of_hash[h] = block_id
                self._hash_of_block[block_id] = h

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (finish, abort or preempt; its progress is the scheduler's)."""
        for block_id in reversed(seq.block_table):  # tail blocks are the least reusable
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count
            if count == 0:
                if self._hash_of_block[block_id] is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None
        seq.block_table = []
        seq.block_hashes = []

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            h = self._hash_of_block[block_id]
            self._hash_of_block[block_id] = None
            if h is not None:
                del self._block_of_hash[h]
        self._ref_counts[block_id] = 1
        return block_id

    def check_invariants(self) -> None:
        """Raise if the books do not balance (used by tests)."""
        free = set(self._free_plain) | set(self._free_cached)
        if len(free) != self.num_free_blocks:
            raise AssertionError("a block is on the free lists twice")
        for block_id, count in enumerate(self._ref_counts):
            if count < 0 or (count == 0) != (block_id in free):
                raise AssertionError(f"block {block_id}: ref count {count}, free={block_id in free}")
        for h, block_id in self._block_of_hash.items():
            if self._hash_of_block[block_id] != h:
                raise AssertionError(f"hash map disagrees for block {block_id}")
        if any(self._hash_of_block[b] is not None for b in self._free_plain):
            raise AssertionError("a hashed block is on the plain free list")
