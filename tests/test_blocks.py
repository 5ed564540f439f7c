"""Building blocks against cases worked out by hand: norms, RoPE / YaRN, hyper-connections, compressor
pooling, indexer top-k, router, attention core."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.attention import CompressedKeys, core_attention_jnp, index_topk_jnp, pool_windows
from dsv4.config import Config, RopeConfig
from dsv4.layers import (
    HyperConnection,
    RMSNorm,
    Rope,
    apply_rope,
    apply_rope_in_place,
    exact_float32,
    hc_merge,
    inverse_rms,
    linear,
    normalize_and_rope,
    normalized_mixes,
    rms_normalize,
    rope_in_place_with_scale,
    rope_inv_freq,
)
from dsv4.moe import MoE, routed_experts_jnp, swiglu


def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0]])  # mean square 12.5
    np.testing.assert_allclose(rms_normalize(x, 0.0), [[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)]], rtol=1e-6)
    norm = RMSNorm(2, 0.0, axis_name="embed", rngs=np.random.default_rng(0))
    norm.weight.set_value(jnp.array([2.0, -1.0]))
    np.testing.assert_allclose(norm(x), [[6 / math.sqrt(12.5), -4 / math.sqrt(12.5)]], rtol=1e-6)


def test_rope_rotates_interleaved_pairs_of_the_trailing_channels():
    # 2 pass-through channels, then one pair rotated by angle = position * inv_freq.
    x = jnp.array([[[10.0, 20.0, 1.0, 0.0]]])  # [B=1, S=1, D=4]
    angle = 0.7
    cos, sin = jnp.array([[[math.cos(angle)]]]), jnp.array([[[math.sin(angle)]]])
    out = apply_rope(x, cos, sin)
    np.testing.assert_allclose(out, [[[10, 20, math.cos(angle), math.sin(angle)]]], rtol=1e-6)
    np.testing.assert_allclose(apply_rope(out, cos, -sin), x, atol=1e-6)  # -sin undoes it


def test_rope_relative_property_and_head_broadcast():
    rope = Rope.build(RopeConfig(rope_theta=10000.0, partial_rotary_factor=1.0), 8)
    q = jax.random.normal(jax.random.key(0), (1, 1, 2, 8))  # [B, S, H, D]
    k = jax.random.normal(jax.random.key(1), (1, 1, 8))
    dots = []
    for p in (3, 10):  # q at p+4, k at p: the dot product depends on the distance only
        cq, sq = rope.cos_sin(jnp.array([[p + 4]]))
        ck, sk = rope.cos_sin(jnp.array([[p]]))
        dots.append(jnp.einsum("bshd,bsd->h", apply_rope(q, cq, sq), apply_rope(k, ck, sk)))
    np.testing.assert_allclose(dots[0], dots[1], rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_rope_in_place_equals_rope(dtype):
    """The in-place form (pairs as uint32 words, updated where they lie) gives apply_rope's values bit for bit, as
    the block's output does: x made in the same jit (so XLA may update its buffer in place), undone with -sin,
    read by a matmul; and by hand, a pair turned by 90°."""
    x = jax.random.normal(jax.random.key(5), (2, 7, 3, 24)) * 4.0  # [B, S, H, D], rope on the last 8 channels
    angles = jax.random.uniform(jax.random.key(6), (2, 7, 4), maxval=6.0)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    w = jax.random.normal(jax.random.key(7), (3 * 24, 5)).astype(dtype)

    def out(rope):
        def f(x, cos, sin, w):
            o = jnp.tanh(x).astype(dtype)  # a fresh buffer, as the attention kernel's output is
            o = rope(o, cos, -sin)
            return o, o.reshape(2, 7, -1) @ w

        return [np.asarray(a, np.float32) for a in jax.jit(f)(x, cos, sin, w)]

    (got, got_y), (want, want_y) = out(apply_rope_in_place), out(apply_rope)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_y, want_y)
    row = jnp.array([[[3.0, -2.0, 1.5, 0.25, -7.0, 6.0]]], dtype)  # [B=1, S=1, D=6]: 2 channels kept, 2 pairs
    turned = apply_rope_in_place(row, jnp.array([[[0.0, 1.0]]]), jnp.array([[[1.0, 0.0]]]))
    np.testing.assert_array_equal(np.asarray(turned, np.float32), [[[3.0, -2.0, -0.25, 1.5, -7.0, 6.0]]])


def test_rope_in_place_with_scale_takes_the_rms_before_rotating():
    """Rotated rows as apply_rope's, bit for bit, and the factor of the rows before the rotation (cos and sin scaled
    by 1.2, as YaRN's magnitude factor scales them, so the rotated rows' RMS is another); x made in the jit."""
    x = (jax.random.normal(jax.random.key(8), (1, 7, 3, 24)) * 4.0).astype(jnp.bfloat16)  # rope: last 8 channels
    angles = jax.random.uniform(jax.random.key(9), (1, 7, 4), maxval=6.0)
    cos, sin = (jnp.cos(angles) * 1.2).astype(jnp.bfloat16), (jnp.sin(angles) * 1.2).astype(jnp.bfloat16)
    got, scale = jax.jit(lambda x, c, s: rope_in_place_with_scale(-x, c, s, 1e-6))(x, cos, sin)  # -x: exact
    x = -x
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(apply_rope(x, cos, sin), np.float32))
    np.testing.assert_allclose(scale, inverse_rms(x.astype(jnp.float32), 1e-6), rtol=1e-6)
    rotated_rms = inverse_rms(got.astype(jnp.float32), 1e-6)
    assert float(jnp.max(jnp.abs(rotated_rms / scale - 1))) > 1e-2  # the order matters in this test


def test_normalize_and_rope_is_rope_of_the_normalized_rows():
    """Rotating first and scaling by the RMS factor after (one pass over x) equals normalizing, then rotating."""
    x = jax.random.normal(jax.random.key(3), (2, 5, 3, 16)) * 3.0  # [B, S, H, D], rope on the last 8 channels
    angles = jax.random.uniform(jax.random.key(4), (2, 5, 4), maxval=6.0)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    want = apply_rope(rms_normalize(x, 1e-6), cos, sin)
    np.testing.assert_allclose(normalize_and_rope(x, cos, sin, 1e-6), want, rtol=1e-5, atol=1e-6)
    # by hand: one pair rotated by 90° keeps the row's RMS, so only the pair moves
    row = jnp.array([[[3.0, 4.0, 0.0, 5.0]]])  # mean square 12.5
    got = normalize_and_rope(row, jnp.array([[[0.0]]]), jnp.array([[[1.0]]]), 0.0)
    np.testing.assert_allclose(got, [[[3, 4, -5, 0]]] / np.sqrt(12.5), rtol=1e-6, atol=1e-7)


def test_linear_rounds_once_to_the_input_dtype():
    x = jax.random.normal(jax.random.key(5), (4, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(6), (8, 64), jnp.float32)
    want = np.asarray(x) @ np.asarray(w).T
    np.testing.assert_allclose(linear(x, w), want, rtol=1e-5, atol=1e-5)
    got = linear(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64).T
    # float32 accumulation, one rounding to bf16: within half a bf16 step (2^-9 relative) of the exact product
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2**-8, atol=1e-3)


def test_mhc_mixes_and_merge_by_hand():
    """normalized_mixes = RMSNorm(flattened copies) · fnᵀ; hc_merge: copy k = post_k · out + Σ_j comb[j, k] · copy_j."""
    streams = jnp.array([[[[3.0, 4.0], [0.0, 0.0]]]])  # [B=1, S=1, hc=2, D=2]: flattened mean square 25/4
    fn = jnp.array([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    np.testing.assert_allclose(normalized_mixes(streams, fn, 0.0), [[[3 / 2.5, 4 / 2.5]]], rtol=1e-6)
    out = jnp.array([[[10.0, 20.0]]])
    post = jnp.array([[[0.5, 2.0]]])
    comb = jnp.array([[[[0.25, 0.75], [1.0, 0.0]]]])  # comb[j, k]
    # copy 0: 0.5·out + 0.25·copy_0 + 1.0·copy_1; copy 1: 2·out + 0.75·copy_0 + 0·copy_1
    np.testing.assert_allclose(hc_merge(out, streams, post, comb), [[[[5.75, 11.0], [22.25, 43.0]]]], rtol=1e-6)


def test_merge_hands_on_the_mean_square_of_the_copies_it_rounded():
    """hc_merge(with_mean_square=True): the copies as without it, and the mean square of the stored (bf16-rounded)
    values per token, by hand: the mixes it lets the next hyper-connection skip a pass for are the same."""
    streams = jnp.array([[[[3.0, 4.0], [0.0, 0.0]]]])
    out, post = jnp.array([[[10.0, 20.0]]]), jnp.array([[[0.5, 2.0]]])
    comb = jnp.array([[[[0.25, 0.75], [1.0, 0.0]]]])
    copies, ms = hc_merge(out, streams, post, comb, with_mean_square=True)
    np.testing.assert_allclose(copies, [[[[5.75, 11.0], [22.25, 43.0]]]], rtol=1e-6)
    np.testing.assert_allclose(ms, [[[(5.75**2 + 11.0**2 + 22.25**2 + 43.0**2) / 4]]], rtol=1e-6)
    # bf16: 1 + 2^-9 rounds to 1 (bf16 keeps 7 fraction bits), so the copies' mean square is exactly 1
    one = jnp.full((1, 3, 2, 8), 1 + 2**-9, jnp.float32)
    streams16 = jnp.zeros((1, 3, 2, 8), jnp.bfloat16)
    copies16, ms16 = hc_merge(one[:, :, 0], streams16, jnp.ones((1, 3, 2)), jnp.zeros((1, 3, 2, 2)),
                              with_mean_square=True)  # fmt: skip
    assert copies16.dtype == jnp.bfloat16 and float(jnp.abs(copies16.astype(jnp.float32) - 1).max()) == 0
    np.testing.assert_array_equal(np.asarray(ms16), np.ones((1, 3, 1), np.float32))
    fn = jax.random.normal(jax.random.key(0), (5, 16), jnp.float32)
    np.testing.assert_allclose(normalized_mixes(copies16, fn, 1e-6, ms16), normalized_mixes(copies16, fn, 1e-6),
                               rtol=1e-6)  # fmt: skip


def test_exact_float32_of_bfloat16_by_hand():
    x = jnp.array([1.0, -2.5, 3.140625, 0.0, -0.0, jnp.inf], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(exact_float32(x)), np.asarray(x.astype(jnp.float32)))
    assert exact_float32(jnp.float16(1.5)).dtype == jnp.float32


def test_yarn_frequencies_by_hand():
    # dim 8 → 4 pairs, theta 10000: extrapolated inv_freq = 10000^(-2i/8) = 1, 0.1, 0.01, 0.001.
    rope = RopeConfig(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=64,
                      beta_fast=32, beta_slow=1)  # fmt: skip
    inv, scale = rope_inv_freq(rope, 8)
    # correction dim(r) = 8·ln(64 / (2π r)) / (2 ln 10000): r=32 → -0.401 → floor -1 → clamp 0;
    # r=1 → 1.008 → ceil 2. Ramp over pair index i: clip(i / 2, 0, 1) = 0, .5, 1, 1.
    extrapolated = np.array([1, 0.1, 0.01, 0.001])
    keep = np.array([1, 0.5, 0, 0])
    np.testing.assert_allclose(inv, extrapolated / 16 * (1 - keep) + extrapolated * keep, rtol=1e-6)
    assert scale == pytest.approx(0.1 * math.log(16) + 1)  # no attention_factor given: YaRN's mscale
    assert rope_inv_freq(RopeConfig(**{**rope.__dict__, "attention_factor": 1.0}), 8)[1] == 1.0


def test_hyper_connection_comb_is_doubly_stochastic():
    cfg = Config.preset("tiny").replace(hc_sinkhorn_iters=200)
    hc = HyperConnection(cfg, rngs=np.random.default_rng(0))
    hc.fn.set_value(hc.fn[...] * 10)  # make the raw mixing far from uniform
    streams = jax.random.normal(jax.random.key(2), (2, 3, cfg.hc_mult, cfg.hidden_size))
    post, comb, collapsed = hc(streams)
    np.testing.assert_allclose(comb.sum(-1), 1, atol=1e-4)
    np.testing.assert_allclose(comb.sum(-2), 1, atol=1e-4)
    assert float(jnp.abs(comb - 1 / cfg.hc_mult).max()) > 0.05  # and not trivially uniform
    assert post.shape == (2, 3, cfg.hc_mult) and bool(jnp.all((post > 0) & (post < 2)))
    assert collapsed.shape == (2, 3, cfg.hidden_size)


def test_pool_windows_by_hand():
    # rate 2, no overlap, equal gates → plain mean of each complete window; the odd tail token is dropped.
    kv = jnp.arange(5.0).reshape(1, 5, 1)
    gate = jnp.zeros((1, 5, 1))
    out = pool_windows(kv, gate, jnp.zeros((2, 1)), 2, overlap=False, head_dim=1)
    np.testing.assert_allclose(out[0, :, 0], [0.5, 2.5])
    # Overlap: channels [Ca | Cb]; entry w pools Ca of window w-1 and Cb of window w; entry 0 has no Ca.
    kv = jnp.stack([100 + jnp.arange(4.0), jnp.arange(4.0)], -1)[None]  # Ca = 100.., Cb = 0..
    gate = jnp.zeros((1, 4, 2))
    out = pool_windows(kv, gate, jnp.zeros((2, 2)), 2, overlap=True, head_dim=1)
    np.testing.assert_allclose(out[0, :, 0], [0.5, (100 + 101 + 2 + 3) / 4])
    # A position bias can pick one slot: +inf-like bias on slot 1 of the window.
    out = pool_windows(kv[..., 1:], gate[..., 1:], jnp.array([[0.0], [50.0]]), 2, overlap=False, head_dim=1)
    np.testing.assert_allclose(out[0, :, 0], [1, 3], atol=1e-6)


def test_index_topk_by_hand():
    # One head, weight 1, 1-D keys: score = ReLU(q·k)·scale. Keys 0..4 have values [1, 5, 3, -2, 5].
    keys = jnp.array([1.0, 5, 3, -2, 5]).reshape(1, 5, 1)
    q = jnp.ones((1, 4, 1, 1))
    w = jnp.ones((1, 4, 1))
    pos = jnp.array([[3, 7, 19, 200]])  # rate 4: visible entries = (p+1)//4 = 1, 2, 5, 50 (capped at 5)
    idx = np.asarray(index_topk_jnp(q, keys, w, pos, rate=4, k=3, softmax_scale=1.0))
    assert idx[0, 0].tolist() == [0, -1, -1]  # one visible, the rest padded with -1
    assert idx[0, 1].tolist() == [1, 0, -1]
    assert idx[0, 2].tolist() == [1, 4, 2]  # tie 5 vs 5: the lower index first
    assert idx[0, 3].tolist() == [1, 4, 2]


def test_attention_core_by_hand():
    # One head, D=1, window 2. Query at position 2 sees keys at 1 and 2 (values 1 and 2) and the sink.
    q = jnp.ones((1, 3, 1, 1))
    kv = jnp.array([0.0, 1.0, 2.0]).reshape(1, 3, 1)
    pos = jnp.arange(3)[None]
    sink = jnp.array([0.5])
    out = core_attention_jnp(q, kv, pos, pos, sink, sliding_window=2, scale=1.0)
    e = np.exp([1.0, 2.0, 0.5])  # logits q·k = 1, 2 and the sink 0.5 (which has no value)
    np.testing.assert_allclose(out[0, 2, 0, 0], (e[0] * 1 + e[1] * 2) / e.sum(), rtol=1e-6)
    # HCA entry 0 (value 10) becomes visible at position (0+1)*rate - 1 = 1 with rate 2.
    hca = CompressedKeys(jnp.array([[[10.0]]]), rate=2)
    out = core_attention_jnp(q, kv, pos, pos, sink, sliding_window=1, scale=1.0, compressed=hca)
    np.testing.assert_allclose(out[0, 0, 0, 0], 0.0)  # sees key 0 (value 0) and the sink only
    e = np.exp([1.0, 10.0, 0.5])
    np.testing.assert_allclose(out[0, 1, 0, 0], (e[0] * 1 + e[1] * 10) / e.sum(), rtol=1e-6)
    # Every key masked (kv_pos = -1): the sink alone → zero output, not NaN.
    out = core_attention_jnp(q, kv, pos, -jnp.ones_like(pos), sink, sliding_window=2, scale=1.0)
    np.testing.assert_array_equal(out, 0)


def test_query_chunking_does_not_change_the_answer():
    key = jax.random.split(jax.random.key(3), 4)
    b, s, h, d = 2, 45, 3, 8
    q = jax.random.normal(key[0], (b, s, h, d))
    kv = jax.random.normal(key[1], (b, s, d))
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    sinks = jax.random.normal(key[2], (h,))
    entries = jax.random.normal(key[3], (b, 11, d))
    topk = jax.random.randint(key[0], (b, s, 4), -1, 11)
    for compressed in (None, CompressedKeys(entries, 4), CompressedKeys(entries, 4, topk)):
        full = core_attention_jnp(q, kv, pos, pos, sinks, sliding_window=7, scale=0.3, compressed=compressed,
                                  query_chunk=1000)  # fmt: skip
        for chunk, aligned in ((8, False), (8, True), (16, True), (45, True)):
            got = core_attention_jnp(q, kv, pos, pos, sinks, sliding_window=7, scale=0.3, compressed=compressed,
                                     query_chunk=chunk, kv_aligned=aligned)  # fmt: skip
            np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-6)


def test_router_bias_selects_but_does_not_weigh():
    cfg = Config.preset("tiny").replace(n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=2.0)
    moe = MoE(cfg, "moe", rngs=np.random.default_rng(0), dtype=jnp.float32)
    x = jnp.ones((1, cfg.hidden_size))
    w = jnp.zeros((4, cfg.hidden_size)).at[:, 0].set(jnp.array([4.0, 3.0, 2.0, 1.0]))  # logits 4, 3, 2, 1
    moe.gate["weight"].set_value(w)
    score = np.sqrt(np.log1p(np.exp([4.0, 3.0, 2.0, 1.0])))  # sqrtsoftplus
    ids, weights = moe.route(x, jnp.zeros((1,), jnp.int32))
    assert sorted(np.asarray(ids[0]).tolist()) == [0, 1]
    moe.gate["e_score_correction_bias"].set_value(jnp.array([0.0, 0.0, 0.0, 10.0]))  # force expert 3 in
    ids, weights = moe.route(x, jnp.zeros((1,), jnp.int32))
    got = dict(zip(np.asarray(ids[0]).tolist(), np.asarray(weights[0]).tolist()))
    assert sorted(got) == [0, 3]
    np.testing.assert_allclose([got[0], got[3]], 2.0 * score[[0, 3]] / score[[0, 3]].sum(), rtol=1e-5)


def test_hash_routing_uses_the_token_table():
    cfg = Config.preset("tiny")
    moe = MoE(cfg, "hash_moe", rngs=np.random.default_rng(0), dtype=jnp.float32)
    table = np.zeros((cfg.vocab_size, 2), np.int32)
    table[7] = [5, 2]
    moe.gate["tid2eid"].set_value(jnp.asarray(table))
    ids, _ = moe.route(jax.random.normal(jax.random.key(0), (1, cfg.hidden_size)), jnp.array([7]))
    assert np.asarray(ids).tolist() == [[5, 2]]


def test_routed_experts_match_a_per_token_loop():
    rng = np.random.default_rng(0)
    n, d, i, e, k = 9, 6, 4, 5, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    ids[:6] = [0, 1]  # skewed: expert 0 and 1 take most tokens; experts 3/4 may be empty
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, d)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, d, i)), jnp.float32)
    got = routed_experts_jnp(x, jnp.asarray(ids), weights, gate_up, down, limit=1.5)
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(k):
            h = np.asarray(gate_up[ids[t, j]]) @ np.asarray(x[t])
            act = np.asarray(swiglu(jnp.asarray(h[:i]), jnp.asarray(h[i:]), 1.5))
            want[t] += float(weights[t, j]) * (np.asarray(down[ids[t, j]]) @ act)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_swiglu_clamps():
    np.testing.assert_allclose(swiglu(jnp.array([100.0]), jnp.array([-100.0]), 2.0), [2.0 / (1 + math.exp(-2)) * -2])
