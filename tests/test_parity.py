"""Parity with the public reference (transformers 5.23.0 DeepseekV4ForCausalLM) on the tiny fixtures.

The fixtures (tests/fixtures/*, made by scripts/make_reference_fixtures.py) hold random float32 models
with every 1-D parameter randomized, their reference logits, per-layer residual streams, and the
reference's cached greedy generation. Tolerance: max |Δ| / max |ref| < 1e-4 in float32 — both sides
compute the same float32 math in a different order (einsum vs matmul, softmax forms), which costs a few
ulps per op; over 4-5 layers that stays near 1e-6, so 1e-4 leaves room without hiding a real bug
(a wrong mask, RoPE or routing choice moves logits by 1e-2 or more).
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4
from dsv4.generate import generate

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
TOL = 1e-4


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


@functools.cache
def fixture(name):
    ref = dict(np.load(os.path.join(FIXTURES, name, "reference.npz")))
    return dsv4.load(os.path.join(FIXTURES, name), dtype=jnp.float32), ref


def test_fixtures_are_present():
    assert {"tiny_mixed", "tiny_long", "tiny_sigmoid", "tiny_short"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_reference(name):
    model, ref = fixture(name)
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < TOL


@pytest.mark.parametrize("name", ["tiny_mixed", "tiny_sigmoid"])
def test_every_layer_matches_reference(name):
    """Each decoder layer fed the reference's input stream reproduces the reference's output stream."""
    model, ref = fixture(name)
    ids = jnp.asarray(ref["input_ids"])
    b, s = ids.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    hs = ref["hidden_states"]
    embed = model.embed_tokens["weight"][...][ids]
    assert rel_err(jnp.broadcast_to(embed[:, :, None], hs[0].shape), hs[0]) == 0
    layer_fn = jax.jit(lambda g, st, x: nnx.merge(g, st)(x, positions, ids), static_argnums=0)
    for i, layer in enumerate(model.layers):
        g, st = nnx.split(layer)
        err = rel_err(layer_fn(g, st, jnp.asarray(hs[i])), hs[i + 1])
        assert err < TOL, f"layer {i} ({layer.self_attn.layer_type})"


@pytest.mark.parametrize("name", ["tiny_mixed", "tiny_long"])
def test_greedy_generation_matches_reference(name):
    model, ref = fixture(name)
    s = ref["input_ids"].shape[1]
    n = ref["generated"].shape[1] - s
    for row in range(ref["input_ids"].shape[0]):
        result = generate(model, ref["input_ids"][row], n)
        assert result.token_ids == ref["generated"][row, s:].tolist()


@functools.partial(jax.jit, static_argnums=0)
def _chunk_step(graphdef, state, cache, tokens, valid):
    return nnx.merge(graphdef, state).forward_chunk(cache, tokens, valid)


def _committed(cache):
    """The cache committed to the device, as every _chunk_step output is: an uncommitted first cache is a different
    jit cache key, so the second step would compile _chunk_step again (about 8 s on the CPU box)."""
    return jax.device_put(cache, jax.devices()[0])


@pytest.mark.parametrize(
    "name, chunk",
    [("tiny_long", c) for c in (1, 3, 7, 64, 1000)] + [("tiny_sigmoid", 5), ("tiny_mixed", 16)],
)
def test_chunked_prefill_then_decode_matches_reference(name, chunk):
    """Any chunking of the prompt — boundaries that split compression windows and the sliding window —
    then cached decode of the reference's greedy tokens gives the reference's logits and tokens."""
    model, ref = fixture(name)
    ids, generated = ref["input_ids"], ref["generated"]
    b, s = ids.shape
    n_new = generated.shape[1] - s
    graphdef, state = nnx.split(model)
    cache = _committed(model.init_cache(b, max_len=s + n_new + 8))
    width = min(chunk, s)
    for t in range(0, s, width):
        n = min(width, s - t)
        tokens = np.zeros((b, width), np.int32)
        tokens[:, :n] = ids[:, t : t + n]
        logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.full((b,), n, jnp.int32))
        assert rel_err(logits, ref["logits"][:, t + n - 1]) < TOL, f"prefill chunk at {t}"
    assert np.asarray(cache.num_tokens).tolist() == [s] * b
    for step in range(n_new):  # decode: feed the reference's own greedy tokens one at a time
        np.testing.assert_array_equal(np.asarray(logits).argmax(-1), generated[:, s + step])
        assert rel_err(logits, ref["generate_logits"][:, step]) < TOL, f"decode step {step}"
        if step + 1 < n_new:
            tokens = np.zeros((b, width), np.int32)
            tokens[:, 0] = generated[:, s + step]
            logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.ones((b,), jnp.int32))


def test_pallas_kernels_selected_still_match_reference():
    """The model with the Pallas kernels selected (attention, indexer, MoE; interpreted on CPU) passes the same bar."""
    ref = dict(np.load(os.path.join(FIXTURES, "tiny_mixed", "reference.npz")))
    model = dsv4.load(os.path.join(FIXTURES, "tiny_mixed"), dtype=jnp.float32,
                      kernels="attention=pallas,moe=pallas,indexer=pallas")  # fmt: skip
    assert (model.kernels.attention, model.kernels.moe, model.kernels.indexer) == ("pallas",) * 3
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < TOL


@pytest.mark.parametrize("attention", ["jnp", "pallas"])
def test_q_norm_folded_into_the_core_matches_reference(attention, monkeypatch):
    """`Kernels.q_norm="fold"`: q only rotated, its inverse RMS handed to the core (the jnp core folds it into its
    logits, the Pallas core off Hopper, the Triton kernel interpreted, into its logit scale): the reference's logits,
    and with the jnp core also in chunks of 7 then decode, and in one-token steps (those take q normalized). The
    whole prompt's forward never normalizes q itself."""
    import dsv4.attention.block as block

    path = os.path.join(FIXTURES, "tiny_long")
    ref = dict(np.load(os.path.join(path, "reference.npz")))
    model = dsv4.load(path, dtype=jnp.float32, kernels=f"attention={attention},q_norm=fold")
    assert model.kernels.q_norm == "fold"
    normalized = []
    plain = block.normalize_and_rope
    monkeypatch.setattr(block, "normalize_and_rope", lambda q, *a: normalized.append(q.shape) or plain(q, *a))
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < TOL
    assert normalized == []
    if attention == "jnp":
        for chunk in (7, 1):
            got = _prefill_then_decode(model, ref, chunk)
            assert rel_err(got, ref["generate_logits"][:, : got.shape[1]]) < TOL, f"chunks of {chunk}"


