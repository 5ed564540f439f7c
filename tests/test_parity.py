"""Parity with the public reference (transformers 5.23.0 DeepseekV4ForCausalLM) on the tiny fixtures.

The fixtures (tests/fixtures/*, made by scripts/make_reference_fixtures.py) hold random float32 models
with every 1-D parameter randomized, their reference logits, per-layer residual streams, and the
reference's cached greedy generation. Tolerance: max |Δ| / max |ref| < 1e-4 in float32 — both sides
compute the same float32 math in a different order (einsum vs matmul, softmax forms), which costs a few
ulps per op; over 4-5 layers that stays near 1e-6, so 1e-4 leaves room without hiding a real bug
(a wrong mask, RoPE or routing choice moves logits by 1e-2 or more).
"""

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
        assert rel_err(layer_fn(g, st, jnp.asarray(hs[i])), hs[i + 1]) < TOL, f"layer {i} ({layer.self_attn.layer_type})"


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
    cache = model.init_cache(b, max_len=s + n_new + 8)
    width = min(chunk, s)
    for t in range(0, s, width):
        n = min(width, s - t)
        tokens = np.zeros((b, width), np.int32)
        tokens[:, :n] = ids[:, t : t + n]
        logits, cache = _chunk_step(graphdef, state, cache, jnp.asarray(tokens), jnp.full((b,), n, jnp.int32))
        assert rel_err(logits, ref["logits"][:, t + n - 1]) < TOL, f"prefill chunk at {t}"
    assert np.asarray(cache["num_tokens"]).tolist() == [s] * b
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
    model = dsv4.load(os.path.join(FIXTURES, "tiny_mixed"), dtype=jnp.float32, attention_impl="pallas",
                      moe_impl="pallas", indexer_impl="pallas")  # fmt: skip
    assert rel_err(model.logits(ref["input_ids"]), ref["logits"]) < TOL


@pytest.mark.parametrize("name", ["tiny_long", "tiny_mixed"])
def test_paged_cache_with_permuted_block_tables_matches_reference(name):
    """Compressed entries in shared page pools (page size 3: windows and pages never align), reached through
    randomly permuted block tables, then decode: the same logits as the reference."""
    model, ref = fixture(name)
    ids, generated = ref["input_ids"], ref["generated"]
    b, s = ids.shape
    graphdef, state = nnx.split(model)
    num_pages = 64
    cache = model.init_cache(b, max_len=96, page_size=3, num_pages=num_pages)
    free = list(np.random.default_rng(7).permutation(np.arange(1, num_pages)))  # page 0 is the null page
    for table_name, table in cache["block_tables"].items():
        cache["block_tables"][table_name] = jnp.asarray([[free.pop() for _ in range(table.shape[1])] for _ in range(b)])
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
