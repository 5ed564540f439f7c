"""A per-device memory ledger for one long prompt, from the config alone (`dsv4 plan`).

Everything here is arithmetic on `Config` fields (no JAX, no weights), so a 1.6T-parameter plan takes
milliseconds. The placement it assumes is the engine's on a mesh (`dsv4.LLM(..., mesh=...)`, dsv4/runner.py):

- Weights: routed experts split evenly over the devices (expert parallelism: ceil(E / N) experts each);
  everything else (attention, compressors, indexer, shared expert, router, embeddings, norms,
  hyper-connections) replicated on every device, since the chunk's tokens are split, not these weights.
  Weight formats (`WEIGHT_FORMATS`), as DeepSeek releases them and `dsv4.load(..., keep_quantized=True)` holds
  them (`dsv4/quantization.py`, docs/CHECKPOINTS.md):
    bf16         every matrix 2 B; fp32: 4 B.
    fp8          the matrices a release stores in FP8 (`weights.RELEASED_FP8`: wq_a, wq_b, wkv, wo_b, the
                 indexer's wq_b, shared and routed experts) as e4m3, 1 B, plus one float32 scale per 128 × 128
                 block; the rest (wo_a, compressors, the indexer's compressor and weights_proj, the router)
                 in bf16.
    fp4-experts  as fp8, but the routed experts in e2m1, two per byte, plus one scale per row and 32 columns,
                 held in float32 on the device (a release ships them as 1-byte e8m0; the loader widens them).
  Embeddings and the LM head stay bf16 (fp32 with fp32 weights); norms, sinks, mHC weights and the
  hash-routing tables are float32 / int32. FP8 routed experts in 128 × 128 blocks (hidden and expert widths
  multiples of 128, as V4's) run on the FP8 expert kernels as stored (`Kernels.moe="pallas"`, W8A8); otherwise
  (FP4 experts, other widths) the model dequantizes where it reads them (`param[...]`), so the plan also holds one
  layer's local experts dequantized to bf16 (transient). The dense FP8 matrices are dequantized one at a time
  where read (not counted: the largest, wq_b, is 64 MiB in bf16 at V4-Flash widths).
- KV cache: replicated on every device. Bytes from `dsv4.cache.layout.CacheLayout` (the one definition,
  checked against `DeepseekV4.init_cache` in tests/test_cache_layout.py), for the chosen `KVFormat`
  (`FORMAT_NAMES`): every device holds the whole request's cache, per layer the compressed entries (and CSA's
  indexer keys) of all `context` tokens plus the fixed per-request parts (sliding-window ring and positions,
  the compressors' open windows), plus the per-array FP8 scale state. More devices do not shrink it. Why
  replicated: V4's cache is small (about 4.1 KB per token in fp8-channel, ~2.2 GB for a 512K request, against
  the 96-141 GB of an H20 / H200), and every device needs every compressed entry anyway (HCA attends to all
  entries before each query; CSA's top-k and the lightning indexer's scores range over the whole context), so a
  cache sharded by sequence would all-gather the whole context's entries for every layer of every chunk (at
  512K, CSA's entries alone are 128 MiB a layer, per chunk), while a replicated one gathers only each chunk's new
  rows. The host `KVCacheManager` and its page ids are the same for every device.
- Per chunk, on N devices (what the engine does, dsv4/runner.py): the chunk's tokens are split over the devices,
  ceil(chunk / N) each; each layer all-gathers the chunk's K=V rows ([chunk, head_dim] in the compute dtype) and
  writes them, the closed windows' compressed entries and indexer keys into every device's copy of the cache;
  the routed experts run expert-parallel.
- Communication: one layer's gathered K=V rows of the chunk, double-buffered so the next layer's gather overlaps
  this one (a few MiB); the MoE's expert-parallel exchange (`dsv4.sharding.expert_parallel`, schedule "direct";
  past 2 devices the larger of it and "alltoall"'s packs, whose over-capacity fallback it is): per step of at most
  `EP_STEP_TOKENS` of this device's tokens, the copies received
  from the N − 1 other devices (bf16, or fp8 + one float32 scale per 128 values with FP8 experts) and the N − 1
  float32 partial results sent back and received.
- Activations: one layer's temporaries for one chunk (layers run one after another), for the chunk's share of
  tokens on each device (ceil(chunk / N): the chunk's sequence axis is split too). The big ones: the lightning
  indexer's float32 scores slab, one query chunk of the share against every compressed key of the context (the
  two-pass Pallas indexer, `dsv4.pallas.indexer.index_topk_two_pass`, scores `INDEX_SLAB_BYTES` worth of queries
  at a time; the jnp fallback's [512 × heads × keys] float32 dots are far larger), and the MoE's
  per-(token, expert) buffers in the dtypes `moe.routed_experts_jnp` uses (balanced routing).
- Headroom: plan for 1.2× the peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4.cache.layout import DEFAULT_FP8_FORMAT, FORMAT_NAMES, CacheLayout, KVFormat
from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.pallas.indexer_slab import INDEX_SLAB_BYTES, index_slab_rows  # noqa: F401 (the indexer's slab rule)

GIB = 1 << 30
MIB = 1 << 20
FP8_BLOCK = 128  # fp8 weights: one float32 scale per 128 × 128 block
FP4_GROUP = 32  # fp4 experts: one scale per row and 32 columns (dsv4.quantization.FP4_GROUP)
SCALE_BYTES = 4  # weight scales are float32 on the device (BlockQuantized.scale)
EP_STEP_TOKENS = 32768  # = dsv4.sharding.expert_parallel.DEFAULT_CHUNK_TOKENS (that module imports JAX; a test checks)
ACT_BYTES = 2  # activations, open-window state and dequantized weights in bf16 (the compute dtype)

# The expert exchange's schedules (dsv4.sharding.expert_parallel, which imports JAX; the plan sizes its buffers).
SCHEDULES = ("direct", "ring", "sparse", "alltoall", "auto")
# "sparse" / "alltoall": each peer's rows = the uniform-routing share × this margin (routing is not uniform: a peer
# whose experts are popular needs more; past the capacity the chunk goes "direct").
SPARSE_MARGIN = 1.25


def peer_share(num_experts: int, n: int, k: int) -> float:
    """The share of tokens with at least one of their k distinct experts (uniformly routed) among the num_experts / n
    of one peer: 1 − C(E − E/N, k) / C(E, k)."""
    e_l = num_experts // n
    miss = 1.0
    for j in range(k):
        miss *= max(0, num_experts - e_l - j) / (num_experts - j)
    return 1.0 - miss


def sparse_capacity(num_experts: int, n: int, k: int, margin: float = SPARSE_MARGIN) -> float:
    """The rows "sparse" / "alltoall" send each peer, as a share of the chunk's tokens (at most 1)."""
    return min(1.0, peer_share(num_experts, n, k) * margin)


