"""Per-request block tables on top of a `BlockPool`, and the policy that says how many pages N tokens need.

DeepSeek-V4 keeps several kinds of per-request cache, each growing at its own rate with the token count:

- the sliding-window ring: the last `sliding_window` tokens' KV, so it stops growing at the window;
- CSA compressed KV and the lightning indexer's keys: one entry per 4 tokens (`compress_rates`);
- HCA compressed KV: one entry per 128 tokens.

A `PageGroup` describes one such kind (entries per token, entries per page, an optional cap), a `PageSpec`
lists the groups, and a request gets one block table per group, all drawing page ids from the same pool.
The default spec has a single group of one entry per token, i.e. plain `ceil(N / block_size)` pages.

Pure Python: the scheduler calls this between device steps; the device side only ever sees the block
tables (tuples of ints) that come out of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dsv4.cache.block_pool import BlockPool


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class PageGroup:
    """One kind of per-request cache entry, and how many pages it needs for a token count.

    `num_entries(N) = min(ceil(N / tokens_per_entry), max_entries)`; pages = ceil(entries / entries_per_page).

    NOTE: compressed groups round the entry count *up*: the entry for a group of `tokens_per_entry` tokens
    has a slot from the group's first token, not only once the group is complete. The device side may keep
    the in-progress pooling state there or leave it unwritten until complete; either way it costs at most
    one entry per group per request, and the host never has to know which choice the kernel made.

    `entries_per_page` may differ between groups: with one pool of page ids shared by all groups, the device
    side can pick each group's entries per page so every group's page has the same size in bytes, and back
    all groups with one buffer of `num_blocks` pages (vLLM's hybrid allocator does this). Giving each group
    its own array of `num_blocks` pages also works, at the cost of over-provisioning.
    """

    name: str
    entries_per_page: int
    tokens_per_entry: int = 1
    max_entries: int | None = None
    """Stop growing here: a ring buffer (the sliding window) needs only this many entries however long the
    request grows. None: grows without bound."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("PageGroup.name must be non-empty")
        if self.entries_per_page < 1:
            raise ValueError(f"PageGroup {self.name!r}: entries_per_page={self.entries_per_page} must be >= 1")
        if self.tokens_per_entry < 1:
            raise ValueError(f"PageGroup {self.name!r}: tokens_per_entry={self.tokens_per_entry} must be >= 1")
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError(f"PageGroup {self.name!r}: max_entries={self.max_entries} must be >= 1 or None")

    def num_entries(self, num_tokens: int) -> int:
        entries = _ceil_div(num_tokens, self.tokens_per_entry)
        return entries if self.max_entries is None else min(entries, self.max_entries)

    def num_pages(self, num_tokens: int) -> int:
        return _ceil_div(self.num_entries(num_tokens), self.entries_per_page)


@dataclass(frozen=True)
class PageSpec:
    """The `tokens_to_pages` policy: the page groups a request has, in block-table order.

    Page counts must not decrease as the token count grows (each group's does not), so a request's pages
    only ever grow until it is freed, and the pages for its final length bound everything it will hold.
    """

    groups: tuple[PageGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("PageSpec.groups must hold at least one PageGroup")
        names = [group.name for group in self.groups]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"PageSpec: page group names must be unique, repeated: {duplicates}")

    @classmethod
    def tokens(cls, block_size: int) -> PageSpec:
        """The default: one entry per token, `block_size` tokens per page: `ceil(N / block_size)` pages."""
        return cls((PageGroup("tokens", entries_per_page=block_size),))

    @classmethod
    def deepseek_v4(
        cls,
        *,
        sliding_window: int,
        compress_rates: Iterable[int],
        entries_per_page: int | dict[str, int],
    ) -> PageSpec:
        """Groups for a DeepSeek-V4 model: a sliding-window ring, plus one group per distinct compress rate.

        Takes plain ints rather than the model config so `cache/` does not depend on the model package: the
        engine passes `config.sliding_window` and the values of `config.compress_rates`. A page id in a group
        covers every layer that keeps that kind of entry (the device array is `[layers, pages, entries, dim]`),
        so CSA's compressed KV and its indexer keys, both one per 4 tokens, share the `compressed_4` table.

        `entries_per_page`: one number for all groups, or a dict by group name ("sliding_window",
        "compressed_4", "compressed_128", ...) so the device can make page sizes equal in bytes.
        """
        names = ["sliding_window"] + [f"compressed_{rate}" for rate in sorted(set(compress_rates))]
        if isinstance(entries_per_page, int):
            per_group = dict.fromkeys(names, entries_per_page)
        else:
            missing = [name for name in names if name not in entries_per_page]
            if missing:
                raise ValueError(f"PageSpec.deepseek_v4: entries_per_page has no entry for groups {missing}")
            per_group = entries_per_page
        groups = [PageGroup("sliding_window", per_group["sliding_window"], 1, max_entries=sliding_window)]
        for name in names[1:]:
            groups.append(PageGroup(name, per_group[name], tokens_per_entry=int(name.removeprefix("compressed_"))))
        return cls(tuple(groups))

    def pages_per_group(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(group.num_pages(num_tokens) for group in self.groups)

    def num_pages(self, num_tokens: int) -> int:
        """All pages, over all groups, that a request of `num_tokens` tokens holds."""
        return sum(group.num_pages(num_tokens) for group in self.groups)

    def max_tokens(self, num_pages: int) -> int | None:
        """The most tokens whose pages fit in `num_pages`; None when every group is capped and it always fits.

        For error messages ("the pool holds at most N tokens"), so a binary search is fine.
        """
        if all(group.max_entries is not None for group in self.groups):
            return None if self.num_pages(2**62) <= num_pages else self._search(num_pages, hi=2**62)
        return self._search(num_pages, hi=num_pages * max(g.entries_per_page * g.tokens_per_entry for g in self.groups))

    def _search(self, num_pages: int, hi: int) -> int:
        lo = 0  # invariant: num_pages(lo) <= num_pages, and hi + 1 does not fit (or is past the search range)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.num_pages(mid) <= num_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class _RequestPages:
    num_tokens: int = 0
    tables: list[list[int]] = field(default_factory=list)


class KVCacheManager:
    """Block tables of the running requests: which page ids each request holds, per page group.

    A request exists here from its first successful `allocate_slots` until `free`. Its token count is the
    sum of the `num_new_tokens` it was granted; its pages are always `page_spec.pages_per_group(count)`.
    """

    def __init__(self, pool: BlockPool, page_spec: PageSpec | None = None) -> None:
        self._pool = pool
        self._page_spec = page_spec if page_spec is not None else PageSpec.tokens(pool.block_size)
        self._requests: dict[str, _RequestPages] = {}

    @property
    def pool(self) -> BlockPool:
        return self._pool

    @property
    def page_spec(self) -> PageSpec:
        return self._page_spec

    @property
    def num_groups(self) -> int:
        return len(self._page_spec.groups)

    def request_ids(self) -> Iterator[str]:
        """Requests that hold pages (or a token count), in the order they first got some."""
        return iter(self._requests)

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request's pages have room for; 0 for a request that holds none."""
        pages = self._requests.get(request_id)
        return pages.num_tokens if pages is not None else 0

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The request's page ids for one page group, in token order (a copy); [] if it holds none."""
        pages = self._requests.get(request_id)
        return list(pages.tables[group]) if pages is not None else []

    def block_tables(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """One tuple of page ids per page group, in `page_spec.groups` order."""
        pages = self._requests.get(request_id)
        if pages is None:
            return tuple(() for _ in range(self.num_groups))
        return tuple(tuple(table) for table in pages.tables)

    def num_new_pages(self, num_new_tokens: int, request_id: str | None = None) -> int:
        """Pages `allocate_slots(request_id, num_new_tokens)` would take; request_id None: a new request."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens} is negative")
        current = self.num_tokens(request_id) if request_id is not None else 0
        return self._page_spec.num_pages(current + num_new_tokens) - self._page_spec.num_pages(current)

    def can_allocate(self, num_new_tokens: int, request_id: str | None = None) -> bool:
        """Whether `allocate_slots` would succeed now. request_id None (or unknown): a request with no pages."""
        return self.num_new_pages(num_new_tokens, request_id) <= self._pool.num_free

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> list[int] | None:
        """Grows the request by `num_new_tokens` tokens, taking just the pages its new token count needs.

        Returns the newly taken page ids (group by group, in `page_spec.groups` order; [] when the existing
        pages already have room), or None when the pool cannot supply them all, in which case nothing
        changes: no pages taken, token count as before, an unknown request still unknown.
        """
        if num_new_tokens < 0:
            raise ValueError(f"allocate_slots({request_id!r}): num_new_tokens={num_new_tokens} is negative")
        pages = self._requests.get(request_id)
        current = pages.num_tokens if pages is not None else 0
        needed = [
            after - before
            for after, before in zip(
                self._page_spec.pages_per_group(current + num_new_tokens),
                self._page_spec.pages_per_group(current),
                strict=True,
            )
        ]
        new_blocks = self._pool.allocate(sum(needed))
        if new_blocks is None:
            return None
        if pages is None:
            if num_new_tokens == 0:
                return []  # NOTE: a zero-token call does not register the request; "changes nothing" holds
            pages = self._requests[request_id] = _RequestPages(tables=[[] for _ in range(self.num_groups)])
        offset = 0
        for table, count in zip(pages.tables, needed, strict=True):
            table.extend(new_blocks[offset : offset + count])
            offset += count
        pages.num_tokens = current + num_new_tokens
        return new_blocks

    def free(self, request_id: str) -> list[int]:
        """Gives back all of the request's pages and forgets it.

        Returns the page ids that went back to the free queue, in the order they were appended (the pool
        frees a table in reverse, see `BlockPool.free`). An unknown request frees nothing and returns []:
        preempting and then cancelling the same request is legitimate, and must not fail.
        """
        pages = self._requests.pop(request_id, None)
        if pages is None:
            return []
        return self._pool.free([block_id for table in pages.tables for block_id in table])
