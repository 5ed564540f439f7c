#!/usr/bin/env python3
"""Sequence-parallel attention core: 1 device against N devices (`dsv4/attention/sequence_parallel.py`).

    python3 scripts/bench_sp.py --lengths 128k,512k --budget 400                 # any GPU count (N = all devices)
    python3 scripts/bench_sp.py --lengths 128k --core jnp,pallas --trace $OUT/trace --out $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 scripts/bench_sp.py --smoke   # CPU: checks the script

One V4-Flash-shaped attention *core* per layer type (what `Attention.__call__` hands the core in a full-sequence
prefill, kv_aligned=True): B = 1 (``--batch``), H = 64 query heads (``--heads``), D = 512, one shared K=V head,
window 128, random sinks, bf16:
    sliding  window only;
    hca      + C = S / 128 compressed entries (query at p sees c < (p + 1) // 128);
    csa      + C = S / 4 entries and top-512 indices [B, S, 512], all valid and distinct: with n = (p + 1) // 4
             visible, n <= 512 lists 0..n-1, else slot j takes one pseudo-random entry of stratum [j·n/512, (j+1)·n/512)
             (the picks spread over the whole visible past, so over every earlier shard).
Inputs come from an elementwise integer hash of the element's coordinates (uniform, unit variance), so the same
tensor is produced on 1 device and sharded over N without a host copy or RNG temporaries, and the outputs can be
compared: "check" = relative L2 of the N-device output against the 1-device (``--core`` first entry) output on 768
sampled query rows (first / middle / last 256).

Per (length, layer type): t1 = the 1-device core (``--core jnp`` = `core_attention_jnp(query_chunk=512)`, the model's
XLA path; ``pallas`` = `core_attention_pallas`, the Pallas kernel; a list times both), tN = `core_attention_sp` on all
N devices of a 1-D "sp" mesh (for each ``--sp-core`` and ``--balance`` entry: none = contiguous, zigzag, or
zigzag-permuted = the inputs already in zigzag order, as the whole model keeps them), scaling efficiency
eff = t1 / (N · tN) (> 1 is possible against the jnp core: it computes HCA densely over all C entries, the SP core
skips each query chunk's causally invisible entry blocks). Exposed communication: the same SP call with every
ppermute replaced by a local array of the same shape (comm="local": same compute, wrong values), comm ≈ tN − t_local
(negative within noise = fully hidden). Timing: AOT compile (reported apart), 1 warm-up call, median of ``--reps``
(>= 3) synchronized calls.

Memory: at 512K with H = 64, D = 512, q is 32 GiB in bf16 and the output another 32 GiB on one device; the SP core
adds a float32 accumulator (4 bytes per output element) per shard. ``--heads auto`` (default) starts from 64 heads and
halves until the 1-device estimate fits ``--mem-gib`` (120); on OOM a case retries with half the heads (down to 8).
Both the 1-device and the N-device runs of a case use the same H, so eff is like for like; times are ALSO printed per
head (ms / H) so that cases run at different H can be compared: the core's work is linear in H.

Budget: ``--budget`` seconds in all (default 400); before each run the time it is predicted to need (compile + calls,
from the smaller lengths' measurements) is checked against what is left, and a run that does not fit is skipped and
reported (SKIP). Cases run all layer types at the smaller length first, so the budget trims the largest lengths.
``--trace DIR`` wraps one extra N-device call per case of the smallest length in `jax.profiler.trace(DIR/<case>)` and
prints per GPU how much of the communication kernels' time ran alongside compute kernels (scripts/trace_overlap.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from trace_overlap import profile  # noqa: E402

from dsv4.attention import CompressedKeys, core_attention_jnp, core_attention_pallas, core_attention_sp  # noqa: E402
from dsv4.sharding import make_mesh  # noqa: E402
from dsv4.sharding.sequence import zigzag_permute, zigzag_row  # noqa: E402

F32 = jnp.float32
LAYERS = ("sliding", "hca", "csa")
RATES = {"hca": 128, "csa": 4}


def parse_lengths(text: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip().lower()
        mult = 1024 if tok.endswith("k") else 1
        out.append(int(tok.rstrip("k")) * mult)
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="128k,512k")
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--core", default="jnp", help="1-device core(s): jnp, pallas or jnp,pallas")
    p.add_argument("--balance", default="none",
                   help="SP layouts, comma-separated: none (contiguous), zigzag (the core moves q, kv, positions and "
                        "the output in and out of zigzag order each call), zigzag-permuted (the inputs already in "
                        "zigzag order, as the model keeps them under SEQUENCE_PARALLEL_ZIGZAG)")
    p.add_argument("--sp-core", default="jnp", help="each shard's core: jnp, pallas or jnp,pallas")
    p.add_argument("--csa-mode", default="gather", choices=("gather", "ring"))
    p.add_argument("--devices", type=int, default=0, help="N (default: all devices)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", default="auto", help="query heads, or auto (64 halved until it fits --mem-gib)")
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--query-chunk", type=int, default=512)
    p.add_argument("--entry-block", type=int, default=512)
    p.add_argument("--mem-gib", type=float, default=120.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=400.0)
    p.add_argument("--no-local", action="store_true", help="skip the comm=local (exposed-communication) run")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--trace", default=None, help="jax.profiler trace dir (one SP call per case, smallest length)")
    p.add_argument("--out", default=None, help="directory for bench_sp.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): S 512,1024, H 4, D 32, W 16, top-8")
    a = p.parse_args()
    if a.smoke:
        a.lengths, a.heads, a.head_dim, a.window, a.topk = "512,1024", "4", 32, 16, 8
        a.query_chunk, a.entry_block, a.reps = 64, 8, 3
        RATES["hca"] = 16  # so that the tiny HCA case has several entries per shard
    a.reps = max(3, a.reps)
    return a


# ---------------------------------------------------------------------------------------------
# Inputs: an elementwise hash of the coordinates, identical on one device and sharded over N.
# ---------------------------------------------------------------------------------------------
def _mix(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(shape, seed: int):
    h = jnp.full(shape, seed * 0x9E3779B9 & 0xFFFFFFFF, jnp.uint32)
    for axis in range(len(shape)):
        h = _mix(h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(0x27D4EB2F + 2 * axis))
    return h


def _uniform(shape, seed: int):  # [0, 1)
    return (_hash(shape, seed) >> 8).astype(F32) * (1.0 / (1 << 24))


def _values(shape, seed: int, dtype):  # uniform with unit variance
    return ((_uniform(shape, seed) - 0.5) * math.sqrt(12.0)).astype(dtype)


def _topk(b, s, k, rate, count, seed):
    p = jnp.arange(s, dtype=jnp.int32)[None, :, None]
    j = jnp.arange(k, dtype=jnp.int32)[None, None, :]
    n = jnp.minimum((p + 1) // rate, count)
    lo, hi = (j * n) // k, ((j + 1) * n) // k
    u = _uniform((b, s, k), seed)
    pick = jnp.minimum(lo + jnp.floor(u * (hi - lo).astype(F32)).astype(jnp.int32), hi - 1)
    return jnp.where(n >= k, pick, jnp.where(j < n, j, -1)).astype(jnp.int32)


def make_inputs(layer, s, a, h, sharding_seq, sharding_rep):
    """(q, kv, pos, sinks, entries | None, topk | None), generated directly with the given shardings."""
    b, d = a.batch, a.head_dim

    def gen():
        q = _values((b, s, h, d), 1, jnp.bfloat16)
        kv = _values((b, s, d), 2, jnp.bfloat16)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        sinks = _values((h,), 3, F32)
        entries = topk = None
        if layer != "sliding":
            c = s // RATES[layer]
            entries = _values((b, c, d), 4, jnp.bfloat16)
            if layer == "csa":
                topk = _topk(b, s, min(a.topk, c), RATES[layer], c, 5)
        return q, kv, pos, sinks, entries, topk

    shard = (sharding_seq, sharding_seq, sharding_seq, sharding_rep,
             sharding_seq if layer != "sliding" else None, sharding_seq if layer == "csa" else None)  # fmt: skip
    return jax.jit(gen, out_shardings=shard)()


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------
def is_oom(exc: BaseException) -> bool:
    text = str(exc)
    return any(m in text for m in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory"))


def sample_rows(s: int) -> np.ndarray:
    rows = np.concatenate([np.arange(256), s // 2 - 128 + np.arange(256), s - 256 + np.arange(256)])
    return np.unique(np.clip(rows, 0, s - 1))


class Runner:
    def __init__(self, a):
        self.a = a
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.call_s: dict[tuple, tuple[int, float]] = {}  # (layer, kind) → (S, seconds per call) seen last
        self.compile_s: dict[tuple, float] = {}

    def left(self) -> float:
        return self.a.budget - (time.perf_counter() - self.t0)

    def predict(self, layer, kind, s) -> float:
        """Seconds a run needs: compile + (1 + reps) calls, scaled from the last smaller length."""
        if (layer, kind) not in self.call_s:
            return 0.0
        s0, t = self.call_s[(layer, kind)]
        power = 2 if layer == "hca" else 1  # HCA work grows with S·C = S²/128; window and top-k work with S
        return self.compile_s.get((layer, kind), 10.0) * 1.5 + (1 + self.a.reps) * t * (s / s0) ** power

    def time_fn(self, layer, kind, s, fn, *args):
        """→ (median seconds, compile seconds, output, compiled) or raises."""
        t = time.perf_counter()
        compiled = jax.jit(fn).trace(*args).lower().compile()
        comp = time.perf_counter() - t
        out = jax.block_until_ready(compiled(*args))  # warm-up
        times = []
        for _ in range(self.a.reps):
            del out
            t = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        self.call_s[(layer, kind)] = (s, med)
        self.compile_s[(layer, kind)] = comp
        return med, comp, out, compiled


def log(msg: str):
    print(msg, flush=True)


def run_case(r: Runner, layer: str, s: int, h: int, mesh, n: int) -> dict | None:
    """One (layer, S) at H heads: 1-device core(s), then SP per balance, then comm=local. Raises on OOM."""
    a = r.a
    dev0 = jax.devices()[0]
    one = jax.sharding.SingleDeviceSharding(dev0)
    kw = dict(sliding_window=a.window, scale=a.head_dim**-0.5, kv_aligned=True)
    row = {"layer": layer, "S": s, "H": h, "N": n, "t1": {}, "tN": {}, "t_local": {}, "comm": {}, "eff": {},
           "check": {}, "compile": {}}  # fmt: skip
    rows = sample_rows(s)
    want_rows = None

    def with_entries(core_fn):  # every array is an argument (a closed-over array would become a constant)
        def call(q, kv, pos, sinks, entries, topk):
            comp = None if entries is None else CompressedKeys(entries, RATES[layer], topk)
            return core_fn(q, kv, pos, pos, sinks, compressed=comp, **kw)

        return call

    # 1-device runs.
    for core in a.core.split(","):
        kind = f"1dev-{core}"
        need = r.predict(layer, kind, s)
        if need > r.left():
            log(f"SKIP {layer} S={s} {kind}: predicted {need:.0f} s > {r.left():.0f} s left")
            continue
        q, kv, pos, sinks, entries, topk = make_inputs(layer, s, a, h, one, one)
        fn_core = {"jnp": functools.partial(core_attention_jnp, query_chunk=a.query_chunk),
                   "pallas": core_attention_pallas}[core]  # fmt: skip
        t, comp, out, _ = r.time_fn(layer, kind, s, with_entries(fn_core), q, kv, pos, sinks, entries, topk)
        row["t1"][core], row["compile"][kind] = t, comp
        if want_rows is None and not a.no_check:
            want_rows = np.asarray(out[:, rows].astype(F32))
        del q, kv, pos, sinks, entries, topk, out
        log(f"  {layer:7s} S={s:>7} H={h:2d} 1 device {core:6s}: {t * 1e3:9.1f} ms ({t * 1e3 / h:7.2f} ms/head)"
            f"  compile {comp:.1f} s")  # fmt: skip

    if n < 2:
        return row
    seq, rep = NamedSharding(mesh, P(None, "sp")), NamedSharding(mesh, P())
    q, kv, pos, sinks, entries, topk = make_inputs(layer, s, a, h, seq, rep)
    permuted = None
    layouts = [(core, bal) for core in a.sp_core.split(",") for bal in a.balance.split(",")]
    variants = [(core, bal, "ppermute") for core, bal in layouts]
    if not a.no_local:
        variants += [(core, bal, "local") for core, bal in layouts]
    for core, bal, comm in variants:
        name = bal if a.sp_core == "jnp" else f"{core}-{bal}"
        kind = f"sp-{name}-{comm}"
        need = r.predict(layer, kind, s)
        if need > r.left():
            log(f"SKIP {layer} S={s} {kind}: predicted {need:.0f} s > {r.left():.0f} s left")
            continue
        args = (q, kv, pos, sinks, entries, topk)
        if bal == "zigzag-permuted":  # the model's layout: permuted once, outside the layer
            if permuted is None:  # q, kv, positions and top-k rows (the entries stay in sequence order)
                rows_in = [x for x in (q, kv, pos, topk) if x is not None]
                permuted = jax.jit(lambda *xs: [zigzag_permute(x, n) for x in xs], out_shardings=seq)(*rows_in)
            pq, pkv, ppos, *ptopk = permuted
            args = (pq, pkv, ppos, sinks, entries, ptopk[0] if ptopk else None)
        fn = functools.partial(core_attention_sp, mesh=mesh, axis="sp", csa_mode=a.csa_mode, comm=comm,
                               balance="contiguous" if bal == "none" else "zigzag",
                               inputs_permuted=bal == "zigzag-permuted", local_core=core,
                               entry_block=a.entry_block, query_chunk=a.query_chunk)  # fmt: skip
        t, comp, out, compiled = r.time_fn(layer, kind, s, with_entries(fn), *args)
        bal = name
        row["compile"][kind] = comp
        if comm == "local":
            row["t_local"][bal] = t
            if bal in row["tN"]:
                row["comm"][bal] = row["tN"][bal] - t
            log(f"  {layer:7s} S={s:>7} H={h:2d} {n} devices {bal:6s} comm=local: {t * 1e3:9.1f} ms"
                f"  → exposed comm ≈ {row['comm'].get(bal, float('nan')) * 1e3:.1f} ms")  # fmt: skip
        else:
            row["tN"][bal] = t
            if want_rows is not None:
                got_rows = [zigzag_row(int(p), s, n) for p in rows] if "permuted" in bal else rows
                got = np.asarray(out[:, got_rows].astype(F32))
                row["check"][bal] = float(np.linalg.norm(got - want_rows) / np.linalg.norm(want_rows))
            effs = {core: t1 / (n * t) for core, t1 in row["t1"].items()}
            row["eff"][bal] = effs
            eff_text = " ".join(f"{c}:{e:.2f}" for c, e in effs.items())
            log(f"  {layer:7s} S={s:>7} H={h:2d} {n} devices {bal:6s}: {t * 1e3:9.1f} ms ({t * 1e3 / h:7.2f} ms/head)"
                f"  eff {eff_text}  check {row['check'].get(bal, float('nan')):.1e}  compile {comp:.1f} s")  # fmt: skip
            if a.trace and s == min(parse_lengths(a.lengths)) and r.left() > 2 * t + 5:
                row.setdefault("trace", {})[bal] = profile(compiled, args, str(Path(a.trace) / f"{layer}-{s}-{bal}"),
                                                           indent="    ")
        del out, args
    del q, kv, pos, sinks, entries, topk, permuted
    return row


def estimate_gib(s, h, a) -> float:
    """1-device bytes: q + output chunks + final output (bf16), kv, CSA top-k and one chunk of gathered keys."""
    elems = a.batch * s * h * a.head_dim
    return (3 * 2 * elems + a.batch * s * (a.head_dim * 2 + a.topk * 4)) / 2**30 + 4


def main():
    a = parse_args()
    devices = jax.devices()
    n = a.devices or len(devices)
    mesh = make_mesh(n) if n >= 2 else None
    log(f"bench_sp: {n} × {devices[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"B={a.batch} D={a.head_dim} W={a.window} top-{a.topk}, bf16; 1-device core {a.core}; SP core {a.sp_core}, "
        f"balance {a.balance}, csa_mode {a.csa_mode}; budget {a.budget:.0f} s")  # fmt: skip
    if n < 2:
        log("only one device: the N-device columns are skipped (1-device times only)")
    log(
        "NOTE: H may be below 64 where 64 heads do not fit; 'ms/head' = time / H is the per-head-normalized number "
        "(the core's work is linear in H), eff = t1 / (N · tN) at the same H."
    )
    r = Runner(a)
    for s in parse_lengths(a.lengths):
        for layer in a.layers.split(","):
            if a.heads == "auto":
                h = 64
                while h > 8 and estimate_gib(s, h, a) > a.mem_gib:
                    h //= 2
            else:
                h = int(a.heads)
            while True:
                try:
                    row = run_case(r, layer, s, h, mesh, n)
                    if row:
                        r.rows.append(row)
                    break
                except Exception as exc:  # noqa: BLE001
                    if is_oom(exc) and h > 8:
                        log(f"OOM {layer} S={s} H={h}: retrying with H={h // 2} ({str(exc).splitlines()[0][:200]})")
                        h //= 2
                        continue
                    log(f"{'OOM' if is_oom(exc) else 'ERROR'} {layer} S={s} H={h}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")  # fmt: skip
                    r.rows.append({"layer": layer, "S": s, "H": h, "error": str(exc)[:2000]})
                    break

    log("\nsummary (ms; per head in brackets; eff = t1 / (N·tN); comm = tN − t(comm=local))")
    log(f"{'layer':8s} {'S':>7s} {'H':>3s} {'N':>2s}  {'1 device':>26s}  {'N devices':>34s}  {'eff':>16s} "
        f"{'comm ms':>8s}")  # fmt: skip
    for row in r.rows:
        if "error" in row:
            log(f"{row['layer']:8s} {row['S']:>7d} {row['H']:>3d}  error: {row['error'].splitlines()[0][:80]}")
            continue
        t1 = " ".join(f"{c}:{t * 1e3:.1f}[{t * 1e3 / row['H']:.2f}]" for c, t in row["t1"].items()) or "-"
        for bal, t in row["tN"].items() or [("-", None)]:
            tn = "-" if t is None else f"{bal}:{t * 1e3:.1f}[{t * 1e3 / row['H']:.2f}]"
            eff = " ".join(f"{c}:{e:.2f}" for c, e in row["eff"].get(bal, {}).items()) or "-"
            comm = row["comm"].get(bal)
            log(f"{row['layer']:8s} {row['S']:>7d} {row['H']:>3d} {row['N']:>2d}  {t1:>26s}  {tn:>34s}  {eff:>16s} "
                f"{'-' if comm is None else f'{comm * 1e3:8.1f}':>8s}")  # fmt: skip
    log(f"total {time.perf_counter() - r.t0:.0f} s of budget {a.budget:.0f} s")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_sp.json").write_text(json.dumps({"args": vars(a), "rows": r.rows}, indent=1))


if __name__ == "__main__":
    main()
