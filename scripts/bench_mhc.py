"""The mHC Sinkhorn normalization on a GPU: XLA's loop, the same loop unrolled, and the Pallas kernels, side by side;
then the mHC merge in the forms XLA can run it, against the same run's copy bandwidth.

    PYTHONPATH=. python3 scripts/bench_mhc.py                 # one H200 (~1 min)
    PYTHONPATH=. python3 scripts/bench_mhc.py --variants loop,kernel,mgpu,mgpu-approx --reps 50   # Triton, Mosaic
    PYTHONPATH=. python3 scripts/bench_mhc.py --parts merge    # the merge forms alone

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
    mgpu-recip   `MgpuSinkhornConfig(reciprocal=True)`: each sum inverted once, the entries multiplied by it
    mgpu-recip-approx  both

Each variant's result is compared with the loop's (max abs difference). `--trace DIR` also profiles one call of each
and reports what the GPU spends per normalization (its busy time, and the largest kernel's): the wall time of a call
carries its launches and the host's wait, which a decode step's CUDA graph does not.

The merge (`dsv4.layers.hc_merge`, twice a layer) makes the hc = 4 new residual copies of a 16K-token chunk (D =
4096, bf16): new_k = post_k · output + Σ_j comb[j, k] · copy_j. It moves 1.15 GiB (the copies and the block output
read once, the new copies written), so its floor is the copy bandwidth: the `copy` row times `x * 1` over the same
copies (read and write), in the same interleaved rounds. A chain of `--calls` merges, each feeding the next; time
per merge.

    elementwise  `hc_merge` alone: 4 products summed in float32, one fusion
    with-norm    `hc_merge(with_mean_square=True)`, as the model runs it: also the new copies' mean square per token
                 (the next hyper-connection's norm), to see whether XLA keeps that reduction in the merge's pass
    einsum       the Σ_j as a batched dot (k = 4), the form `hc_merge` replaced
    d-major      the copies stored [B, S, D, hc] (hc innermost): the same sums, each output element's 4 copy values
                 next to each other (the layout the model would have to keep between layers; timed here without
                 the transposes)

Each form's result is compared with `elementwise`'s (max abs difference, d-major transposed back).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_kernels import Rounds  # noqa: E402

from dsv4.layers import hc_merge  # noqa: E402
from dsv4.pallas._device import is_hopper  # noqa: E402
from dsv4.pallas.sinkhorn import MgpuSinkhornConfig, sinkhorn, sinkhorn_mgpu, sinkhorn_reference  # noqa: E402

ITERS, EPS = 20, 1e-6


def unrolled(comb, iters, eps):
    return sinkhorn_reference(comb, iters, eps, unroll=True)


def mgpu_with(**config):
    """sinkhorn_mgpu in a given MgpuSinkhornConfig."""
    return functools.partial(sinkhorn_mgpu, config=MgpuSinkhornConfig(**config))


VARIANTS = {"loop": sinkhorn_reference, "unroll": unrolled, "kernel": sinkhorn, "mgpu": sinkhorn_mgpu,
            "mgpu-approx": mgpu_with(approx_math=True), "mgpu-recip": mgpu_with(reciprocal=True),
            "mgpu-recip-approx": mgpu_with(approx_math=True, reciprocal=True)}


F32 = jnp.float32


def merge_einsum(block_output, streams, post, comb):
    """hc_merge with the Σ_j as a batched dot."""
    mixed = jnp.einsum("bsjk,bsjd->bskd", comb.astype(F32), streams.astype(F32))
    return (post.astype(F32)[..., None] * block_output.astype(F32)[:, :, None, :] + mixed).astype(streams.dtype)


def merge_d_major(block_output, streams_t, post, comb):
    """hc_merge on copies stored [B, S, D, hc] → [B, S, D, hc]."""
    out = block_output.astype(F32)[..., None] * post.astype(F32)[:, :, None, :]
    for j in range(streams_t.shape[-1]):
        out = out + streams_t[..., j, None].astype(F32) * comb.astype(F32)[:, :, None, j, :]
    return out.astype(streams_t.dtype)


def merge_with_mean_square(block_output, streams, post, comb):
    """hc_merge as the model runs it: → (copies, their mean square per token [B, S, 1])."""
    return hc_merge(block_output, streams, post, comb, with_mean_square=True)


MERGES = {"elementwise": hc_merge, "with-norm": merge_with_mean_square, "einsum": merge_einsum,
          "d-major": merge_d_major}  # fmt: skip


def copies_of(result):
    """A merge form's new copies (the first of a tuple)."""
    return result[0] if isinstance(result, tuple) else result


def merge_inputs(b, s, hc, d, dtype=jnp.bfloat16):
    """(block output [B, S, D], copies [B, S, hc, D], post [B, S, hc], comb [B, S, hc, hc] doubly stochastic)."""
    k = jax.random.split(jax.random.key(1), 4)
    comb = sinkhorn_reference(jax.nn.softmax(jax.random.normal(k[0], (b, s, hc, hc)), axis=-1) + EPS, ITERS, EPS)
    return (jax.random.normal(k[1], (b, s, d), dtype), jax.random.normal(k[2], (b, s, hc, d), dtype),
            2 * jax.nn.sigmoid(jax.random.normal(k[3], (b, s, hc))), comb)  # fmt: skip


