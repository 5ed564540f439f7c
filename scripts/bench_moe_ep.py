#!/usr/bin/env python3
"""Expert parallelism for one V4-Flash MoE layer's routed experts: 1 GPU against N GPUs of one host, and how much of
the dispatch/combine communication is exposed.

    python3 scripts/bench_moe_ep.py --tokens 64k,512k --out $OUT/ep          # 2 H200s (kind nvidia-h200-x2)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 scripts/bench_moe_ep.py --smoke   # CPU check

Shapes: D = 4096, I = 2048, E = 256, top-6 (`Config.preset("v4-flash")`), bf16 weights drawn on the devices, the
shared expert excluded. Routing: `bench_kernels.make_routing` (Zipf-like expert popularity, --zipf, default 0.3).

Rows, per token count N (all in one process, same inputs):
  1gpu          `dsv4.pallas.moe.routed_experts` on device 0, over token chunks of --one-chunk (lax.map; the whole
                512K at once needs ~84 GiB of temporaries), all 256 experts local.
  ep-c<C>       `dsv4.sharding.expert_parallel.routed_experts_ep` on all N devices: tokens split over the devices,
                experts split over the same devices (E / N each), dispatch/combine in chunks of C tokens per device
                with the library's defaults (schedule "direct", float32 partial results).
                --variants add: "-scan" (the chunks in a lax.scan instead of one unrolled program), "-ring" (the
                ring schedule), "-f32" / "-bf16" (partial results in that dtype), "-w8a8" (FP8 expert weights in
                128 × 128 blocks, W8A8 kernels, tokens quantized before they are sent: fp8 on the wire; compared
                with a 1gpu-w8a8 row), "-ctas<K>" (the Mosaic kernels on K persistent CTAs instead of one per SM).
  ep-…-local    the same program with every transfer replaced by a local copy of the same shape (comm="local":
                the array rolled by one row; wrong values, identical compute). exposed = t(ep) − t(ep-local): the
                communication time the program fails to hide (the target: ≤ 10% of the MoE time).
  ep-…-comm-only the first variant's program with the expert GEMMs replaced by an elementwise op: the transfers'
                own time. The compiled HLO (the schedule) of the first variant and of the W8A8 ones is written to
                --out at the largest N.
--trace: one more call of the first variant at the largest N under `jax.profiler.trace` (Perfetto JSON in
--out/trace); scripts/trace_overlap.py reports per GPU how much of the NCCL kernels' time ran alongside compute.
Useful FLOPs = 2 · 3 · D · I · N · K (gate, up, down per token-expert pair), the same count for every row; %mm is
against the same run's bf16 matmul (8192³ on device 0). scaling = t(1gpu) / (N · t(ep)). Check: the EP output
against the 1-GPU output (relative L2; both bf16 outputs of float32 sums). Load: the busiest device's share of
token-expert pairs over the mean (the dropless EP's compute imbalance; it sets the EP time).
Timing: AOT compile (reported apart), 1 warm-up call, median of --reps synchronized calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

_SMOKE = "--smoke" in sys.argv
if not _SMOKE:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_kernels import make_routing, quantize_weight_blocks  # noqa: E402
from bench_ttft_sp import parse_ep_variant as parse_variant  # noqa: E402
from bench_ttft_sp import parse_len  # noqa: E402
from trace_overlap import profile  # noqa: E402

from dsv4.config import Config  # noqa: E402
from dsv4.moe import routed_experts_pallas  # noqa: E402
from dsv4.pallas.moe import quantize_per_token_group  # noqa: E402
from dsv4.pallas.moe_mgpu import MgpuMoeConfig, routed_experts_mgpu  # noqa: E402
from dsv4.sharding import make_mesh, use_mesh  # noqa: E402
from dsv4.sharding.expert_parallel import routed_experts_ep  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def ep_call(local_experts, a, v: dict, kind: str):
    """routed_experts_ep on the bench's arguments: (x, ids, w, gate_up, down) or, W8A8, (xq, x_scales, ids, w,
    gate_up, down, gate_up_scales, down_scales)."""
    kw = dict(chunk_tokens=v["chunk"], unroll=v["unroll"], schedule=v["schedule"],
              comm="local" if kind == "local" else "ppermute")  # fmt: skip
    if v["combine"] is not None:  # else the library's default
        kw["combine_dtype"] = v["combine"]
    if v["w8a8"]:
        xq, xs, ids, w, gq, dq, gs, ds = a
        return routed_experts_ep(local_experts, xq, ids, w, gq, dq, x_scales=xs, gate_up_scales=gs, down_scales=ds,
                                 out_dtype=BF16, **kw)  # fmt: skip
    return routed_experts_ep(local_experts, *a, **kw)


def timed(compiled, args, reps: int) -> dict:
    out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return dict(ms=statistics.median(times) * 1e3, times_ms=[t * 1e3 for t in times]), out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="64k,512k")
    p.add_argument("--variants", default="c32k,c32k-ring-f32,c64k,c32k-w8a8",
                   help="EP variants: c<chunk tokens per step>[-scan][-ring][-f32|-bf16][-w8a8][-ctas<K>] (above)")
    p.add_argument("--one-chunk", default="64k", help="token chunk of the 1-GPU row")
    p.add_argument("--zipf", type=float, default=0.3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true",
                   help="profile one call of the first variant at the largest N into --out/trace and report, per GPU, "
                        "how much of the communication kernels' time overlaps compute (scripts/trace_overlap.py)")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny preset (D 256, I 128), 2 host devices")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # smoke: the tiny preset at the smallest widths the FP8 blocks take
    cfg = Config.preset("tiny").replace(hidden_size=256, moe_intermediate_size=128) if args.smoke else \
        Config.preset("v4-flash")
    d, inter, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    tokens = [24, 40] if args.smoke else [parse_len(x) for x in args.tokens.split(",")]
    variants = ["c8", "c8-scan-ring-f32", "c8-w8a8"] if args.smoke else args.variants.split(",")
    one_chunk = 16 if args.smoke else parse_len(args.one_chunk)
    n_dev = len(jax.devices())
    if n_dev < 2:
        raise SystemExit("bench_moe_ep needs at least 2 devices "
                         "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    mesh = make_mesh(n_dev)
    dev0 = jax.devices()[0]
    print(f"jax {jax.__version__}, {n_dev} × {dev0.device_kind}, {time.strftime('%Y-%m-%d %H:%M')}; D={d} I={inter} "
          f"E={e} top-{k}, zipf {args.zipf}", flush=True)  # fmt: skip
    limit = cfg.swiglu_limit
    rows = []

    # Same-run ceiling on device 0.
    mm_n = 256 if args.smoke else 8192
    a = jax.device_put(jax.random.normal(jax.random.key(1), (mm_n, mm_n), BF16), dev0)
    mm = jax.jit(lambda a: a @ a).lower(a).compile()
    t_mm, _ = timed(mm, (a,), args.reps)
    mm_tf = 2.0 * mm_n**3 / (t_mm["ms"] * 1e-3) / 1e12
    print(f"  bf16 matmul {mm_n}^3: {mm_tf:.0f} TF/s", flush=True)
    del a, mm

    # Weights: one copy on device 0 (1-GPU rows), one split over the mesh (EP rows).
    kw = jax.random.split(jax.random.key(args.seed), 2)
    scale = 0.02
    split = NamedSharding(mesh, P("sp"))
    gu_ep, dn_ep = jax.jit(lambda kk: (jax.random.normal(kk[0], (e, 2 * inter, d), BF16) * scale,
                                       jax.random.normal(kk[1], (e, d, inter), BF16) * scale),
                           out_shardings=(split, split))(kw)  # fmt: skip
    experts = {"bf16": (gu_ep, dn_ep)}
    if any(parse_variant(v)["w8a8"] for v in variants):  # DeepSeek's format: fp8 values, one scale per 128 × 128
        (gq, gs), (dq, ds) = jax.jit(lambda a, b: (quantize_weight_blocks(a), quantize_weight_blocks(b)),
                                     out_shardings=((split, split), (split, split)))(gu_ep, dn_ep)  # fmt: skip
        experts["w8a8"] = (gq, dq, gs, ds)
    experts_1 = {mode: jax.device_put(ws, dev0) for mode, ws in experts.items()}

    def one_gpu(x, ids, w, gu, dn, *scales):
        n = x.shape[0]
        c = min(one_chunk, n)
        pad = -n % c
        xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, c, d)
        ids_ = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1).reshape(-1, c, k)
        ws = jnp.pad(w, ((0, pad), (0, 0))).reshape(-1, c, k)
        fp8 = dict(zip(("gate_up_scales", "down_scales"), scales))
        y = jax.lax.map(lambda t: routed_experts_pallas(*t, gu, dn, limit, **fp8), (xs, ids_, ws))
        return y.reshape(-1, d)[:n]

    def local_experts_for(ctas):
        if ctas is None:
            return lambda x_, ids_, w_, gu_, dn_, **kw: routed_experts_pallas(x_, ids_, w_, gu_, dn_, limit,
                                                                              out_dtype=F32, **kw)  # fmt: skip
        cfg = MgpuMoeConfig(num_ctas=ctas)
        return lambda x_, ids_, w_, gu_, dn_, **kw: routed_experts_mgpu(x_, ids_, w_, gu_, dn_, limit, config=cfg,
                                                                        out_dtype=F32, **kw)  # fmt: skip

    def comm_only(x_, ids_, w_, gu_, dn_, **kw):  # no expert GEMMs: the transfers (and an elementwise op) alone
        return x_.astype(F32) * w_[:, :1]

    quantize_tokens = jax.jit(lambda x: tuple(a.reshape(1, x.shape[1], -1) for a in quantize_per_token_group(x[0])))

    seq = NamedSharding(mesh, P(None, "sp"))
    for n in tokens:
        flops = 2.0 * 3 * d * inter * n * k
        kx, kr = jax.random.split(jax.random.fold_in(jax.random.key(args.seed + 1), n))
        x = jax.random.normal(kx, (n, d), BF16)
        ids, w = make_routing(kr, tokens=n, experts=e, k=k, zipf=args.zipf)
        per_dev = jnp.bincount(ids.reshape(-1) // (e // n_dev), length=n_dev)
        load = float(per_dev.max() / per_dev.mean())
        row = dict(tokens=n, flops=flops, load_max_over_mean=load, mm_bf16_tflops=mm_tf)
        y1 = {}
        for mode, ws in experts_1.items():
            name = "1gpu" if mode == "bf16" else f"1gpu-{mode}"
            try:
                args1 = jax.device_put((x, ids, w), dev0) + ws
                exe = jax.jit(one_gpu).lower(*args1).compile()
                r, y = timed(exe, args1, args.reps)
                row[name] = r
                y1[mode] = jax.device_get(y).astype("float32")
                print(f"  N={n} {name}: {r['ms']:8.2f} ms  {flops / r['ms'] / 1e9:6.0f} TF/s  "
                      f"{flops / r['ms'] / 1e9 / mm_tf:4.0%} mm", flush=True)  # fmt: skip
                del args1, exe, y
            except Exception as exc:  # noqa: BLE001
                row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(f"  N={n} {name}: FAILED {row[name]['error']}", flush=True)
        xs = jax.device_put(x[None], seq)
        ids_s, w_s = jax.device_put(ids[None], seq), jax.device_put(w[None], seq)
        xq = quantize_tokens(xs) if "w8a8" in experts else None
        del x, ids, w
        for vi, variant in enumerate(variants):
            v = parse_variant(variant)
            mode = "w8a8" if v["w8a8"] else "bf16"
            ep_args = (*(xq if v["w8a8"] else (xs,)), ids_s, w_s, *experts[mode])
            kinds = ("ppermute", "local", "comm-only") if vi == 0 else ("ppermute", "local")
            for kind in kinds:
                name = f"ep-{variant}" + ("" if kind == "ppermute" else f"-{kind}")
                fn_local = comm_only if kind == "comm-only" else local_experts_for(v["ctas"])
                try:
                    with use_mesh(mesh):
                        fn = jax.jit(lambda *a, v=v, f=fn_local, k=kind: ep_call(f, a, v, k))
                        t0 = time.perf_counter()
                        exe = fn.lower(*ep_args).compile()
                        cs = time.perf_counter() - t0
                    if kind == "ppermute" and n == tokens[-1] and args.out and (vi == 0 or v["w8a8"]):
                        os.makedirs(args.out, exist_ok=True)
                        with open(os.path.join(args.out, f"hlo_ep-{variant}_{n}.txt"), "w") as f:
                            f.write(exe.as_text())
                    r, y = timed(exe, ep_args, args.reps)
                    r["compile_s"] = cs
                    if args.trace and args.out and vi == 0 and kind == "ppermute" and n == tokens[-1]:
                        r["trace"] = profile(exe, ep_args, os.path.join(args.out, "trace"))
                    if kind == "ppermute" and mode in y1:
                        yn, ref = jax.device_get(y)[0].astype("float32"), y1[mode]
                        r["rel_l2_vs_1gpu"] = float(((yn - ref) ** 2).sum() ** 0.5 / max((ref**2).sum() ** 0.5, 1e-30))
                    row[name] = r
                    note = f"  rel L2 vs 1gpu {r['rel_l2_vs_1gpu']:.1e}" if "rel_l2_vs_1gpu" in r else ""
                    print(f"  N={n} {name}: {r['ms']:8.2f} ms  {flops / r['ms'] / 1e9:6.0f} TF/s  "
                          f"compile {cs:.1f} s{note}", flush=True)  # fmt: skip
                    del exe, y
                except Exception as exc:  # noqa: BLE001
                    row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    print(f"  N={n} {name}: FAILED {row[name]['error']}", flush=True)
            ep, loc = row.get(f"ep-{variant}", {}), row.get(f"ep-{variant}-local", {})
            if "ms" in ep and "ms" in loc:
                exposed = max(ep["ms"] - loc["ms"], 0.0)
                ep["exposed_ms"], ep["exposed_frac"] = exposed, exposed / ep["ms"]
                one = row.get("1gpu" if mode == "bf16" else f"1gpu-{mode}", {})
                if "ms" in one:
                    ep["scaling"] = one["ms"] / (n_dev * ep["ms"])
                print(f"  N={n} ep-{variant}: exposed comm {exposed:.2f} ms = {exposed / ep['ms']:.1%} of the layer; "
                      f"scaling {ep.get('scaling', float('nan')):.2f}; busiest device {load:.2f}x the mean pairs",
                      flush=True)  # fmt: skip
        del xs, ids_s, w_s, xq
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_moe_ep.json"), "w") as f:
            json.dump(dict(argv=sys.argv, jax=jax.__version__, devices=n_dev, device_kind=dev0.device_kind, rows=rows),
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
