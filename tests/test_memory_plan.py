"""`dsv4.memory_plan`: the KV lines come from `dsv4.cache.layout.CacheLayout` (the whole request, replicated on
every device), the weights from the config, and the 512K V4-Flash verdict on 8 × H20 is worked out by hand here.

Plain arithmetic on the config (no JAX arrays, no device).
"""

import json

import pytest

from dsv4.cache.layout import FORMAT_NAMES, CacheLayout, KVFormat
from dsv4.cli import main
from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.memory_plan import DEVICE_MIB, EP_STEP_TOKENS, GIB, MIB, count_params, plan_memory, suggestions

N = 524288  # 512K tokens
FLASH = Config.preset("v4-flash")  # 2 sliding + 21 CSA + 20 HCA layers; head_dim 512 (64 RoPE), index_head_dim 128
KV_LINES = ("KV cache: sliding layers", "KV cache: CSA layers", "KV cache: HCA layers")
H20 = 97871 * MIB  # what nvidia-smi reports for an H20 ("96 GB"): 102,625,181,696 B = 95.58 GiB


def kv_by_type(plan):
    return {name: plan.line(name).bytes_per_device for name in KV_LINES}


def flash_layer_bytes(tokens: int, entry: int, key: int, window: int) -> dict[str, int]:
    """One V4-Flash layer of each type for one request of `tokens`, by hand: `entry` / `key` / `window` are the
    stored row bytes of a compressed entry, an indexer key and a ring row."""
    ring = 128 * window + 128 * 4  # sliding window of 128 rows + int32 positions
    # CSA (rate 4): open window = compressor kv + gate (4 × 1024, bf16) + overlap half (4 × 512 bf16, 4 × 512
    # float32); the indexer's the same at 256 / 128 wide.
    csa_open = 2 * 4 * 1024 * 2 + 4 * 512 * 2 + 4 * 512 * 4 + 2 * 4 * 256 * 2 + 4 * 128 * 2 + 4 * 128 * 4
    hca_open = 2 * 128 * 512 * 2  # HCA (rate 128): kv + gate of the open window, 512 wide, bf16
    return {
        SLIDING: ring,
        CSA: -(-tokens // 4) * (entry + key) + ring + csa_open,
        HCA: -(-tokens // 128) * entry + ring + hca_open,
    }


# Row bytes. bf16: 512 × 2 = 1024, key 128 × 2 = 256. fp8-channel: 448 e4m3 + 64 RoPE channels in bf16 = 576,
# key 64 + 64 × 2 = 192.
ROWS = {"bf16": (1024, 256, 1024), "fp8-channel": (576, 192, 576)}


@pytest.mark.parametrize("devices", [1, 2, 8])
@pytest.mark.parametrize("fmt, hand_per_token", [("fp8-channel", 4139.5), ("bf16", 6902.2)])
def test_kv_lines_are_the_whole_request_on_every_device_v4_flash_512k(fmt, hand_per_token, devices):
    """The cache is replicated: on any device count each device holds the whole 512K request, the KV lines are
    CacheLayout's per-type bytes for all 524,288 tokens, which are docs/BENCHMARKS.md's hand numbers
    (fp8-channel 4139.5, bf16 6902.2 B/token)."""
    layers = flash_layer_bytes(N, *ROWS[fmt])
    want = {"KV cache: sliding layers": 2 * layers[SLIDING], "KV cache: CSA layers": 21 * layers[CSA],
            "KV cache: HCA layers": 20 * layers[HCA]}  # fmt: skip
    plan = plan_memory(FLASH, context=N, devices=devices, kv_format=fmt, weights="fp8")
    assert kv_by_type(plan) == want
    # fp8-channel: CSA 21 × (131072 × 768 + 74240 + 35840) = 2,116,240,896; HCA 20 × (4096 × 576 + 74240 +
    # 262144) = 53,913,600; sliding 2 × 74240 = 148,480 → 2,170,302,976 B = 4139.50 B/token.
    total = sum(want.values())
    if fmt == "fp8-channel":
        assert want["KV cache: CSA layers"] == 2_116_240_896 and want["KV cache: HCA layers"] == 53_913_600
        assert total == 2_170_302_976
    assert total / N == pytest.approx(hand_per_token, abs=0.05)
    layout = CacheLayout.from_config(FLASH, KVFormat.named(fmt, rope_dim=64))
    assert total == layout.bytes_per_request(N) - 4  # (the layout's 4-byte token count is left out)
    assert plan.kv_bytes_per_token == pytest.approx(hand_per_token, abs=0.05)
    assert all("replicated on every device" in plan.line(name).how for name in KV_LINES)
    # Per-array scale state, fp8-channel: scale + amax per nope channel, float32, for each layer's ring and
    # compressed entries (448 channels) and CSA's indexer keys (64): 2 × 3584 + 21 × 7680 + 20 × 7168.
    scale = plan.line("KV cache: scale state (replicated)").bytes_per_device
    assert scale == (311808 if fmt == "fp8-channel" else 0) == layout.shared_bytes


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_format_is_sized_by_the_layout_and_only_new_rows_are_gathered(fmt):
    """8 devices: each holds every token's entries (the layout's bytes for the whole context); the gather is one
    layer's new K=V rows of the chunk, [8192, 512] bf16, double-buffered: 16 MiB whatever the KV format."""
    plan = plan_memory(FLASH, context=N, devices=8, kv_format=fmt, weights="fp8")
    layout = CacheLayout.from_config(FLASH, KVFormat.named(fmt, rope_dim=64))
    assert sum(kv_by_type(plan).values()) == layout.bytes_per_request(N) - 4
    assert plan.line("KV cache: scale state (replicated)").bytes_per_device == layout.shared_bytes
    if fmt in ROWS:
        assert plan.line("KV cache: CSA layers").bytes_per_device == 21 * flash_layer_bytes(N, *ROWS[fmt])[CSA]
    assert plan.line("communication: chunk K=V all-gather").bytes_per_device == 2 * 8192 * 512 * 2 == 16 * MIB
    assert "communication: KV all-gather" not in {line.name for line in plan.lines}  # no whole-context gather


@pytest.mark.parametrize("devices, chunk, context, rows", [
    (1, 8192, N, 0),       # one device: nothing to gather
    (2, 8192, N, 8192),    # 4096 tokens each
    (8, 4096, N, 4096),    # 512 each
    (8, 8192, 1024, 1024),  # the whole prompt is one chunk of 1024 tokens, 128 each
    (8, 1001, N, 1008),    # ceil(1001 / 8) = 126 each, padded to the same share: 8 × 126
])  # fmt: skip
def test_the_gather_is_the_chunks_new_kv_rows(devices, chunk, context, rows):
    """rows × head_dim 512 × 2 B (bf16, the compute dtype), 2 buffers; it does not grow with the context."""
    plan = plan_memory(FLASH, context=context, devices=devices, chunk_size=chunk, weights="fp8")
    assert plan.line("communication: chunk K=V all-gather").bytes_per_device == 2 * rows * 512 * 2


def test_v4_flash_fp8_weights_fit_8_h20_at_512k_bf16_do_not():
    """By hand, per device, 512K tokens over 8 H20s (97871 MiB each), fp8-channel KV, chunk 8192, 1.2× headroom.

    Routed experts, 32 of 256 per device, 43 layers; one expert = gate/up 4096 × 4096 + down 4096 × 2048 =
    25,165,824 weights, in 32 × 32 + 32 × 16 = 1536 blocks of 128 × 128:
      fp8:  32 × 43 × (25,165,824 + 1536 × 4)              = 34,636,627,968 B (32.26 GiB)
      bf16: 32 × 43 × 25,165,824 × 2                       = 69,256,347,648 B (64.50 GiB)
    Dense, replicated, per layer: wq_a 1024×4096, wq_b 32768×1024, wkv 512×4096, wo_b 4096×8192, shared expert
    3 × 2048×4096 = 98,566,144 fp8 weights in 6016 blocks (+ CSA: indexer wq_b 8192×1024, 512 blocks); in bf16
    as released: wo_a 8192×4096 + router 256×4096 = 34,603,008 (+ CSA: compressor 2 × 1024×4096, indexer
    compressor 2 × 256×4096, weights_proj 64×4096 = 10,747,904; HCA: compressor 2 × 512×4096 = 4,194,304):
      fp8:  43 × 98,566,144 + 21 × 8,388,608 = 4,414,504,960 B + (43 × 6016 + 21 × 512) × 4 = 1,077,760 B
            + 2 × (43 × 34,603,008 + 21 × 10,747,904 + 20 × 4,194,304) = 3,595,042,816 B
            = 8,010,625,536 B (7.46 GiB)
      bf16: 6,212,026,368 weights × 2                      = 12,424,052,736 B (11.57 GiB)
    Embedding + LM head 2 × 129280 × 4096 × 2 B = 2,118,123,520 B; norms, mHC, sinks, hash tables 152,355,164 B.
    fp8: no dequantized layer (4096 and 2048 are multiples of 128: the FP8 expert kernels read the experts as stored).
    Weights: fp8 44,917,732,188 B; bf16 83,950,879,068 B.
    KV, replicated: the whole 524,288 tokens on every device, fp8-channel 2,170,302,976 B (see above) + 311,808 B
      scales = 2,170,614,784 B (2.02 GiB). Gather: one layer's new K=V rows of the chunk, 2 × 8192 × 512 × 2 B
      = 16,777,216 B.
    Activations, 1024 tokens (8192 / 8): 1024 × 502,784 B + indexer scores 1024 × 131072 × 4 (the two-pass
      indexer's slab: 2^29 / (4 × 131072) = 1024 queries per step) + logits 129280 × 4 = 1,052,238,848 B.
      MoE exchange (1024 tokens in one step, 7 other devices): 7 × 1024 × (tokens in + 2 × 4096 × 4 B partial
      results out and back); tokens fp8 + scales (4096 + 32 × 4 B) → 265,158,656 B, bf16 (4096 × 2 B) →
      293,601,280 B.
    fp8:  44,917,732,188 + 2,170,614,784 + 1,052,238,848 + 16,777,216 + 265,158,656 = 48,422,521,692 B
          (45.10 GiB) × 1.2 = 58,107,026,031 B (54.12 GiB, rounded up)  ≤  102,625,181,696 B: fits,
          44,518,155,665 B = 41.46 GiB spare.
    bf16: 83,950,879,068 + 2,170,614,784 + 1,052,238,848 + 16,777,216 + 293,601,280 = 87,484,111,196 B
          (81.48 GiB) × 1.2 = 104,980,933,436 B (97.77 GiB)  >  102,625,181,696 B: does not fit, 2,355,751,740 B
          = 2.19 GiB over (the whole-context cache on every device, 2.02 GiB, tips it).
    """
    fp8 = plan_memory(FLASH, context=N, devices=8, weights="fp8", device="h20")
    bf16 = plan_memory(FLASH, context=N, devices=8, weights="bf16", device="h20")
    assert fp8.capacity_bytes == bf16.capacity_bytes == H20 == 102_625_181_696
    w = {line.name: line.bytes_per_device for line in fp8.lines}
    assert w["weights: routed experts"] == 32 * 43 * (25_165_824 + 1536 * 4) == 34_636_627_968
    assert w["weights: dense (replicated)"] == 4_414_504_960 + 1_077_760 + 3_595_042_816 == 8_010_625_536
    assert w["weights: embeddings, norms (replicated)"] == 2_118_123_520 + 152_355_164
    assert w["weights: dequantized layer (transient)"] == 0
    assert sum(kv_by_type(fp8).values()) + w["KV cache: scale state (replicated)"] == 2_170_614_784
    assert w["communication: chunk K=V all-gather"] == 2 * 8192 * 512 * 2 == 16_777_216
    assert w["communication: MoE exchange"] == 7 * 1024 * ((4096 + 32 * 4) + 2 * 4096 * 4) == 265_158_656
    assert w["activations: one chunk"] == 1_052_238_848
    assert fp8.total_bytes == 48_422_521_692 and fp8.required_bytes == 58_107_026_031 and fp8.fits
    assert H20 - fp8.required_bytes == 44_518_155_665

    assert bf16.line("weights: routed experts").bytes_per_device == 69_256_347_648
    assert bf16.line("weights: dense (replicated)").bytes_per_device == 12_424_052_736
    assert bf16.line("communication: MoE exchange").bytes_per_device == 7 * 1024 * (4096 * 2 + 2 * 4096 * 4)
    assert bf16.total_bytes == 87_484_111_196 and bf16.required_bytes == 104_980_933_436 and not bf16.fits
    assert bf16.required_bytes - H20 == 2_355_751_740
    # The advice: FP8 weights first; then the fewest devices that split the 256 experts evenly (not 9-15: the
    # engine refuses those) and fit. At 16 devices, by hand: experts 16 × 43 × 25,165,824 × 2 = 34,628,173,824;
    # replicated weights 12,424,052,736 + 2,270,478,684 and the KV cache 2,170,614,784 unchanged; 512 tokens:
    # activations 512 × 502,784 + 512 × 131072 × 4 + 129280 × 4 = 526,377,984, gather 2 × 16 × 512 × 512 × 2 =
    # 16,777,216, exchange 15 × 512 × (4096 × 2 + 2 × 4096 × 4) = 314,572,800 → 52,351,048,028 B × 1.2 = 58.5 GiB.
    tips = suggestions(bf16)
    assert tips[0].startswith("--weights fp8: needs 54.1 GiB")
    assert tips[1] == "--devices 16: needs 58.5 GiB per device (with headroom)"
    assert plan_memory(FLASH, context=N, devices=16, weights="bf16").total_bytes == 52_351_048_028
    assert plan_memory(FLASH, context=N, devices=9, weights="bf16").fits  # fits on paper, but 9 ∤ 256

    # fp4 experts: ½ B per weight + one float32 scale per row and 32 columns (786,432 per expert).
    fp4 = plan_memory(FLASH, context=N, devices=8, weights="fp4-experts")
    assert fp4.line("weights: routed experts").bytes_per_device == 32 * 43 * (25_165_824 // 2 + 786_432 * 4)
    assert count_params(FLASH).routed_experts_fp4_scales == 256 * 43 * 786_432


def test_more_devices_are_not_suggested_when_the_replicated_cache_is_what_does_not_fit():
    """1M tokens, bf16 KV (6.74 GiB on every device), fp8 weights, on 20 GiB devices: even at 256 devices (one
    expert each) the replicated weights (9.56 GiB) and the cache do not fit with headroom, so the advice names the
    FP8 KV format and says why more devices do not help; with both, 256 devices would fit."""
    m = 1 << 20
    plan = plan_memory(FLASH, context=m, devices=8, weights="fp8", kv_format="bf16", device_memory_gib=20)
    layout = CacheLayout.from_config(FLASH, KVFormat.named("bf16", rope_dim=64))
    kv = sum(kv_by_type(plan).values())
    assert kv == layout.bytes_per_request(m) - 4 and 6.7 < kv / GIB < 6.8
    assert not plan.fits and not plan_memory(FLASH, context=m, devices=256, weights="fp8", kv_format="bf16",
                                             device_memory_gib=20).fits  # fmt: skip
    assert plan_memory(FLASH, context=m, devices=256, weights="fp8", kv_format="fp8-channel",
                       device_memory_gib=20).fits  # fmt: skip
    tips = suggestions(plan)
    assert not any(t.startswith("--devices") for t in tips)
    assert any(t.startswith("--kv-format fp8-channel: needs") for t in tips)
    (why,) = [t for t in tips if t.startswith("more devices alone do not help")]
    assert "(up to 256, dividing the 256 routed experts)" in why and "the whole KV cache (6.7 GiB)" in why


def test_cli_prints_the_ledger_and_verdict(capsys):
    argv = ["plan", "--model", "v4-flash", "--context", "512k", "--devices", "8", "--weights", "fp8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "8 h20 device(s)" in out and "4139.5 B/token" in out and "KV cache: CSA layers" in out
    assert "KV cache replicated on every device" in out and out.count("replicated on every device") >= 4
    assert "communication: chunk K=V all-gather" in out
    assert "fits: 41.46 GiB per device to spare" in out and "of 95.58 GiB per h20 device" in out
    assert main([*argv[:-1], "bf16"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: 2.19 GiB per device over" in out and "--weights fp8: needs 54.1 GiB" in out
    assert "--devices 16: needs 58.5 GiB" in out
    # The old flags still work and mean the same plan.
    assert main([*argv, "--json"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert main([*argv[:-2], "--weights-dtype", "fp8", "--kv-format", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == new and new["kv_format"] == "fp8-channel"
    # Device presets; --device-memory-gib overrides them.
    assert main([*argv[:-1], "bf16", "--device", "h200", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["capacity_bytes"] == DEVICE_MIB["h200"] * MIB and plan["device"] == "h200"
    assert main([*argv[:-1], "bf16", "--device-memory-gib", "98", "--json"]) == 0  # 97.77 ≤ 98 GiB
    assert json.loads(capsys.readouterr().out)["capacity_bytes"] == 98 * GIB


def test_too_long_a_context_is_refused_naming_the_limit(capsys):
    with pytest.raises(ValueError, match=r"context=1048577 tokens exceeds the model's limit, "
                                         r"max_position_embeddings=1048576"):  # fmt: skip
        plan_memory(FLASH, context=(1 << 20) + 1, devices=8)
    assert main(["plan", "--model", "v4-flash", "--context", "2m"]) == 2
    assert "max_position_embeddings=1048576" in capsys.readouterr().err
    # Within the model's limit but over the memory: the advice names the longest context that fits as is.
    plan = plan_memory(FLASH, context=1 << 20, devices=8, weights="bf16")
    assert not plan.fits
    (tip,) = [t for t in suggestions(plan) if t.startswith("--context ")]
    longest = int(tip.split()[1].rstrip(":"))
    assert plan_memory(FLASH, context=longest, devices=8, weights="bf16").fits
    assert not plan_memory(FLASH, context=longest + 1, devices=8, weights="bf16").fits


@pytest.mark.parametrize("keys, batch, rows", [
    (131072, 1, 1024),  # 2^29 / (4 · 2^17) = 1024: a 512K prompt's CSA keys
    (32768, 1, 4096),   # 128K: 4096 fit
    (8192, 1, 4096),    # 16384 fit, clipped to 4096
    (1, 1, 4096),
    (131072, 4, 256),   # 2^29 / (4 · 4 · 2^17) = 256
    (131072, 16, 128),  # 64 fit, raised to 128
    (1 << 23, 1, 128),  # 16 fit, raised to 128
    (100_000, 1, 1280),  # 1342 fit, rounded down to a multiple of 128
    (131072 + 512, 1, 896),  # a 512K prompt and 2K generated tokens: 1020 fit (a power of two would give 512)
])  # fmt: skip
def test_index_slab_rows_by_hand_and_the_indexer_uses_them(keys, batch, rows):
    from dsv4.memory_plan import index_slab_rows
    from dsv4.pallas.indexer import default_query_chunk

    assert index_slab_rows(keys, batch) == rows == default_query_chunk(keys, batch)


def test_the_plan_steps_the_expert_exchange_as_the_code_does():
    from dsv4.sharding.expert_parallel import DEFAULT_CHUNK_TOKENS

    assert EP_STEP_TOKENS == DEFAULT_CHUNK_TOKENS
    # Prefill chunks larger than one exchange step: the buffers are one step's, not the whole share's.
    big = plan_memory(FLASH, context=N, devices=2, weights="fp8", chunk_size=N)
    step = big.line("communication: MoE exchange").bytes_per_device
    assert step == 1 * EP_STEP_TOKENS * ((4096 + 32 * 4) + 2 * 4096 * 4)
    # FP4 experts are re-blocked as FP8 per layer (1 B a weight + a 4 B scale per 128 × 128 block: 1,536 an
    # expert), and run W8A8, so their tokens travel in fp8 too: 7 peers × 1,024 tokens × (4,224 + 2 × 16 KiB).
    fp4 = plan_memory(FLASH, context=N, devices=8, weights="fp4-experts")
    assert fp4.line("weights: dequantized layer (transient)").bytes_per_device == 32 * (25_165_824 + 1_536 * 4)
    assert fp4.line("communication: MoE exchange").bytes_per_device == 7 * 1024 * (4096 + 32 * 4 + 2 * 4096 * 4)
    # On 4 devices each peer's all-to-all pack holds every token (0.82 of them needed × 1.25, capped): 4 packs of
    # 1,024 rows out and in, and as many parts, outweigh direct's 3 copies in and parts out and back.
    four = plan_memory(FLASH, context=N, devices=4, weights="fp8")
    assert four.line("communication: MoE exchange").bytes_per_device == 4 * 2048 * 2 * (4096 + 32 * 4 + 4096 * 4)
    # Widths off the 128 grid have no FP8 kernel: dequantized to bf16 per layer, tokens in bf16.
    odd = plan_memory(FLASH.replace(moe_intermediate_size=2000), context=N, devices=8, weights="fp4-experts")
    assert odd.line("weights: dequantized layer (transient)").bytes_per_device == 32 * 3 * 2000 * 4096 * 2
    assert odd.line("communication: MoE exchange").bytes_per_device == 7 * 1024 * (4096 * 2 + 2 * 4096 * 4)