def test_csa_layers_ask_the_pallas_core_for_the_mosaic_kernel_under_kernels_csa(monkeypatch):
    """`Kernels.csa="pallas"`: the Pallas core is asked for the Mosaic kernel in CSA layers only, in the whole prompt's
    forward and in cached chunks (off Hopper it runs the Triton kernel, so the logits stay the reference's); the
    default asks in none."""
    from dsv4.attention import dispatch

    path = os.path.join(FIXTURES, "tiny_mixed")
    ref = dict(np.load(os.path.join(path, "reference.npz")))
    plain = dispatch.ATTENTION_CORES["pallas"]
    asked = []

    def recording(*args, csa_mosaic=False, **kwargs):
        asked.append((kwargs["compressed"] is not None and kwargs["compressed"].topk_indices is not None, csa_mosaic))
        return plain(*args, csa_mosaic=csa_mosaic, **kwargs)

    monkeypatch.setitem(dispatch.ATTENTION_CORES, "pallas", recording)
    model = dsv4.load(path, dtype=jnp.float32, kernels="attention=pallas,csa=pallas")
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < TOL
    got = _prefill_then_decode(model, ref, 7)
    assert rel_err(got, ref["generate_logits"][:, : got.shape[1]]) < TOL
    assert asked and all(listed == mosaic for listed, mosaic in asked) and any(m for _, m in asked)
    asked.clear()
    dsv4.load(path, dtype=jnp.float32, kernels="attention=pallas").logits(ref["input_ids"])
    assert asked and not any(m for _, m in asked)


