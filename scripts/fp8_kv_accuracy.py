#!/usr/bin/env python3
"""FP8 KV-cache accuracy: each storage format of `dsv4/cache/quant.py` against a bf16 cache.

    PYTHONPATH=. python scripts/fp8_kv_accuracy.py                      # both parts, defaults below
    PYTHONPATH=. python scripts/fp8_kv_accuracy.py --only tiny          # tiny fixture model only (~3 min on 2 CPUs)
    PYTHONPATH=. python scripts/fp8_kv_accuracy.py --bytes-table        # print the bytes-per-token tables

Each variant runs the model over a cache that stores its rows in the format (`DeepseekV4.init_cache(kv_format=,
index_format=)`, `Attention.init_state`: every window ring, compressed-entry and indexer-key array is a
`dsv4.cache.store.KVStore`), so what is measured is what the engine stores and reads back. A chunk's own K=V
rows are rounded through the format before its attention uses them (`KVStore.round_trip`), exactly as the
cache will give them back to later chunks. The model computes in float32, so two runs differ only in how the
cache stores rows; "bf16 vs f32 cache" is the bf16 cache's own error against an unquantized float32 cache
(kv_format None).

The script turns off XLA's "excess precision" (`--xla_allow_excess_precision=false` in XLA_FLAGS, before the
backend starts): inside one jitted step XLA on GPU may otherwise drop the f32 → bf16/fp8 → f32 convert pair
of the in-flight round trip (quant.py's NOTE), and the chunk's own rows would silently stay unrounded. Rows
stored in the cache between steps are not affected either way.

Variants: bf16; fp8-tensor and fp8-channel with scales from the RMSNorm bound (`rms_norm_bound` of the kv_norm
weight that produced the rows: cannot saturate; what the cache does) or calibrated on the first write (headroom
2, then frozen; the cache's bound scale states are swapped for unset ones, `init_scale_state` without a bound);
fp8-tile (per-token 64-wide tiles, float32 scales) and fp8-tile-e8m0 (power-of-two scales, FlashMLA's V4
layout).

Part 1, tiny: a fixture model (`--fixture`, loaded with `dsv4.load` in float32), random prompts (`--batch`
× `--tiny-len` tokens, past the sliding window and through many compressed windows): chunked prefill of the
first `--prefill` tokens in chunks of `--chunk`, then one token at a time (teacher-forced), the logits of every
single-token step compared with the bf16-cache run: max |Δ|, relative L2, top-1 agreement.

Part 2, real size: one DeepSeek-V4-Flash attention layer per `--layers` type (D = 512, 64 heads, W = 128,
CSA 4 / HCA 128, indexer 64 × 128, top-512), random weights as `init_random` draws them, float32, random
N(0, 1) hidden states. `--context` tokens fill the cache (compressor and indexer `extend` per 4096-token chunk;
the ring from the last chunk; no attention over the context is computed), then `--decode-steps` single-token
`forward_chunk` calls; their attention-block outputs [hidden] are compared with the bf16-cache run (relative
L2, max |Δ|, smallest cosine over the steps) and, for CSA, the indexer's top-k picks with the bf16 run's.
The fill runs once, into an unquantized float32 state; each variant's state is then built with
`Attention.init_state(kv_format=, index_format=)` and its stores written (`KVStore.write`) with those rows in
the fill's order (each 4096-token chunk's entries, the ring of chunk 0 before the last chunk's, as a calibrated
scale's first write would see them). That stores exactly what filling in the format would: the compressors
compute entries in the model dtype from their raw open windows, never from stored entries.
"idx bf16" keeps the indexer keys in bf16 (`index_format="bf16"`), separating the K=V rows' error from changed
picks. `--norm-weights skewed` draws every kv_norm weight log-normal (σ = 1), so channel ranges differ by up to
~50× as trained norms can; "flat" keeps them at 1 (as `init_random` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dsv4
from dsv4.attention import Attention, Compressor
from dsv4.cache.layout import CSA, HCA, SLIDING, CacheLayout, KVFormat
from dsv4.cache.quant import init_scale_state, saturated
from dsv4.cache.state import LayerCache
from dsv4.cache.store import KVStore
from dsv4.config import Config
from dsv4.layers import apply_rope, linear

F32 = jnp.float32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")

# (label, format of K=V rows and compressed entries, scale policy, format of the indexer keys: None = the same).
# Policy "bound": scales from rms_norm_bound of the kv_norm weight that made the rows (the cache's own);
# "calibrated": set by the first write.
VARIANTS = [
    ("bf16", "bf16", None, None),
    ("fp8-tensor (bound)", "fp8-tensor", "bound", None),
    ("fp8-tensor (calibrated)", "fp8-tensor", "calibrated", None),
    ("fp8-channel (bound)", "fp8-channel", "bound", None),
    ("fp8-channel (calibrated)", "fp8-channel", "calibrated", None),
    ("fp8-tile", "fp8-tile", None, None),
    ("fp8-tile-e8m0", "fp8-tile-e8m0", None, None),
    ("fp8-channel (bound), idx bf16", "fp8-channel", "bound", "bf16"),
    ("fp8-tile, idx bf16", "fp8-tile", None, "bf16"),
]


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# The cache's stores.
# ---------------------------------------------------------------------------------------------
def _is_store(x) -> bool:
    return isinstance(x, KVStore)


def formats(kv_name: str, index_name: str | None, rope_dim: int) -> tuple[KVFormat, KVFormat]:
    kv = KVFormat.named(kv_name, rope_dim=rope_dim)
    return kv, kv if index_name is None else KVFormat.named(index_name, rope_dim=rope_dim)


def calibrated(cache):
    """The cache with every per-array scale state unset (no bound): the first write calibrates it."""

    def unbound(node):
        if _is_store(node) and node.scale is not None:
            return dataclasses.replace(node, scale=init_scale_state(node.width, node.fmt))
        return node

    return jax.tree.map(unbound, cache, is_leaf=_is_store)


def with_policy(cache, policy: str | None):
    return calibrated(cache) if policy == "calibrated" else cache


def any_saturated(cache) -> int:
    """How many of the cache's stores saw values beyond their scale's range (clipped)."""
    stores = [x for x in jax.tree.leaves(cache, is_leaf=_is_store) if _is_store(x)]
    return sum(int(saturated(store.scale)) for store in stores)


def compare(got: np.ndarray, want: np.ndarray) -> dict:
    """got, want: [N, features] → max |Δ|, relative L2, top-1 agreement."""
    diff = got - want
    return {
        "max_abs": float(np.abs(diff).max()),
        "rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(want)),
        "top1": float(np.mean(got.argmax(-1) == want.argmax(-1))),
    }


# ---------------------------------------------------------------------------------------------
# Part 1: the tiny fixture model, whole-model logits.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _chunk_step(graphdef, params, cache, tokens):
    return nnx.merge(graphdef, params).forward_chunk(cache, tokens)


def run_tiny(model, prompts: np.ndarray, *, prefill: int, chunk: int, fmts: tuple[KVFormat, KVFormat] | None, policy):
    """→ (logits of each single-token step [B, S - prefill, V], saturated stores). fmts None: f32 cache."""
    graphdef, params = nnx.split(model)
    b, s = prompts.shape
    kv_fmt, index_fmt = fmts if fmts is not None else (None, None)
    cache = model.init_cache(b, max_len=s + 16, dtype=F32, kv_format=kv_fmt, index_format=index_fmt)
    cache = with_policy(cache, policy)
    outputs = []
    t = 0
    while t < s:
        n = chunk if t < prefill else 1
        logits, cache = _chunk_step(graphdef, params, cache, jnp.asarray(prompts[:, t : t + n]))
        if t >= prefill:
            outputs.append(np.asarray(logits))
        t += n
    return np.stack(outputs, 1), any_saturated(cache)


def part_tiny(args) -> list[dict]:
    model = dsv4.load(os.path.join(FIXTURES, args.fixture), dtype=F32)
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, cfg.vocab_size, (args.batch, args.tiny_len), dtype=np.int32)
    log(f"tiny: fixture {args.fixture} (D={cfg.head_dim}, rope {cfg.qk_rope_head_dim}, W={cfg.sliding_window}, "
        f"layers {[t.split('_')[0] for t in cfg.layer_types]}), {args.batch} × {args.tiny_len} random tokens, "
        f"prefill {args.prefill} in chunks of {args.chunk}, then one token at a time")  # fmt: skip
    run = functools.partial(run_tiny, model, prompts, prefill=args.prefill, chunk=args.chunk)
    t0 = time.perf_counter()
    exact, _ = run(fmts=None, policy=None)
    results = []
    base = None
    for label, name, policy, index_name in VARIANTS:
        fmt, index_fmt = formats(name, index_name, cfg.qk_rope_head_dim)
        logits, n_sat = run(fmts=(fmt, index_fmt), policy=policy)
        flat = logits.reshape(-1, logits.shape[-1])
        if base is None:
            base = flat
            row = {"variant": "bf16 vs f32 cache", **compare(flat, exact.reshape(flat.shape))}
        else:
            row = {"variant": label, **compare(flat, base)}
        row.update(
            row_bytes=fmt.row_bytes(cfg.head_dim),
            index_row_bytes=index_fmt.row_bytes(cfg.index_head_dim),
            saturated_arrays=n_sat,
        )
        results.append(row)
        log(f"  {row['variant']:30s} max|Δlogit| {row['max_abs']:.2e}  rel L2 {row['rel_l2']:.2e}  "
            f"top-1 {100 * row['top1']:.2f}%  saturated arrays {n_sat}")  # fmt: skip
    log(f"  ({flat.shape[0]} logit vectors per variant; logits std {base.std():.3f}; {time.perf_counter() - t0:.0f} s)")
    return results


# ---------------------------------------------------------------------------------------------
# Part 2: one real-size V4-Flash attention layer.
# ---------------------------------------------------------------------------------------------
FILL_CHUNK = 4096


@functools.partial(jax.jit, static_argnums=0)
def _extend(graphdef, params, state, x, start):
    """Compressor (and indexer) state after the chunk x [1, n, hidden] at `start`: no attention computed."""
    attn = nnx.merge(graphdef, params)
    n = x.shape[1]
    valid = jnp.full((1,), n, jnp.int32)
    changes = {}
    if attn.layer_type != SLIDING:
        changes["compressor"] = attn.compressor.extend(state.compressor, x, start, valid, attn.rope)
    if attn.layer_type == CSA:
        indexer = attn.compressor.indexer
        changes["indexer"] = indexer.extend(state.indexer, x, start, valid, attn.rope)
    return dataclasses.replace(state, **changes)


@functools.partial(jax.jit, static_argnums=0)
def _ring(graphdef, params, state, x, start):
    """The sliding-window ring holding the last W rows of the chunk x [1, n >= W, hidden] at `start`."""
    attn = nnx.merge(graphdef, params)
    w, n = attn.sliding_window, x.shape[1]
    positions = start[:, None] + jnp.arange(n - w, n)[None]  # [1, W]
    cos, sin = attn.rope.cos_sin(positions)
    kv = apply_rope(attn.kv_norm(linear(x[:, n - w :], attn.kv_proj["weight"][...])), cos, sin)  # [1, W, D]
    return dataclasses.replace(
        state,
        window=state.window.write(kv, positions % w),  # every ring row rewritten
        window_pos=jnp.full_like(state.window_pos, -1).at[0, positions[0] % w].set(positions[0]),
    )


@jax.jit
def _write(store: KVStore, rows: jax.Array, index: jax.Array) -> KVStore:
    return store.write(rows, index)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, params, state, x, start):
    """One token through the layer → (output [1, 1, hidden], new state, CSA: the indexer's picks [1, 1, k])."""
    attn = nnx.merge(graphdef, params)
    out, new = attn.forward_chunk(x, start, jnp.ones((1,), jnp.int32), state)
    picks = jnp.zeros((1, 1, 1), jnp.int32)
    if attn.layer_type == CSA:  # the same selection forward_chunk made, recomputed to compare it across variants
        q_residual = attn.q_a_norm(linear(x, attn.q_a_proj["weight"][...]))
        indexer = attn.compressor.indexer
        keys = Compressor.read(new.indexer, x.dtype)
        picks = indexer.select(x, q_residual, start[:, None], keys, attn.rope)
    return out, new, picks


def stored_as(attn: Attention, filled: LayerCache, first_ring: LayerCache, context: int, capacity: int,
              fmts: tuple[KVFormat, KVFormat] | None, policy: str | None) -> LayerCache:  # fmt: skip
    """The layer's state in `fmts` (None: unquantized float32) holding the rows of the float32 fill `filled`,
    written in the fill's order: chunk 0's ring (`first_ring`) then the last chunk's, and each fill chunk's
    compressed entries in turn, so a calibrated scale sees the first write it would have seen."""
    kv_fmt, index_fmt = fmts if fmts is not None else (None, None)
    state = with_policy(attn.init_state(1, capacity, F32, kv_fmt, index_fmt), policy)
    ring = jnp.arange(attn.sliding_window)[None]
    window = state.window
    for source in (first_ring, filled):
        window = _write(window, source.window.read(F32), ring)
    state = dataclasses.replace(state, window=window, window_pos=filled.window_pos)
    for key in ("compressor", "indexer"):
        if getattr(state, key) is None:
            continue
        rate = attn.compressor.rate  # the indexer's rate is CSA's too
        rows = getattr(filled, key).entries.read(F32)  # [1, capacity // rate, hd]
        store, per_chunk = getattr(state, key).entries, FILL_CHUNK // rate
        for first in range(0, context // rate, per_chunk):
            store = _write(store, rows[:, first : first + per_chunk], jnp.arange(first, first + per_chunk)[None])
        state = dataclasses.replace(state, **{key: dataclasses.replace(getattr(filled, key), entries=store)})
    return state


def topk_overlap(picks: np.ndarray, ref: np.ndarray) -> float:
    """Mean fraction of the reference's valid picks that a variant also picked. picks, ref: [steps, k]."""
    shares = [len(set(p[p >= 0]) & set(r[r >= 0])) / max(1, (r >= 0).sum()) for p, r in zip(picks, ref)]
    return float(np.mean(shares))


def part_real(args) -> list[dict]:
    cfg = Config.preset("v4-flash")
    context, steps = args.context, args.decode_steps
    if context % FILL_CHUNK:
        raise SystemExit(f"--context={context} must be a multiple of {FILL_CHUNK}")
    results = []
    for layer_name in args.layers.split(","):
        layer_type = {"sliding": SLIDING, "csa": CSA, "hca": HCA}[layer_name]
        for weights in args.norm_weights.split(","):
            t0 = time.perf_counter()
            rng = np.random.default_rng(args.seed)
            attn = Attention(cfg, layer_type, rngs=rng, dtype=F32)
            if weights == "skewed":
                norms = [attn.kv_norm] + ([attn.compressor.kv_norm] if layer_type != SLIDING else []) \
                    + ([attn.compressor.indexer.kv_norm] if layer_type == CSA else [])  # fmt: skip
                for norm in norms:
                    d = norm.weight[...].shape[0]
                    norm.weight.set_value(jnp.asarray(np.exp(rng.standard_normal(d)).astype(np.float32)))
            graphdef, params = nnx.split(attn)
            capacity = context + 128
            state = attn.init_state(1, capacity, F32)  # the fill: unquantized float32
            key = jax.random.key(args.seed)
            first_ring = None
            for start in range(0, context, FILL_CHUNK):
                key, sub = jax.random.split(key)
                x = jax.random.normal(sub, (1, FILL_CHUNK, cfg.hidden_size), F32)
                state = _extend(graphdef, params, state, x, jnp.array([start], jnp.int32))
                if start == 0:  # what a first-write calibration sees: chunk 0's ring
                    first_ring = _ring(graphdef, params, state, x, jnp.array([0], jnp.int32))
            state = _ring(graphdef, params, state, x, jnp.array([context - FILL_CHUNK], jnp.int32))
            queries = jax.random.normal(key, (steps, 1, 1, cfg.hidden_size), F32)
            fill_s = time.perf_counter() - t0
            log(
                f"real: V4-Flash {layer_name} layer, norm weights {weights}, context {context}: "
                f"filled in {fill_s:.0f} s"
            )

            outs = {}
            variants = [("f32", None, None, None)] + [v for v in VARIANTS if layer_type == CSA or v[3] is None]
            for label, name, policy, index_name in variants:
                fmts = formats(name, index_name, cfg.qk_rope_head_dim) if name else None
                s = stored_as(attn, state, first_ring, context, capacity, fmts, policy)
                out, picks = [], []
                for t in range(steps):
                    y, s, p = _decode(graphdef, params, s, queries[t], jnp.array([context + t], jnp.int32))
                    out.append(np.asarray(y[0, 0]))
                    picks.append(np.asarray(p[0, 0]))
                outs[label] = (np.stack(out), np.stack(picks), any_saturated(s), fmts)
            for label, (out, picks, n_sat, fmts) in outs.items():
                if label == "f32":
                    continue
                ref, ref_picks = outs["f32" if label == "bf16" else "bf16"][:2]
                row = {"layer": layer_name, "norm_weights": weights, "context": context,
                       "variant": "bf16 vs f32 cache" if label == "bf16" else label, **compare(out, ref),
                       "row_bytes": fmts[0].row_bytes(cfg.head_dim), "saturated_arrays": n_sat}  # fmt: skip
                del row["top1"]  # hidden states, not logits
                cos = np.sum(out * ref, -1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1))
                row["min_cos"] = float(cos.min())
                row["topk_overlap"] = topk_overlap(picks, ref_picks) if layer_type == CSA else None
                results.append(row)
                overlap = f"  top-k overlap {100 * row['topk_overlap']:.1f}%" if layer_type == CSA else ""
                log(f"  {row['variant']:30s} rel L2 {row['rel_l2']:.2e}  max|Δ| {row['max_abs']:.2e}  "
                    f"min cos {row['min_cos']:.6f}{overlap}  saturated arrays {n_sat}")  # fmt: skip
            log(f"  ({steps} decode steps per variant; {time.perf_counter() - t0:.0f} s for this layer)")
    return results


# ---------------------------------------------------------------------------------------------
# Bytes per token (docs/BENCHMARKS.md, "KV cache bytes per token").
# ---------------------------------------------------------------------------------------------
TABLE_FORMATS = ("bf16", "fp8-channel", "fp8-tile", "fp8-tile-e8m0")
TABLE_TOKENS = 512 * 1024
LAYER_LABELS = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


def bytes_tables(num_tokens: int = TABLE_TOKENS) -> str:
    """The markdown tables of the docs section, from `CacheLayout` (tests/test_cache_layout.py re-derives them)."""
    lines = ["| model | layer type | layers | " + " | ".join(f"{f} B/token/layer" for f in TABLE_FORMATS) + " |",
             "| --- | --- | --- |" + " --- |" * len(TABLE_FORMATS)]  # fmt: skip
    totals = ["| model | " + " | ".join(f"{f} GiB/request" for f in TABLE_FORMATS) + " | "
              + " | ".join(f"{f} B/token" for f in TABLE_FORMATS) + " |",
              "| --- |" + " --- |" * (2 * len(TABLE_FORMATS))]  # fmt: skip
    for label, preset in (("V4-Flash", "v4-flash"), ("V4-Pro", "v4-pro")):
        cfg = Config.preset(preset)
        rope = cfg.qk_rope_head_dim
        layouts = [CacheLayout.from_config(cfg, KVFormat.named(f, rope_dim=rope)) for f in TABLE_FORMATS]
        per_type = [layout.by_layer_type(num_tokens) for layout in layouts]
        for layer_type in (SLIDING, CSA, HCA):
            if layer_type not in per_type[0]:
                continue
            cells = [f"{p[layer_type]['per_layer_per_token']:.2f}" for p in per_type]
            lines.append(f"| {label} | {LAYER_LABELS[layer_type]} | {per_type[0][layer_type]['layers']} | "
                         + " | ".join(cells) + " |")  # fmt: skip
        gib = [f"{layout.bytes_per_request(num_tokens) / 2**30:.3f}" for layout in layouts]
        per_token = [f"{layout.bytes_per_token(num_tokens):.1f}" for layout in layouts]
        totals.append(f"| {label} | " + " | ".join(gib) + " | " + " | ".join(per_token) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(totals)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", choices=["tiny", "real"], help="run one part (default both)")
    p.add_argument("--bytes-table", action="store_true", help="print the bytes-per-token tables and exit")
    p.add_argument("--fixture", default="tiny_long")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tiny-len", type=int, default=320)
    p.add_argument("--prefill", type=int, default=64)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--layers", default="csa,hca", help="real-size layer types: sliding,csa,hca")
    p.add_argument("--norm-weights", default="skewed", help="skewed (log-normal kv_norm weights) and/or flat")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write all results here")
    args = p.parse_args(argv)
    if args.bytes_table:
        print(bytes_tables())
        return 0
    # NOTE: before the backend starts (module docstring): keep the in-flight round trip's convert pairs.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
    # NOTE: a GPU would otherwise run float32 matmuls in TF32, noise of the order of the bf16 cache's own error.
    jax.config.update("jax_default_matmul_precision", "highest")
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs; "
        f"command: {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}")  # fmt: skip
    results = {}
    t0 = time.perf_counter()
    if args.only in (None, "tiny"):
        results["tiny"] = part_tiny(args)
    if args.only in (None, "real"):
        results["real"] = part_real(args)
    log(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **results}, f, indent=1)
    return 0 if all(math.isfinite(r["rel_l2"]) for rows in results.values() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
