"""The Mosaic GPU attention core (dsv4/pallas/attention_mgpu.py) on a GPU: correctness, then timings against the
Triton kernel, the same run's bf16 matmul and, optionally, cuDNN's causal attention; and one-token chunks.

    PYTHONPATH=. python3 scripts/bench_attention.py --quick                  # one H200: S = 8K, 32K (~2-4 min)
    PYTHONPATH=. python3 scripts/bench_attention.py                          # S = 8K, 32K, 128K
    PYTHONPATH=. python3 scripts/bench_attention.py --seqs 131072,524288 --variants mgpu-persistent --skip-triton \
        --rounds 5 --iters 3 --cudnn                                         # interleaved rounds, cuDNN as ceiling
    PYTHONPATH=. python3 scripts/bench_attention.py --seqs 131072 --variants mgpu-persistent --fp8 --iters 9
    PYTHONPATH=. python3 scripts/bench_attention.py --only one-token --iters 15   # decode-sized chunks
    PYTHONPATH=. python3 scripts/bench_attention.py --only csa --seqs 131072,524288 --iters 3   # CSA: Mosaic vs Triton

Sections (``--only prefill,one-token,csa``; prefill by default):

prefill  1. Correctness of every variant against the jnp reference (B=1, H=64, D=512, W=128; S = 301 and 1000;
            window and HCA with rate 4 so several HCA tiles are visited): max abs error, PASS if < 3e-2. A variant
            that fails is not timed.
         2. Timings (median of --iters runs after a warm-up, jax.block_until_ready) at each S for window and HCA
            (rate 128): the mgpu variants (``--variants``) next to the Triton kernel
            (dsv4.pallas.attention.v4_attention), plus a same-run bf16 8192³ matmul rate. Useful FLOPs = 4·H·D per
            unmasked (query, key) pair: min(p+1, W) window keys plus (p+1)//rate HCA entries per query.
            ``--rounds R`` (> 1) interleaves them: each round times the matmul, then every kernel, and the table
            gives medians of the per-round ratios (so each ratio compares two rates measured seconds apart);
            ``--cudnn`` adds ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`` at head dim
            256 on its best shape (16 heads up to 128K, 4 above; FLOPs 4·d·H·S²/2) to the HCA rounds, as the
            library-kernel ceiling.
            ``--fp8`` adds FP8 KV (per-channel scales): a dequantize pass to bf16 plus the Mosaic kernel (the
            model's route on Hopper), and the Triton kernel's in-kernel dequantization, each on the same quantized
            values; the first is also compared with the bf16 kernel on the dequantized values (S <= 128K).
one-token  one-token chunks (a decode step over a dense cache), the Triton kernel against the Mosaic kernel, on
           the layout `Attention.forward_chunk` passes: kv rows [0, W) the W positions before the token, row W its
           own, HCA entries for a context of L tokens (``--one-token-contexts``, ``--one-token-batches``). Each
           timing is the median over --iters runs of one jit that calls the kernel 8 times on 8 different queries
           (as a model step calls its layers), divided by 8: µs per call, Mosaic's speed-up over Triton, and the
           max abs difference between the two outputs.
csa      CSA layers (rate 4: C = S / 4 entries, 512 listed per token): the Mosaic kernel's CSA mode (each listed
         row gathered by TMA, ``v4_attention_mgpu(topk_indices=...)``, the mgpu-persistent configuration, once per
         ``--csa-warps`` count (producer warps issuing the row TMAs), ``--csa-barriers`` setting and
         ``--csa-gather-batches`` value: row indices a warp loads together) against the Triton kernel. Correctness
         first (S = 301, 1000 against the jnp reference; PASS < 3e-2), then timings at --seqs. ``--csa-debug
         no_regroup,contiguous`` adds timing probes (wrong results, not checked) that locate a gathered step's
         cost: rows landed but not re-laid, and contiguous tiles in place of gathered rows (the consumers' side
         alone).
         Lists: token p takes min(512, n) of its n = (p + 1) // 4 visible entries, evenly spread and rotated by a
         random offset per token (distinct; neighbours share few rows, so L2 helps less than with an indexer's
         picks). Useful FLOPs = 4·H·D per (query, key) pair: window keys plus listed entries.

Every variant is caught separately: one failure prints its error and the rest go on. Progress is flushed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.pallas.attention import v4_attention, v4_attention_reference
from dsv4.pallas.attention_mgpu import MgpuConfig, v4_attention_mgpu

H, D, W, RATE = 64, 512, 128, 128
T0 = time.time()


def log(*args):
    print(f"[{time.time() - T0:7.1f}s]", *args, flush=True)


VARIANTS = {
    # "ws" names: one CTA per token; "mgpu-persistent": one CTA per SM, the library's default configuration.
    "mgpu-ws-kv64x2": MgpuConfig(variant="ws", block_kv=64, num_slots=2, persistent=False),
    "mgpu-prefetch-kv64x2": MgpuConfig(variant="prefetch", block_kv=64, num_slots=2),
    "mgpu-ws-kv64x1": MgpuConfig(variant="ws", block_kv=64, num_slots=1, persistent=False),
    "mgpu-ws-kv64x2-store": MgpuConfig(variant="ws", block_kv=64, num_slots=2, pv_form="store", persistent=False),
    "mgpu-persistent": MgpuConfig(variant="ws", block_kv=64, num_slots=2, persistent=True),
    "mgpu-persistent-nobar": MgpuConfig(variant="ws", block_kv=64, num_slots=2, persistent=True, auto_barriers=False),
}


def inputs(seq, *, hca, rate, seed=0):
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    kq, kk, kc = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, seq, H, D), jnp.bfloat16)
    kv = jax.random.normal(kk, (1, seq, D), jnp.bfloat16)
    q_pos = jnp.arange(seq, dtype=jnp.int32)[None, :]
    sinks = jnp.asarray(rng.standard_normal(H) * 2.0, jnp.float32)
    comp = jax.random.normal(kc, (1, max(seq // rate, 1), D), jnp.bfloat16) if hca else None
    return q, kv, q_pos, sinks, comp


def run_mgpu(config, q, kv, q_pos, sinks, comp, rate):
    return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=W, scale=D**-0.5, compressed=comp,
                             compress_rate=rate if comp is not None else None, config=config,
                             check_positions=False)  # fmt: skip


def run_triton(q, kv, q_pos, sinks, comp, rate):
    return v4_attention(q, kv, q_pos, q_pos, sinks, sliding_window=W, scale=D**-0.5, compressed=comp,
                        compress_rate=rate if comp is not None else None)  # fmt: skip


def quantize_channels(x):
    """x [B, N, D] → (e4m3 values, float32 [D] scales): per-channel amax / 448, as the cache's fp8-channel format."""
    scales = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 1)) / 448.0, 1e-12)
    return (x.astype(jnp.float32) / scales).astype(jnp.float8_e4m3fn), scales