def chained(fn, calls):
    """`calls` applications of fn(x, *rest) → x (or a tuple whose first element is x), each feeding the next; a
    barrier between them keeps XLA from fusing one into the next (an elementwise chain would otherwise become one
    pass) and keeps every output of fn computed."""

    @jax.jit
    def run(x, *rest):
        for _ in range(calls):
            x = copies_of(jax.lax.optimization_barrier(fn(x, *rest)))
        return x

    return run


def bench_merge(calls, reps, b=1, s=16384, hc=4, d=4096):
    """The merge forms and the copy ceiling at a 16K-token chunk, timed in `reps` interleaved rounds (each round
    calls every form once); prints a table of medians."""
    block_output, copies, post, comb = merge_inputs(b, s, hc, d)
    moved = 2 * copies.nbytes + block_output.nbytes  # the copies read and written, the block output read
    want = hc_merge(block_output, copies, post, comb).astype(F32)
    calls_of = {"copy": (lambda run=chained(lambda x: x * 1.5, calls): run(copies))}
    diffs = {"copy": 0.0}
    for name, fn in MERGES.items():
        x = jnp.swapaxes(copies, 2, 3) if name == "d-major" else copies  # stored so before the clock
        run = chained(lambda y, bo, pst, cmb, fn=fn: fn(bo, y, pst, cmb), calls)
        calls_of[name] = lambda run=run, x=x: run(x, block_output, post, comb)
        got = copies_of(fn(block_output, x, post, comb))
        got = jnp.swapaxes(got, 2, 3) if name == "d-major" else got
        diffs[name] = float(jnp.max(jnp.abs(got.astype(F32) - want)))
    rounds, medians = Rounds(), {}
    for name, fn in calls_of.items():
        rounds.add(fn, lambda ms, name=name: medians.__setitem__(name, ms / 1e3 / calls))
    rounds.run(reps)
    rows = []
    for name, t in medians.items():
        rate = (2 * copies.nbytes if name == "copy" else moved) / t
        rows.append((name, t, rate))
        print(f"  merge B={b} S={s} {name:12s} {t * 1e3:8.3f} ms  {rate / 1e9:7.0f} GB/s  max |diff| "
              f"{diffs[name]:.1e}", flush=True)  # fmt: skip
    copy_rate = rows[0][2]
    print(f"\n| form | ms a merge | GB/s | % of copy |   ({moved / 2**30:.2f} GiB a merge; medians of {reps} rounds)")
    print("| --- | --- | --- | --- |")
    for name, t, rate in rows:
        print(f"| {name} | {t * 1e3:.3f} | {rate / 1e9:.0f} | {100 * rate / copy_rate:.0f}% |")


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
    p.add_argument("--parts", default="sinkhorn,merge", help="sinkhorn, merge or both (default)")
    p.add_argument("--trace", default=None, help="also profile one call of each Sinkhorn variant into this folder "
                   "and report the GPU's busy time and largest kernel per normalization")  # fmt: skip
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"sinkhorn", "merge"}:
        p.error(f"--parts {args.parts!r}: sinkhorn, merge or both")
    if "sinkhorn" in parts:
        bench_sinkhorn(p, args)
    if "merge" in parts:
        bench_merge(args.calls, args.reps)


def bench_sinkhorn(p, args):
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
            gpu = trace_gpu_us(fn, comb, f"{args.trace}/{b}x{s}-{name}", args.calls) if args.trace else {}
            rows.append((b, s, name, t, gpu))
            print(f"  B={b} S={s} {name:7s} {t * 1e6:9.1f} us a normalization, max |diff| vs loop {diff:.1e}"
                  + (f"; GPU busy {gpu['busy']:.1f} us, {gpu['kernel']} {gpu['kernel_us']:.1f} us" if gpu else ""),
                  flush=True)  # fmt: skip
    traced = " | GPU busy us | largest kernel us" if args.trace else ""
    print(f"\n| B | S | variant | us a normalization | vs loop{traced} |")
    print("| --- | --- | --- | --- | --- |" + (" --- | --- |" if args.trace else ""))
    for b, s, name, t, gpu in rows:
        loop = next(r[3] for r in rows if r[:2] == (b, s) and r[2] == "loop")
        extra = f" | {gpu['busy']:.1f} | {gpu['kernel_us']:.1f}" if gpu else (" | | " if args.trace else "")
        print(f"| {b} | {s} | {name} | {t * 1e6:.1f} | {loop / t:.2f}x faster{extra} |")


def trace_gpu_us(fn, x, trace_dir, calls):
    """One call of fn(x) under the profiler: the GPU's busy time and its largest kernel's (name, time), each per
    normalization. Wall time a call carries the launches and the host's wait; this is what the GPU spends."""
    from trace_overlap import kernel_table

    jax.block_until_ready(fn(x))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):  # the JSON `kernel_table` reads
        jax.block_until_ready(fn(x))
    try:
        table = kernel_table(trace_dir)
    except FileNotFoundError:
        return {}
    if not table:
        return {}
    gpu = table[sorted(table)[0]]
    name, (total, _) = max(gpu["kernels"].items(), key=lambda kv: kv[1][0])
    return dict(busy=gpu["busy_us"] / calls, kernel=name[:40], kernel_us=total / calls)


if __name__ == "__main__":
    main()
