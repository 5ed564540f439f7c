#!/usr/bin/env python3
"""TTFT with sequence parallelism, end to end: the same V4-Flash-shaped model as `bench_ttft.py`, full-sequence
prefill, on 1 device and on N devices of one host.

    python3 scripts/bench_ttft_sp.py --lengths 128k,512k --out $OUT        # 2 H200s (kind nvidia-h200-x2)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 scripts/bench_ttft_sp.py --smoke   # CPU check

Model: `bench_ttft.py`'s (V4-Flash widths, 3 layers sliding / CSA / HCA, bf16, random weights drawn on the device,
B = 1, random token ids), built with Kernels(attention="sp", indexer="pallas", moe="pallas")
(`dsv4/attention/sequence_parallel.py`: the sequence split evenly over an "sp" mesh, halo exchange for the window,
ring-passed compressed entries, each shard's core in jnp; ``--attention sp-pallas``: the Triton kernel per shard,
entries all-gathered): the indexer runs per shard (`per_sequence_shard`); the routed experts are split over the
devices and the tokens reach them round a ring (`dsv4/sharding/expert_parallel.py`; ``--experts replicated``: every
device holds every expert and runs its own tokens). The other weights are replicated. Token ids are sharded over the
sequence. The whole prompt at once (no chunking), timed as `bench_ttft.py` times its full-sequence variants: embed,
each layer, and the last token's head, each a jitted call.

Per length, in one process: the 1-device run of the same model (attention="sp" falls back to the jnp core
with no mesh; the Pallas indexer and MoE as in (3); ``--one-device auto``: Kernels' defaults, the Pallas attention
kernels, i.e. bench_ttft's (3); ``none``: skipped) when it fits, then the N-device run for each ``--order``
(contiguous: the sequence split in order; zigzag: `SEQUENCE_PARALLEL_ZIGZAG`, the ids permuted once in the embed
call, the last token read from its zigzag row); ``--baseline`` adds bench_ttft's XLA baseline (1c) on one device
first, and every run's speed-up over it. Timing: AOT compile (reported apart), 1 warm-up call, median of --reps
calls (1 when a call takes over 8 s); one layer in flight at a time, as in bench_ttft. Speed-up = t1 / tN, scaling
efficiency = t1 / (N · tN). Peak memory per device from `memory_stats()`.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ttft import build_model_on_device, default_mix, model_flops, use_capacity_moe, with_layers  # noqa: E402

from dsv4.config import Config  # noqa: E402
from dsv4.kernels import Kernels  # noqa: E402
from dsv4.model import DeepseekV4  # noqa: E402
from dsv4.sharding import SEQUENCE_ONLY, SEQUENCE_PARALLEL, make_mesh, use_mesh  # noqa: E402
from dsv4.sharding.rules import named_sharding  # noqa: E402
from dsv4.sharding.sequence import zigzag_model_rows, zigzag_permute, zigzag_row  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def parse_len(x: str) -> int:
    x = x.strip().lower()
    return int(x[:-1]) * 1024 if x.endswith("k") else int(x)


def parse_ep_variant(v: str) -> dict:
    """bench_moe_ep.py's variants: "c32k-scan-ring-f32-w8a8-ctas120" → dict(chunk=32768, unroll=False,
    schedule="ring", combine=float32, w8a8=True, ctas=120); unset parts take the library's defaults (unroll /
    combine None, schedule "direct")."""
    parts = v.split("-")
    flags = {"scan", "ring", "f32", "bf16", "w8a8"}
    bad = [x for x in parts[1:] if x not in flags and not (x.startswith("ctas") and x[4:].isdigit())]
    if not parts[0].startswith("c") or bad:
        raise SystemExit(f"bad variant {v!r}: expected c<tokens>[-scan][-ring][-f32|-bf16][-w8a8][-ctas<K>]")
    ctas = [int(x[4:]) for x in parts[1:] if x.startswith("ctas")]
    return dict(chunk=parse_len(parts[0][1:]), unroll=False if "scan" in parts else None,
                schedule="ring" if "ring" in parts else "direct",
                combine=F32 if "f32" in parts else BF16 if "bf16" in parts else None, w8a8="w8a8" in parts,
                ctas=ctas[0] if ctas else None)  # fmt: skip


def peak_gib() -> list[float]:
    out = []
    for d in jax.local_devices():
        s = d.memory_stats() or {}
        out.append(round(s.get("peak_bytes_in_use", 0) / 2**30, 1))
    return out


def _embed(embed_w, ids, hc, zigzag_n):
    if zigzag_n:  # the whole model runs in zigzag order: the token ids are permuted once, here
        ids = zigzag_permute(ids, zigzag_n)
    x = embed_w[ids]
    return jnp.broadcast_to(x[:, :, None, :], (*ids.shape, hc, x.shape[-1]))


def _layer(gd, st, streams, positions, ids, layout):
    del layout  # static: the rules are read while tracing, so a different layout must be a different program
    return nnx.merge(gd, st)(streams, positions, ids)


def _last(streams, row):
    return streams[:, row : row + 1]


def _head(gd_h, st_h, gd_n, st_n, last, lm_w):
    h = nnx.merge(gd_n, st_n)(nnx.merge(gd_h, st_h)(last))[:, 0]
    return jnp.einsum("bd,vd->bv", h, lm_w, preferred_element_type=F32)


def place(state, mesh, rules):
    """The state laid out on `mesh` by `rules` (each parameter by its logical axes; the experts split when the
    rules say so), the old arrays dropped as it goes (never two copies of a tensor on one device)."""
    flat = nnx.to_flat_state(state)
    for _, var in flat:
        axes = var.get_metadata().get("axes", (None,) * var.ndim)
        var.set_value(jax.device_put(var[...], named_sharding(mesh, rules, axes, var.shape)))
    return state


def run(gd, state, ids, mesh, reps: int, rules=SEQUENCE_PARALLEL) -> dict:
    """Compile + time one prompt's prefill (state and ids already placed; mesh None: one device), as
    `bench_ttft.py` times its full-sequence variants: embed → each layer → last-token head, each its own jitted
    call (a whole-model jit holds several layers' temporaries at once: at 128K it peaked 12 GiB higher)."""
    model = nnx.merge(gd, state)
    hc = model.config.hc_mult
    seq = ids.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    zigzag_n, last_row = 0, seq - 1
    if mesh is not None and rules.seq_order == "zigzag":
        zigzag_n = mesh.shape["sp"]
        # The model would pad; this harness times unpadded lengths only.
        if 2 * zigzag_n * zigzag_model_rows(model.config, seq, zigzag_n) != seq:
            raise ValueError(f"--order zigzag: S={seq} is not 2N blocks of whole compressor windows (N={zigzag_n})")
        positions, last_row = zigzag_permute(positions, zigzag_n), zigzag_row(seq - 1, seq, zigzag_n)
    stream_sharding = None
    if mesh is not None:
        positions = jax.device_put(positions, NamedSharding(mesh, P(None, "sp")))
        stream_sharding = NamedSharding(mesh, P(None, "sp"))
    embed_w, lm_w = model.embed_tokens["weight"][...], model.lm_head["weight"][...]
    pieces = [nnx.split(layer) for layer in model.layers]
    gd_h, st_h = nnx.split(model.hc_head)
    gd_n, st_n = nnx.split(model.norm)
    t0 = time.perf_counter()
    with use_mesh(mesh, rules) if mesh is not None else _nothing():
        e_embed = jax.jit(_embed, static_argnums=(2, 3), out_shardings=stream_sharding).lower(
            embed_w, ids, hc, zigzag_n).compile()
        streams_abs = jax.ShapeDtypeStruct((1, seq, hc, model.config.hidden_size), embed_w.dtype,
                                           sharding=stream_sharding)
        layer_exes = [jax.jit(_layer, static_argnums=(0, 5), out_shardings=stream_sharding).lower(
            g, st, streams_abs, positions, ids, rules if mesh is not None else None).compile()
            for g, st in pieces]  # fmt: skip
        # The last token's streams are cut out (and replicated) by a call of their own: with the whole sharded
        # [1, S, hc, D] streams as its input, the head's executable needs ~100 GiB at 512K.
        replicated = None if mesh is None else NamedSharding(mesh, P())
        e_last = jax.jit(_last, static_argnums=1, out_shardings=replicated).lower(streams_abs, last_row).compile()
        last_abs = jax.ShapeDtypeStruct((1, 1, hc, model.config.hidden_size), embed_w.dtype, sharding=replicated)
        e_head = jax.jit(_head, static_argnums=(0, 2)).lower(gd_h, st_h, gd_n, st_n, last_abs, lm_w).compile()
    compile_s = time.perf_counter() - t0

    def one_pass():
        t = time.perf_counter()
        streams = e_embed(embed_w, ids)
        for exe, (_, st) in zip(layer_exes, pieces):
            # One layer in flight at a time, as bench_ttft.py: a call dispatched while the previous one still runs
            # has its buffers allocated at dispatch, so two layers' temporaries would coexist (at 512K the XLA
            # baseline's are ~64 GiB, and an out-of-memory failure is reported against the last call dispatched).
            streams = jax.block_until_ready(exe(st, streams, positions, ids))
        out = jax.block_until_ready(e_head(st_h, st_n, e_last(streams), lm_w))
        return time.perf_counter() - t, out

    warm, out = one_pass()
    n = 1 if warm > 8.0 else reps
    times = [one_pass()[0] for _ in range(n)]
    return dict(ttft_s=statistics.median(times), times_s=times, warm_s=warm, compile_s=compile_s,
                logits=jax.device_get(out).astype("float32"))  # fmt: skip


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def measure(name, s, gd, state, ids, mesh, reps, row, flops, rules=SEQUENCE_PARALLEL):
    try:
        r = run(gd, state, ids, mesh, reps, rules)
        row[name] = {k: v for k, v in r.items() if k != "logits"}
        row[name + "_logits"] = r["logits"]
        print(f"  S={s} {name}: TTFT {r['ttft_s'] * 1e3:9.1f} ms  {flops / r['ttft_s'] / 1e12:6.1f} TF/s  "
              f"compile {r['compile_s']:.1f} s  peak GiB per device so far {peak_gib()}", flush=True)  # fmt: skip
    except Exception as e:  # noqa: BLE001
        row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"  S={s} {name}: FAILED {row[name]['error']}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128k,512k")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--attention", default="sp", choices=("sp", "sp-pallas"),
                   help="the SP core: jnp per shard with ring-passed entries, or the Triton kernel per shard")
    p.add_argument("--experts", default="split", choices=("split", "replicated"),
                   help="N devices: routed experts split over the devices (expert parallelism, the ring of "
                        "dsv4/sharding/expert_parallel.py) or replicated (each device runs its own tokens' experts)")
    p.add_argument("--order", default="contiguous",
                   help="N devices, comma-separated: contiguous (the sequence split in order) and/or zigzag (shard i "
                        "holds blocks i and 2N-1-i; the ids permuted once at the input, SEQUENCE_PARALLEL_ZIGZAG)")
    p.add_argument("--indexer", default="pallas",
                   help="comma-separated Kernels.indexer values for the N-device runs: pallas (bf16 two-pass) and/or "
                        "pallas-fp8 (e4m3 q and keys, the Mosaic scores kernel on Hopper); the first one also for "
                        "the 1-device run")
    p.add_argument("--ep", default="default",
                   help="expert-parallel settings to compare, comma-separated: 'default' (the library's) or "
                        "c<chunk tokens>[-ring][-f32|-bf16] as in bench_moe_ep.py (set on every MoE layer)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-1dev-from", default="512k", help="no 1-device run at or above this length (OOM)")
    p.add_argument("--baseline", action="store_true",
                   help="also time bench_ttft's XLA baseline (1c) on one device, in the same process")
    p.add_argument("--one-device", default="same", choices=("same", "auto", "none"),
                   help="the 1-device model: the same kernels without a mesh, Kernels' defaults (Pallas), or none "
                        "(e.g. only the baseline at a length where the full-sequence 1-device model does not fit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny preset at S = 64 and 96")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lengths = [64, 96] if args.smoke else [parse_len(x) for x in args.lengths.split(",")]
    skip_from = 1 << 40 if args.smoke else parse_len(args.skip_1dev_from)
    n_dev = len(jax.devices())
    base = Config.preset("tiny" if args.smoke else "v4-flash")
    cfg = with_layers(base, default_mix(args.layers))
    print(f"jax {jax.__version__}, {n_dev} × {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"{'tiny' if args.smoke else 'v4-flash'} {args.layers} layers; attention {args.attention}, experts "
          f"{args.experts}, order {args.order}", flush=True)  # fmt: skip
    model, info = build_model_on_device(cfg, args.seed, F32 if args.smoke else BF16)
    _, state = nnx.split(model)
    def graphdef(kernels: Kernels, ep="default", capacity_moe=False):
        """capacity_moe: the MoE layers as bench_ttft's capacity-padded XLA MoE (its (1c))."""
        abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=F32 if args.smoke else BF16,
                                                     kernels=kernels))  # fmt: skip
        if capacity_moe:
            use_capacity_moe(abstract)
        if ep != "default":
            v = parse_ep_variant(ep)
            for layer in abstract.layers:
                mlp = layer.mlp
                mlp.ep_chunk_tokens, mlp.ep_schedule = v["chunk"], v["schedule"]
                if v["combine"] is not None:  # else the model's default
                    mlp.ep_combine_dtype = v["combine"]
        return nnx.split(abstract)[0]

    indexers = [x.strip() for x in args.indexer.split(",") if x.strip()]
    eps = [x.strip() for x in args.ep.split(",") if x.strip()]
    gds = {(ix, ep): graphdef(Kernels(attention=args.attention, indexer=ix, moe="pallas"), ep=ep)
           for ix in indexers for ep in eps}  # fmt: skip
    gd = gds[indexers[0], eps[0]]
    # The 1-device run: the same SP model without a mesh (its core falls back to jnp), or with --one-device
    # auto, the best 1-GPU full-sequence model (bench_ttft's (3): the Pallas / Mosaic attention kernels).
    gd_one = gd if args.one_device == "same" else graphdef(Kernels(indexer=indexers[0], moe="pallas"))
    gd_base = graphdef(Kernels.all("jnp"), capacity_moe=True) if args.baseline else None
    del model
    print(f"  weights {info['param_bytes'] / 2**30:.1f} GiB, drawn in {info['init_s']:.0f} s", flush=True)
    mesh = make_mesh(n_dev) if n_dev > 1 else None
    many = f"{n_dev}dev"
    if any(o not in ("contiguous", "zigzag") for o in args.order.split(",")):
        p.error(f"--order {args.order!r}: each entry must be contiguous or zigzag")
    rows = {s: dict(s=s, flops=model_flops(cfg, cfg.layer_types, s)) for s in lengths}

    def token_ids(s):
        return jax.random.randint(jax.random.key(args.seed * 7919 + s), (1, s), 0, cfg.vocab_size, jnp.int32)

    # Every 1-device run first, then the weights are replicated (the single-device copy dropped) for the N-device
    # runs: never two copies on device 0.
    for s in lengths:
        if s >= skip_from:
            print(f"  S={s} 1dev: skipped (--skip-1dev-from)", flush=True)
            continue
        if args.baseline:  # bench_ttft's (1c): XLA attention and indexer, the capacity-padded XLA MoE
            measure("baseline", s, gd_base, state, token_ids(s), None, args.reps, rows[s], rows[s]["flops"])
        if args.one_device != "none":
            measure("1dev", s, gd_one, state, token_ids(s), None, args.reps, rows[s], rows[s]["flops"])
    orders = args.order.split(",")
    runs = [(order, ix, ep, (many if order == "contiguous" else f"{many}-{order}")
             + ("" if ix == indexers[0] else f"-{ix}") + ("" if ep == eps[0] else f"-ep:{ep}"))
            for order in orders for ix in indexers for ep in eps]  # fmt: skip
    names = [name for *_, name in runs]
    if mesh is not None:
        # split: sequence and routed experts over the devices, the rest replicated;
        # replicated: every weight on every device, so the MoE runs data-parallel on each shard's tokens.
        rules = SEQUENCE_PARALLEL if args.experts == "split" else SEQUENCE_ONLY
        placed = jax.block_until_ready(place(state, mesh, rules))
        del state
        for s in lengths:
            ids = jax.device_put(token_ids(s), NamedSharding(mesh, P(None, "sp")))
            for order, ix, ep, name in runs:  # the orders (indexers, EP settings) side by side, length by length
                layout = dataclasses.replace(rules, seq_order=order)
                measure(name, s, gds[ix, ep], placed, ids, mesh, args.reps, rows[s], rows[s]["flops"], layout)
    for s, row in rows.items():
        one = row.get("1dev", {})
        for name in names:
            nd = row.get(name, {})
            if "ttft_s" in one and "ttft_s" in nd:
                a, b = row["1dev_logits"], row[name + "_logits"]
                rel = float(((a - b) ** 2).sum() ** 0.5 / max(((a**2).sum()) ** 0.5, 1e-30))
                nd.update(speedup=one["ttft_s"] / nd["ttft_s"], efficiency=one["ttft_s"] / (n_dev * nd["ttft_s"]),
                          logits_rel_l2=rel)  # fmt: skip
                print(f"  S={s}: {name} speed-up {nd['speedup']:.2f}x, efficiency {nd['efficiency']:.2f}, last-token "
                      f"logits rel. L2 {rel:.2e} ({n_dev} devices vs 1)", flush=True)  # fmt: skip
        first = names[0] if names else None
        for name in names[1:]:  # the N-device runs against the first (where no 1-device run fits)
            if first + "_logits" in row and name + "_logits" in row:
                a, b = row[first + "_logits"], row[name + "_logits"]
                rel = float(((a - b) ** 2).sum() ** 0.5 / max(((a**2).sum()) ** 0.5, 1e-30))
                row[name][f"logits_rel_l2_vs_{first}"] = rel
                print(f"  S={s}: {name} last-token logits rel. L2 {rel:.2e} against {first}", flush=True)
        base = row.get("baseline", {})
        if "ttft_s" in base:
            for name in ("1dev", *names):
                if "ttft_s" in row.get(name, {}):
                    row[name]["vs_baseline"] = base["ttft_s"] / row[name]["ttft_s"]
                    print(f"  S={s}: {name} {row[name]['vs_baseline']:.2f}x the baseline (1c)", flush=True)
        for name in ("baseline", "1dev", *names):
            row.pop(name + "_logits", None)
    rows = list(rows.values())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ttft_sp.json"), "w") as f:
            json.dump(dict(argv=sys.argv, jax=jax.__version__, devices=n_dev, rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
