"""One GPU session for the Mosaic GPU attention core (dsv4/pallas/attention_mgpu.py): correctness, then timings.

    PYTHONPATH=. python3 scripts/try_attention_mgpu.py --quick     # S = 8K, 32K only (~2-4 min)
    PYTHONPATH=. python3 scripts/try_attention_mgpu.py             # S = 8K, 32K, 128K

1. Correctness of every variant against the jnp reference (B=1, H=64, D=512, W=128; S = 301 and 1000; window and
   HCA with rate 4 so several HCA tiles are visited): max abs error, PASS if < 3e-2.
2. Timings (median of --iters runs after a warmup, jax.block_until_ready) at each S for window and HCA (rate 128):
   the mgpu variants next to the Triton kernel (dsv4.pallas.attention.v4_attention), plus a same-run bf16
   8192³ matmul rate. Useful FLOPs = 4·H·D per unmasked (query, key) pair: min(p+1, W) window keys plus
   (p+1)//rate HCA entries per query.
   --rounds R interleaves them: each round times the matmul, then every kernel, and the table gives medians of the
   per-round ratios; --cudnn adds cuDNN's causal head-dim-256 attention (16 heads up to 128K, 4 above) to the HCA
   rounds, the issue's "best library kernel" comparator.
   --fp8 adds FP8 KV (per-channel scales): a dequantize pass to bf16 plus the Mosaic kernel (the model's route on
   Hopper), and the Triton kernel's in-kernel dequantization, each on the same quantized values.
Every variant is caught separately: one failure prints its error and the rest go on. Progress is flushed.
"""

from __future__ import annotations

import argparse
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
    # The "ws" names are one CTA per token, as they were measured before the persistent launch became the default;
    # "mgpu-persistent" is the library's default configuration.
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
    """One fused reduction: eagerly, the float32 casts of two 512K outputs would need 64 GiB each (the fourteenth
    session's first --fp8 run ran out of memory there)."""
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
    a few seconds apart (the same-run matmul moved between 537 and 746 TFLOP/s across calls). → table rows with the
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S = 8K, 32K only")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cudnn", action="store_true", help="with --rounds: cuDNN's causal head-dim-256 attention "
                    "(the issue's comparator) in the HCA rounds")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="> 1: interleave the matmul and the kernels in rounds "
                    "and report medians of the per-round ratios")  # fmt: skip
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--seqs", default=None, help="comma-separated S values (overrides --quick)")
    ap.add_argument("--fp8", action="store_true",
                    help="also FP8 KV (per-channel scales): dequantize pass + the first variant's Mosaic kernel, "
                         "and the Triton kernel's in-kernel dequantization (unless --skip-triton)")  # fmt: skip
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    log("devices:", jax.devices())

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


if __name__ == "__main__":
    main()
