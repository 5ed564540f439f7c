"""Useful FLOPs of a DeepSeek-V4 prefill by part, the precision each part runs in, and the floor they set.

Useful work is 2 FLOPs per multiply-add of the model's matmuls, each query against only the keys it may see (causal),
never what an implementation computes and throws away (a dense indexer's scores over every key, padded expert
tiles). A chunked prefill of a whole prompt does the same useful work as one full-sequence forward, since query p
sees the same keys either way, so the sums over p = 0 … S-1 below are the causal averages a chunked prefill runs.
Elementwise work (norms, RoPE, softmax, SwiGLU, Sinkhorn, pooling, the indexer's top-k) is not counted.

Per token and layer, with D hidden, H heads × hd, q LoRA r_q, G output groups × r_o, E experts, k routed + 1 shared
expert of width I, hc residual copies, W window, H_i × hd_i indexer heads, K index_topk, and n(p) = ⌊(p + 1) / rate⌋
the compressed entries query p sees (rate 4 for CSA, 128 for HCA):

    attn-qkv        2·(D·r_q + r_q·H·hd + D·hd)           q_a, q_b, the shared K=V projection
    attn-out-a      2·H·hd·r_o                            the grouped o_a
    attn-out-b      2·G·r_o·D                             o_b
    window-core     4·H·hd·min(p + 1, W)                  QKᵀ and PV (V = K) over the window, every layer
    csa-core        4·H·hd·min(n(p), K)                   the entries the indexer picked
    hca-core        4·H·hd·n(p)                           every compressed entry
    compressor      2·2·D·w (w = 2·hd CSA, hd HCA)        the compressor's kv and gate projections
    indexer-keys    2·2·D·2·hd_i                          the indexer's own compressor (CSA)
    indexer-q       2·r_q·H_i·hd_i                        its q projection (CSA)
    indexer-weights 2·D·H_i                               its head weights (CSA)
    indexer-scores  2·H_i·hd_i·n(p)                       q·k over every visible key (CSA)
    router          2·D·E
    moe-routed      k·(2·D·2I + 2·I·D)                    gate_up and down of the k picked experts
    moe-shared      2·D·2I + 2·I·D
    mhc             2 × 2·(hc·D)·(2 + hc)·hc              both hyper-connections' mixes; + 2·(hc·D)·hc once for
                                                          the hyper-head
    head            2·D·vocab, once                       the LM head of the last token only

V4-Flash per token and layer (M = 1e6): attention projections 214 M, MoE + router 354 M, window core 17 M, CSA core
67 M, CSA compressor + indexer projections 38 M; over a 512K prompt the indexer scores average 1,074 M and the HCA
core 268 M. Its 2 sliding + 21 CSA + 20 HCA layers: about 5.6e10 FLOPs a token, 2.9e16 for a 512K prompt.

Precision: `part_precisions` says which matmul precision each part runs in for a resolved `dsv4.Kernels` and the
weights as stored (the formats of `dsv4 plan` and `scripts/bench_ttft.py --weights`), following what the model does
with them (`dsv4.moe.MoE.expert_weights`, `dsv4.attention.Indexer.select`, `dsv4.quantization.BlockQuantized`):

- the dense matrices a release stores in FP8 (`RELEASED_FP8_PARTS`: q_a, q_b, the K=V projection, o_b, the
  indexer's q, the shared expert) run in FP8 (W8A8) under `Kernels.dense="pallas"` with FP8-stored weights
  (`dsv4.layers.project`); every other dense matrix, and these under `dense="jnp"`, run in the compute dtype (a
  kept-quantized weight is dequantized where it is read);
- the routed experts run in FP8 (W8A8) with FP8 weights in 128 × 128 blocks, or FP4 ones re-blocked as such, on
  the Pallas MoE (`Kernels.moe="pallas"`) with FP8 activations; the jnp MoE reads them dequantized;
- the indexer scores run in FP8 under `Kernels.indexer="pallas-fp8"`;
- the hyper-connection mixes are float32 matmuls (their weights stay float32, as in the reference).

`floor_seconds` puts each precision's FLOPs at its own rate: the mixed-precision floor MFU is measured against.
Pure Python (host layer): no JAX.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv4.config import CSA, HCA, LAYER_TYPES, Config
from dsv4.memory_plan import fp8_expert_kernels

PARTS = ("attn-qkv", "attn-out-a", "attn-out-b", "window-core", "csa-core", "hca-core", "compressor", "indexer-keys",
         "indexer-q", "indexer-weights", "indexer-scores", "router", "moe-routed", "moe-shared", "mhc",
         "head")  # fmt: skip
# The dense parts whose matrices V4 releases store in FP8 (`dsv4.weights.RELEASED_FP8`): their W8A8 route is
# `Kernels.dense`. Not o_a, the compressors, the indexer's keys and head weights, the router.
RELEASED_FP8_PARTS = ("attn-qkv", "attn-out-b", "indexer-q", "moe-shared")
# The rows of the usual per-token table, as sums of parts.
GROUPS = {
    "attention projections": ("attn-qkv", "attn-out-a", "attn-out-b"),
    "window core": ("window-core",),
    "CSA core": ("csa-core",),
    "HCA core": ("hca-core",),
    "compressor + indexer projections": ("compressor", "indexer-keys", "indexer-q", "indexer-weights"),
    "indexer scores": ("indexer-scores",),
    "MoE + router": ("router", "moe-routed", "moe-shared"),
    "mHC": ("mhc",),
    "head": ("head",),
}
PRECISIONS = ("fp8", "bf16", "f32")
# Weights as stored: bf16 / fp32 everywhere, or as V4 releases them (FP8 matrices, optionally FP4 routed experts;
# "fp4-experts" is `dsv4 plan`'s name for "fp8-fp4-experts").
WEIGHTS = ("bf16", "fp8", "fp8-fp4-experts", "fp4-experts", "fp32")


# ---------------------------------------------------------------------------------------------
# Exact causal sums over query positions p = 0 … seq-1 (integers, no loop).
# ---------------------------------------------------------------------------------------------
def _window_keys(seq: int, window: int) -> int:
    """Σ_p min(p + 1, window)."""
    if seq <= window:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def _entries(seq: int, rate: int) -> int:
    """Σ_p ⌊(p + 1) / rate⌋: the rate queries with p + 1 in [k·rate, (k + 1)·rate) see k entries each, the last
    rem + 1 of them q."""
    q, rem = divmod(seq, rate)
    return rate * q * (q - 1) // 2 + q * (rem + 1)


def _entries_capped(seq: int, rate: int, cap: int) -> int:
    """Σ_p min(⌊(p + 1) / rate⌋, cap): the uncapped sum less what the queries with p + 1 >= cap·rate see beyond cap,
    ⌊(p + 1 - cap·rate) / rate⌋ each."""
    over = seq - cap * rate
    return _entries(seq, rate) - (_entries(over, rate) if over > 0 else 0)


# ---------------------------------------------------------------------------------------------
# FLOPs.
# ---------------------------------------------------------------------------------------------
def layer_flops(config: Config, layer_type: str, seq: int) -> dict[str, float]:
    """Useful FLOPs of one layer of `layer_type` over a prompt of `seq` tokens, by part (only the parts this layer
    type has; the formulas are in the module docstring)."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type={layer_type!r}; choose one of {list(LAYER_TYPES)}")
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq={seq!r}: a prompt length of at least 1 token")
    c = config
    d, h, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    inter, hc = c.moe_intermediate_size, c.hc_mult
    expert = 2.0 * d * 2 * inter + 2.0 * inter * d  # gate_up, then down
    out = {
        "attn-qkv": 2.0 * (d * c.q_lora_rank + c.q_lora_rank * h * hd + d * hd) * seq,
        "attn-out-a": 2.0 * h * hd * c.o_lora_rank * seq,
        "attn-out-b": 2.0 * c.o_groups * c.o_lora_rank * d * seq,
        "window-core": 4.0 * h * hd * _window_keys(seq, c.sliding_window),
        "router": 2.0 * d * c.n_routed_experts * seq,
        "moe-routed": c.num_experts_per_tok * expert * seq,
        "moe-shared": c.n_shared_experts * expert * seq,
        "mhc": 2 * 2.0 * (hc * d) * (2 + hc) * hc * seq,
    }
    if layer_type == CSA:
        rate, ih, ihd = c.compress_rate(CSA), c.index_n_heads, c.index_head_dim
        out["csa-core"] = 4.0 * h * hd * _entries_capped(seq, rate, c.index_topk)
        out["compressor"] = 2 * 2.0 * d * (2 * hd) * seq
        out["indexer-keys"] = 2 * 2.0 * d * (2 * ihd) * seq
        out["indexer-q"] = 2.0 * c.q_lora_rank * ih * ihd * seq
        out["indexer-weights"] = 2.0 * d * ih * seq
        out["indexer-scores"] = 2.0 * ih * ihd * _entries(seq, rate)
    elif layer_type == HCA:
        out["hca-core"] = 4.0 * h * hd * _entries(seq, c.compress_rate(HCA))
        out["compressor"] = 2 * 2.0 * d * hd * seq
    return out


