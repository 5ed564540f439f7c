"""The mHC Sinkhorn normalization on a GPU: XLA's loop, the same loop unrolled, and the Pallas kernels, side by side.

    PYTHONPATH=. python3 scripts/bench_mhc.py                 # one H200 (~1 min)
    PYTHONPATH=. python3 scripts/bench_mhc.py --variants loop,kernel,mgpu,mgpu-approx --reps 50   # Triton, Mosaic

What one item times: a jitted function that runs `--calls` (default 6, a 3-layer model's hyper-connections)
normalizations one after another on [B, S, 4, 4] float32 matrices (each feeding the next, so none is dropped), V4's
20 iterations; median of --reps calls after a warm-up, time per normalization. Token counts: a decode step of 32
requests (B = 32, S = 1) and a 16K-token prefill chunk (B = 1, S = 16384).

    loop     `dsv4.pallas.sinkhorn.sinkhorn_reference`: a `lax.fori_loop` of 19 rounds (XLA runs a while loop from
             the host: kernels and a predicate copy per iteration)
    unroll   the same rounds as straight-line XLA (`fori_loop(..., unroll=True)`)
    kernel   `dsv4.pallas.sinkhorn.sinkhorn`: one Pallas kernel, every round in registers (Triton lowering)
    mgpu     `dsv4.pallas.sinkhorn.sinkhorn_mgpu`: the same rounds as a Mosaic GPU kernel, IEEE divisions (Hopper
             only; the mgpu variants are skipped elsewhere)
    mgpu-approx  the same with Mosaic's approx_math (approximate divisions, as the Triton lowering's)

Each variant's result is compared with the loop's (max abs difference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsv4.pallas._device import is_hopper  # noqa: E402
from dsv4.pallas.sinkhorn import MgpuSinkhornConfig, sinkhorn, sinkhorn_mgpu, sinkhorn_reference  # noqa: E402

ITERS, EPS = 20, 1e-6


def unrolled(comb, iters, eps):
    return sinkhorn_reference(comb, iters, eps, unroll=True)


def mgpu_approx(comb, iters, eps):
    return sinkhorn_mgpu(comb, iters, eps, config=MgpuSinkhornConfig(approx_math=True))


VARIANTS = {"loop": sinkhorn_reference, "unroll": unrolled, "kernel": sinkhorn, "mgpu": sinkhorn_mgpu,
            "mgpu-approx": mgpu_approx}  # fmt: skip


def chain(fn, calls):
    @jax.jit
    def run(comb):
        for _ in range(calls):
            comb = fn(comb * 1.5 + EPS, ITERS, EPS)
        return comb

    return run


def median_s(fn, x, reps):
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=6)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    args = p.parse_args()
    wanted = [v for v in args.variants.split(",") if v]
    if "loop" not in wanted or any(v not in VARIANTS for v in wanted):
        p.error(f"--variants {args.variants!r}: 'loop' (the baseline) and any of {list(VARIANTS)}")
    if not is_hopper() and any(v.startswith("mgpu") for v in wanted):
        print("not a Hopper GPU: the mgpu variants are skipped")
        wanted = [v for v in wanted if not v.startswith("mgpu")]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; {args.calls} normalizations a call", flush=True)
    rows = []
    for b, s in ((32, 1), (1, 16384)):
        logits = jax.random.normal(jax.random.key(0), (b, s, 4, 4)) * 3.0
        comb = jax.nn.softmax(logits, axis=-1) + EPS
        fns = {name: chain(VARIANTS[name], args.calls) for name in wanted}
        base = fns["loop"](comb)
        for name, fn in fns.items():
            t = median_s(fn, comb, args.reps) / args.calls
            diff = float(jnp.max(jnp.abs(fn(comb) - base)))
            rows.append((b, s, name, t))
            print(f"  B={b} S={s} {name:7s} {t * 1e6:9.1f} us a normalization, max |diff| vs loop {diff:.1e}",
                  flush=True)  # fmt: skip
    print("\n| B | S | variant | us a normalization | vs loop |")
    print("| --- | --- | --- | --- | --- |")
    for b, s, name, t in rows:
        loop = next(r[3] for r in rows if r[:2] == (b, s) and r[2] == "loop")
        print(f"| {b} | {s} | {name} | {t * 1e6:.1f} | {loop / t:.2f}x faster |")


if __name__ == "__main__":
    main()
