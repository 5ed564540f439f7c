"""The model's cached paths on the Pallas kernels against the jnp ones, end to end on a GPU (GPU only).

The same random weights and the same ragged batch run twice, each path from its own paged cache:
- the chunked prefill: each chunk after the first runs its window / HCA attention on the Mosaic kernel from the
  cache's ring (the first chunk, with no ring yet, and CSA layers take the Triton kernel, or under
  `Kernels.csa="pallas"` the Mosaic kernel's CSA mode); every chunk's last logits must agree with the jnp path's;
- the decode steps through the paged decode kernel on the cache itself: bf16 rows or, with an FP8 cache, its split
  rows as stored (e4m3 nope channels and their scales, bf16 RoPE channels). With an FP8 cache both paths decode from
  the jnp path's cache (the Pallas path's new cache is dropped each step): two caches written from slightly
  different bf16 values round apart in FP8, and that would be measured, not the attention route.

Tolerance: relative L2 of the logits < 5e-2 (the two paths round at different places; the kernel's softmax state is
float32 throughout). A decode step may exceed it by as much as its noise floor allows: the jnp path again with
Gaussian noise of 2e-3 × the RMS (bf16 rounding) on every layer's attention output, 4 seeds; the step passes under
1.2× the largest logit change that noise caused there. Some steps of this random model sit near a discrete flip
(top-k, routing), where rounding alone moves the logits by up to 7e-2. Greedy tokens can swap on near-ties in bf16,
so they are not compared.

Model: V4-Flash's attention shapes (64 heads × 512, window 128, CSA 4:1 with a 64 × 128 indexer keeping 512, HCA
128:1) with a narrow residual stream and few experts; layers sliding, CSA, HCA; bf16. Cache paged (256-token pages,
permuted block table). Prompts of 20000 and 19667 tokens in 8192-token chunks, then 8 decode steps, the second slot
idle in one of them.

    python3 -m pytest -m gpu -v tests/test_gpu_decode.py      # one H200
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

PROMPT, CHUNK, STEPS = 20000, 8192, 8
TOL = 5e-2
NOISE_REL, NOISE_SEEDS, NOISE_MARGIN = 2e-3, 4, 1.2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]


def _config():
    from dsv4.config import Config

    return Config.from_hf({
        "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 256, "qk_rope_head_dim": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 128,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["moe"] * 3, "max_position_embeddings": 1 << 20,
    })  # fmt: skip


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _attention_cores() -> dict:
    """The name → attention core table the model looks its core up in when it traces."""
    from dsv4.attention.dispatch import ATTENTION_CORES

    return ATTENTION_CORES


_NOISE = {"seed": 0}


def _noisy(core):
    """`core` plus Gaussian noise of NOISE_REL × its output's RMS, seeded from _NOISE["seed"] (read at run time, so
    one executable serves every seed) and the layer: a stand-in for a kernel whose only difference from jnp is
    rounding."""
    import jax.numpy as jnp

    layer = [0]

    def noisy_core(q, kv, q_pos, kv_pos, sinks, **kwargs):
        kwargs.pop("kv_prefix", None)
        out = core(q, kv, q_pos, kv_pos, sinks, **kwargs)
        seed = jax.pure_callback(lambda: np.int32(_NOISE["seed"]), jax.ShapeDtypeStruct((), jnp.int32))
        layer[0] += 1
        key = jax.random.fold_in(jax.random.key(seed), layer[0])
        o = out.astype(jnp.float32)
        rms = jnp.sqrt(jnp.mean(o * o))
        return (o + NOISE_REL * rms * jax.random.normal(key, o.shape)).astype(out.dtype)

    return noisy_core


@pytest.mark.parametrize(
    "kv_format, csa",
    [(None, "pallas-triton"), ("fp8-channel", "pallas-triton"), (None, "pallas")],
    ids=["bf16", "fp8-channel", "bf16-csa-mosaic"],
)
def test_gpu_cached_paths_match_jnp(kv_format, csa, monkeypatch):
    """Prefill chunks and decode steps with the Pallas kernels (Kernels attention / decode / kv_write "pallas")
    against the jnp path (all three "jnp"), bf16 and FP8 caches; and with the CSA layer's chunks on the Mosaic
    kernel's CSA mode (`Kernels.csa="pallas"`)."""
    import jax.numpy as jnp
    from flax import nnx

    import dsv4

    def step(graphdef, state, cache, tokens, valid):
        return nnx.merge(graphdef, state).forward_chunk(cache, tokens, valid)

    run, run_noisy = jax.jit(step), jax.jit(step)  # separate executables: the noisy one traces the patched core

    cfg = _config()
    reference = dsv4.init_random(cfg, seed=0, dtype=jnp.bfloat16,
                                 kernels=dsv4.Kernels(attention="jnp", decode="jnp", kv_write="jnp"))  # fmt: skip
    pallas = dsv4.init_random(cfg, seed=0, dtype=jnp.bfloat16,
                              kernels=dsv4.Kernels(attention="pallas", decode="pallas", kv_write="pallas",
                                                   csa=csa))  # fmt: skip
    g_jnp, state = nnx.split(reference)
    g_pallas, _ = nnx.split(pallas)
    del pallas

    lens = np.array([PROMPT, PROMPT - 333])
    page_tokens, max_len = 256, PROMPT + STEPS + 256
    cols = -(-max_len // page_tokens)
    cache = reference.init_cache(2, max_len=max_len, kv_format=kv_format, page_tokens=page_tokens,
                                 num_pages=2 * cols + 1)  # fmt: skip
    pages = np.random.default_rng(1).permutation(np.arange(1, 2 * cols + 1)).reshape(2, cols)
    cache = cache.replace(block_table=jnp.asarray(pages, jnp.int32))
    cache = jax.device_put(cache, jax.devices()[0])
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, PROMPT)).astype(np.int32)
    graphs = (("jnp", g_jnp), ("pallas", g_pallas))
    caches = {"jnp": cache, "pallas": cache}
    failures = []

    for start in range(0, PROMPT, CHUNK):
        n = min(CHUNK, PROMPT - start)
        valid = jnp.asarray(np.clip(lens - start, 0, n).astype(np.int32))
        tokens = np.zeros((2, CHUNK), np.int32)
        tokens[:, :n] = prompt[:, start : start + n]
        out = {}
        for impl, g in graphs:
            out[impl], caches[impl] = run(g, state, caches[impl], jnp.asarray(tokens), valid)
        err = _rel_err(out["pallas"], out["jnp"])
        if err >= TOL:
            failures.append(f"prefill chunk at {start}: rel err {err:.2e} >= {TOL}")

    tok = np.asarray(out["jnp"]).argmax(-1).astype(np.int32)
    one_cache = kv_format not in (None, "bf16")
    cores = _attention_cores()
    noisy_core = _noisy(cores["jnp"])
    for i in range(STEPS):
        valid = jnp.asarray([1, 0 if i == 1 else 1], jnp.int32)
        if one_cache:
            caches["pallas"] = caches["jnp"]
        before = caches["jnp"]
        out = {}
        for impl, g in graphs:
            out[impl], caches[impl] = run(g, state, caches[impl], jnp.asarray(tok[:, None]), valid)
        active = np.asarray(valid) > 0
        ref = np.asarray(out["jnp"])[active]
        err = _rel_err(np.asarray(out["pallas"])[active], ref)
        floor = []
        for seed in range(NOISE_SEEDS):
            _NOISE["seed"] = seed
            with monkeypatch.context() as patch:  # run_noisy traces (once) with the noisy core in jnp's place
                patch.setitem(cores, "jnp", noisy_core)
                noisy = np.asarray(run_noisy(g_jnp, state, before, jnp.asarray(tok[:, None]), valid)[0])
            floor.append(_rel_err(noisy[active], ref))
        allowed = max(TOL, NOISE_MARGIN * max(floor))
        if err >= allowed:
            failures.append(f"decode step {i}: rel err {err:.2e} >= {allowed:.2e} (noise floor {max(floor):.2e})")
        tok = np.asarray(out["jnp"]).argmax(-1).astype(np.int32)  # both paths continue from the same tokens

    assert not failures, failures