def test_q_norm_folds_by_default_only_under_the_pallas_core_on_hopper():
    """The fold is the measured default where the Mosaic attention kernel runs (a Hopper GPU, the Pallas core); an
    explicit choice stands; other devices and cores keep q normalized by XLA."""
    resolve = dsv4.Kernels.resolve
    assert resolve(dsv4.Kernels(), jnp.bfloat16, gpu=True, hopper=True).q_norm == "fold"
    assert resolve(dsv4.Kernels(attention="pallas"), jnp.float32, gpu=True, hopper=True).q_norm == "fold"
    assert resolve(dsv4.Kernels(q_norm="jnp"), jnp.bfloat16, gpu=True, hopper=True).q_norm == "jnp"
    assert resolve(dsv4.Kernels(), jnp.bfloat16, gpu=True, hopper=False).q_norm == "jnp"
    assert resolve(dsv4.Kernels(), jnp.float32, gpu=True, hopper=True).q_norm == "jnp"  # the jnp core
    assert resolve(dsv4.Kernels(attention="sp-pallas"), jnp.bfloat16, gpu=True, hopper=True).q_norm == "jnp"
    assert resolve(dsv4.Kernels(), jnp.bfloat16, gpu=False).q_norm == "jnp"
    assert resolve(dsv4.Kernels(), jnp.bfloat16, gpu=True, hopper=True).csa == "pallas"  # measured faster there
    assert resolve(dsv4.Kernels(), jnp.bfloat16, gpu=True, hopper=False).csa == "pallas-triton"
    assert resolve(dsv4.Kernels(csa="pallas-triton"), jnp.bfloat16, gpu=True, hopper=True).csa == "pallas-triton"
    assert dsv4.Kernels.parse("jnp").csa == dsv4.Kernels.parse("pallas").csa == "pallas"  # a valid choice either way


@pytest.mark.parametrize("name", ["tiny_long", "tiny_mixed"])
def test_paged_cache_with_permuted_block_tables_matches_reference(name):
    """Compressed entries in shared page pools (16-token pages: 4 CSA entries, 1 HCA entry each; chunks of 7
    never align with them), reached through a randomly permuted block table, then decode: the same logits as
    the reference."""
    model, ref = fixture(name)
    ids, generated = ref["input_ids"], ref["generated"]
    b, s = ids.shape
    graphdef, state = nnx.split(model)
    num_pages = 64
    cache = model.init_cache(b, max_len=96, page_tokens=16, num_pages=num_pages)
    free = list(np.random.default_rng(7).permutation(np.arange(1, num_pages)))  # page 0 is the null page
    table = cache.block_table
    pages = [[free.pop() for _ in range(table.shape[1])] for _ in range(b)]
    cache = cache.replace(block_table=jnp.asarray(pages, jnp.int32))
    cache = _committed(cache)
    chunk = 7
    for t in range(0, s, chunk):
        n = min(chunk, s - t)
        tokens = np.zeros((b, chunk), np.int32)
        tokens[:, :n] = ids[:, t : t + n]
        logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.full((b,), n, jnp.int32))
        assert rel_err(logits, ref["logits"][:, t + n - 1]) < TOL, f"prefill chunk at {t}"
    tokens = np.zeros((b, chunk), np.int32)
    tokens[:, 0] = generated[:, s]
    logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.ones((b,), jnp.int32))
    assert rel_err(logits, ref["generate_logits"][:, 1]) < TOL


def _prefill_then_decode(model, ref, chunk, **cache_args):
    """Prefill the fixture's prompt in chunks of `chunk`, then decode the reference's greedy tokens one at a time.
    → logits [B, 1 + decode steps, vocab]: after the prompt, then after each fed token."""
    ids, generated = ref["input_ids"], ref["generated"]
    b, s = ids.shape
    n_new = generated.shape[1] - s
    graphdef, state = nnx.split(model)
    cache = model.init_cache(b, max_len=s + n_new + 8, **cache_args)
    if cache.block_table is not None:  # distinct pages in a shuffled order (page 0 is the null page)
        table = cache.block_table
        ids_ = np.random.default_rng(3).permutation(np.arange(1, cache_args["num_pages"]))[: table.size]
        cache = cache.replace(block_table=jnp.asarray(ids_.reshape(table.shape), jnp.int32))
    cache = _committed(cache)
    width = min(chunk, s)
    for t in range(0, s, width):
        n = min(width, s - t)
        tokens = np.zeros((b, width), np.int32)
        tokens[:, :n] = ids[:, t : t + n]
        logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.full((b,), n, jnp.int32))
    out = [logits]
    for step in range(n_new - 1):
        tokens = np.zeros((b, width), np.int32)
        tokens[:, 0] = generated[:, s + step]
        logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.ones((b,), jnp.int32))
        out.append(logits)
    return np.stack([np.asarray(x) for x in out], axis=1)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8-channel", "fp8-tile-e8m0"])