def head_flops(config: Config) -> dict[str, float]:
    """The last token's head: the hyper-head's mix (float32, counted with mhc) and the LM head."""
    d, hc = config.hidden_size, config.hc_mult
    return {"mhc": 2.0 * (hc * d) * hc, "head": 2.0 * d * config.vocab_size}


def prefill_flops(config: Config, seq: int, layer_types=None) -> dict[str, float]:
    """Useful FLOPs of a `seq`-token prefill through `layer_types` (default: the config's own) and the last token's
    head, by part: every name of `PARTS`, 0.0 where no layer has it."""
    types = config.layer_types if layer_types is None else tuple(layer_types)
    out = dict.fromkeys(PARTS, 0.0)
    for layer_type in types:
        for part, flops in layer_flops(config, layer_type, seq).items():
            out[part] += flops
    for part, flops in head_flops(config).items():
        out[part] += flops
    return out


def grouped(parts: Mapping[str, float]) -> dict[str, float]:
    """`prefill_flops` (or `layer_flops`) summed into the rows of `GROUPS`."""
    return {name: sum(parts.get(p, 0.0) for p in members) for name, members in GROUPS.items()}


# ---------------------------------------------------------------------------------------------
# Precisions and the floor.
# ---------------------------------------------------------------------------------------------
def _choice(kernels, part: str) -> str:
    value = kernels.get(part, "auto") if isinstance(kernels, Mapping) else getattr(kernels, part)
    if value == "auto":
        raise ValueError(f"kernels: {part}='auto' does not say what runs; pass the resolved value (model.kernels, or "
                         f"Kernels.resolve(dtype))")  # fmt: skip
    return value


