"""`dsv4.flops`: the prefill FLOP model against per-position counts and V4-Flash's per-token figures worked out by
hand, the precision of each part against what the model's MoE actually hands its kernels, and the floor."""

import dataclasses

import numpy as np
import pytest

from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.flops import (
    PARTS,
    PRECISIONS,
    by_precision,
    floor_seconds,
    grouped,
    layer_flops,
    part_precisions,
    prefill_flops,
)

FLASH = Config.preset("v4-flash")
S512K = 524288
M = 1e6


def per_position_reference(cfg: Config, layer_type: str, seq: int) -> dict[str, float]:
    """Each query's multiply-adds summed position by position (the visibility rules written out: entry c is visible
    to the query at p iff c < (p + 1) // rate, the window holds the last W positions up to p)."""
    d, h, hd, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, r = cfg.o_groups, cfg.o_lora_rank
    out = dict.fromkeys(PARTS, 0)
    for p in range(seq):
        out["attn-qkv"] += d * ql + ql * h * hd + d * hd
        out["attn-out-a"] += g * r * (h * hd // g)  # each group's o_a
        out["attn-out-b"] += g * r * d
        out["window-core"] += 2 * h * hd * len(range(max(0, p + 1 - cfg.sliding_window), p + 1))
        out["router"] += d * cfg.n_routed_experts
        one_expert = d * 2 * cfg.moe_intermediate_size + cfg.moe_intermediate_size * d
        out["moe-routed"] += cfg.num_experts_per_tok * one_expert
        out["moe-shared"] += one_expert
        out["mhc"] += 2 * (cfg.hc_mult * d) * (2 + cfg.hc_mult) * cfg.hc_mult
        if layer_type == CSA:
            visible = len([c for c in range(seq) if c < (p + 1) // cfg.compress_rate(CSA)])
            out["csa-core"] += 2 * h * hd * min(visible, cfg.index_topk)
            out["compressor"] += 2 * d * 2 * hd
            out["indexer-keys"] += 2 * d * 2 * cfg.index_head_dim
            out["indexer-q"] += ql * cfg.index_n_heads * cfg.index_head_dim
            out["indexer-weights"] += d * cfg.index_n_heads
            out["indexer-scores"] += cfg.index_n_heads * cfg.index_head_dim * visible
        elif layer_type == HCA:
            visible = len([c for c in range(seq) if c < (p + 1) // cfg.compress_rate(HCA)])
            out["hca-core"] += 2 * h * hd * visible
            out["compressor"] += 2 * d * hd
    kept = {SLIDING: (), CSA: ("csa-core", "compressor", "indexer-keys", "indexer-q", "indexer-weights",
                               "indexer-scores"),
            HCA: ("hca-core", "compressor")}[layer_type]  # fmt: skip
    common = ("attn-qkv", "attn-out-a", "attn-out-b", "window-core", "router", "moe-routed", "moe-shared", "mhc")
    return {k: 2.0 * v for k, v in out.items() if k in common + kept}


@pytest.mark.parametrize("seq", [1, 3, 16, 17, 37, 70])
def test_layer_flops_match_the_per_position_count(seq):
    """Tiny config (window 16, rates 4 and 16, index_topk 8): lengths below and past the window, past topk · rate
    (32), not multiples of either rate."""
    cfg = Config.preset("tiny")
    for layer_type in (SLIDING, CSA, HCA):
        assert layer_flops(cfg, layer_type, seq) == pytest.approx(per_position_reference(cfg, layer_type, seq),
                                                                  rel=1e-15)  # fmt: skip


def test_v4_flash_per_token_figures():
    """The per-token table of V4-Flash (hidden 4096, 64 heads × 512, q LoRA 1024, 8 groups × 1024, 6 + 1 experts of
    2048, 256 experts, index 64 × 128 top-512, window 128, rates 4 / 128) by hand."""
    csa = layer_flops(FLASH, CSA, S512K)
    hca = layer_flops(FLASH, HCA, S512K)
    per_token = {k: v / S512K for k, v in grouped(csa).items()}
    # q_a 4096·1024 + q_b 1024·32768 + kv 4096·512 + o_a 32768·1024 + o_b 8·1024·4096 multiply-adds
    assert per_token["attention projections"] == 2 * (4194304 + 33554432 + 2097152 + 33554432 + 33554432)  # 214 M
    # router 4096·256, then 7 experts of gate_up 4096·4096 + down 2048·4096
    assert per_token["MoE + router"] == 2 * (1048576 + 7 * (16777216 + 8388608))  # 354 M
    # compressor kv + gate 2 × 4096·1024, indexer keys 2 × 4096·256, indexer q 1024·8192, head weights 4096·64
    assert per_token["compressor + indexer projections"] == 2 * (8388608 + 2097152 + 8388608 + 262144)  # 38 M
    assert round(per_token["window core"] / M) == 17  # 4 · 64 · 512 · 128 once p >= 127
    assert round(per_token["CSA core"] / M) == 67  # 4 · 64 · 512 · 512 once 512 entries are visible
    positions = np.arange(1, S512K + 1, dtype=np.int64)
    assert per_token["indexer scores"] == 2 * 64 * 128 * (positions // 4).sum() / S512K
    assert round(per_token["indexer scores"] / M) == 1074
    assert hca["hca-core"] / S512K == 4 * 64 * 512 * (positions // 128).sum() / S512K
    assert round(hca["hca-core"] / S512K / M) == 268
    assert round(hca["compressor"] / S512K / M, 1) == 8.4


def test_whole_models_at_512k():
    """V4-Flash's 2 sliding + 21 CSA + 20 HCA layers: about 5.6e10 FLOPs a token, 2.9e16 at 512K (41% indexer); the
    benchmark's 3 layers (sliding, CSA, HCA): 1.69e15, of which the indexer scores are 0.56e15."""
    full = prefill_flops(FLASH, S512K)
    total = sum(full.values())
    assert set(full) == set(PARTS)
    assert 5.55e10 < total / S512K < 5.56e10 and 2.90e16 < total < 2.92e16
    assert 0.40 < full["indexer-scores"] / total < 0.41
    three = prefill_flops(FLASH, S512K, (SLIDING, CSA, HCA))
    assert 1.685e15 < sum(three.values()) < 1.690e15
    assert 0.562e15 < three["indexer-scores"] < 0.564e15
    # the head is the last token's only: 2 · 4096 · 129280 + the hyper-head's 2 · 16384 · 4
    assert three["head"] == 2 * 4096 * 129280
    assert three["mhc"] == 3 * 2 * 2 * 16384 * 24 * S512K + 2 * 16384 * 4


@dataclasses.dataclass(frozen=True)
class Choices:  # what part_precisions reads of a resolved dsv4.Kernels
    indexer: str = "pallas"
    moe: str = "pallas"
    dense: str = "jnp"


def test_precisions_follow_kernels_and_weights():
    everything_bf16 = {p: "f32" if p == "mhc" else "bf16" for p in PARTS}
    assert part_precisions(Choices(), "bf16") == everything_bf16
    fp8_idx = part_precisions(Choices(indexer="pallas-fp8"), "bf16")
    assert {p for p, v in fp8_idx.items() if v == "fp8"} == {"indexer-scores"}
    fp8 = part_precisions({"indexer": "pallas-fp8", "moe": "pallas"}, "fp8", config=FLASH)
    assert {p for p, v in fp8.items() if v == "fp8"} == {"indexer-scores", "moe-routed"}
    # W8A8 dense layers: the matrices releases store in FP8 (q_a, q_b, K=V, o_b, the indexer's q, the shared expert)
    dense = part_precisions(Choices(indexer="pallas-fp8", dense="pallas"), "fp8", config=FLASH)
    assert {p for p, v in dense.items() if v == "fp8"} == {"indexer-scores", "moe-routed", "attn-qkv", "attn-out-b",
                                                            "indexer-q", "moe-shared"}  # fmt: skip
    assert part_precisions(Choices(dense="pallas"), "bf16") == everything_bf16  # nothing stored in FP8
    # FP4 experts are re-blocked as FP8 for the same kernels
    for weights in ("fp8-fp4-experts", "fp4-experts"):
        assert part_precisions(Choices(), weights, config=FLASH)["moe-routed"] == "fp8"
    # the jnp MoE and W8A16 dequantize / upcast quantized experts; widths off the 128 grid have no FP8 kernel
    for kernels, weights, kw in [(Choices(moe="jnp"), "fp8-fp4-experts", {}), (Choices(moe="jnp"), "fp8", {}),
                                 (Choices(), "fp8", dict(fp8_activations=False)),
                                 (Choices(), "fp8", dict(config=Config.preset("tiny"))),
                                 (Choices(), "fp8-fp4-experts", dict(config=Config.preset("tiny")))]:  # fmt: skip
        assert part_precisions(kernels, weights, **kw)["moe-routed"] == "bf16", (kernels, weights, kw)
    assert set(part_precisions(Choices(moe="jnp"), "fp32").values()) == {"f32"}
    with pytest.raises(ValueError, match="'auto'"):
        part_precisions(Choices(moe="auto"), "fp8")
    with pytest.raises(ValueError, match="weights='int4'"):
        part_precisions(Choices(), "int4")


def test_the_moe_runs_fp8_exactly_where_part_precisions_says():
    """The model's own dispatch (`MoE.expert_weights`) is the reference: FP8 values reach the expert kernels iff
    part_precisions puts the routed experts in fp8, for each weights format and MoE choice."""
    import jax.numpy as jnp

    from dsv4.moe import MoE
    from dsv4.quantization import BlockQuantized, quantize_fp4, quantize_fp8

    cfg = Config.from_hf({"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 2,
                          "num_experts_per_tok": 1, "num_hidden_layers": 1, "layer_types": [SLIDING],
                          "mlp_layer_types": ["moe"]})  # fmt: skip
    rng, bf16 = np.random.default_rng(0), "bfloat16"
    for impl in ("pallas", "jnp"):
        for weights in ("bf16", "fp8", "fp8-fp4-experts"):
            moe = MoE(cfg, "moe", rngs=rng, dtype=jnp.bfloat16, moe_impl=impl)  # host-side init: no compiles
            for name in ("gate_up_proj", "down_proj"):
                var = moe.experts[name]
                w = np.asarray(var.get_value(), np.float32)
                if weights == "fp8":
                    q, s = quantize_fp8(w, (128, 128))
                    var.set_value(BlockQuantized(jnp.asarray(q), jnp.asarray(s), "fp8", (128, 128), w.shape, bf16))
                elif weights == "fp8-fp4-experts":
                    q, s = quantize_fp4(w)
                    var.set_value(BlockQuantized(jnp.asarray(q), jnp.asarray(s), "fp4", (1, 32), w.shape, bf16))
            gate_up, _, _ = moe.expert_weights()
            says_fp8 = part_precisions(Choices(moe=impl), weights, config=cfg)["moe-routed"] == "fp8"
            assert (gate_up.dtype == jnp.float8_e4m3fn) == says_fp8, (impl, weights)


def test_by_precision_and_the_floor():
    """The benchmark's 3 layers at 512K with the FP8 indexer: 0.56e15 FLOPs at ~1,390 TFLOP/s and the rest at 670
    take about 2.1 s; the full V4-Flash model's 2.91e16 about 4.3 s on 8 H200s, 19.5 s on 8 H20s (148 / 296)."""
    kernels = Choices(indexer="pallas-fp8")
    three = by_precision(prefill_flops(FLASH, S512K, (SLIDING, CSA, HCA)), kernels, "bf16")
    assert set(three) == set(PRECISIONS)
    assert three["fp8"] == prefill_flops(FLASH, S512K, (SLIDING, CSA, HCA))["indexer-scores"]
    assert three["f32"] == 3 * 2 * 2 * 16384 * 24 * S512K + 2 * 16384 * 4  # the mixes alone
    h200 = {"bf16": 670e12, "fp8": 1390e12, "f32": 670e12}
    assert floor_seconds(three, h200) == pytest.approx(three["fp8"] / 1390e12 + (three["bf16"] + three["f32"]) / 670e12)
    assert 2.05 < floor_seconds(three, h200) < 2.12
    full = by_precision(prefill_flops(FLASH, S512K), kernels, "bf16")
    assert 4.25 < floor_seconds(full, h200) / 8 < 4.35
    assert 19.4 < floor_seconds(full, {"bf16": 148e12, "fp8": 296e12, "f32": 148e12}) / 8 < 19.7
    # FP8 experts move the routed experts' 302 M a token to the FP8 rate as well
    fp8 = by_precision(prefill_flops(FLASH, S512K, (SLIDING, CSA, HCA)), kernels, "fp8", config=FLASH)
    assert fp8["fp8"] - three["fp8"] == 3 * 6 * 2 * (16777216 + 8388608) * S512K
    # ... and W8A8 dense layers a token's q_a 4096·1024 + q_b 1024·32768 + K=V 4096·512 + o_b 8192·4096 + the shared
    # expert's 4096·4096 + 2048·4096 in every layer, and the indexer's q 1024·8192 in the CSA one
    dense = by_precision(prefill_flops(FLASH, S512K, (SLIDING, CSA, HCA)), Choices(indexer="pallas-fp8",
                         dense="pallas"), "fp8", config=FLASH)  # fmt: skip
    per_layer = 4194304 + 33554432 + 2097152 + 33554432 + 16777216 + 8388608
    assert dense["fp8"] - fp8["fp8"] == 2 * (3 * per_layer + 8388608) * S512K
    assert dense["bf16"] == fp8["bf16"] - (dense["fp8"] - fp8["fp8"])
    assert floor_seconds(fp8, h200) < floor_seconds(three, h200)
    with pytest.raises(ValueError, match="no rate for fp8"):
        floor_seconds(three, {"bf16": 670e12, "f32": 670e12})
    with pytest.raises(ValueError, match="FLOP/s"):
        floor_seconds(three, {"bf16": 670, "fp8": 1390, "f32": 670})
    assert floor_seconds({"fp8": 0.0, "bf16": 1e12}, {"bf16": 1e12}) == 1.0  # no FP8 work: no FP8 rate needed
    with pytest.raises(ValueError, match="not FLOP parts"):
        by_precision({"qkv": 1.0}, kernels)