def test_stored_cache_formats_give_the_same_logits_for_any_chunking(kv_format):
    """With the cache stored in bf16 or FP8, chunks of 7 (paged) and 64 (dense) give the logits of the
    whole prompt in one chunk to float32 noise: a chunk's own rows are rounded as the cache stores them.
    bf16 stays within bf16 rounding of the reference and keeps its greedy tokens; FP8 is measured in
    docs/BENCHMARKS.md, and here only has to keep the greedy tokens of this fixture."""
    model, ref = fixture("tiny_long")
    whole = _prefill_then_decode(model, ref, 10**6, kv_format=kv_format)
    for chunk, paged in ((7, True), (64, False)):
        args = dict(page_tokens=16, num_pages=24) if paged else {}
        got = _prefill_then_decode(model, ref, chunk, kv_format=kv_format, **args)
        # NOTE: 1e-4, not 1e-5: float32 noise can move a value across an FP8 rounding boundary (a 6 % step).
        # Using the chunk's own rows unrounded instead would differ by ~1e-2.
        assert rel_err(got, whole) < 1e-4, f"chunk {chunk}, paged={paged}"
    s = ref["input_ids"].shape[1]
    assert rel_err(whole, ref["generate_logits"][:, : whole.shape[1]]) < (5e-3 if kv_format == "bf16" else 0.1)
    np.testing.assert_array_equal(whole.argmax(-1), ref["generated"][:, s : s + whole.shape[1]])


def _ragged_decode_batch(model, ref, paged: bool, kv_format, seed: int):
    """The decode tests' ragged batch from the tiny_long fixture: slot 0 holds the whole prompt, slot 1 its first 50
    tokens. → (empty cache, paged through a permuted block table or dense per slot, in kv_format; prompt [2, S];
    prompt lengths [2])."""
    ids = ref["input_ids"][0]
    s = ids.shape[0]
    args = dict(page_tokens=16, num_pages=24) if paged else {}
    if kv_format:
        args["kv_format"] = kv_format
    cache = model.init_cache(2, max_len=s + 16, **args)
    if paged:  # distinct pages in a shuffled order (page 0 is the null page)
        table = cache.block_table
        pages = np.random.default_rng(seed).permutation(np.arange(1, 24))[: table.size]
        cache = cache.replace(block_table=jnp.asarray(pages.reshape(table.shape), jnp.int32))
    prompt = np.zeros((2, s), np.int32)
    prompt[0], prompt[1, :50] = ids, ids[:50]
    return cache, jnp.asarray(prompt), jnp.asarray([s, 50], jnp.int32)


@pytest.mark.parametrize("paged, kv_format", [(True, None), (False, None), (True, "fp8-channel"),
                                              (False, "fp8-tile-e8m0")])  # fmt: skip
def test_decode_kernel_in_the_model_matches_the_jnp_step(paged, kv_format):
    """`Kernels.decode="pallas"` runs one-token steps through `paged_decode_attention` (interpreted here), reading
    the ring and the compressed entries from the cache itself (paged: a permuted block table; dense: per slot).
    A ragged batch (83 and 50 prompt tokens, then 5 steps, one with the second slot idle), each path decoding from
    its own cache: every active slot's logits equal the jnp path's (itself checked against the reference above),
    and the full prompt's equal the reference's greedy logits. With an FP8 cache the kernel reads the stored rows
    as they are (e4m3 nope channels and their scales, bf16 RoPE channels) where the jnp path dequantizes them:
    both decode from the jnp path's cache (two caches written from float32-noise-apart rows could round apart in
    FP8, a 6% step), and the logits must agree to float32 noise; against the reference, FP8's own error (0.1, as in
    the formats test above)."""
    jnp_model, ref = fixture("tiny_long")
    kernel_model = dsv4.load(os.path.join(FIXTURES, "tiny_long"), dtype=jnp.float32,
                             kernels="attention=pallas,decode=pallas,kv_write=pallas")  # fmt: skip
    generated, s = ref["generated"][0], ref["input_ids"].shape[1]
    cache, prompt, lens = _ragged_decode_batch(jnp_model, ref, paged, kv_format, seed=11)
    g_jnp, st = nnx.split(jnp_model)
    g_kernel, _ = nnx.split(kernel_model)
    _, cache = _chunk_step(g_jnp, st, _committed(cache), prompt, lens)
    kernel_cache = cache
    for step in range(5):
        tokens = jnp.asarray([[generated[s + step]], [7 + step]], jnp.int32)
        valid = jnp.asarray([1, 0 if step == 2 else 1], jnp.int32)
        got, kernel_cache = _chunk_step(g_kernel, st, cache if kv_format else kernel_cache, tokens, valid)
        want, cache = _chunk_step(g_jnp, st, cache, tokens, valid)
        active = np.asarray(valid) > 0
        assert rel_err(np.asarray(got)[active], np.asarray(want)[active]) < TOL, f"step {step}"
        assert rel_err(np.asarray(got)[0], ref["generate_logits"][0, step + 1]) < (0.1 if kv_format else TOL), \
            f"step {step}"  # fmt: skip