def resolve_schedule(schedule: str, num_experts: int, n: int, k: int) -> str:
    """Resolves "auto": "direct" on 2 devices (measured: its one transfer each way overlaps the expert GEMMs),
    "alltoall" on more (predicted: two collectives a step instead of 2 (N − 1), each peer sent only its share)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    if schedule != "auto":
        return schedule
    return "direct" if n <= 2 else "alltoall"


WEIGHT_FORMATS = ("bf16", "fp8", "fp4-experts", "fp32")
KV_FORMATS = (*FORMAT_NAMES, "fp8", "fp32")  # "fp8" = DEFAULT_FP8_FORMAT; "fp32": unquantized float32 rows
# Device memory as the driver reports it (nvidia-smi's total, MiB): what a process can see, a little under
# the nominal size (an H20's "96 GB" is 97871 MiB = 95.6 GiB).
DEVICE_MIB = {"h20": 97871, "h100": 81559, "h800": 81559, "h200": 143771}
DEFAULT_DEVICE = "h20"  # the seed article's 8 × H20


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter (and buffer) element counts of a config, by how they are stored and placed."""

    routed_experts: int
    """Routed experts' gate/up and down matrices: split over the devices."""
    dense_linear: int
    """Attention, compressor, indexer, shared-expert and router matrices: replicated."""
    embeddings: int
    """Token embedding and LM head: replicated, bf16 even with fp8 weights."""
    small_fp32: int
    """Norm weights, sinks, position biases, hyper-connection weights: replicated, float32."""
    buffers: int
    """Hash-routing tables (int32) and expert-selection biases (float32): 4 bytes each, replicated."""
    dense_linear_fp8: int
    """The part of `dense_linear` a release stores in FP8 (wq_a, wq_b, wkv, wo_b, indexer wq_b, shared expert)."""
    dense_linear_fp8_blocks: int
    routed_experts_fp8_blocks: int
    """128 × 128 blocks of those FP8 matrices: one float32 scale each."""
    routed_experts_fp4_scales: int
    """Scales of the routed experts stored in FP4: one per row and 32 columns."""

    @property
    def num_params(self) -> int:
        """nnx.Param elements: what `dsv4.num_params(model)` counts (buffers are not parameters)."""
        return self.routed_experts + self.dense_linear + self.embeddings + self.small_fp32


