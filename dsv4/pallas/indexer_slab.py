"""How many queries the two-pass indexer scores per step: the rule the kernel entry and the memory plan share.

Plain Python (no jax), so that `dsv4.memory_plan` counts the indexer's scores slab without importing kernels.
"""

from __future__ import annotations

__all__ = ["INDEX_SLAB_BYTES", "index_slab_rows"]

# The two-pass indexer's float32 scores slab per step: queries per step at most clip(floor_128(INDEX_SLAB_BYTES /
# (4 · keys)), 128, 4096). 512 MiB rather than 256: a 16K-token chunk at the end of a 512K prompt takes 19 steps
# instead of 43 (fewer top-k launches, less wave tail), 1.008× TTFT at 512K (docs/BENCHMARKS.md).
INDEX_SLAB_BYTES = 1 << 29


def index_slab_rows(num_keys: int, batch: int = 1) -> int:
    """The most queries a step of the two-pass indexer takes: its float32 [batch, rows, keys] scores stay within
    INDEX_SLAB_BYTES; 128..4096, a multiple of 128. (A power of two halved the rows of a cache just past a power
    of two, as a 512K prompt plus its generated tokens has: twice the steps.) The indexer
    (`dsv4.pallas.indexer.default_query_chunk`) and the memory plan both use this."""
    fit = INDEX_SLAB_BYTES // max(1, 4 * batch * num_keys)
    return int(min(4096, max(128, fit // 128 * 128)))