def _decode_route_config(heads: int):
    return dsv4.Config.from_hf({
        "vocab_size": 64, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": heads, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4,
        "index_head_dim": 32, "index_topk": 8, "sliding_window": 16,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["moe"] * 3,
    })  # fmt: skip


@pytest.mark.parametrize("decode, backend, heads, dtype, kv_format, want", [
    ("pallas", "cpu", 4, jnp.bfloat16, "bf16", True),  # "pallas" takes the kernel for any store it reads
    ("pallas", "cpu", 4, jnp.bfloat16, "fp8-channel", True),
    ("pallas", "gpu", 16, jnp.bfloat16, "fp8-channel", True),
    ("pallas", "gpu", 16, jnp.bfloat16, "fp8-tile-e8m0", True),
    ("pallas", "gpu", 16, jnp.float32, "bf16", False),  # bf16 rows under a float32 model: not the compute dtype
    ("pallas", "gpu", 4, jnp.bfloat16, "fp8-channel", False),  # 4 heads: below the compiled kernel's 16 rows
    ("jnp", "gpu", 16, jnp.bfloat16, "fp8-channel", False),
    ("auto", "gpu", 16, jnp.bfloat16, "fp8-channel", False),  # "auto" decodes with jnp: measured as fast
    ("auto", "cpu", 16, jnp.bfloat16, "fp8-channel", False),
])  # fmt: skip
def test_which_decode_steps_take_the_paged_kernel(monkeypatch, decode, backend, heads, dtype, kv_format, want):
    """`Attention._decode_kernel_applies`, the static choice of a one-token step's route, worked out by hand from
    its rule for every layer type: `Kernels.decode` resolved to "pallas", on a GPU only for heads that fit the
    compiled kernel (16 or more a program), and every store in a form the kernel reads."""
    import dsv4.attention.block as block

    kernels = dsv4.Kernels(decode=decode).resolve(dtype, gpu=backend == "gpu", hopper=True)
    model = dsv4.init_random(_decode_route_config(heads), seed=0, dtype=dtype, kernels=kernels)
    assert model.kernels == kernels
    cache = model.init_cache(1, max_len=64, kv_format=kv_format)
    monkeypatch.setattr(block, "on_gpu", lambda: backend == "gpu")
    for layer, state in zip(model.layers, cache.layers):
        assert layer.self_attn._decode_kernel_applies(state, dtype) is want, layer.self_attn.layer_type