def part_precisions(kernels, weights: str = "bf16", *, config: Config | None = None,
                    fp8_activations: bool = True) -> dict[str, str]:  # fmt: skip
    """The matmul precision ("fp8", "bf16", "f32") of each part of `PARTS` in a model computing in bf16 (float32 for
    weights "fp32").

    kernels: a resolved `dsv4.Kernels`, or a mapping with its "indexer" and "moe" choices (and "dense": absent is
    "jnp"). weights: one of `WEIGHTS`.
    config: checks that the expert widths fit the FP8 kernels' 128 × 128 blocks (None: assumed, as V4's do).
    fp8_activations: `MoE.fp8_activations` (False: FP8 experts run W8A16, in bf16).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; choose one of {list(WEIGHTS)}")
    dense = "f32" if weights == "fp32" else "bf16"
    out = dict.fromkeys(PARTS, dense)
    out["mhc"] = "f32"
    if _choice(kernels, "indexer") == "pallas-fp8":
        out["indexer-scores"] = "fp8"
    fits = config is None or fp8_expert_kernels(config, "fp8")
    quantized_experts = weights in ("fp8", "fp8-fp4-experts", "fp4-experts")  # FP4 ones re-blocked as FP8 (dsv4.moe)
    dense_impl = kernels.get("dense", "jnp") if isinstance(kernels, Mapping) else _choice(kernels, "dense")
    if quantized_experts and dense_impl == "pallas":  # every release keeps these dense matrices FP8
        out.update(dict.fromkeys(RELEASED_FP8_PARTS, "fp8"))
    if quantized_experts and _choice(kernels, "moe") == "pallas" and fp8_activations and fits:
        out["moe-routed"] = "fp8"
    return out


def by_precision(parts: Mapping[str, float], kernels, weights: str = "bf16", *, config: Config | None = None,
                 fp8_activations: bool = True) -> dict[str, float]:  # fmt: skip
    """FLOPs by precision: `parts` (from `prefill_flops` or `layer_flops`) summed by `part_precisions(...)`. Every
    precision of `PRECISIONS` is a key (0.0 where none runs)."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"parts {unknown} are not FLOP parts; known: {list(PARTS)}")
    where = part_precisions(kernels, weights, config=config, fp8_activations=fp8_activations)
    out = dict.fromkeys(PRECISIONS, 0.0)
    for part, flops in parts.items():
        out[where[part]] += flops
    return out


def floor_seconds(flops_by_precision: Mapping[str, float], rates: Mapping[str, float]) -> float:
    """Σ FLOPs / rate over precisions: the time the work takes with every FLOP at its precision's rate.

    rates: FLOP/s per precision (measured matmul ceilings), needed for every precision with work.
    """
    total = 0.0
    for precision, flops in flops_by_precision.items():
        if not flops:
            continue
        rate = rates.get(precision)
        if rate is None:
            raise ValueError(f"no rate for {precision} ({flops:.3g} FLOPs); rates given: {dict(rates)}")
        if rate < 1e9:  # no accelerator is that slow: a rate in TFLOP/s passed where FLOP/s are asked for
            raise ValueError(f"rates[{precision!r}]={rate!r}: rates are in FLOP/s (e.g. 7.0e14, not 700)")
        total += flops / rate
    return total


__all__ = ["GROUPS", "PARTS", "PRECISIONS", "WEIGHTS", "by_precision", "floor_seconds", "grouped", "head_flops",
           "layer_flops", "part_precisions", "prefill_flops"]  # fmt: skip
