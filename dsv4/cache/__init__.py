"""Host-side KV-cache bookkeeping: page pool, per-request block tables, the tokens-to-pages policy.

Pure Python; see README.md for what lives here and what it may import.
"""

from dsv4.cache.block_pool import NULL_BLOCK_ID, BlockPool
from dsv4.cache.manager import KVCacheManager, PageGroup, PageSpec

__all__ = ["NULL_BLOCK_ID", "BlockPool", "KVCacheManager", "PageGroup", "PageSpec"]