@pytest.mark.parametrize("impl, backend, index_heads, kv_format, n, paged, want", [
    ("pallas", "cpu", 4, "bf16", 1, "auto", True),  # "pallas" anywhere (interpreted off a GPU)
    ("pallas", "cpu", 4, "fp8-channel", 1, "auto", True),
    ("pallas", "cpu", 4, "fp8-tile-e8m0", 1, "auto", True),
    ("pallas", "cpu", 4, "bf16", 2, "auto", False),  # a two-token chunk: the dense route
    ("pallas", "cpu", 4, "bf16", 1, "jnp", False),  # the paged route switched off
    ("jnp", "gpu", 16, "bf16", 1, "auto", False),  # follows the indexer's path
    ("pallas-triton", "gpu", 16, "bf16", 1, "auto", True),  # "pallas-triton" there too
    ("jnp", "cpu", 4, "bf16", 1, "pallas-triton", True),
    ("auto", "cpu", 16, "bf16", 1, "auto", False),  # "auto" is jnp off a GPU
    ("auto", "gpu", 16, "fp8-channel", 1, "auto", True),  # "auto" is pallas on a GPU for a 16-bit model
    ("auto", "gpu", 4, "bf16", 1, "auto", False),  # 4 heads: below the compiled kernel's 16 dot rows
])  # fmt: skip
def test_which_decode_steps_take_the_paged_indexer(monkeypatch, impl, backend, index_heads, kv_format, n, paged,
                                                    want):  # fmt: skip
    """`Indexer.paged_select_applies`, the static choice of a step's indexer route, worked out by hand from its rule:
    `Kernels.paged_indexer` ("auto": the indexer's own path), one query a request, and on a GPU the compiled kernel's
    shapes."""
    import dsv4.attention.indexer as indexer_module

    hf = {"vocab_size": 64, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 16, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": index_heads,
          "index_head_dim": 32, "index_topk": 8, "sliding_window": 16, "compress_rates":
          {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
          "layer_types": ["compressed_sparse_attention"], "mlp_layer_types": ["moe"]}  # fmt: skip
    kernels = dsv4.Kernels(indexer=impl, paged_indexer=paged).resolve(jnp.bfloat16, gpu=backend == "gpu")
    assert kernels.paged_indexer == (paged if paged != "auto" else impl if impl.startswith("pallas") else
                                     "pallas" if impl == "auto" and backend == "gpu" else "jnp")  # fmt: skip
    model = dsv4.init_random(dsv4.Config.from_hf(hf), seed=0, dtype=jnp.bfloat16, kernels=kernels)
    cache = model.init_cache(1, max_len=64, kv_format=kv_format, page_tokens=16, num_pages=6)
    monkeypatch.setattr(indexer_module, "on_gpu", lambda: backend == "gpu")
    indexer = model.layers[0].self_attn.compressor.indexer
    store = cache.layers[0].indexer.entries
    assert indexer.paged_select_applies(store, cache.block_table, n, jnp.bfloat16) is want


@pytest.mark.parametrize("paged, kv_format", [(True, None), (False, None), (True, "fp8-channel"),
                                              (False, "fp8-tile-e8m0")])  # fmt: skip
def test_paged_indexer_in_the_model_matches_the_dense_route(monkeypatch, paged, kv_format):
    """`Kernels.indexer="pallas"`: a one-token step's CSA indexer scores its keys where the cache stores them
    (`index_topk_paged`, interpreted here; paged through a permuted block table, or a dense store's slots as pages;
    FP8 keys as stored: e4m3 channels, scales, bf16 RoPE channels) instead of a dense copy. A ragged batch (83 and
    50 prompt tokens, then 4 steps, one with the second slot idle) decodes the same from one prefilled cache with
    `Kernels.paged_indexer` "pallas" and "jnp": the paged route is taken (and only then), every active slot's logits
    agree to float32 noise, and the full prompt's stay on the reference's greedy logits."""
    import dsv4.attention.indexer as indexer_module

    model = dsv4.load(os.path.join(FIXTURES, "tiny_long"), dtype=jnp.float32, kernels="indexer=pallas")
    assert model.kernels.paged_indexer == "pallas"
    dense = dsv4.load(os.path.join(FIXTURES, "tiny_long"), dtype=jnp.float32,
                      kernels="indexer=pallas,paged_indexer=jnp")  # fmt: skip
    ref = dict(np.load(os.path.join(FIXTURES, "tiny_long", "reference.npz")))
    generated, s = ref["generated"][0], ref["input_ids"].shape[1]
    cache, prompt, lens = _ragged_decode_batch(model, ref, paged, kv_format, seed=5)
    graphdefs = {True: nnx.split(model)[0], False: nnx.split(dense)[0]}
    state = nnx.split(model)[1]
    calls = []
    paged_topk = indexer_module.index_topk_paged
    monkeypatch.setattr(indexer_module, "index_topk_paged", lambda *a, **k: calls.append(1) or paged_topk(*a, **k))

    def decode(on: bool):
        graphdef = graphdefs[on]
        step = jax.jit(lambda st, c, t, v: nnx.merge(graphdef, st).forward_chunk(c, t, v))  # traced anew per route
        _, c = step(state, _committed(cache), prompt, lens)
        out = []
        for i in range(4):
            tokens = jnp.asarray([[generated[s + i]], [7 + i]], jnp.int32)
            logits, c = step(state, c, tokens, jnp.asarray([1, 0 if i == 2 else 1], jnp.int32))
            out.append(np.asarray(logits))
        return np.stack(out, axis=1)  # [2, steps, vocab]

    got = decode(True)
    taken = len(calls)
    want = decode(False)
    assert taken > 0 and len(calls) == taken, "the paged indexer must serve the decode steps, and only when on"
    assert rel_err(got[0], want[0]) < 1e-5
    assert rel_err(got[1, [0, 1, 3]], want[1, [0, 1, 3]]) < 1e-5  # step 2: slot 1 idle
    assert rel_err(got[0], ref["generate_logits"][0, 1:5]) < (0.1 if kv_format else TOL)


def test_cached_chunks_hand_the_pallas_core_the_prefix_layout(monkeypatch):
    """What the Mosaic kernel relies on for cached chunks (`kv_prefix`; it places rows by index, not position):
    `Attention.forward_chunk` gives the "pallas" core the ring in position order, kv row i holding position
    start - W + i (-1 before the prompt's start), then the chunk's own rows, and says so with kv_prefix = W. A
    recording core (the jnp one underneath) checks every call of a ragged batch's chunked prefill, and the
    logits still equal the reference's, and `mosaic_takes_prefix` (the run-time choice between the Mosaic and the
    Triton kernel) sends every one of those calls to the Mosaic kernel, a prompt's first chunk included."""
    import dsv4.attention.dispatch as dispatch
    from dsv4.attention.core import core_attention_jnp
    from dsv4.attention.pallas_core import mosaic_takes_prefix

    model, ref = fixture("tiny_long")
    w = model.config.sliding_window
    calls = []

    def recording_core(q, kv, q_pos, kv_pos, sinks, *, kv_prefix=0, **kw):
        record = lambda *a: calls.append((*map(np.asarray, a[:2]), kv_prefix, bool(a[2])))  # noqa: E731
        jax.debug.callback(record, q_pos, kv_pos, mosaic_takes_prefix(q_pos, kv_pos, kv_prefix))
        return core_attention_jnp(q, kv, q_pos, kv_pos, sinks, **kw)

    monkeypatch.setitem(dispatch.ATTENTION_CORES, "pallas", recording_core)
    for layer in model.layers:
        kernels = dataclasses.replace(layer.self_attn.kernels, attention="pallas")
        monkeypatch.setattr(layer.self_attn, "kernels", kernels)
    graphdef, state = nnx.split(model)
    # a jit of its own: the recording core must be traced here, not found in `_chunk_step`'s cache (nor left in it)
    step = jax.jit(lambda state, cache, tokens, valid: nnx.merge(graphdef, state).forward_chunk(cache, tokens, valid))
    ids = ref["input_ids"][0]
    s, chunk = ids.shape[0], 2 * w + 5  # chunks start at 0, 37, 74 (W = 16): the first has no ring yet
    lens = np.array([s, s - 9])
    cache = _committed(model.init_cache(2, max_len=s + 8))
    for start in range(0, s, chunk):
        n = min(chunk, s - start)
        tokens = np.zeros((2, chunk), np.int32)
        tokens[:, :n] = ids[None, start : start + n]
        valid = np.clip(lens - start, 0, n).astype(np.int32)
        logits, cache = step(state, cache, jnp.asarray(tokens), jnp.asarray(valid))
        jax.effects_barrier()
        last = start + valid[0] - 1
        assert rel_err(logits[0], ref["logits"][0, last]) < TOL, f"chunk at {start}"
        for q_pos, kv_pos, prefix, mosaic in calls:
            assert prefix == w and kv_pos.shape[1] == w + chunk
            np.testing.assert_array_equal(q_pos, start + np.arange(chunk)[None].repeat(2, 0))
            for b in range(2):
                want = [p if p >= 0 else -1 for p in range(start - w, start)]
                np.testing.assert_array_equal(kv_pos[b, :w], want)
                real = np.arange(chunk) < valid[b]
                np.testing.assert_array_equal(kv_pos[b, w:], np.where(real, start + np.arange(chunk), -1))
            assert mosaic
        assert len(calls) == len(model.layers)
        calls.clear()
