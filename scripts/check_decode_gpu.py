"""GPU check of the model's cached paths with the Pallas kernels (`attention_impl="pallas"`) against the jnp ones,
on the same random weights and the same ragged batch, each path from its own cache:
- the chunked prefill: each chunk after the first runs its window / HCA attention on the Mosaic kernel from the
  cache's ring (`kv_prefix`; the first chunk, with no ring yet, and CSA layers take the Triton kernel); every
  chunk's last logits must agree;
- the decode through the paged decode kernel on the cache itself (KERNEL_NOTES decode item 8), bf16 or, with
  `--kv-format fp8-channel` (or another FP8 format), its split rows as stored (e4m3 nope channels and their
  scales, bf16 RoPE channels; the Triton kernel): logits must agree and the greedy tokens match. (`--one-token`
  picks the kernel of one-token chunks, which decode steps now take only where the paged kernel does not take
  the cache.) With an FP8 cache both paths decode from the jnp path's cache (each step's new
  cache from the Pallas path is dropped): two caches written from slightly different bf16 values round apart in
  FP8, and that would be measured, not the attention route.
- the noise floor of each decode step (bf16): the jnp path again, with rounding-sized Gaussian noise (`--noise`,
  2e-3 of the RMS) on every layer's attention output, `--noise-seeds` times. A step passes under 5e-2, or under
  1.2x the largest logit change that noise caused there. Some steps of this random model sit near a discrete flip:
  at the FP8 run's first decode step, 9 of 12 noise seeds moved the logits by 6.5-7.1e-2 and 3 by 1.6-1.9e-2, while
  each layer's Mosaic output there was as close to a float32 reference as jnp's (2.05e-3 against 2.08e-3;
  `scripts/probe_step0.py`, docs/BENCHMARKS.md "One-token chunks on the Mosaic kernel").
Prints the per-chunk and per-step time of each path (not a benchmark: one small model, a few steps).

    PYTHONPATH=. python3 scripts/check_decode_gpu.py                    # one H200: 64 heads x 512, 3 layers
    PYTHONPATH=. python3 scripts/check_decode_gpu.py --kv-format fp8-channel [--one-token triton]   # FP8 cache
    PYTHONPATH=. python3 scripts/check_decode_gpu.py --prompt 600 --steps 3 --small   # CPU smoke (interpreted)

Model: V4-Flash's attention shapes (64 heads x 512, window 128, CSA 4:1 with a 64 x 128 indexer keeping 512, HCA
128:1) with a narrow residual stream and few experts, layers sliding, CSA, HCA; bf16. Cache paged (256-token
pages, permuted block table). Prompts: `--prompt` and `--prompt` - 333 tokens in `--chunk`-token chunks; then
`--steps` decode steps, the second slot idle in one of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4  # noqa: E402
import dsv4.attention  # noqa: E402
from dsv4.config import Config  # noqa: E402


def config(small: bool, repeats: int = 1) -> Config:
    """The check's model; repeats: the (sliding, CSA, HCA) pattern that many times (3 · repeats layers)."""
    heads, head_dim, idx_heads, idx_dim, topk = (4, 64, 4, 32, 16) if small else (64, 512, 64, 128, 512)
    return Config.from_hf({
        "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 3 * repeats,
        "num_attention_heads": heads, "head_dim": head_dim, "q_lora_rank": 256, "qk_rope_head_dim": 16 if small else 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 128,
        "index_n_heads": idx_heads, "index_head_dim": idx_dim, "index_topk": topk, "sliding_window": 128,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * repeats,
        "mlp_layer_types": ["moe"] * 3 * repeats, "max_position_embeddings": 1 << 20,
    })  # fmt: skip


@jax.jit
def _step(graphdef, state, cache, tokens, valid):
    return nnx.merge(graphdef, state).forward_chunk(cache, tokens, valid)


NOISE = {"rel": 0.0, "seed": 0}
_LAYER_AT_TRACE = [0]


