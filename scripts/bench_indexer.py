"""GPU exploration of the two-pass lightning indexer: scores-kernel tilings, the grouped exact top-k, and the
whole indexer at V4-Flash shapes against the XLA path, the streaming kernel and the same-run FP8 matmul rate.

    PYTHONPATH=. python3 scripts/bench_indexer.py --out $OUT/ix            # one H200, about 5 minutes

Sections (``--only scores,select,full``):
  scores  `index_scores` over one chunk of R queries at the end of an S-token prompt (C = S / 4 keys, all but
          the last few visible), per tiling (rows, block_q, block_c, num_warps) and dtype, and the Mosaic kernel
          (`index_scores_mgpu`) per config on e4m3 and on bf16; TFLOP/s of the visible pairs (2 · Hi · Di per pair).
  select  `dsv4.topk.top_k` (per group size) against `lax.top_k` on random float32 [R, N] rows, k = 512 / 2048.
  full    `index_topk_two_pass` at S = 32K, 128K, 512K (B = 1, Hi = 64, Di = 128, top-512; fp8 q and keys, and
          bf16, each with Triton or Mosaic scores), against `dsv4.attention.index_topk_jnp` (bf16, XLA; S <=
          --xla-max) and the streaming kernel `index_topk` (S <= --stream-max); at the smallest S the two-pass bf16
          index sets checked against the XLA path's, and the Mosaic ones against Triton's.
Prints a table per section; medians of --reps timed calls after one warm-up call. JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv4.attention import index_topk_jnp
from dsv4.pallas.indexer import ScoreBlocks, index_scores, index_topk, index_topk_two_pass
from dsv4.pallas.indexer_mgpu import MgpuScoreConfig, default_config, index_scores_mgpu
from dsv4.topk import top_k

HI, DI, RATE, FP8 = 64, 128, 4, jnp.float8_e4m3fn
INTERPRET = jax.default_backend() != "gpu"  # CPU smoke runs only (tiny --lengths)


def timed(fn, *args, reps: int) -> tuple[float, float]:
    """→ (compile + first call s, median of reps calls s)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def matmul_rate(dtype, n: int, reps: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32 if dtype == FP8 else None))
    _, t = timed(f, a, b, reps=reps)
    return 2 * n**3 / t / 1e12


def make_inputs(s: int, c: int, *, fp8: bool, seed: int = 0, offset: int = 0):
    """q [1, s, Hi, Di], keys [1, c, Di], weights, positions offset + arange(s); fp8 with per-entry k scales."""
    kq, kk, kw = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, s, HI, DI), jnp.bfloat16)
    keys = jax.random.normal(kk, (1, c, DI), jnp.bfloat16)
    weights = jax.random.normal(kw, (1, s, HI), jnp.float32)
    positions = (offset + jnp.arange(s, dtype=jnp.int32))[None]
    args = dict(q=q, keys=keys, weights=weights, positions=positions)
    if fp8:
        args.update(q=q.astype(FP8), keys=keys.astype(FP8), q_scale=jnp.float32(1.0),
                    k_scale=jnp.ones((1, c), jnp.float32))  # fmt: skip
    return args


