"""A per-device memory ledger for one long prompt, from the config alone (`dsv4 plan`).

Everything here is arithmetic on `Config` fields (no JAX, no weights), so a 1.6T-parameter plan takes
milliseconds. The layout it assumes is the one the seed article describes for 512K prompts on 8 GPUs:

- Weights: routed experts split evenly over the devices (expert parallelism); everything else (attention,
  compressors, indexer, shared expert, router, embeddings, norms, hyper-connections) replicated on every
  device, since sequence parallelism splits tokens, not these weights. FP8 weights are e4m3 with one
  float32 scale per 128×128 block, for the linear layers and experts (embeddings and the LM head stay
  bf16, norms and the like float32), as DeepSeek releases them.
- KV cache: the context's compressed entries (CSA: 1 per 4 tokens, head_dim wide, plus the indexer's key
  of index_head_dim; HCA: 1 per 128 tokens, head_dim wide) split over the devices along the sequence; each
  device also keeps every layer's sliding-window ring (sliding_window × head_dim).
- Activations: one layer's temporaries for one chunk (layers run one after another), for the chunk's
  share of tokens on each device; the big one is the indexer's float32 scores of every query in the
  chunk against every compressed key of the context, before its top-k.
- Communication buffers: one layer's gathered compressed KV, double-buffered so the all-gather of the
  next layer overlaps this one; the MoE all-to-all's dispatch and combine buffers (send + receive).
- Headroom: the seed's rule, plan for 1.2× the peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dsv4.config import CSA, HCA, Config

GIB = 1 << 30
BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
FP8_BLOCK = 128  # fp8 weights: one float32 scale per 128 × 128 block
ACT_BYTES = 2  # activations in bf16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter (and buffer) element counts of a config, by how they are stored and placed."""

    routed_experts: int
    """Routed experts' gate/up and down matrices: split over the devices."""
    dense_linear: int
    """Attention, compressor, indexer, shared-expert and router matrices: replicated, fp8-able."""
    embeddings: int
    """Token embedding and LM head: replicated, bf16 even with fp8 weights."""
    small_fp32: int
    """Norm weights, sinks, position biases, hyper-connection weights: replicated, float32."""
    buffers: int
    """Hash-routing tables (int32) and expert-selection biases (float32): 4 bytes each, replicated."""
    dense_linear_fp8_blocks: int
    routed_experts_fp8_blocks: int
    """128 × 128 blocks of those matrices: one float32 scale each when stored in fp8."""

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
    counts = dict(routed=0, dense=0, small=0, buffers=0, dense_blocks=0, routed_blocks=0)

    def matrix(rows: int, cols: int, copies: int = 1, kind: str = "dense") -> None:
        counts["routed" if kind == "routed" else "dense"] += copies * rows * cols
        counts[f"{kind}_blocks"] += copies * _ceil_div(rows, FP8_BLOCK) * _ceil_div(cols, FP8_BLOCK)

    hc_mix = (2 + hc) * hc
    for layer_type, mlp_type in zip(config.layer_types, config.mlp_layer_types, strict=True):
        counts["small"] += 2 * (hc_mix * hc * d + hc_mix + 3)  # attn_hc, ffn_hc: fn, base, scale
        counts["small"] += 2 * d  # input / post-attention norms
        # attention: q LoRA, shared K=V head, grouped low-rank output, sinks
        matrix(ql, d)
        matrix(h * hd, ql)
        matrix(hd, d)
        matrix(g * r, h * hd // g)
        matrix(d, g * r)
        counts["small"] += ql + hd + h  # q_a_norm, kv_norm, sinks
        if layer_type != "sliding_attention":
            rate = config.compress_rate(layer_type)
            width = 2 * hd if layer_type == CSA else hd  # CSA pools overlapping windows: two halves
            matrix(width, d, copies=2)  # kv_proj, gate_proj
            counts["small"] += rate * width + hd  # position_bias, kv_norm
        if layer_type == CSA:  # the lightning indexer: its own overlapping compressor + query and weights
            matrix(2 * ihd, d, copies=2)
            counts["small"] += config.compress_rate(CSA) * 2 * ihd + ihd
            matrix(ih * ihd, ql)
            matrix(ih, d)
        # MoE: router, routed experts (gate+up fused, down), one shared expert
        matrix(e, d)
        matrix(2 * i, d, copies=e, kind="routed")
        matrix(d, i, copies=e, kind="routed")
        matrix(i, d, copies=2)
        matrix(d, i)
        counts["buffers"] += v * k if mlp_type == "hash_moe" else e
    counts["small"] += hc * hc * d + hc + 1 + d  # hyper-head, final norm
    return ParamCounts(
        routed_experts=counts["routed"], dense_linear=counts["dense"], embeddings=2 * v * d,
        small_fp32=counts["small"], buffers=counts["buffers"], dense_linear_fp8_blocks=counts["dense_blocks"],
        routed_experts_fp8_blocks=counts["routed_blocks"],
    )  # fmt: skip


def kv_bytes_per_token(config: Config, kv_dtype: str = "bf16") -> dict[str, float]:
    """KV bytes one context token adds, per layer type summed over the layers of that type (the rings,
    constant in the context length, are not included)."""
    per_type = {"sliding_attention": 0.0, CSA: 0.0, HCA: 0.0}
    for layer_type in config.layer_types:
        if layer_type == CSA:
            per_type[CSA] += (config.head_dim + config.index_head_dim) / config.compress_rate(CSA)
        elif layer_type == HCA:
            per_type[HCA] += config.head_dim / config.compress_rate(HCA)
    return {t: elements * BYTES[kv_dtype] for t, elements in per_type.items()}


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
    kv_dtype: str
    weights_dtype: str
    chunk_size: int
    device_memory_gib: float
    headroom: float
    lines: tuple[LedgerLine, ...]

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


def plan_memory(
    config: Config,
    *,
    context: int,
    devices: int,
    kv_dtype: str = "bf16",
    weights_dtype: str = "bf16",
    chunk_size: int = 8192,
    device_memory_gib: float = 96.0,
    headroom: float = 1.2,
) -> MemoryPlan:
    """The per-device ledger for one request of `context` tokens on `devices` devices."""
    for name, value in (("kv_dtype", kv_dtype), ("weights_dtype", weights_dtype)):
        if value not in BYTES:
            raise ValueError(f"{name}={value!r}: choose one of {sorted(BYTES)}")
    for name, value in (("context", context), ("devices", devices), ("chunk_size", chunk_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if context > config.max_position_embeddings:
        raise ValueError(
            f"context={context} exceeds the model's max_position_embeddings={config.max_position_embeddings}"
        )
    if device_memory_gib <= 0 or headroom < 1:
        raise ValueError(f"device_memory_gib={device_memory_gib} must be > 0 and headroom={headroom} >= 1")
    c = count_params(config)
    wb = BYTES[weights_dtype]
    scale = 4 if weights_dtype == "fp8" else 0  # bytes of one fp8 block scale
    routed = _ceil_div(c.routed_experts * wb + c.routed_experts_fp8_blocks * scale, devices)
    dense = c.dense_linear * wb + c.dense_linear_fp8_blocks * scale
    embed_bytes = max(wb, 2)  # fp8 releases keep embeddings and the LM head in bf16
    small = c.embeddings * embed_bytes + (c.small_fp32 + c.buffers) * 4

    kb = BYTES[kv_dtype]
    entries = 0  # compressed-KV elements of the whole context
    largest_layer = 0  # one layer's gathered compressed KV, in elements
    for layer_type in config.layer_types:
        if layer_type == "sliding_attention":
            continue
        n = _ceil_div(context, config.compress_rate(layer_type))
        width = config.head_dim + (config.index_head_dim if layer_type == CSA else 0)
        entries += n * width
        largest_layer = max(largest_layer, n * width)
    kv = _ceil_div(entries * kb, devices)
    ring = config.num_hidden_layers * config.sliding_window * config.head_dim * kb

    t = _ceil_div(min(chunk_size, context), devices)  # this device's share of one chunk
    d, k = config.hidden_size, config.num_experts_per_tok
    per_token = (
        2 * config.hc_mult * d  # residual streams in and out
        + config.q_lora_rank + 2 * config.num_attention_heads * config.head_dim + config.head_dim  # q, out, kv
        + config.index_n_heads * config.index_head_dim  # indexer queries
        + k * (2 * d + 2 * config.moe_intermediate_size)  # MoE: dispatched copies, gate/up, expert outputs
    ) * ACT_BYTES  # fmt: skip
    has_csa = CSA in config.layer_types
    index_scores = t * _ceil_div(context, config.compress_rate(CSA)) * 4 if has_csa else 0
    activations = t * per_token + index_scores + config.vocab_size * 4

    kv_gather = 2 * largest_layer * kb if devices > 1 else 0
    all_to_all = 4 * t * k * d * ACT_BYTES if devices > 1 else 0

    rate_note = ", ".join(f"{name} 1/{config.compress_rate(t_)}" for name, t_ in (("CSA", CSA), ("HCA", HCA))
                          if t_ in config.layer_types)  # fmt: skip
    lines = (
        LedgerLine(
            "weights: routed experts",
            routed,
            f"{c.routed_experts / 1e9:.2f}B params × {wb} B{' + block scales' if scale else ''} / {devices} devices",
        ),
        LedgerLine(
            "weights: dense (replicated)",
            dense,
            f"{c.dense_linear / 1e9:.2f}B params × {wb} B{' + block scales' if scale else ''}: attention, "
            "compressors, indexer, shared experts, routers",
        ),
        LedgerLine(
            "weights: embeddings, norms (replicated)",
            small,
            f"embed + lm_head {c.embeddings / 1e9:.2f}B × {embed_bytes} B; norms, sinks, mHC, hash tables × 4 B",
        ),
        LedgerLine(
            "KV cache: compressed entries",
            kv,
            f"{context} tokens × {sum(kv_bytes_per_token(config, kv_dtype).values()):.1f} B/token ({rate_note}; "
            f"{kv_dtype}) / {devices} devices",
        ),
        LedgerLine(
            "KV cache: sliding-window rings",
            ring,
            f"{config.num_hidden_layers} layers × {config.sliding_window} × {config.head_dim} × {kb} B",
        ),
        LedgerLine(
            "activations: one chunk",
            activations,
            f"{t} tokens of a {chunk_size}-token chunk, one layer; indexer scores {t} × "
            f"{_ceil_div(context, config.compress_rate(CSA)) if has_csa else 0} × 4 B",
        ),
        LedgerLine(
            "communication: KV all-gather",
            kv_gather,
            "largest layer's compressed KV of the whole context, double-buffered",
        ),
        LedgerLine(
            "communication: MoE all-to-all",
            all_to_all,
            f"dispatch + combine, send + receive: 4 × {t} tokens × top-{k} × {d} × {ACT_BYTES} B",
        ),
    )
    return MemoryPlan(config, context, devices, kv_dtype, weights_dtype, chunk_size, device_memory_gib, headroom,
                      lines)  # fmt: skip


def _replan(plan: MemoryPlan, **changes) -> MemoryPlan:
    args = dict(
        context=plan.context,
        devices=plan.devices,
        kv_dtype=plan.kv_dtype,
        weights_dtype=plan.weights_dtype,
        chunk_size=plan.chunk_size,
        device_memory_gib=plan.device_memory_gib,
        headroom=plan.headroom,
    )
    args.update(changes)
    return plan_memory(plan.config, **args)


def suggestions(plan: MemoryPlan, *, max_devices: int = 4096) -> list[str]:
    """What would make a plan that does not fit, fit: each change alone, with its new per-device need."""
    if plan.fits:
        return []
    out = []

    def describe(flag: str, alt: MemoryPlan) -> str:
        return f"{flag}: needs {alt.required_bytes / GIB:.1f} GiB per device (with headroom)"

    for flag, change in (("--weights-dtype fp8", dict(weights_dtype="fp8")), ("--kv-dtype fp8", dict(kv_dtype="fp8"))):
        key = next(iter(change))
        if BYTES[change[key]] < BYTES[getattr(plan, key)]:
            alt = _replan(plan, **change)
            out.append(describe(flag, alt) + ("" if alt.fits else ", still too much alone"))
    devices = plan.devices
    while devices < max_devices and not _replan(plan, devices=devices).fits:
        devices *= 2
    if _replan(plan, devices=devices).fits:
        lo = max(plan.devices + 1, devices // 2)  # the smallest device count that fits, between the doublings
        while lo < devices:
            mid = (lo + devices) // 2
            if _replan(plan, devices=mid).fits:
                devices = mid
            else:
                lo = mid + 1
        out.append(describe(f"--devices {devices}", _replan(plan, devices=devices)))
    else:
        out.append(f"more devices alone do not help up to {max_devices}: the replicated weights do not fit one device")
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


def format_plan(plan: MemoryPlan) -> str:
    c = plan.config
    rows = [f"memory plan: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.n_routed_experts} experts; "
            f"context {plan.context} tokens, {plan.devices} device(s), weights {plan.weights_dtype}, "
            f"KV {plan.kv_dtype}, chunk {plan.chunk_size}", ""]  # fmt: skip
    width = max(len(line.name) for line in plan.lines)
    for line in plan.lines:
        rows.append(f"  {line.name:<{width}}  {line.bytes_per_device / GIB:9.3f} GiB   {line.how}")
    rows += [
        f"  {'total':<{width}}  {plan.total_bytes / GIB:9.3f} GiB",
        f"  {f'× {plan.headroom} headroom':<{width}}  {plan.required_bytes / GIB:9.3f} GiB   "
        f"of {plan.device_memory_gib:g} GiB per device",
        "",
        "fits" if plan.fits else "DOES NOT FIT",
    ]  # fmt: skip
    tips = suggestions(plan)
    if tips:
        rows.append("to make it fit, change one of:")
        rows += [f"  {tip}" for tip in tips]
    return "\n".join(rows)


def plan_to_dict(plan: MemoryPlan) -> dict:
    return {
        "context": plan.context, "devices": plan.devices, "kv_dtype": plan.kv_dtype,
        "weights_dtype": plan.weights_dtype, "chunk_size": plan.chunk_size,
        "device_memory_gib": plan.device_memory_gib, "headroom": plan.headroom,
        "lines": [{"name": ln.name, "bytes_per_device": ln.bytes_per_device, "how": ln.how} for ln in plan.lines],
        "total_bytes": plan.total_bytes, "required_bytes": plan.required_bytes, "capacity_bytes": plan.capacity_bytes,
        "fits": plan.fits, "suggestions": suggestions(plan),
    }  # fmt: skip


__all__ = ["LedgerLine", "MemoryPlan", "ParamCounts", "count_params", "format_plan", "kv_bytes_per_token",
           "plan_memory", "plan_to_dict", "suggestions"]  # fmt: skip
