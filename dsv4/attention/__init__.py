"""DeepSeek-V4 attention: shared-KV MQA with sinks, a sliding window, and the CSA / HCA compressors.

All three layer types attend over a causal sliding window of raw tokens; HCA layers add every causally complete
entry of a 128:1 compressor, CSA layers the `index_topk` entries of a 4:1 overlapping compressor that a lightning
indexer picks per query.

    core.py               the core in jnp (the spec the other cores are tested against)
    pallas_core.py        the core on the Pallas kernels (Mosaic GPU on Hopper, Triton elsewhere)
    sequence_parallel.py  the core split over the mesh's sequence axis (shard_map, halo and entry exchange)
    dispatch.py           `Kernels.attention` name → core
    compressor.py         pooling windows into entries
    indexer.py            the lightning indexer and its top-k paths
    block.py              `Attention`: projections, cache reads and writes, decode steps
"""

from dsv4.attention.block import Attention
from dsv4.attention.compressor import Compressor, pool_windows, pool_windows_zigzag
from dsv4.attention.core import CompressedKeys, core_attention_jnp
from dsv4.attention.dispatch import ATTENTION_CORES, attention_core
from dsv4.attention.indexer import Indexer, index_topk_fp8, index_topk_jnp, quantize_rows_e4m3
from dsv4.attention.pallas_core import core_attention_pallas, mosaic_applies
from dsv4.attention.sequence_parallel import core_attention_sp, core_attention_sp_pallas

__all__ = ["ATTENTION_CORES", "Attention", "CompressedKeys", "Compressor", "Indexer", "attention_core",
           "core_attention_jnp", "core_attention_pallas", "core_attention_sp", "core_attention_sp_pallas",
           "index_topk_fp8", "index_topk_jnp", "mosaic_applies", "pool_windows", "pool_windows_zigzag",
           "quantize_rows_e4m3"]  # fmt: skip