def visible_pairs(s_end: int, n_queries: int) -> float:
    """Σ over the queries at positions s_end - n_queries .. s_end - 1 of their visible entries ((p + 1) // rate)."""
    p = np.arange(s_end - n_queries, s_end, dtype=np.int64)
    return float(((p + 1) // RATE).sum())


def section_scores(args, rows_out):
    s_end, r = args.scores_s, args.scores_r
    c = s_end // RATE
    tilings = [
        ScoreBlocks(block_q=1, block_c=128, rows="keys"),
        ScoreBlocks(block_q=2, block_c=128, rows="keys"),
        ScoreBlocks(block_q=4, block_c=128, rows="keys"),
        ScoreBlocks(block_q=2, block_c=64, rows="keys"),
        ScoreBlocks(block_q=2, block_c=128, rows="keys", num_warps=8),
        ScoreBlocks(block_q=4, block_c=128, rows="keys", num_warps=8),
        ScoreBlocks(block_q=2, block_c=128, rows="keys", num_stages=3),
        ScoreBlocks(block_q=2, block_c=128, rows="keys", q_transposed=True),
        ScoreBlocks(block_q=2, block_c=64, rows="keys", q_transposed=True),
        ScoreBlocks(block_q=1, block_c=256, rows="keys", num_warps=8),
        ScoreBlocks(block_q=2, block_c=256, rows="keys", num_warps=8),
        ScoreBlocks(block_q=2, block_c=256, rows="keys", num_warps=8, q_transposed=True),
        ScoreBlocks(block_q=1, block_c=64, rows="queries"),
    ]
    tilings = tilings[: args.triton_tilings]
    flops = 2 * HI * DI * visible_pairs(s_end, r)
    for fp8 in (True, False):
        inp = make_inputs(r, c, fp8=fp8, offset=s_end - r)
        section_scores_mgpu(args, rows_out, inp, flops)
        for blocks in tilings:
            name = f"{'fp8' if fp8 else 'bf16'} rows={blocks.rows}{'-qT' if blocks.q_transposed else ''} " \
                   f"bq={blocks.block_q} bc={blocks.block_c} w={blocks.num_warps} st={blocks.num_stages}"  # fmt: skip
            try:
                f = jax.jit(functools.partial(index_scores, rate=RATE, softmax_scale=DI**-0.5, blocks=blocks,
                                              interpret=INTERPRET))
                first, t = timed(lambda: f(**inp), reps=args.reps)
                row = dict(section="scores", name=name, ms=t * 1e3, tflops=flops / t / 1e12, first_s=first)
                print(f"  scores {name:55s} {t * 1e3:8.2f} ms {flops / t / 1e12:7.1f} TF/s (first {first:.1f} s)",
                      flush=True)  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row = dict(section="scores", name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
                print(f"  scores {name:55s} FAILED {row['error']}", flush=True)
            rows_out.append(row)


def parse_mgpu_configs(text: str) -> list[tuple[str, MgpuScoreConfig]]:
    """'t8-s2048:tokens=8,span=2048,slots=4;...' → [(name, MgpuScoreConfig)]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, spec = item.partition(":")
        fields = {k.strip(): int(v) for k, v in (kv.split("=") for kv in filter(None, spec.split(",")))}
        fields["num_slots"] = fields.pop("slots", MgpuScoreConfig.num_slots)
        out.append((name.strip(), MgpuScoreConfig(**fields)))
    return out


def section_scores_mgpu(args, rows_out, inp, flops):
    """The Mosaic scores kernel per config (the dtype's default first) on the inputs' dtype (e4m3 or bf16), checked
    against the Triton kernel on the same inputs (itself tested against the reference): the -inf pattern must match
    exactly, the finite scores to a relative error."""
    dtype = "fp8" if inp["q"].dtype == FP8 else "bf16"
    ref = None
    try:
        ref = np.asarray(jax.jit(functools.partial(index_scores, rate=RATE, softmax_scale=DI**-0.5,
                                                   interpret=INTERPRET))(**inp))  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(f"  scores mgpu: Triton {dtype} reference FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    interpret = None
    if INTERPRET:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret = InterpretGPUParams()
    for name, config in [("default", default_config(inp["q"].dtype)), *parse_mgpu_configs(args.mgpu_configs)]:
        name = f"{dtype} mgpu {name}"
        try:
            f = jax.jit(functools.partial(index_scores_mgpu, rate=RATE, softmax_scale=DI**-0.5, config=config,
                                          interpret=interpret))  # fmt: skip
            first, t = timed(lambda: f(**inp), reps=args.reps)
            row = dict(section="scores", name=name, ms=t * 1e3, tflops=flops / t / 1e12, first_s=first)
            check = ""
            if ref is not None:
                got = np.asarray(f(**inp))
                fin = np.isfinite(ref)
                same_inf = bool(np.array_equal(np.isneginf(got), np.isneginf(ref)))
                err = float(np.abs(got[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), 1e-30))
                row.update(same_inf=same_inf, rel_err=err, nans=int(np.isnan(got).sum()))
                check = f" check: -inf pattern {'same' if same_inf else 'DIFFERS'}, max rel err {err:.1e}, " \
                        f"NaN {row['nans']}"  # fmt: skip
            print(f"  scores {name:55s} {t * 1e3:8.2f} ms {flops / t / 1e12:7.1f} TF/s (first {first:.1f} s){check}",
                  flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            row = dict(section="scores", name=name, error=f"{type(e).__name__}: {str(e)[:600]}")
            print(f"  scores {name:55s} FAILED {row['error']}", flush=True)
        rows_out.append(row)


def section_select(args, rows_out):
    for r, n in ((2048, 32768), (512, 131072)):
        x = jax.random.normal(jax.random.key(3), (r, n), jnp.float32)
        for k in (512, 2048):
            base = jax.jit(lambda v, k=k: lax.top_k(v, k))
            _, t_base = timed(base, x, reps=args.reps)
            ref = np.asarray(base(x)[1])
            print(f"  select R={r} N={n} k={k}: lax.top_k {t_base * 1e3:8.2f} ms", flush=True)
            rows_out.append(dict(section="select", r=r, n=n, k=k, name="lax.top_k", ms=t_base * 1e3))
            for group in (4, 8, 16):
                for direct_max in (2048, 8192):
                    f = jax.jit(functools.partial(top_k, k=k, group=group, direct_max=direct_max))
                    _, t = timed(f, x, reps=args.reps)
                    same = bool(np.array_equal(np.asarray(f(x)[1]), ref))
                    print(f"  select R={r} N={n} k={k}: group={group:2d} direct_max={direct_max:5d} "
                          f"{t * 1e3:8.2f} ms ({t_base / t:5.1f}x) exact={same}", flush=True)  # fmt: skip
                    rows_out.append(dict(section="select", r=r, n=n, k=k, name=f"group={group},direct={direct_max}",
                                         ms=t * 1e3, speedup=t_base / t, exact=same))  # fmt: skip


def section_full(args, rows_out):
    blocks = ScoreBlocks(block_q=args.block_q, block_c=args.block_c, rows=args.rows, num_warps=args.num_warps,
                         q_transposed=args.q_transposed)  # fmt: skip
    for s in args.lengths:
        c = s // RATE
        flops = 2 * HI * DI * visible_pairs(s, s)
        inp8 = make_inputs(s, c, fp8=True)
        static = dict(rate=RATE, k=args.k, softmax_scale=DI**-0.5)
        results = {}
        mgpu = parse_mgpu_configs(args.mgpu_configs)
        several = (len(mgpu[: args.full_mgpu]), len(args.bands), len(args.selection)) != (1, 1, 1)
        mgpu_runs = [(f"two-pass fp8 mgpu {cname} b{bands}" + (f" {sel}" if sel != "auto" else "") if several else
                      "two-pass fp8 mgpu",
                      functools.partial(index_topk_two_pass, **static, group=args.group, interpret=INTERPRET,
                                        scores_impl="mgpu", mgpu_config=config, width_bands=bands, selection=sel),
                      inp8)
                     for cname, config in mgpu[: args.full_mgpu] for bands in args.bands
                     for sel in args.selection]  # fmt: skip
        for name, fn, inp in (
            ("two-pass fp8", functools.partial(index_topk_two_pass, **static, blocks=blocks, group=args.group,
                                                interpret=INTERPRET, width_bands=args.bands[0]), inp8),
            *mgpu_runs,
            ("two-pass bf16", functools.partial(index_topk_two_pass, **static, blocks=blocks, group=args.group,
                                                 interpret=INTERPRET), "bf16"),
            ("two-pass bf16 mgpu", functools.partial(index_topk_two_pass, **static, group=args.group,
                                                      interpret=INTERPRET, scores_impl="mgpu",
                                                      width_bands=args.bands[0]), "bf16"),
            ("xla bf16", functools.partial(index_topk_jnp, rate=RATE, k=args.k, softmax_scale=DI**-0.5,
                                           query_chunk=1024), "bf16"),
            ("stream fp8", functools.partial(index_topk, **static, interpret=INTERPRET), inp8),
        ):
            if args.full_names and not any(name.startswith(x) for x in args.full_names.split(",")):
                continue
            if name.startswith("xla") and s > args.xla_max:
                print(f"  full S={s} {name}: skipped (S > --xla-max {args.xla_max})", flush=True)
                continue
            if name.startswith("stream") and s > args.stream_max:
                print(f"  full S={s} {name}: skipped (S > --stream-max {args.stream_max})", flush=True)
                continue
            if inp == "bf16":
                inp = make_inputs(s, c, fp8=False)
            try:
                f = jax.jit(fn)
                first, t = timed(lambda: f(**inp), reps=args.reps if s < 262144 else max(1, args.reps // 2))
                results[name] = np.asarray(f(**inp)) if s == min(args.lengths) else None
                if name.startswith("two-pass fp8 mgpu") and results[name] is not None:
                    results.setdefault("two-pass fp8 mgpu", results[name])
                print(f"  full S={s} {name:14s} {t * 1e3:9.1f} ms {flops / t / 1e12:7.1f} TF/s (first {first:.1f} s)",
                      flush=True)  # fmt: skip
                rows_out.append(dict(section="full", s=s, name=name, ms=t * 1e3, tflops=flops / t / 1e12,
                                     first_s=first))  # fmt: skip
            except Exception as e:  # noqa: BLE001
                print(f"  full S={s} {name} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                rows_out.append(dict(section="full", s=s, name=name, error=str(e)[:400]))
        mgpu_names = [name for name, _, _ in mgpu_runs if results.get(name) is not None]
        for name in mgpu_names[1:]:  # every further Mosaic configuration against the first one
            a, b = results[name], results[mgpu_names[0]]
            same_rows = np.mean(np.all(np.sort(a[0], axis=-1) == np.sort(b[0], axis=-1), axis=-1))  # same sets
            print(f"  full S={s} check: {name} vs {mgpu_names[0]} identical index sets in {same_rows:.4%} of rows",
                  flush=True)  # fmt: skip
            rows_out.append(dict(section="full-check-mgpu-configs", s=s, name=name, same_rows=float(same_rows)))
        for section, got, want, label in (
            ("full-check-mgpu", "two-pass fp8 mgpu", "two-pass fp8", "two-pass fp8 mgpu vs Triton"),
            ("full-check-bf16-mgpu", "two-pass bf16 mgpu", "two-pass bf16", "two-pass bf16 mgpu vs Triton"),
            ("full-check", "two-pass bf16", "xla bf16", "two-pass bf16 vs xla bf16"),
        ):  # index sets of one path against another's, row by row
            if results.get(got) is None or results.get(want) is None:
                continue
            same_rows = np.mean([set(x) == set(y) for x, y in zip(results[got][0], results[want][0])])
            print(f"  full S={s} check: {label} identical index sets in {same_rows:.4%} of rows", flush=True)
            rows_out.append(dict(section=section, s=s, same_rows=float(same_rows)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="scores,select,full")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--scores-s", type=int, default=131072, help="prompt length of the scores section's chunk")
    p.add_argument("--scores-r", type=int, default=2048, help="queries in the scores section's chunk")
    p.add_argument("--lengths", default="32768,131072,524288")
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--q-transposed", action="store_true")
    p.add_argument("--rows", default="keys")
    p.add_argument("--block-q", type=int, default=2)
    p.add_argument("--block-c", type=int, default=128)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--triton-tilings", type=int, default=13, help="the first N Triton tilings of the scores section")
    p.add_argument("--mgpu-configs", default="t8-s2048:tokens=8,span=2048,slots=4",
                   help="Mosaic scores configs 'name:tokens=,span=,slots=;...', timed after each dtype's default on "
                        "e4m3 and bf16 (the first is used by full's fp8 run)")
    p.add_argument("--bands", default="1", help="full: index_topk_two_pass width_bands values to time (mgpu; the first "
                                                "also for the Triton fp8 run)")
    p.add_argument("--full-mgpu", type=int, default=1, help="full: time the first N --mgpu-configs")
    p.add_argument("--selection", default="auto", help="full: index_topk_two_pass selection values (mgpu; comma: "
                                                      "auto, xla, kernel)")
    p.add_argument("--full-names", default="", help="full: only runs whose names start with one of these (comma)")
    p.add_argument("--xla-max", type=int, default=131072)
    p.add_argument("--stream-max", type=int, default=32768)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.bands = [int(x) for x in args.bands.split(",")]
    args.selection = [x.strip() for x in args.selection.split(",") if x.strip()]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows = []
    try:
        mm8 = max(matmul_rate(FP8, n, args.reps) for n in (8192, 16384))
        mm16 = max(matmul_rate(jnp.bfloat16, n, args.reps) for n in (8192, 16384))
        print(f"  same-run matmul, best of 8192^3 and 16384^3: fp8 {mm8:.0f} TF/s, bf16 {mm16:.0f} TF/s", flush=True)
        rows.append(dict(section="ceiling", fp8_tflops=mm8, bf16_tflops=mm16))
        for section in args.only.split(","):
            print(f"== {section}", flush=True)
            try:
                {"scores": section_scores, "select": section_select, "full": section_full}[section](args, rows)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    finally:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_indexer.json"), "w") as f:
                json.dump(dict(argv=sys.argv, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
