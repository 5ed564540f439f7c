"""BlockPool and KVCacheManager: exact page ids, reference counts and free-queue order after each operation.

The pattern is vLLM's `tests/v1/core/test_prefix_caching.py`: every operation is followed by asserts on the
whole visible state, so a change in allocation order shows up as a test failure, not as a silent change.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.cache.block_pool import NULL_BLOCK_ID, BlockPool
from dsv4.cache.manager import KVCacheManager, PageGroup, PageSpec

REPO_ROOT = Path(__file__).resolve().parents[1]


def ref_counts(pool: BlockPool) -> list[int]:
    return [pool.ref_count(block_id) for block_id in range(1, pool.num_blocks)]


# ----- BlockPool ---------------------------------------------------------------------------------------


def test_new_pool_hands_out_ids_in_ascending_order_and_never_the_null_block():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.num_free == 5
    assert pool.num_usable_blocks == 5
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert ref_counts(pool) == [0, 0, 0, 0, 0]
    assert pool.allocate(5) == [1, 2, 3, 4, 5]
    assert pool.num_free == 0
    assert NULL_BLOCK_ID == 0


def test_allocate_then_free_returns_blocks_to_the_tail_in_reverse():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.free_block_ids() == [4, 5, 6, 7]
    assert ref_counts(pool) == [1, 1, 1, 0, 0, 0, 0]
    assert pool.allocate(2) == [4, 5]
    assert pool.free_block_ids() == [6, 7]

    # The first request's table [1, 2, 3] goes back reversed: its first page is reused last.
    assert pool.free([1, 2, 3]) == [3, 2, 1]
    assert pool.free_block_ids() == [6, 7, 3, 2, 1]
    assert ref_counts(pool) == [0, 0, 0, 1, 1, 0, 0]
    assert pool.num_free == 5

    # FIFO: pages that were free before are handed out before the ones just freed.
    assert pool.allocate(3) == [6, 7, 3]
    assert pool.free_block_ids() == [2, 1]
    assert pool.free([4, 5]) == [5, 4]
    assert pool.free_block_ids() == [2, 1, 5, 4]
    assert pool.free([6, 7, 3]) == [3, 7, 6]
    assert pool.free_block_ids() == [2, 1, 5, 4, 3, 7, 6]
    assert ref_counts(pool) == [0] * 7


def test_allocate_more_than_free_returns_none_and_changes_nothing():
    pool = BlockPool(num_blocks=5, block_size=2)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) is None
    assert pool.free_block_ids() == [3, 4]
    assert ref_counts(pool) == [1, 1, 0, 0]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(1) is None
    assert pool.num_free == 0


def test_allocate_zero_and_negative():
    pool = BlockPool(num_blocks=3, block_size=2)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [1, 2]
    with pytest.raises(ValueError, match="-1"):
        pool.allocate(-1)


def test_shared_block_returns_to_free_queue_only_when_last_owner_frees():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.incref([1])
    assert ref_counts(pool) == [2, 1, 0, 0]

    assert pool.free([1, 2]) == [2]  # page 1 still has an owner
    assert ref_counts(pool) == [1, 0, 0, 0]
    assert pool.free_block_ids() == [3, 4, 2]

    assert pool.free([1]) == [1]
    assert ref_counts(pool) == [0, 0, 0, 0]
    assert pool.free_block_ids() == [3, 4, 2, 1]

    # Freeing the same id twice in one call is fine when it has two owners.
    assert pool.allocate(1) == [3]
    pool.incref([3, 3])
    assert pool.ref_count(3) == 3
    assert pool.free([3, 3]) == []
    assert pool.free([3]) == [3]
    assert pool.free_block_ids() == [4, 2, 1, 3]


@pytest.mark.parametrize(
    ("bad_free", "message"),
    [
        ([2], "block 2 is already free"),
        ([0], "block 0 is the reserved null block"),
        ([5], "block 5 is not a block id"),
        ([-1], "block -1 is not a block id"),
        ([1, 1], "block 1 freed 2 times but has only 1 owner"),
        ([1, 3], "block 3 is already free"),  # the valid page 1 must not be freed either
    ],
)
def test_bad_free_raises_naming_the_block_and_changes_nothing(bad_free, message):
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.allocate(2) == [1, 2]
    pool.free([2])
    before = (pool.free_block_ids(), ref_counts(pool))
    with pytest.raises(ValueError, match=message):
        pool.free(bad_free)
    assert (pool.free_block_ids(), ref_counts(pool)) == before == ([3, 4, 2], [1, 0, 0, 0])


def test_bad_incref_raises_naming_the_block_and_changes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate(1) == [1]
    with pytest.raises(ValueError, match="block 2 is free"):
        pool.incref([1, 2])
    with pytest.raises(ValueError, match="block 0 is the reserved null block"):
        pool.incref([0])
    with pytest.raises(ValueError, match="block 9 is not a block id"):
        pool.incref([9])
    assert ref_counts(pool) == [1, 0, 0]
    with pytest.raises(ValueError, match="block 0"):
        pool.ref_count(0)


@pytest.mark.parametrize(("num_blocks", "block_size", "message"), [(1, 4, "num_blocks=1"), (4, 0, "block_size=0")])
def test_pool_constructor_rejects_bad_sizes(num_blocks, block_size, message):
    with pytest.raises(ValueError, match=message):
        BlockPool(num_blocks, block_size)


# ----- PageSpec ----------------------------------------------------------------------------------------


def test_default_page_spec_is_ceil_of_tokens_over_block_size():
    spec = PageSpec.tokens(16)
    assert [spec.num_pages(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert spec.max_tokens(6) == 96


def test_deepseek_v4_page_spec_grows_each_group_at_its_own_rate():
    spec = PageSpec.deepseek_v4(sliding_window=128, compress_rates=[4, 128, 4], entries_per_page=64)
    assert [group.name for group in spec.groups] == ["sliding_window", "compressed_4", "compressed_128"]
    # window: min(N, 128) entries / 64; CSA: ceil(N/4) / 64; HCA: ceil(N/128) / 64.
    assert spec.pages_per_group(1) == (1, 1, 1)
    assert spec.pages_per_group(64) == (1, 1, 1)
    assert spec.pages_per_group(65) == (2, 1, 1)
    assert spec.pages_per_group(257) == (2, 2, 1)  # the ring stops at 2 pages; 65 CSA entries
    assert spec.pages_per_group(8192) == (2, 32, 1)
    assert spec.pages_per_group(8193) == (2, 33, 2)
    assert spec.num_pages(8193) == 37
    assert spec.max_tokens(10) == 1792  # 2 + ceil(448 / 64) + 1 = 10; one token more needs an 8th CSA page

    per_group = PageSpec.deepseek_v4(
        sliding_window=128,
        compress_rates=[4, 128],
        entries_per_page={"sliding_window": 16, "compressed_4": 64, "compressed_128": 256},
    )
    assert per_group.pages_per_group(1000) == (8, 4, 1)
    with pytest.raises(ValueError, match="compressed_128"):
        PageSpec.deepseek_v4(sliding_window=128, compress_rates=[4, 128], entries_per_page={"sliding_window": 16})


def test_page_spec_with_only_a_ring_always_fits():
    assert PageSpec((PageGroup("ring", 4, max_entries=8),)).max_tokens(2) is None
    assert PageSpec((PageGroup("ring", 4, max_entries=8),)).max_tokens(1) == 4


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PageGroup("", 4), "name"),
        (lambda: PageGroup("g", 0), "entries_per_page=0"),
        (lambda: PageGroup("g", 4, tokens_per_entry=0), "tokens_per_entry=0"),
        (lambda: PageGroup("g", 4, max_entries=0), "max_entries=0"),
        (lambda: PageSpec(()), "at least one"),
        (lambda: PageSpec((PageGroup("g", 4), PageGroup("g", 8))), "'g'"),
    ],
)
def test_page_spec_rejects_bad_values_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----- KVCacheManager ----------------------------------------------------------------------------------


def test_allocate_slots_takes_just_the_pages_the_new_token_count_needs():
    pool = BlockPool(num_blocks=8, block_size=4)
    kv = KVCacheManager(pool)
    assert kv.allocate_slots("a", 5) == [1, 2]
    assert kv.num_tokens("a") == 5 and kv.block_table("a") == [1, 2]
    assert kv.allocate_slots("a", 3) == []  # 8 tokens still fit in 2 pages
    assert kv.num_tokens("a") == 8 and kv.block_table("a") == [1, 2]
    assert kv.allocate_slots("b", 1) == [3]
    assert kv.allocate_slots("a", 1) == [4]
    assert kv.block_table("a") == [1, 2, 4]
    assert kv.block_tables("a") == ((1, 2, 4),)
    assert kv.num_tokens("a") == 9
    assert ref_counts(pool) == [1, 1, 1, 1, 0, 0, 0]
    assert pool.free_block_ids() == [5, 6, 7]
    assert list(kv.request_ids()) == ["a", "b"]

    assert kv.free("a") == [4, 2, 1]
    assert pool.free_block_ids() == [5, 6, 7, 4, 2, 1]
    assert kv.block_table("a") == [] and kv.num_tokens("a") == 0
    assert kv.free("a") == []  # already gone: a no-op, not an error
    assert kv.free("b") == [3]
    assert pool.num_free == pool.num_blocks - 1


def test_allocate_slots_none_leaves_everything_unchanged():
    pool = BlockPool(num_blocks=4, block_size=4)
    kv = KVCacheManager(pool)
    assert kv.allocate_slots("a", 8) == [1, 2]
    assert kv.can_allocate(4, "a") and kv.can_allocate(1) and not kv.can_allocate(5, "a")
    assert kv.num_new_pages(5, "a") == 2
    assert kv.allocate_slots("a", 5) is None
    assert kv.allocate_slots("b", 5) is None
    assert kv.num_tokens("a") == 8 and kv.block_table("a") == [1, 2]
    assert list(kv.request_ids()) == ["a"]  # the failed new request was not registered
    assert pool.free_block_ids() == [3]
    assert kv.allocate_slots("b", 0) == [] and list(kv.request_ids()) == ["a"]
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        kv.allocate_slots("a", -1)
    assert kv.free("a") == [2, 1]


def test_manager_with_several_page_groups_keeps_one_table_per_group():
    spec = PageSpec(
        (
            PageGroup("sliding_window", entries_per_page=4, max_entries=8),  # a ring of 2 pages
            PageGroup("compressed_4", entries_per_page=2, tokens_per_entry=4),  # 8 tokens per page
        )
    )
    pool = BlockPool(num_blocks=10, block_size=4)
    kv = KVCacheManager(pool, spec)
    assert kv.allocate_slots("a", 5) == [1, 2, 3]  # window: 2 pages; compressed: ceil(2 / 2) = 1
    assert kv.block_tables("a") == ((1, 2), (3,))
    assert kv.allocate_slots("b", 3) == [4, 5]
    # 25 tokens: the window stays at 2 pages; ceil(25 / 4) = 7 compressed entries -> 4 pages, 3 of them new.
    assert kv.allocate_slots("a", 20) == [6, 7, 8]
    assert kv.block_tables("a") == ((1, 2), (3, 6, 7, 8))
    assert kv.block_table("a", group=1) == [3, 6, 7, 8]
    assert kv.num_new_pages(8, "a") == 1 and kv.num_new_pages(8) == 3
    assert kv.allocate_slots("b", 100) is None
    assert kv.block_tables("b") == ((4,), (5,))
    assert kv.free("a") == [8, 7, 6, 3, 2, 1]
    assert kv.free("b") == [5, 4]
    assert pool.free_block_ids() == [9, 8, 7, 6, 3, 2, 1, 5, 4]


# ----- layering ----------------------------------------------------------------------------------------


def test_host_side_modules_import_no_jax_flax_or_numpy():
    """cache/ (its host side: pool, manager, layout) and the scheduler must stay importable without the device
    stack (cache/README.md): the engine and the memory planner size pools with no device.

    A fresh interpreter with a stand-in `dsv4` package, so `dsv4/__init__.py` (which imports the model,
    hence JAX) does not run; importing any of the forbidden packages then fails loudly.
    """
    script = f"""
import sys, types
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "numpy"):
            raise ImportError("host-side module imported " + name)
sys.meta_path.insert(0, Block())
package = types.ModuleType("dsv4")
package.__path__ = [{str(REPO_ROOT / "dsv4")!r}]
sys.modules["dsv4"] = package
import dsv4.cache, dsv4.cache.block_pool, dsv4.cache.layout, dsv4.cache.manager, dsv4.scheduler
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
