"""GPU probe of the FP8 lightning indexer (Mosaic scores kernel + grouped top-k): compile and run times apart, scores
configurations side by side, and where one query chunk's time goes. Written in the eleventh session to find out why
two options "did not finish" (docs/KERNEL_NOTES.md IX13-IX15); every mode prints as it goes.

    PYTHONPATH=. python scripts/probe_indexer_mgpu.py cfgs "name:k=v,k=v;name2:..."   MgpuScoreConfig fields (debug
        flags joined by +), on the 2048 queries x 32K keys at the end of a 128K prompt (bench_indexer's scores chunk);
        7 timed calls each, median; outputs compared with the first configuration's
    PYTHONPATH=. python scripts/probe_indexer_mgpu.py bands B S [out.npy]   index_topk_two_pass (FP8, Mosaic scores)
        at S tokens with width_bands=B: lower, compile, first call and timed calls printed apart
    PYTHONPATH=. python scripts/probe_indexer_mgpu.py breakdown S R   one chunk of R queries ending at S, S/2, S/4:
        scores kernel alone, dsv4.topk.top_k variants (among them each level refined by dsv4.pallas.select), the
        first group-max level alone, as a reduction and as a max of strided slices (ms, medians of 7)

Set MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=<existing dir> for ptxas' register and spill report per kernel.
"""
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from dsv4.pallas.indexer import index_topk_two_pass  # noqa: E402
from dsv4.pallas.indexer_mgpu import MgpuScoreConfig, index_scores_mgpu  # noqa: E402
from scripts.bench_indexer import DI, HI, RATE, make_inputs, visible_pairs  # noqa: E402


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def median_ms(fn, *a, reps=7):
    jax.block_until_ready(fn(*a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def loop_ms(fn, x, n=20):
    """Per-call time of fn(x) run n times inside one jit (a fori_loop): no launch or host-sync overhead per call,
    unlike median_ms. Optimization barriers tie the input to the carry (so XLA cannot hoist the call out of the loop)
    and keep the whole output live: the thirteenth session's form read back only element [0] of fn's output, and XLA
    sliced the elementwise passes down to it (a "copy" of 0.27 GB in 0.03 ms, 9 TB/s, more than the HBM has)."""

    def body(i, c):
        xi, c = jax.lax.optimization_barrier((x, c))
        out = jax.lax.optimization_barrier(fn(xi))
        leaf = jax.tree.leaves(out)[0]
        return c + jnp.ravel(leaf)[0].astype(jnp.float32) * 0.0

    looped = jax.jit(lambda x: jax.lax.fori_loop(0, n, body, jnp.float32(0)))
    return median_ms(looped, x, reps=3) / n


def loops(s: int, r: int):
    """The 512K end chunk's indexer stages timed inside one jit each (loop_ms): the scores kernel, the group maxima,
    the whole selection with the refinement kernel, against plain passes over the same slab."""
    from dsv4.pallas.select import refine_top_k
    from dsv4.topk import top_k

    w = -(-((s // RATE) + 63) // 64) * 64
    inp = make_inputs(r, w, fp8=True, offset=s - r)
    f = functools.partial(index_scores_mgpu, rate=RATE, softmax_scale=DI**-0.5)
    scores = jax.jit(f)
    sc = scores(**inp)
    row = dict(end=s, W=w, slab_GB=sc.size * 4 / 1e9)
    row["loop_scores"] = loop_ms(lambda q: f(**{**inp, "q": q}), inp["q"])
    row["loop_copy"] = loop_ms(lambda x: x * 2.0, sc)
    row["loop_sum"] = loop_ms(lambda x: x.sum(-1), sc)
    row["loop_gmax4"] = loop_ms(lambda x: x.reshape(r, -1, 4).max(-1), sc)
    row["loop_topk_g4_kernel"] = loop_ms(lambda x: top_k(x, 512, refine=refine_top_k), sc)
    row["loop_topk_g8_kernel"] = loop_ms(lambda x: top_k(x, 512, group=8, refine=refine_top_k), sc)
    row["loop_topk_g4_xla"] = loop_ms(lambda x: top_k(x, 512), sc)
    row["single_scores"] = median_ms(lambda: scores(**inp))
    row["single_topk_g4_kernel"] = median_ms(jax.jit(lambda x: top_k(x, 512, refine=refine_top_k)), sc)
    say("LOOPS " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


def stages(fn, inp, reps):
    """Lower, compile, first call, then `reps` timed calls, each printed. → (output, median seconds)."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(**inp)
    t1 = time.perf_counter()
    say(f"lowered in {t1 - t0:.1f} s")
    compiled = lowered.compile()
    t2 = time.perf_counter()
    say(f"compiled in {t2 - t1:.1f} s")
    out = compiled(**inp)
    jax.block_until_ready(out)
    say(f"first run {time.perf_counter() - t2:.2f} s")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(**inp))
        times.append(time.perf_counter() - t)
        say(f"  run {times[-1] * 1e3:.1f} ms")
    return out, statistics.median(times)


def parse_config(spec: str) -> MgpuScoreConfig:
    kw = {}
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=")
        kw[k] = tuple(v.split("+")) if k == "debug" else int(v)
    return MgpuScoreConfig(**kw)


def cfgs(specs: str):
    s_end, r = 131072, 2048
    inp = make_inputs(r, s_end // RATE, fp8=True, offset=s_end - r)
    flops = 2 * HI * DI * visible_pairs(s_end, r)
    ref = None
    for item in specs.split(";"):
        name, _, spec = item.partition(":")
        try:
            cfg = parse_config(spec)
            f = jax.jit(functools.partial(index_scores_mgpu, rate=RATE, softmax_scale=DI**-0.5, config=cfg))
            out = np.asarray(f(**inp))
            t = median_ms(lambda: f(**inp)) / 1e3
            check = ""
            if not cfg.debug:
                ref = out if ref is None else ref
                fin = np.isfinite(ref)
                err = float(np.abs(out[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))
                same_inf = np.array_equal(np.isneginf(out), np.isneginf(ref))
                check = f"same as first: {np.array_equal(out, ref)} (max diff {err:.1e} of the largest, " \
                        f"-inf {same_inf})"  # fmt: skip
            say(f"RESULT {name}: {t * 1e3:.3f} ms {flops / t / 1e12:.1f} TF/s {check}")
        except Exception as e:  # noqa: BLE001
            say(f"RESULT {name}: FAILED {type(e).__name__}: {str(e)[:500]}")


def bands(n_bands: int, s: int, save: str | None):
    inp = make_inputs(s, s // RATE, fp8=True)
    flops = 2 * HI * DI * visible_pairs(s, s)
    fn = functools.partial(index_topk_two_pass, rate=RATE, k=512, softmax_scale=DI**-0.5, scores_impl="mgpu",
                           width_bands=n_bands)  # fmt: skip
    out, t = stages(fn, inp, 3 if s >= 262144 else 5)
    say(f"RESULT bands={n_bands} S={s}: {t * 1e3:.1f} ms {flops / t / 1e12:.1f} TF/s")
    if save:
        np.save(save, np.asarray(out[0, -4096:]))


def breakdown(s: int, r: int):
    from dsv4.pallas.select import SelectBlocks, refine_top_k
    from dsv4.topk import top_k

    def xla_refine(x, groups, group):  # dsv4.topk.top_k's own refinement step (sort ids, gather, lax.top_k)
        g = jnp.sort(groups, axis=-1)
        cand = jnp.take_along_axis(x.reshape(r, -1, group), g[..., None], axis=-2).reshape(r, -1)
        v, pos = jax.lax.top_k(cand, groups.shape[-1])
        return v, jnp.take_along_axis(g, pos // group, axis=-1) * group + pos % group

    for end in (s, s // 2, s // 4):
        w = -(-((end // RATE) + 63) // 64) * 64  # the chunk's visible keys, whole 64-key tiles
        inp = make_inputs(r, w, fp8=True, offset=end - r)
        f = jax.jit(functools.partial(index_scores_mgpu, rate=RATE, softmax_scale=DI**-0.5))
        sc = f(**inp)  # [1, r, w]
        row = dict(end=end, W=w, scores=median_ms(lambda: f(**inp)))
        row["topk_g4"] = median_ms(jax.jit(lambda x: top_k(x, 512)), sc)
        row["topk_g8"] = median_ms(jax.jit(lambda x: top_k(x, 512, group=8)), sc)
        row["topk_g4_d4096"] = median_ms(jax.jit(lambda x: top_k(x, 512, direct_max=4096)), sc)
        row["gmax4"] = median_ms(jax.jit(lambda x: x.reshape(r, -1, 4).max(-1)), sc)
        # the same maxima as an elementwise max of 4 strided slices (no minor-dim reduction of 4)
        strided = jax.jit(lambda x: functools.reduce(jnp.maximum, [x[..., i::4] for i in range(4)]))
        row["gmax4_strided"] = median_ms(strided, sc)
        row["gmax16"] = median_ms(jax.jit(lambda x: x.reshape(r, -1, 16).max(-1)), sc)
        row["lax_top_k"] = median_ms(jax.jit(lambda x: jax.lax.top_k(x, 512)), sc)
        # each level refined by dsv4.pallas.select.refine_top_k instead of XLA's sort + gather + lax.top_k
        row["topk_g4_refine_kernel"] = median_ms(jax.jit(lambda x: top_k(x, 512, refine=refine_top_k)), sc)
        same = np.array_equal(np.asarray(top_k(sc, 512, refine=refine_top_k)[1]), np.asarray(top_k(sc, 512)[1]))
        row["refine_same"] = str(same)
        # the first level alone (131K -> 512 from the 512 best groups of 4): XLA's sort + gather + top_k vs the kernel
        best = jax.jit(lambda x: top_k(x.reshape(r, -1, 4).max(-1), 512)[1])(sc)
        row["level0_xla"] = median_ms(jax.jit(lambda x, g: xla_refine(x, g, 4)), sc[0], best)
        row["level0_kernel"] = median_ms(jax.jit(lambda x, g: refine_top_k(x, g, group=4)), sc[0], best)
        row["level0_kernel_unordered"] = median_ms(jax.jit(lambda x, g: refine_top_k(x, g, group=4, ordered=False)),
                                                   sc[0], best)  # fmt: skip
        # queue item 2: a pass over the kernel's slab vs over a fresh XLA array of the same shape (IX22's 1.2 TB/s)
        fresh = jax.jit(lambda: jnp.full((1, r, w), 1.0, jnp.float32))()
        for name, x in (("slab", sc), ("fresh", fresh)):
            row[f"copy_{name}"] = median_ms(jax.jit(lambda x: x * 2.0), x)
            row[f"gmax4_{name}"] = median_ms(jax.jit(lambda x: x.reshape(r, -1, 4).max(-1)), x)
            row[f"sum_{name}"] = median_ms(jax.jit(lambda x: x.sum(-1)), x)
            row[f"loop_copy_{name}"] = loop_ms(lambda x: x * 2.0, x)  # the same passes without per-call overhead
            row[f"loop_gmax4_{name}"] = loop_ms(lambda x: x.reshape(r, -1, 4).max(-1), x)
        row["slab_GB"] = sc.size * 4 / 1e9
        say("BREAKDOWN " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        row = dict(end=end)
        variants = (("r1w1", SelectBlocks(1, 1)), ("r1w2", SelectBlocks(1, 2)), ("r1w8", SelectBlocks(1, 8)),
                    ("r4w4", SelectBlocks(4, 4)))  # fmt: skip
        for name, blocks in variants if end == s else ():  # launch shapes, at the longest row only
            refine = functools.partial(refine_top_k, blocks=blocks)
            row[f"topk_g4_refine_{name}"] = median_ms(jax.jit(lambda x, f=refine: top_k(x, 512, refine=f)), sc)
        for g in (8, 16) if end == s else ():  # wider groups: fewer levels, now that a level is one kernel
            wide = jax.jit(lambda x, g=g: top_k(x, 512, group=g, refine=refine_top_k))
            row[f"topk_g{g}_refine_kernel"] = median_ms(wide, sc)
        if len(row) > 1:
            say("BREAKDOWN " + " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "end") + f" (end={end})")


def main():
    mode = sys.argv[1]
    if mode == "cfgs":
        cfgs(sys.argv[2])
    elif mode == "bands":
        bands(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif mode == "loops":
        loops(int(sys.argv[2]), int(sys.argv[3]))
    elif mode == "breakdown":
        breakdown(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