def count_params(config: Config) -> ParamCounts:
    """Element counts of every tensor `DeepseekV4(config)` declares, grouped for the ledger."""
    d, hc, v = config.hidden_size, config.hc_mult, config.vocab_size
    h, hd, ql = config.num_attention_heads, config.head_dim, config.q_lora_rank
    g, r = config.o_groups, config.o_lora_rank
    e, i, k = config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok
    ih, ihd = config.index_n_heads, config.index_head_dim
    counts = dict(routed=0, dense=0, dense_fp8=0, small=0, buffers=0, dense_blocks=0, routed_blocks=0, fp4=0)

    def matrix(rows: int, cols: int, copies: int = 1, kind: str = "dense", fp8: bool = True) -> None:
        """`kind` "routed" or "dense"; `fp8`: a release stores it in FP8 (routed experts always)."""
        counts["routed" if kind == "routed" else "dense"] += copies * rows * cols
        if kind == "routed":
            counts["fp4"] += copies * rows * _ceil_div(cols, FP4_GROUP)
        elif fp8:
            counts["dense_fp8"] += copies * rows * cols
        if fp8:
            counts[f"{kind}_blocks"] += copies * _ceil_div(rows, FP8_BLOCK) * _ceil_div(cols, FP8_BLOCK)

    hc_mix = (2 + hc) * hc
    for layer_type, mlp_type in zip(config.layer_types, config.mlp_layer_types, strict=True):
        counts["small"] += 2 * (hc_mix * hc * d + hc_mix + 3)  # attn_hc, ffn_hc: fn, base, scale
        counts["small"] += 2 * d  # input / post-attention norms
        # attention: q LoRA, shared K=V head, grouped low-rank output (wo_a ships in bf16), sinks
        matrix(ql, d)
        matrix(h * hd, ql)
        matrix(hd, d)
        matrix(g * r, h * hd // g, fp8=False)
        matrix(d, g * r)
        counts["small"] += ql + hd + h  # q_a_norm, kv_norm, sinks
        if layer_type != SLIDING:
            rate = config.compress_rate(layer_type)
            width = 2 * hd if layer_type == CSA else hd  # CSA pools overlapping windows: two halves
            matrix(width, d, copies=2, fp8=False)  # kv_proj, gate_proj ("stored in bf16")
            counts["small"] += rate * width + hd  # position_bias, kv_norm
        if layer_type == CSA:  # the lightning indexer: its own overlapping compressor + query and weights
            matrix(2 * ihd, d, copies=2, fp8=False)
            counts["small"] += config.compress_rate(CSA) * 2 * ihd + ihd
            matrix(ih * ihd, ql)
            matrix(ih, d, fp8=False)
        # MoE: router (float in releases), routed experts (gate+up fused, down), one shared expert
        matrix(e, d, fp8=False)
        matrix(2 * i, d, copies=e, kind="routed")
        matrix(d, i, copies=e, kind="routed")
        matrix(i, d, copies=2)
        matrix(d, i)
        counts["buffers"] += v * k if mlp_type == "hash_moe" else e
    counts["small"] += hc * hc * d + hc + 1 + d  # hyper-head, final norm
    return ParamCounts(
        routed_experts=counts["routed"], dense_linear=counts["dense"], embeddings=2 * v * d,
        small_fp32=counts["small"], buffers=counts["buffers"], dense_linear_fp8=counts["dense_fp8"],
        dense_linear_fp8_blocks=counts["dense_blocks"], routed_experts_fp8_blocks=counts["routed_blocks"],
        routed_experts_fp4_scales=counts["fp4"],
    )  # fmt: skip


def kv_format(name: str, config: Config) -> KVFormat:
    """A `KV_FORMATS` name → the `KVFormat` the cache stores ("fp8" is the default FP8 format)."""
    if name == "fp8":
        name = DEFAULT_FP8_FORMAT
    if name == "fp32":
        return KVFormat("fp32", dtype="float32")
    if name not in FORMAT_NAMES:
        raise ValueError(f"KV format {name!r}: choose one of {list(KV_FORMATS)}")
    return KVFormat.named(name, rope_dim=config.qk_rope_head_dim)


def cache_layout(config: Config, kv: str) -> CacheLayout:
    """The per-layer cache layout the plan sizes the KV cache with (open-window state in bf16)."""
    return CacheLayout.from_config(config, kv_format(kv, config), state_dtype="bfloat16")


@dataclass(frozen=True)
class LedgerLine:
    name: str
    bytes_per_device: int
    how: str


@dataclass(frozen=True)
class MemoryPlan:
    config: Config = field(repr=False)
    context: int
    devices: int
    kv_format: str
    weights: str
    chunk_size: int
    device_memory_gib: float
    headroom: float
    lines: tuple[LedgerLine, ...]
    device: str | None = None
    kv_bytes_per_token: float = 0.0
    """One request's whole cache (all layers, CacheLayout) at `context` tokens / `context`."""

    @property
    def total_bytes(self) -> int:
        return sum(line.bytes_per_device for line in self.lines)

    @property
    def required_bytes(self) -> int:
        return math.ceil(self.total_bytes * self.headroom)

    @property
    def capacity_bytes(self) -> int:
        return int(self.device_memory_gib * GIB)

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes

    def line(self, name: str) -> LedgerLine:
        return next(line for line in self.lines if line.name == name)

    def more_slots_bytes(self, slots: int) -> float:
        """The caches of `slots` − 1 more requests of `context` tokens: the ledger counts one request's."""
        return (slots - 1) * self.kv_bytes_per_token * self.context


def device_gib(device: str) -> float:
    """A `DEVICE_MIB` preset's memory in GiB."""
    if device not in DEVICE_MIB:
        raise ValueError(f"device {device!r}: choose one of {sorted(DEVICE_MIB)} or give the memory in GiB")
    return DEVICE_MIB[device] * MIB / GIB


def fp8_expert_kernels(config: Config, weights: str) -> bool:
    """The routed experts run on the FP8 kernels (`dsv4.moe`, Pallas): fp8 weights in 128 × 128 blocks as stored,
    or fp4 ones re-blocked as fp8 each step; both need expert widths that are multiples of 128."""
    fits = config.hidden_size % FP8_BLOCK == 0 and config.moe_intermediate_size % FP8_BLOCK == 0
    return weights in ("fp8", "fp4-experts") and fits


def _weights_lines(config: Config, c: ParamCounts, weights: str, devices: int) -> list[LedgerLine]:
    e = config.n_routed_experts
    local = _ceil_div(e, devices)  # experts on the device that holds the most
    if weights in ("bf16", "fp32"):
        wb = 2 if weights == "bf16" else 4
        routed_all, routed_how = c.routed_experts * wb, f"{c.routed_experts / 1e9:.2f}B params × {wb} B"
        dense = c.dense_linear * wb
        dense_how = f"{c.dense_linear / 1e9:.2f}B params × {wb} B"
        dequant, dequant_how = 0, "none: weights used as stored"
    else:
        if weights == "fp8":
            routed_all = c.routed_experts + c.routed_experts_fp8_blocks * SCALE_BYTES
            routed_how = f"{c.routed_experts / 1e9:.2f}B params × 1 B (e4m3) + 1 float32 scale / 128×128 block"
        else:
            routed_all = _ceil_div(c.routed_experts, 2) + c.routed_experts_fp4_scales * SCALE_BYTES
            routed_how = f"{c.routed_experts / 1e9:.2f}B params × ½ B (e2m1) + 1 float32 scale / 32 columns"
        bf16_dense = c.dense_linear - c.dense_linear_fp8
        dense = c.dense_linear_fp8 + c.dense_linear_fp8_blocks * SCALE_BYTES + bf16_dense * 2
        dense_how = (f"{c.dense_linear_fp8 / 1e9:.2f}B fp8 (+ block scales: wq_a, wq_b, wkv, wo_b, indexer wq_b, "
                     f"shared experts) + {bf16_dense / 1e9:.2f}B bf16 (wo_a, compressors, router)")  # fmt: skip
        layer_experts = 3 * config.moe_intermediate_size * config.hidden_size  # gate, up, down of one expert
        if fp8_expert_kernels(config, weights) and weights == "fp8":
            dequant = 0
            dequant_how = "none: the FP8 expert kernels read e4m3 + block scales as stored (Kernels.moe pallas)"
        elif fp8_expert_kernels(config, weights):
            blocks = layer_experts // (FP8_BLOCK * FP8_BLOCK)
            dequant = local * (layer_experts + blocks * SCALE_BYTES)
            dequant_how = f"one layer's {local} local experts re-blocked as FP8 (1 B + block scales), transient"
        else:
            dequant = local * layer_experts * ACT_BYTES
            dequant_how = (f"one layer's {local} local experts dequantized to bf16 (widths not multiples of 128: "
                           "no FP8 kernel), transient")  # fmt: skip
    routed = local * routed_all // e  # every expert of every layer has the same shape
    embed_bytes = 4 if weights == "fp32" else 2
    small = c.embeddings * embed_bytes + (c.small_fp32 + c.buffers) * 4
    return [
        LedgerLine("weights: routed experts", routed, f"{routed_how}; {local} of {e} experts per device"),
        LedgerLine("weights: dense (replicated)", dense, dense_how),
        LedgerLine(
            "weights: embeddings, norms (replicated)",
            small,
            f"embed + lm_head {c.embeddings / 1e9:.2f}B × {embed_bytes} B; norms, sinks, mHC, hash tables × 4 B",
        ),  # fmt: skip
        LedgerLine("weights: dequantized layer (transient)", dequant, dequant_how),
    ]


_TYPE_LABEL = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


def _kv_lines(config: Config, layout: CacheLayout, context: int) -> list[LedgerLine]:
    """Per layer type: the whole request's cache (every token's compressed rows + the fixed per-request parts),
    which every device holds (replicated: the same on any device count)."""
    fmt = layout.kv_format.name
    lines = []
    for layer_type in (SLIDING, CSA, HCA):
        layers = [layer for layer in layout.layers if layer.layer_type == layer_type]
        if not layers:
            continue
        one = layers[0]
        growing = [a for a in one.arrays if a.tokens_per_row]
        fixed = sum(a.bytes(context) for a in one.arrays if not a.tokens_per_row)
        parts = [f"{a.num_rows(context)} {a.path} × {a.row_bytes} B" for a in growing]
        ring = sum(a.bytes(context) for a in one.arrays if a.path in ("window", "window_pos"))
        fixed_how = f"ring {ring / 1024:.1f} KiB" + (
            f" + open windows {(fixed - ring) / 1024:.1f} KiB" if fixed > ring else ""
        )
        parts.append(fixed_how)
        total = sum(layer.bytes_per_request(context) for layer in layers)
        tokens = f"all {context} tokens: " if growing else ""
        lines.append(LedgerLine(f"KV cache: {_TYPE_LABEL[layer_type]} layers", total,
                                f"{len(layers)} × ({tokens}{' + '.join(parts)}); {fmt}; replicated on every "
                                "device"))  # fmt: skip
    lines.append(LedgerLine(
        "KV cache: scale state (replicated)", layout.shared_bytes,
        f"{fmt}: per-array float32 scales, every layer" if layout.shared_bytes else f"{fmt}: none per array",
    ))  # fmt: skip
    return lines


# Prefill chunk tokens a device, the engine's defaults: 32K where the device has the room, else 16K. At 512K on one
# H100, 32K-token chunks took 3462 ms against 3605 ms for 16K (1.041x) for 2.5 GiB more peak memory; on an H200 16K
# took 5593 ms against 5912 ms for 8K. The MoE's grouped GEMMs run faster on more tokens, and fewer chunks launch
# fewer kernels (docs/BENCHMARKS.md, the ablation's step table). 32K costs V4-Flash at 512K on 8 devices 14.3 GiB
# more a device with the headroom.
CHUNK_TOKENS_PER_DEVICE = 16384
LONG_CHUNK_TOKENS_PER_DEVICE = 32768


DEFAULT_MAX_MODEL_LEN = 32768


def default_max_model_len(config: Config) -> int:
    """The engine's default request length limit (prompt + new tokens): `DEFAULT_MAX_MODEL_LEN`, or the model's
    max_position_embeddings if shorter."""
    return min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def default_chunk_size(context: int, devices: int = 1, fits: Callable[[int], bool] | None = None) -> int:
    """The default prefill chunk: `LONG_CHUNK_TOKENS_PER_DEVICE` tokens a device where `fits(chunk)` says the device
    has the room for it, else `CHUNK_TOKENS_PER_DEVICE` (also when `fits` is None); a chunk's tokens are split over
    the devices, and a chunk is at most `context` (a longer one would only compile a wider call no prompt fills)."""
    short = max(1, min(CHUNK_TOKENS_PER_DEVICE * devices, context))
    long = max(1, min(LONG_CHUNK_TOKENS_PER_DEVICE * devices, context))
    return long if long > short and fits is not None and fits(long) else short


def plan_memory(
    config: Config,
    *,
    context: int,
    devices: int,
    kv_format: str = DEFAULT_FP8_FORMAT,
    weights: str = "bf16",
    chunk_size: int = 8192,
    device_memory_gib: float | None = None,
    device: str | None = DEFAULT_DEVICE,
    headroom: float = 1.2,
) -> MemoryPlan:
    """The per-device ledger for one request of `context` tokens on `devices` devices.

    Device memory: `device_memory_gib` if given, else the `device` preset's (`DEVICE_MIB`). The defaults (chunk
    8192, `device` h20) are the seed article's deployment; the engine's own chunk is `default_chunk_size`."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r}: choose one of {list(KV_FORMATS)}")
    kv_format = DEFAULT_FP8_FORMAT if kv_format == "fp8" else kv_format
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}: choose one of {list(WEIGHT_FORMATS)}")
    for name, value in (("context", context), ("devices", devices), ("chunk_size", chunk_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if context > config.max_position_embeddings:
        raise ValueError(
            f"context={context} tokens exceeds the model's limit, max_position_embeddings="
            f"{config.max_position_embeddings}: the longest prompt this model takes"
        )
    if device_memory_gib is None:
        if device is None:
            raise ValueError("give a device preset or device_memory_gib")
        device_memory_gib = device_gib(device)
    else:
        device = None
    if device_memory_gib <= 0 or headroom < 1:
        raise ValueError(f"device_memory_gib={device_memory_gib} must be > 0 and headroom={headroom} >= 1")

    c = count_params(config)
    layout = cache_layout(config, kv_format)
    lines = _weights_lines(config, c, weights, devices)
    lines += _kv_lines(config, layout, context)

    t = _ceil_div(min(chunk_size, context), devices)  # this device's share of one chunk
    # The cache is replicated: each layer gathers only the chunk's new K=V rows (every device's share, padded to
    # the same length), in the compute dtype, double-buffered so the next layer's gather overlaps this one.
    gathered, gathered_how = 0, "one device: nothing to gather"
    if devices > 1:
        gathered = 2 * devices * t * config.head_dim * ACT_BYTES
        gathered_how = (f"2 × one layer's new K=V rows of the chunk: {devices} × {t} tokens × {config.head_dim} × "
                        f"{ACT_BYTES} B (all-gathered per layer, double-buffered), written into every device's "
                        "cache")  # fmt: skip
    d, k, i = config.hidden_size, config.num_experts_per_tok, config.moe_intermediate_size
    per_token = (
        2 * config.hc_mult * d  # residual streams in and out
        + config.q_lora_rank + 2 * config.num_attention_heads * config.head_dim + config.head_dim  # q, out, kv
        + config.index_n_heads * config.index_head_dim  # indexer queries
    ) * ACT_BYTES  # fmt: skip
    # MoE per (token, expert) pair, as `routed_experts_jnp` holds them: the gathered input (bf16), gate/up
    # (float32), SwiGLU (bf16), the weighted output (float32); plus the float32 combine per token.
    moe_pair = d * ACT_BYTES + 2 * i * 4 + i * ACT_BYTES + d * 4
    per_token += k * moe_pair + d * 4
    has_csa = CSA in config.layer_types
    csa_keys = _ceil_div(context, config.compress_rate(CSA)) if has_csa else 0
    slab_rows = index_slab_rows(csa_keys)
    index_scores = min(t, slab_rows) * csa_keys * 4
    activations = t * per_token + index_scores + config.vocab_size * 4

    # Expert parallelism ("direct"): the other devices' copies of one step's tokens, and the float32 partial
    # results for them, sent back and received. "alltoall" (the model's default past 2 devices): each device's packs
    # out and in, and their parts out and back; its fallback is "direct", so the larger of the two.
    step = min(t, EP_STEP_TOKENS)
    token_bytes = d + d // FP8_BLOCK * SCALE_BYTES if fp8_expert_kernels(config, weights) else d * ACT_BYTES
    token_how = (
        f"{d} B fp8 + {d // FP8_BLOCK} × 4 B scales" if fp8_expert_kernels(config, weights) else f"{d} × {ACT_BYTES} B"
    )
    exchange = (devices - 1) * step * (token_bytes + 2 * d * 4)
    exchange_how = (f"{devices - 1} other devices × {step} tokens × ({token_how} in + 2 × {d} × 4 B partial "
                    "results out and back)")  # fmt: skip
    e, k = config.n_routed_experts, config.num_experts_per_tok
    if devices > 1 and resolve_schedule("auto", e, devices, k) == "alltoall":
        rows = math.ceil(sparse_capacity(e, devices, k) * step)
        packed = devices * rows * 2 * (token_bytes + d * 4)
        if packed > exchange:
            exchange = packed
            exchange_how = (f"all-to-all: {devices} packs × {rows} rows × 2 × ({token_how} + {d} × 4 B partial "
                            "results), out and in")  # fmt: skip
    lines += [
        LedgerLine("activations: one chunk", activations,
                   f"{t} tokens (of a {chunk_size}-token chunk) × {per_token} B, one layer; indexer scores "
                   f"{min(t, slab_rows)} × {csa_keys} × 4 B; last-token logits"),
        LedgerLine("communication: chunk K=V all-gather", gathered, gathered_how),
        LedgerLine("communication: MoE exchange", exchange, exchange_how),
    ]  # fmt: skip
    return MemoryPlan(config, context, devices, kv_format, weights, chunk_size, device_memory_gib, headroom,
                      tuple(lines), device, layout.bytes_per_request(context) / context)  # fmt: skip


def _replan(plan: MemoryPlan, **changes) -> MemoryPlan:
    args = dict(
        context=plan.context,
        devices=plan.devices,
        kv_format=plan.kv_format,
        weights=plan.weights,
        chunk_size=plan.chunk_size,
        device_memory_gib=plan.device_memory_gib,
        headroom=plan.headroom,
    )
    args.update(changes)
    return dataclasses.replace(plan_memory(plan.config, **args), device=plan.device)


def suggestions(plan: MemoryPlan, *, max_devices: int = 4096) -> list[str]:
    """What would make a plan that does not fit, fit: each change alone, with its new per-device need.

    The KV cache is replicated, so more devices shrink only the routed experts, one chunk's activations and
    the exchange buffers: `--devices` is named only where that alone makes the plan fit; a cache too big for
    one device calls for an FP8 KV format or a shorter context."""
    if plan.fits:
        return []
    out = []

    def describe(flag: str, alt: MemoryPlan) -> str:
        return f"{flag}: needs {alt.required_bytes / GIB:.1f} GiB per device (with headroom)"

    for options in ((("--weights fp8", dict(weights="fp8")), ("--weights fp4-experts", dict(weights="fp4-experts"))),
                    ((f"--kv-format {DEFAULT_FP8_FORMAT}", dict(kv_format=DEFAULT_FP8_FORMAT)),)):  # fmt: skip
        for flag, change in options:  # smallest change first; stop at the first that fits
            alt = _replan(plan, **change)
            if alt.required_bytes < plan.required_bytes:
                out.append(describe(flag, alt) + ("" if alt.fits else ", still too much alone"))
                if alt.fits:
                    break
    # The engine splits the routed experts evenly (`dsv4.sharding.check_mesh`): only device counts dividing them.
    e = plan.config.n_routed_experts
    counts = [n for n in range(plan.devices + 1, min(e, max_devices) + 1) if e % n == 0]
    devices = next((n for n in counts if _replan(plan, devices=n).fits), None)
    if devices is not None:
        out.append(describe(f"--devices {devices}", _replan(plan, devices=devices)))
    else:  # what no device count shrinks: the replicated weights and the KV cache (replicated, whole context)
        weights = sum(ln.bytes_per_device for ln in plan.lines if ln.name.startswith("weights: ") and
                      "(replicated)" in ln.name)  # fmt: skip
        kv = sum(ln.bytes_per_device for ln in plan.lines if ln.name.startswith("KV cache: "))
        tried = f" (up to {counts[-1]}, dividing the {e} routed experts)" if counts else ""
        out.append(f"more devices alone do not help{tried}: every device holds the replicated weights "
                   f"({weights / GIB:.1f} GiB) and the whole KV cache ({kv / GIB:.1f} GiB), whatever their "
                   "number")  # fmt: skip
    lo, hi = 1, plan.context  # the longest context that fits as is
    if _replan(plan, context=lo).fits:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _replan(plan, context=mid).fits:
                lo = mid
            else:
                hi = mid - 1
        out.append(describe(f"--context {lo}", _replan(plan, context=lo)) + " (the longest that fits as is)")
    else:
        out.append("no context length fits as is: the weights alone exceed the device")
    return out


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:9.3f} {unit}"
    return f"{n:9d} B  "


def format_plan(plan: MemoryPlan) -> str:
    c = plan.config
    where = f"{plan.device} " if plan.device else ""
    rows = [f"memory plan: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.n_routed_experts} experts; "
            f"context {plan.context} tokens over {plan.devices} {where}device(s) (each chunk's tokens split evenly, "
            f"KV cache replicated on every device), "
            f"weights {plan.weights}, KV {plan.kv_format} ({plan.kv_bytes_per_token:.1f} B/token for the whole "
            f"request), chunk {plan.chunk_size}", "per device:"]  # fmt: skip
    width = max(len(line.name) for line in plan.lines)
    for line in plan.lines:
        rows.append(f"  {line.name:<{width}}  {_size(line.bytes_per_device)}   {line.how}")
    rows += [
        f"  {'total':<{width}}  {_size(plan.total_bytes)}",
        f"  {f'× {plan.headroom} headroom':<{width}}  {_size(plan.required_bytes)}   "
        f"of {plan.device_memory_gib:.2f} GiB per {where}device",
        "",
    ]  # fmt: skip
    spare = plan.capacity_bytes - plan.required_bytes
    if plan.fits:
        rows.append(f"fits: {spare / GIB:.2f} GiB per device to spare after {plan.headroom}x headroom")
    else:
        rows.append(f"DOES NOT FIT: {-spare / GIB:.2f} GiB per device over, with {plan.headroom}x headroom")
    tips = suggestions(plan)
    if tips:
        rows.append("to make it fit, change one of:")
        rows += [f"  {tip}" for tip in tips]
    return "\n".join(rows)


def plan_to_dict(plan: MemoryPlan) -> dict:
    return {
        "context": plan.context, "devices": plan.devices, "device": plan.device, "kv_format": plan.kv_format,
        "kv_bytes_per_token": plan.kv_bytes_per_token, "weights": plan.weights, "chunk_size": plan.chunk_size,
        "device_memory_gib": plan.device_memory_gib, "headroom": plan.headroom,
        "lines": [{"name": ln.name, "bytes_per_device": ln.bytes_per_device, "how": ln.how} for ln in plan.lines],
        "total_bytes": plan.total_bytes, "required_bytes": plan.required_bytes, "capacity_bytes": plan.capacity_bytes,
        "fits": plan.fits, "suggestions": suggestions(plan),
    }  # fmt: skip


__all__ = ["CHUNK_TOKENS_PER_DEVICE", "DEVICE_MIB", "GIB", "KV_FORMATS", "LONG_CHUNK_TOKENS_PER_DEVICE",
           "WEIGHT_FORMATS", "LedgerLine", "MemoryPlan", "ParamCounts", "cache_layout", "count_params",
           "default_chunk_size", "default_max_model_len", "device_gib", "format_plan", "kv_format", "plan_memory",
           "plan_to_dict", "suggestions"]  # fmt: skip