def noisy_core(q, kv, q_pos, kv_pos, sinks, **kwargs):
    """core_attention_jnp plus Gaussian noise of NOISE["rel"] × the output's RMS, seeded from NOISE["seed"] (read
    at run time, so one executable serves every seed) and the layer: a stand-in for a kernel whose only difference
    from jnp is rounding. Registered as attention_impl "noisy"."""
    kwargs.pop("kv_prefix", None)
    out = dsv4.attention.core_attention_jnp(q, kv, q_pos, kv_pos, sinks, **kwargs)
    seed = jax.pure_callback(lambda: np.int32(NOISE["seed"]), jax.ShapeDtypeStruct((), jnp.int32))
    _LAYER_AT_TRACE[0] += 1
    key = jax.random.fold_in(jax.random.key(seed), _LAYER_AT_TRACE[0])
    o = out.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(o * o))
    return (o + NOISE["rel"] * rms * jax.random.normal(key, o.shape)).astype(out.dtype)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--small", action="store_true", help="4 heads x 64 (CPU smoke)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--kv-format", default=None, help="cache format (dsv4.cache.layout.FORMAT_NAMES; default: the "
                   "model dtype, unquantized). FP8 formats reach the paged kernel as split rows (Triton)")
    p.add_argument("--one-token", choices=("triton", "mosaic"), default=None,
                   help="which kernel takes one-token chunks (dsv4.attention.MOSAIC_ONE_TOKEN; default: the "
                        "library's, mosaic)")  # fmt: skip
    p.add_argument("--noise", type=float, default=None, help="the noise floor: each decode step also runs the jnp "
                   "path with this much relative Gaussian noise on every layer's attention output, --noise-seeds "
                   "times; 0 = off (default: 2e-3, bf16's rounding 2^-9, for bf16; off for float32)")  # fmt: skip
    p.add_argument("--noise-seeds", type=int, default=4)
    args = p.parse_args()
    if args.one_token is not None:
        dsv4.attention.MOSAIC_ONE_TOKEN = args.one_token == "mosaic"
    args.one_token = "mosaic" if dsv4.attention.MOSAIC_ONE_TOKEN else "triton"
    dsv4.attention.register_attention_impl("noisy", noisy_core)
    if args.noise is None:
        args.noise = 2e-3 if args.dtype == "bfloat16" else 0.0
    NOISE["rel"] = args.noise
    cfg = config(args.small)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, cache {args.kv_format or args.dtype}, one-token "
          f"chunks on the {args.one_token} kernel", flush=True)  # fmt: skip
    models = {impl: dsv4.init_random(cfg, seed=0, dtype=jnp.dtype(args.dtype), attention_impl=impl)
              for impl in ("jnp", "pallas", "noisy")}  # fmt: skip
    lens = np.array([args.prompt, args.prompt - 333])
    page_tokens, max_len = 256, args.prompt + args.steps + 256
    cols = -(-max_len // page_tokens)
    cache = models["jnp"].init_cache(2, max_len=max_len, kv_format=args.kv_format, page_tokens=page_tokens,
                                     num_pages=2 * cols + 1)  # fmt: skip
    pages = np.random.default_rng(1).permutation(np.arange(1, 2 * cols + 1)).reshape(2, cols)
    cache["block_table"] = jnp.asarray(pages, jnp.int32)
    cache = jax.device_put(cache, jax.devices()[0])
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, cfg.vocab_size, (2, args.prompt)).astype(np.int32)
    g_jnp, state = nnx.split(models["jnp"])
    g_pallas, _ = nnx.split(models["pallas"])
    g_noisy, _ = nnx.split(models["noisy"])
    graphs = (("jnp", g_jnp), ("pallas", g_pallas))
    caches = {"jnp": cache, "pallas": cache}
    # bf16: the two paths round at different places (the kernel's softmax state is float32 throughout); on the CPU
    # the random bf16 model's logits differ by 1e-2 to 3e-2 between them, float32 by 1e-6. Greedy tokens can swap
    # on near-ties in bf16, so they are reported, not required there.
    tol = 1e-4 if args.dtype == "float32" else 5e-2
    worst, worst_over = 0.0, 0.0
    for start in range(0, args.prompt, args.chunk):
        n = min(args.chunk, args.prompt - start)
        valid = np.clip(lens - start, 0, n).astype(np.int32)
        tokens = np.zeros((2, args.chunk), np.int32)
        tokens[:, :n] = prompt[:, start : start + n]
        out, took = {}, {}
        for impl, g in graphs:
            t = time.perf_counter()
            out[impl], caches[impl] = _step(g, state, caches[impl], jnp.asarray(tokens), jnp.asarray(valid))
            jax.block_until_ready(out[impl])
            took[impl] = time.perf_counter() - t
        err = rel_err(out["pallas"], out["jnp"])
        worst, worst_over = max(worst, err), max(worst_over, err / tol)
        print(f"prefill chunk at {start}: rel err {err:.2e}; jnp {took['jnp']:.2f} s, pallas {took['pallas']:.2f} s "
              f"(the first chunk includes compiles)", flush=True)  # fmt: skip
    logits = out["jnp"]
    tok = np.asarray(logits).argmax(-1).astype(np.int32)
    times = {"jnp": [], "pallas": []}
    same = True
    one_cache = args.kv_format not in (None, "bf16")
    for step in range(args.steps):
        valid = jnp.asarray([1, 0 if step == 1 else 1], jnp.int32)
        if one_cache:
            caches["pallas"] = caches["jnp"]
        before = caches["jnp"]
        out = {}
        for impl, g in graphs:
            t = time.perf_counter()
            out[impl], caches[impl] = _step(g, state, caches[impl], jnp.asarray(tok[:, None]), valid)
            jax.block_until_ready(out[impl])
            times[impl].append(time.perf_counter() - t)
        active = np.asarray(valid) > 0
        ref = np.asarray(out["jnp"])[active]
        err = rel_err(np.asarray(out["pallas"])[active], ref)
        floor = []
        for seed in range(args.noise_seeds if args.noise > 0 else 0):
            NOISE["seed"] = seed
            noisy = np.asarray(_step(g_noisy, state, before, jnp.asarray(tok[:, None]), valid)[0])
            floor.append(rel_err(noisy[active], ref))
        # A step may exceed the tolerance by as much as rounding-sized noise in jnp's own attention moves the logits
        # there (20% margin): that measures the model's sensitivity, not the kernel (docs/BENCHMARKS.md, "One-token
        # chunks on the Mosaic kernel").
        allowed = max(tol, 1.2 * max(floor, default=0.0))
        worst_over = max(worst_over, err / allowed)
        worst = max(worst, err)
        picks = {k: np.asarray(v).argmax(-1) for k, v in out.items()}
        same &= bool(np.array_equal(picks["pallas"][active], picks["jnp"][active]))
        shown = {k: [t if a else "idle" for t, a in zip(v.tolist(), active)] for k, v in picks.items()}
        noise = f", noise floor {max(floor):.2e}" if floor else ""
        print(f"step {step}: rel err {err:.2e}{noise}, tokens jnp {shown['jnp']} pallas {shown['pallas']}", flush=True)
        tok = picks["jnp"].astype(np.int32)  # both paths continue from the same tokens
    for impl, ts in times.items():
        print(f"{impl:6s} decode step: median {statistics.median(ts[1:] or ts) * 1e3:.2f} ms "
              f"(first, with compile, {ts[0]:.1f} s)")  # fmt: skip
    ok = worst_over < 1 and (same or args.dtype != "float32")
    print(f"RESULT worst rel err {worst:.2e} (tolerance {tol:g}, or 1.2x a decode step's noise floor), worst "
          f"share of what its step allows {worst_over:.2f}, greedy tokens equal: {same} -> "
          f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