@jax.jit
def dequantize(x8, scales):
    return (x8.astype(jnp.float32) * scales).astype(jnp.bfloat16)


def fp8_runners(config, q, kv, q_pos, sinks, comp, rate, *, triton):
    """FP8 KV (per-channel scales) two ways: the route the model takes on Hopper (a dequantize pass to bf16 in XLA,
    then the Mosaic kernel; `Attention.forward_chunk` reads FP8 caches out as bf16), and the Triton kernel, which
    dequantizes inside. → ([(name, fn)], the bf16 inputs those values dequantize to, for a same-values check)."""
    kv8, kv_s = quantize_channels(kv)
    comp8, comp_s = quantize_channels(comp) if comp is not None else (None, None)

    @jax.jit
    def mosaic(q, kv8, kv_s, q_pos, sinks, comp8, comp_s):
        comp = dequantize(comp8, comp_s) if comp8 is not None else None
        return run_mgpu(config, q, dequantize(kv8, kv_s), q_pos, sinks, comp, rate)

    runners = [("mgpu-fp8-deq-pass", lambda: mosaic(q, kv8, kv_s, q_pos, sinks, comp8, comp_s))]
    if triton:
        runners.append(("triton-fp8", lambda: v4_attention(
            q, kv8, q_pos, q_pos, sinks, sliding_window=W, scale=D**-0.5, kv_scales=kv_s, compressed=comp8,
            compressed_scales=comp_s, compress_rate=rate if comp is not None else None)))
    deq = (dequantize(kv8, kv_s), dequantize(comp8, comp_s) if comp is not None else None)
    return runners, deq


