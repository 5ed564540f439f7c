"""A pool of fixed-size KV-cache pages (blocks), handed out by id.

The pool only does bookkeeping: which page ids are free, in what order they will be handed out, and how
many owners each page has. It knows nothing about requests, tokens or what a page holds on the device;
`KVCacheManager` (manager.py) maps requests and token counts onto page ids, and the device side indexes
its page arrays with those ids.

Pure Python on purpose (no JAX, no numpy): it runs on the host between device steps and its tests assert
exact ids and orders.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

NULL_BLOCK_ID = 0
"""Page 0 is never handed out. Block tables are padded with it on the device side, so a padded slot reads
(and, for masked writes, writes) a page that belongs to no request."""


class BlockPool:
    """`num_blocks` pages of `block_size` entries each; page `NULL_BLOCK_ID` is reserved.

    Free pages sit in one FIFO queue. `allocate` takes from its head, `free` appends to its tail, so the
    order in which ids come back out is deterministic: initially 1, 2, ..., num_blocks - 1, and a freed
    page is reused only after every page that was free before it. Each page has a reference count;
    `incref` lets a second owner share a page (prefix sharing later), and a page returns to the free queue
    only when its last owner frees it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (page 0 is reserved as the null page)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be at least 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free_queue: deque[int] = deque(range(1, num_blocks))

    @property
    def num_blocks(self) -> int:
        """All pages, the null page included."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_usable_blocks(self) -> int:
        """Pages that can ever be handed out: all but the null page."""
        return self._num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free_queue)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next handed out) first. A copy, for tests and debugging."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Takes `num_blocks` pages from the head of the free queue, each with reference count 1.

        Returns None, and takes nothing, when fewer than `num_blocks` are free: running out is an ordinary
        event the caller handles (wait, or preempt someone), not an error.
        """
        if num_blocks < 0:
            raise ValueError(f"allocate: num_blocks={num_blocks} is negative")
        if num_blocks > len(self._free_queue):
            return None
        allocated = [self._free_queue.popleft() for _ in range(num_blocks)]
        for block_id in allocated:
            self._ref_counts[block_id] = 1
        return allocated

    def incref(self, block_ids: Sequence[int]) -> None:
        """Adds one owner to each page. Every page must be allocated (a free page has no content to share).

        All ids are checked before any count changes, so a bad id leaves the pool as it was.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"incref: block {block_id} is free; only an allocated block can be shared")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> list[int]:
        """Drops one owner from each page; pages left with no owner go to the tail of the free queue.

        Pages are released in reverse order of `block_ids`, and the ones that reached zero are returned in
        the order they were appended to the queue.

        NOTE: reverse order is deliberate (vLLM does the same). A request's block table runs from its first
        tokens to its last, so freeing it reversed puts its *last* pages nearer the head of the queue and
        its *first* pages at the very tail: the first pages stay unused longest. Those are the pages worth
        keeping: once prefix caching keeps content on free pages, a shared prompt prefix (system prompt,
        earlier turns) lives in a request's leading pages, and evicting them last maximizes the hits.
        Without prefix caching the order does not matter for correctness; it only has to be deterministic.

        Raises ValueError naming the block for the null page, an id out of range, or a page freed more
        times than it has owners (double free). All ids are checked first, so an error changes nothing.
        """
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if times > self._ref_counts[block_id]:
                if self._ref_counts[block_id] == 0:
                    raise ValueError(f"free: block {block_id} is already free (double free)")
                raise ValueError(
                    f"free: block {block_id} freed {times} times but has only {self._ref_counts[block_id]} owner(s)"
                )
        released = []
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue.append(block_id)
                released.append(block_id)
        return released

    def _check_id(self, block_id: int) -> None:
        if block_id == NULL_BLOCK_ID:
            raise ValueError(f"block {block_id} is the reserved null block; it is never allocated or freed")
        if not isinstance(block_id, int) or not 0 < block_id < self._num_blocks:
            raise ValueError(f"block {block_id!r} is not a block id of this pool (ids 1..{self._num_blocks - 1})")

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, block_size={self._block_size}, num_free={self.num_free})"