@jax.jit
def max_abs_diff(a, b):
    """One fused reduction: eagerly, the float32 casts of two 512K outputs would need 64 GiB each."""
    return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))


def useful_flops(seq, hca, rate):
    p = np.arange(seq, dtype=np.int64)
    pairs = np.minimum(p + 1, W).sum()
    if hca:
        pairs += np.minimum((p + 1) // rate, max(seq // rate, 1)).sum()
    return 4 * H * D * int(pairs)


def bench(fn, iters):
    jax.block_until_ready(fn())  # compile + warmup
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cudnn_runner(seq, d=256):
    """cuDNN's causal flash attention at head dim 256 (its largest) on its best shape at this length (bench_kernels'
    cudnn section: 16 heads up to 128K, 4 above), B = 1. → (name, fn, useful FLOPs = 4·d·H·S²/2)."""
    heads = 16 if seq <= 131072 else 4
    keys = jax.random.split(jax.random.PRNGKey(seq), 3)
    q, k, v = (jax.random.normal(kk, (1, seq, heads, d), jnp.bfloat16) for kk in keys)
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    return f"cudnn-d{d}-H{heads}", lambda: fn(q, k, v), 4.0 * d * heads * seq * seq / 2


def interleaved(seq, mode, runners, flops, matmul_rate, args, own_flops=None):
    """--rounds: each round times the bf16 matmul, then every runner, so that each ratio compares two rates measured
    a few seconds apart (the matmul's own rate varies from one process to the next). → table rows with the
    median time, the median rate and the median of the per-round ratios. own_flops: {name: useful FLOPs} for
    runners whose work is not the V4 layer's (the cuDNN comparator)."""
    times = {name: [] for name, _ in runners}
    ratios = {name: [] for name, _ in runners}
    own = own_flops or {}
    for r in range(args.rounds):
        mm_rate = matmul_rate()
        for name, fn in runners:
            f = own.get(name, flops)
            try:
                t = bench(fn, args.iters)
            except Exception as e:  # noqa: BLE001
                log(f"  S={seq} {mode} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
                continue
            times[name].append(t)
            ratios[name].append(f / t / 1e12 / mm_rate)
            log(f"  round {r}: matmul {mm_rate:5.0f} TFLOP/s | S={seq:6d} {mode:6s} {name:24s} {t * 1e3:9.3f} ms "
                f"{f / t / 1e12:7.1f} TFLOP/s ({100 * ratios[name][-1]:5.1f}% of matmul)")  # fmt: skip
    rows = []
    for name, _ in runners:
        if times[name]:
            t = statistics.median(times[name])
            frac = statistics.median(ratios[name])
            rows.append((seq, mode, name, t * 1e3, own.get(name, flops) / t / 1e12, frac))
            log(f"  S={seq:6d} {mode:6s} {name:24s} median {t * 1e3:9.3f} ms, {100 * frac:5.1f}% of matmul "
                f"(rounds {100 * min(ratios[name]):.1f}-{100 * max(ratios[name]):.1f}%)")  # fmt: skip
    return rows


def correctness(names):
    log("== correctness (max abs err vs jnp reference, bf16, PASS < 3e-2) ==")
    results = {}
    for seq in (301, 1000):
        for hca in (False, True):
            rate = 4  # several HCA tiles even at S = 301
            args = inputs(seq, hca=hca, rate=rate, seed=seq)
            q, kv, q_pos, sinks, comp = args
            ref = v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=W, scale=D**-0.5,
                                         compressed=comp, compress_rate=rate if hca else None)  # fmt: skip
            ref = np.asarray(ref, np.float32)
            for name in names:
                try:
                    poison = run_mgpu(VARIANTS[name], jnp.full_like(q, jnp.nan), kv, q_pos, sinks, comp, rate)
                    jax.block_until_ready(poison)
                    del poison
                    out = np.asarray(run_mgpu(VARIANTS[name], *args, rate), np.float32)
                    err = float(np.nanmax(np.abs(out - ref))) if not np.isnan(out).any() else float("nan")
                    ok = err < 3e-2
                    results[name] = results.get(name, True) and ok
                    log(f"  S={seq:5d} {'HCA   ' if hca else 'window'} {name:24s} max_err={err:.3e} "
                        f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    results[name] = False
                    log(f"  S={seq:5d} {'HCA   ' if hca else 'window'} {name:24s} ERROR {type(e).__name__}: "
                        f"{str(e)[:400]}")  # fmt: skip
                    traceback.print_exc(limit=3, file=sys.stdout)
    return results


def prefill(args):
    names = [n for n in args.variants.split(",") if n]

    ok = correctness(names)
    log("correctness summary:", ok)

    log("== bf16 matmul 8192^3 ==")
    a = jax.random.normal(jax.random.PRNGKey(1), (8192, 8192), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    t = bench(lambda: mm(a, a), max(args.iters, 5))
    mm_rate = 2 * 8192**3 / t / 1e12
    log(f"  matmul: {t * 1e3:.2f} ms  {mm_rate:.0f} TFLOP/s")

    def matmul_rate():
        return 2 * 8192**3 / bench(lambda: mm(a, a), max(args.iters, 5)) / 1e12

    seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else ([8192, 32768] if args.quick else
                                                                       [8192, 32768, 131072])  # fmt: skip
    rows = []
    for seq in seqs:
        for hca in (False, True):
            mode = "HCA" if hca else "window"
            data = inputs(seq, hca=hca, rate=RATE)
            flops = useful_flops(seq, hca, RATE)
            runners = [(n, (lambda c: lambda: run_mgpu(c, *data, RATE))(VARIANTS[n])) for n in names if ok.get(n)]
            skipped = [n for n in names if not ok.get(n)]
            if not args.skip_triton:
                runners.append(("triton", lambda: run_triton(*data, RATE)))
            first = next((n for n in names if ok.get(n)), None)
            if args.fp8 and first is not None:
                fp8, (kv_deq, comp_deq) = fp8_runners(VARIANTS[first], *data, RATE, triton=not args.skip_triton)
                # the FP8 route against the bf16 kernel on the same (dequantized) values: only the rounding differs.
                # Up to 128K: at 512K, q and two outputs are 96 GiB, more than JAX's default 75% of an H200's memory
                if seq <= 131072:
                    q, _, q_pos, sinks, _ = data
                    same = run_mgpu(VARIANTS[first], q, kv_deq, q_pos, sinks, comp_deq, RATE)
                    err = float(max_abs_diff(fp8[0][1](), same))
                    log(f"  S={seq} {mode} mgpu-fp8-deq-pass vs {first} on the dequantized values: "
                        f"max abs diff {err:.2e}")  # fmt: skip
                    same = None
                kv_deq = comp_deq = None
                runners += fp8
            for n in skipped:
                log(f"  S={seq} {mode} {n}: skipped (failed correctness)")
            if args.rounds > 1:  # each round: the matmul, then every runner; ratios taken within a round
                own = {}
                if args.cudnn and hca:
                    name, fn, own[name] = cudnn_runner(seq)
                    runners.append((name, fn))
                rows += interleaved(seq, mode, runners, flops, matmul_rate, args, own)
                runners = None
                data = None
                continue
            for name, fn in runners:
                try:
                    t = bench(fn, args.iters)
                    rate = flops / t / 1e12
                    rows.append((seq, mode, name, t * 1e3, rate, rate / mm_rate))
                    log(f"  S={seq:6d} {mode:6s} {name:24s} {t * 1e3:9.3f} ms {rate:7.1f} TFLOP/s "
                        f"({100 * rate / mm_rate:5.1f}% of matmul)")  # fmt: skip
                except Exception as e:  # noqa: BLE001
                    log(f"  S={seq} {mode} {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            data = None  # free the inputs before the next shape (the runners close over the name)

    a = None  # free the operand (a name, not `del`: the timed lambda closes over it)
    if args.rounds > 1:
        log(f"== table (useful TFLOP/s, medians over {args.rounds} rounds; %mm: the median of each round's ratio to "
            "that round's bf16 matmul) ==")
    else:
        log("== table (useful TFLOP/s; % of same-run bf16 matmul", f"{mm_rate:.0f} TFLOP/s) ==")
    print(f"{'S':>7} {'mode':6} {'variant':24} {'ms':>9} {'TFLOP/s':>8} {'%mm':>6}")
    for seq, mode, name, ms, rate, frac in rows:
        print(f"{seq:7d} {mode:6} {name:24} {ms:9.3f} {rate:8.1f} {100 * frac:6.1f}")
    sys.stdout.flush()


CSA_RATE, CSA_TOPK = 4, 512


def csa_inputs(seq, seed=0):
    """Window inputs plus CSA entries [1, S / 4, D] and lists [1, S, 512] (see the module docstring)."""
    q, kv, q_pos, sinks, _ = inputs(seq, hca=False, rate=RATE, seed=seed)
    kc, kr = jax.random.split(jax.random.PRNGKey(seed + 1))
    comp = jax.random.normal(kc, (1, max(seq // CSA_RATE, 1), D), jnp.bfloat16)
    p = jnp.arange(seq, dtype=jnp.int32)[:, None]
    j = jnp.arange(CSA_TOPK, dtype=jnp.int32)[None, :]
    n = (p + 1) // CSA_RATE  # visible entries
    spread = j * jnp.maximum(n, CSA_TOPK) // CSA_TOPK  # distinct, < max(n, 512)
    rotated = (spread + jax.random.randint(kr, (seq, 1), 0, 2**30)) % jnp.maximum(n, 1)
    topk = jnp.where(j < n, rotated, -1).astype(jnp.int32)[None]
    return q, kv, q_pos, sinks, comp, topk


def csa_flops(seq):
    p = np.arange(seq, dtype=np.int64)
    return 4 * H * D * int((np.minimum(p + 1, W) + np.minimum((p + 1) // CSA_RATE, CSA_TOPK)).sum())


def csa(args):
    batches = [int(x) for x in args.csa_gather_batches.split(",")]
    configs = {}
    for barriers in filter(None, args.csa_barriers.split(",")):  # "off": without Pallas' automatic SMEM barriers
        for warps in (int(x) for x in args.csa_warps.split(",")):  # MgpuConfig.csa_warps: TMA-issuing warps
            name = ("" if barriers == "on" else "nobar-") + f"w{warps}-"
            for nb in batches:
                config = dataclasses.replace(VARIANTS["mgpu-persistent"], gather_batch=nb,
                                             auto_barriers=barriers == "on", csa_warps=warps)  # fmt: skip
                if config.csa_batch == nb:  # past a warp's share the batch is capped: a smaller batch's form
                    configs[f"mosaic-{name}g{nb}"] = config

    probes = {}  # timing probes with wrong results (MgpuConfig.debug "csa_*"), at the last gather batch
    for probe in filter(None, args.csa_debug.split(",")):
        probes[f"mosaic-g{batches[-1]}-{probe}"] = dataclasses.replace(
            VARIANTS["mgpu-persistent"], gather_batch=batches[-1], debug=(f"csa_{probe}",))

    def mosaic_with(config):
        def mosaic(q, kv, q_pos, sinks, comp, topk):
            return v4_attention_mgpu(q, kv, q_pos, sinks, sliding_window=W, scale=D**-0.5, compressed=comp,
                                     topk_indices=topk, config=config, check_positions=False)  # fmt: skip

        return mosaic

    def triton(q, kv, q_pos, sinks, comp, topk):
        return v4_attention(q, kv, q_pos, q_pos, sinks, sliding_window=W, scale=D**-0.5, compressed=comp,
                            topk_indices=topk)  # fmt: skip

    log("== CSA correctness (max abs err vs jnp reference, bf16, PASS < 3e-2) ==")
    passed = set(configs)
    for seq in (301, 1000):
        data = csa_inputs(seq, seed=seq)
        q, kv, q_pos, sinks, comp, topk = data
        ref = np.asarray(v4_attention_reference(q, kv, q_pos, q_pos, sinks, sliding_window=W, scale=D**-0.5,
                                                compressed=comp, topk_indices=topk), np.float32)  # fmt: skip
        for name, config in configs.items():
            mosaic = mosaic_with(config)
            try:
                jax.block_until_ready(mosaic(jnp.full_like(q, jnp.nan), *data[1:]))  # poison a recycled buffer
                out = np.asarray(mosaic(*data), np.float32)
                err = float(np.abs(out - ref).max()) if not np.isnan(out).any() else float("nan")
            except Exception as e:  # noqa: BLE001
                log(f"  S={seq} CSA {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(limit=3, file=sys.stdout)
                err = float("nan")
            if not err < 3e-2:
                passed.discard(name)
            log(f"  S={seq:5d} CSA {name} max_err={err:.3e} {'PASS' if err < 3e-2 else 'FAIL'}")
    log("== CSA timings (median of --iters) ==")
    for seq in [int(x) for x in args.seqs.split(",")] if args.seqs else [32768, 131072]:
        data = csa_inputs(seq)
        flops = csa_flops(seq)
        runners = [(name, jax.jit(mosaic_with(c))) for name, c in configs.items() if name in passed]
        runners += [(name, jax.jit(mosaic_with(c))) for name, c in probes.items()]
        runners.append(("triton", jax.jit(triton)))
        times = {}
        for name, fn in runners:
            try:
                times[name] = bench(lambda fn=fn: fn(*data), args.iters)
                log(f"  S={seq:6d} CSA {name:10s} {times[name] * 1e3:9.3f} ms {flops / times[name] / 1e12:7.1f} "
                    f"TFLOP/s")  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"  S={seq} CSA {name}: ERROR {type(e).__name__}: {str(e)[:400]}")
        for name in times.keys() - {"triton"} if "triton" in times else ():
            log(f"  S={seq:6d} CSA {name} speed-up over triton: {times['triton'] / times[name]:.2f}x")
        data = None


ONE_TOKEN_CALLS = 8


def one_token_inputs(batch, context, hca, seed=0):
    """One decode token per request at position context - 1 over a dense cache: kv rows [0, W) the W positions
    before it, row W its own; HCA: context // RATE compressed entries. q: ONE_TOKEN_CALLS queries per request."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q8 = jax.random.normal(ks[0], (ONE_TOKEN_CALLS, batch, 1, H, D), jnp.bfloat16)
    kv = jax.random.normal(ks[1], (batch, W + 1, D), jnp.bfloat16)
    sinks = jax.random.normal(ks[2], (H,), jnp.float32)
    pos = context - 1
    q_pos = jnp.full((batch, 1), pos, jnp.int32)
    kv_pos = jnp.broadcast_to(jnp.arange(pos - W, pos + 1, dtype=jnp.int32), (batch, W + 1))
    comp = jax.random.normal(ks[3], (batch, context // RATE, D), jnp.bfloat16) if hca else None
    return q8, kv, sinks, q_pos, kv_pos, comp


def one_token_runners(q8, kv, sinks, q_pos, kv_pos, comp):
    """{"triton", "mosaic"}: one jit each, the kernel mapped over the ONE_TOKEN_CALLS queries."""
    kw = dict(sliding_window=W, scale=D**-0.5, compressed=comp, compress_rate=RATE if comp is not None else None)

    def triton(q):
        return v4_attention(q, kv, q_pos, kv_pos, sinks, **kw)

    def mosaic(q):
        return v4_attention_mgpu(q, kv, q_pos, sinks, kv_offset=W, check_positions=False, **kw)

    return {name: jax.jit(lambda q8, f=f: jax.lax.map(f, q8)) for name, f in (("triton", triton), ("mosaic", mosaic))}


def one_token(args):
    log("== one-token chunks: Triton against Mosaic (us per call, median of --iters) ==")
    print(f"{'layer':6} {'context':>8} {'B':>3} {'triton us':>10} {'mosaic us':>10} {'mosaic speed-up':>15} "
          f"{'max diff':>9}")  # fmt: skip
    contexts = [int(x) for x in args.one_token_contexts.split(",")]
    for hca in (False, True):
        for context in contexts if hca else contexts[:1]:  # a window layer's work does not depend on the context
            for batch in (int(x) for x in args.one_token_batches.split(",")):
                try:
                    data = one_token_inputs(batch, context, hca)
                    fns = one_token_runners(*data)
                    outs = {k: np.asarray(f(data[0]), np.float32) for k, f in fns.items()}
                    diff = float(np.abs(outs["mosaic"] - outs["triton"]).max())
                    t = {k: bench(lambda f=f: f(data[0]), args.iters) / ONE_TOKEN_CALLS * 1e6 for k, f in fns.items()}
                except Exception as e:  # noqa: BLE001
                    log(f"  one-token {'HCA' if hca else 'window'} context={context} B={batch}: ERROR "
                        f"{type(e).__name__}: {str(e)[:400]}")  # fmt: skip
                    continue
                print(f"{'HCA' if hca else 'window':6} {context:8d} {batch:3d} {t['triton']:10.1f} {t['mosaic']:10.1f} "
                      f"{t['triton'] / t['mosaic']:14.2f}x {diff:9.2e}", flush=True)  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S = 8K, 32K only")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cudnn", action="store_true", help="with --rounds: cuDNN's causal head-dim-256 attention "
                    "(the library-kernel ceiling) in the HCA rounds")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="> 1: interleave the matmul and the kernels in rounds "
                    "and report medians of the per-round ratios")  # fmt: skip
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--seqs", default=None, help="comma-separated S values (overrides --quick)")
    ap.add_argument("--fp8", action="store_true",
                    help="also FP8 KV (per-channel scales): dequantize pass + the first variant's Mosaic kernel, "
                         "and the Triton kernel's in-kernel dequantization (unless --skip-triton)")  # fmt: skip
    ap.add_argument("--csa-gather-batches", default="1,8,16",
                    help="csa: MgpuConfig.gather_batch values to time (row indices loaded together; 1: one a row)")
    ap.add_argument("--csa-barriers", default="on", help="csa: comma-separated on,off: Pallas' automatic SMEM-store "
                    "barriers (MgpuConfig.auto_barriers), each at every gather batch")  # fmt: skip
    ap.add_argument("--csa-warps", default="4", help="csa: comma-separated 1,2,4: producer warps issuing the row "
                    "TMAs (MgpuConfig.csa_warps), each at every barrier setting and gather batch")  # fmt: skip
    ap.add_argument("--csa-debug", default="", help="csa: comma-separated timing probes no_regroup,contiguous "
                    "(MgpuConfig.debug csa_*: wrong results, timed only)")  # fmt: skip
    ap.add_argument("--only", default="prefill", help="comma-separated subset of prefill,one-token,csa")
    ap.add_argument("--one-token-contexts", default="32768,524288", help="one-token: HCA context lengths (window "
                    "layers: the first only, their work does not depend on the context)")  # fmt: skip
    ap.add_argument("--one-token-batches", default="1,32")
    args = ap.parse_args()
    log("devices:", jax.devices())
    sections = args.only.split(",")
    if "prefill" in sections:
        prefill(args)
    if "one-token" in sections:
        one_token(args)
    if "csa" in sections:
        csa(args)


if __name__ == "__main__":
    main()
