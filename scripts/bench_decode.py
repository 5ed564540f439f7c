"""Paged decode attention bandwidth, timed the way a model's decode step runs it: several calls (one per layer)
inside one jit, so the host dispatches once per step, not once per call.

    PYTHONPATH=. python3 scripts/bench_decode.py --out $OUT/dec        # one H200
    PYTHONPATH=. python3 scripts/bench_decode.py --smoke               # CPU, interpret mode, tiny shapes (~1 min)

What one item measures: `--calls` (default 8) `dsv4.pallas.decode.paged_decode_attention` calls in one jitted
function, each with its own q and its own block tables into shared page pools (so each call reads different
pages), for one (layer, context, batch, dtype, BlockSizes variant). Time per call = median step time / calls.
Shapes, bytes and layer kinds are scripts/bench_kernels.py's decode section's (V4-Flash: H = 64, D = 512,
window ring 128, 64 entries per page):

    hca     ring rows + every compressed entry (C = ctx / 128)
    csa     ring rows + 512 distinct random picks of C = ctx / 4 entries
    sweep   ring rows + every entry of the CSA pool (C = ctx / 4): the full-cache read

Bytes needed (`bench_kernels.decode_bytes`): q and output, the visible rows with their scales, top-k lists and
block-table entries; the kernel's split partials are not counted. TB/s = bytes needed / time; "% copy" against
the same run's copy bandwidth (`x ^ 1` over 4 GiB of uint32, read + write, timed the same way). Each compiled
item's first call is checked against `paged_decode_attention_reference` (relative L2) while that fits
(--check-max-bytes).

Variants (`--variants`, applied to the items named by `--variant-items`): `name:kv=64,s=3,w=8,h=32,sp=4,spx=2`
(block_kv, num_stages, num_warps, block_h, num_splits, over the kernel's default tiles for the item's rows:
`decode.default_block_sizes`; and spx = a multiple of the default split count), and
`impl=mgpu`: `dsv4.pallas.decode_mgpu.paged_decode_attention_mgpu` (the Mosaic GPU kernel; window and HCA layers,
bf16 pages, or fp8 ones with `--scales channel`; sp / spx set its split count, sl its num_slots, ab=0 turns its
auto_barriers off, pc its pv_chunks, fl its fp8_layout (wgmma, upcast2x, upcast4x), rc its consumers' register
count (the producer gets the rest of 504); stream=1, compute=1, noxchg=1, nosm=1, noconv=1, noscale=1, nomask=1 set
its debug flags stream_only, compute_only, skip_exchange, skip_softmax, skip_convert, skip_scale, skip_mask
(measurement forms: they fail the check); the Triton keys do not apply).
`--impl mgpu` runs the main sweep on it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# NOTE: bench_kernels sets the platform / memory-fraction environment (from --smoke) before importing jax.
from bench_kernels import (  # noqa: E402, I001
    GPU_SHAPES, SMOKE_SHAPES, decode_bytes, decode_entries, make_decode_pool, make_request_topk, parse_lengths, randn,
)  # fmt: skip

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dsv4.pallas.decode as dc  # noqa: E402
import dsv4.pallas.decode_mgpu as dcm  # noqa: E402
from dsv4.pallas._device import sm_count  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
GiB = 1 << 30
VARIANT_KEYS = {"kv": "block_kv", "s": "num_stages", "w": "num_warps", "h": "block_h", "sp": "num_splits"}
# kv64 at 4 stages would need 256 KiB of shared memory for bf16 keys (64 KiB a stage): over the H200's 227 KiB.
GPU_VARIANTS = "default;mgpu:impl=mgpu;mgpu-stream:impl=mgpu,stream=1;mgpu-compute:impl=mgpu,compute=1"
SMOKE_VARIANTS = "default;kv16:kv=16;spx2:spx=2"
IMPLS = ("triton", "mgpu")
EXTRA_KEYS = ("kv_scales", "compressed_scales", "kv_rope_pages", "compressed_rope_pages")
MGPU_KEYS = {"sl": "num_slots", "ab": "auto_barriers", "pc": "pv_chunks", "fl": "fp8_layout", "rc": "registers"}
DEBUG_KEYS = {"stream": "stream_only", "compute": "compute_only", "noxchg": "skip_exchange", "nosm": "skip_softmax",
              "noconv": "skip_convert", "noscale": "skip_scale", "nomask": "skip_mask"}  # fmt: skip


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
    p.add_argument("--contexts", default=None, help="context lengths (GPU default 32k,128k,512k)")
    p.add_argument("--batches", default=None, help="batch sizes (GPU default 1,32)")
    p.add_argument("--layers", default="hca,csa,sweep", help="layer kinds: hca, csa, sweep")
    p.add_argument("--dtypes", default="bf16,fp8", help="page dtypes: bf16, fp8 (whole e4m3 rows), fp8s (the cache's "
                   "split rows: e4m3 nope channels, bf16 RoPE channels; Triton only)")
    p.add_argument("--sweep-contexts", default=None, help="contexts of the sweep (default: the largest)")
    p.add_argument("--scales", choices=("tile", "channel"), default="tile", help="fp8 scale layout")
    p.add_argument("--calls", type=int, default=None, help="decode calls per jitted step (GPU default 8)")
    p.add_argument("--variants", default=None, help=f"BlockSizes variants (GPU default {GPU_VARIANTS!r})")
    p.add_argument("--variant-items", default="hca:512k:32,sweep:512k:1,sweep:512k:32",
                   help="layer:context:batch items the variants run on (both dtypes)")
    p.add_argument("--impl", choices=IMPLS, default="triton", help="kernel of the main sweep (variants name theirs)")
    p.add_argument("--per-call", action="store_true", help="also time the first item one call per dispatch")
    p.add_argument("--check-max-bytes", type=float, default=8e9, help="skip the reference check above this")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--budget", type=float, default=400.0, help="seconds; items past it are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for results.json")
    args = p.parse_args()
    args.contexts = parse_lengths(args.contexts or ("256,512" if args.smoke else "32k,128k,512k"))
    args.batches = parse_lengths(args.batches or ("2" if args.smoke else "1,32"))
    args.sweep_contexts = parse_lengths(args.sweep_contexts) if args.sweep_contexts else [max(args.contexts)]
    args.layers = [x.strip() for x in args.layers.split(",") if x.strip()]
    args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    args.calls = args.calls or (2 if args.smoke else 8)
    args.variants = args.variants or (SMOKE_VARIANTS if args.smoke else GPU_VARIANTS)
    items = []
    for text in filter(None, (t.strip() for t in args.variant_items.split(","))):
        layer, ctx, batch = text.split(":")
        items.append((layer, parse_lengths(ctx)[0], int(batch)))
    if args.smoke:
        items = [("hca", max(args.contexts), max(args.batches))]
    args.variant_items = items
    return args


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str = "default"
    fields: tuple = ()  # (BlockSizes field, value) pairs over the kernel's default tiles for the item's rows
    split_factor: int = 1  # num_splits = this × the default split count (when block_sizes.num_splits is None)
    impl: str = "triton"  # "mgpu": the Mosaic GPU kernel (dsv4/pallas/decode_mgpu.py)
    mgpu: tuple = ()  # (field, value) pairs of its MgpuDecodeConfig


def parse_variants(text: str) -> list[Variant]:
    """'name:kv=64,s=3,spx=2;...' → [Variant]."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, spec = item.partition(":")
        fields, extra = {}, {}
        for kv in filter(None, spec.split(",")):
            k, _, v = kv.partition("=")
            k = k.strip()
            if k == "spx":
                extra["split_factor"] = int(v)
            elif k in DEBUG_KEYS:  # the Mosaic kernel's measurement switches (MgpuDecodeConfig.debug)
                flags = dict(extra.get("mgpu", ())).get("debug", ()) + (DEBUG_KEYS[k],)
                extra["mgpu"] = tuple(kv for kv in extra.get("mgpu", ()) if kv[0] != "debug") + (("debug", flags),)
            elif k in MGPU_KEYS:
                if k == "rc":  # the consumers' count; the producer takes what is left of 504 (MgpuDecodeConfig)
                    value = (int(v), 504 - 2 * int(v))
                else:
                    value = bool(int(v)) if k == "ab" else v if k == "fl" else int(v)
                extra["mgpu"] = extra.get("mgpu", ()) + ((MGPU_KEYS[k], value),)
            elif k == "impl":
                if v not in IMPLS:
                    raise ValueError(f"variant {name!r}: impl={v!r} must be one of {IMPLS}")
                extra["impl"] = v
            else:
                fields[VARIANT_KEYS[k]] = int(v)
        dc.BlockSizes(**fields)  # validates now, not at the item
        out.append(Variant(name.strip(), tuple(fields.items()), **extra))
    return out


class Bench:
    def __init__(self, args):
        self.args = args
        self.sh = SMOKE_SHAPES if args.smoke else GPU_SHAPES
        self.interpret = jax.default_backend() != "gpu"
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.copy_tbps = None
        self.pools: dict[str, dict] = {}
        self.sm_count = sm_count()

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def log(self, msg: str):
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    def time_step(self, fn, arg_sets) -> dict:
        """Median seconds per jitted step over --reps bursts of back-to-back steps (one sync per burst)."""
        jax.block_until_ready(fn(*arg_sets[0]))  # warm-up
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*arg_sets[1 % len(arg_sets)]))
        one = time.perf_counter() - t0
        n = int(min(200, max(3, 0.05 / max(one, 1e-6))))
        times = []
        for r in range(self.args.reps):
            t0 = time.perf_counter()
            out = None
            for i in range(n):
                out = fn(*arg_sets[(r * n + i) % len(arg_sets)])
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / n)
        med = statistics.median(times)
        return dict(s=med, spread=(max(times) - min(times)) / med, steps=n)

    # ----- the copy ceiling -----
    def copy_ceiling(self):
        n = self.sh.copy_bytes // 4
        x = jax.random.bits(jax.random.key(self.args.seed + 7), (n,), jnp.uint32)
        fn = jax.jit(lambda x: x ^ jnp.uint32(1)).lower(x).compile()
        t = self.time_step(fn, [(x,)])
        self.copy_tbps = 2.0 * self.sh.copy_bytes / t["s"] / 1e12
        self.log(f"copy ceiling: {self.copy_tbps:.2f} TB/s ({2 * self.sh.copy_bytes / GiB:.0f} GiB moved per call, "
                 f"{t['s'] * 1e3:.2f} ms)")  # fmt: skip
        del x

    # ----- pools and per-call inputs -----
    def pool(self, dtype_name: str) -> dict:
        if dtype_name in self.pools:
            return self.pools[dtype_name]
        pool = make_decode_pool(self.sh, self.args.seed, dtype_name, self.scales)
        self.pools[dtype_name] = pool
        self.log(f"pool {dtype_name}: ring {pool['kv_pages'].shape[0]} pages, compressed "
                 f"{pool['compressed_pages'].shape[0]} pages of {self.sh.page_size} x {self.sh.head_dim} "
                 f"({sum(a.nbytes for a in pool.values()) / GiB:.2f} GiB)")  # fmt: skip
        return pool

    @property
    def scales(self) -> str:
        return self.args.scales if self.sh.head_dim % 64 == 0 else "channel"

    def step_inputs(self, pool, layer, ctx, batch, seed) -> tuple[dict, tuple]:
        """→ (static kwargs, per-step arrays): q [calls, B, H, D], ring tables [calls, B, r], compressed tables
        [calls, B, c], top-k [calls, B, K] or None. Every call's tables point at random pool pages."""
        sh, calls = self.sh, self.args.calls
        count, topk, _ = decode_entries(layer, ctx, sh)
        ps = sh.page_size
        ring_cols, ccols = -(-sh.window // ps), -(-count // ps)
        keys = jax.random.split(jax.random.key(seed), 4)
        n = calls * batch
        ring = jax.random.randint(keys[0], (calls, batch, ring_cols), 1, pool["kv_pages"].shape[0], jnp.int32)
        comp = jax.random.randint(keys[1], (calls, batch, ccols), 1, pool["compressed_pages"].shape[0], jnp.int32)
        picks = None
        if topk is not None:
            picks = make_request_topk(keys[2], n_requests=n, count=count, k=topk).reshape(calls, batch, topk)
        q = randn(keys[3], (calls, batch, sh.heads, sh.head_dim), BF16)
        lens = (jnp.full((batch,), ctx, jnp.int32), jnp.full((batch,), count, jnp.int32))
        return dict(count=count, topk=topk), (q, ring, comp, picks, *lens)

    def build(self, pool, block_sizes, impl="triton", mgpu=()):
        """The jitted step: --calls decode calls, each on its own q and tables (a Python loop: one kernel launch
        per call in the compiled program, as the model's layers would be)."""
        sh, interpret = self.sh, self.interpret
        static = dict(sliding_window=sh.window, scale=sh.head_dim**-0.5)
        if impl == "mgpu":
            config = dcm.MgpuDecodeConfig(num_splits=block_sizes.num_splits, **dict(mgpu))

            def one(q, kv_pages, ring, seq_lens, sinks, topk_indices, **kw):
                assert topk_indices is None
                return dcm.paged_decode_attention_mgpu(q, kv_pages, ring, seq_lens, sinks, config=config, **kw)
        else:
            def one(*args, **kw):
                return dc.paged_decode_attention(*args, block_sizes=block_sizes, interpret=interpret, impl="triton",
                                                 **kw)
        extra = {k: pool[k] for k in EXTRA_KEYS if k in pool}

        def step(kv_pages, compressed_pages, sinks, extra, q, ring, comp, picks, seq_lens, compressed_lens):
            outs = []
            for i in range(q.shape[0]):
                outs.append(one(q[i], kv_pages, ring[i], seq_lens, sinks, compressed_pages=compressed_pages,
                                compressed_block_tables=comp[i], compressed_lens=compressed_lens,
                                topk_indices=None if picks is None else picks[i], **extra, **static))  # fmt: skip
            return jnp.stack(outs)

        fixed = (pool["kv_pages"], pool["compressed_pages"], pool["sinks"], extra)
        return step, fixed, static

    def splits(self, layer, ctx, batch, bs: dc.BlockSizes, impl="triton") -> int:
        """The split count the kernel's heuristic picks for this item (mirrors paged_decode_attention and
        paged_decode_attention_mgpu)."""
        count, topk, _ = decode_entries(layer, ctx, self.sh)
        items = topk or -(-count // self.sh.page_size) * self.sh.page_size  # the kernel's max_items
        if impl == "mgpu":  # 64-row tiles; the window may start anywhere in its first tile
            tiles = -(-(self.sh.window + dcm.TILE - 1) // dcm.TILE) + -(-items // dcm.TILE)
            return dc.default_num_splits(batch * (self.sh.heads // dcm.HEADS_PER_CTA), tiles, self.sm_count)
        programs = batch * (self.sh.heads // min(bs.block_h, self.sh.heads))
        return dc.default_num_splits(programs, -(-self.sh.window // bs.block_kv) + -(-items // bs.block_kv),
                                     self.sm_count)  # fmt: skip

    def item(self, layer, ctx, batch, dtype_name, variant=Variant()):
        name, impl = variant.name, variant.impl
        base = dc.default_block_sizes(dtype_name == "fp8s", dtype_name == "fp8")
        bs = dataclasses.replace(base, **dict(variant.fields))
        if bs.num_splits is None and variant.split_factor != 1:
            bs = dataclasses.replace(bs, num_splits=variant.split_factor * self.splits(layer, ctx, batch, bs, impl))
        where = f"{layer} ctx={ctx} B={batch} {dtype_name} {name}"
        if impl == "mgpu" and (layer == "csa" or self.interpret or dtype_name == "fp8s"
                               or (dtype_name != "bf16" and self.scales != "channel")):  # fmt: skip
            self.log(f"SKIP {where}: the Mosaic kernel takes window / HCA layers with bf16 pages or whole fp8 rows "
                     f"with per-channel scales (--scales channel), on a GPU")  # fmt: skip
            return
        nbytes = decode_bytes(layer, ctx, batch, self.sh, dtype_name, self.scales)
        if self.left() < 5:
            self.log(f"SKIP {where}: budget spent")
            return
        try:
            pool = self.pool(dtype_name)
            meta, arrays = self.step_inputs(pool, layer, ctx, batch, self.args.seed * 1000 + ctx % 9973 + batch)
            step, fixed, static = self.build(pool, bs, impl, variant.mgpu)
            t0 = time.perf_counter()
            compiled = jax.jit(step).lower(*fixed, *arrays).compile()
            compile_s = time.perf_counter() - t0
            out = compiled(*fixed, *arrays)
            check = self.check(pool, arrays, static, out, nbytes)
            del out
            # a second input set with other tables and q, so consecutive steps do not reread the same pages
            _, arrays2 = self.step_inputs(pool, layer, ctx, batch, self.args.seed * 1000 + ctx % 9973 + batch + 1)
            t = self.time_step(compiled, [(*fixed, *arrays), (*fixed, *arrays2)])
        except Exception as exc:
            self.log(f"ERROR {where}: {type(exc).__name__}: {str(exc)[:800]}")
            traceback.print_exc(limit=3)
            return
        per_call = t["s"] / self.args.calls
        tbps = nbytes / per_call / 1e12
        splits = bs.num_splits or self.splits(layer, ctx, batch, bs, impl)
        row = dict(layer=layer, ctx=ctx, batch=batch, dtype=dtype_name, variant=name, impl=impl, block_kv=bs.block_kv,
                   num_stages=bs.num_stages, num_warps=bs.num_warps, block_h=bs.block_h, splits=splits,
                   us_per_call=per_call * 1e6, mbytes=nbytes / 1e6, tbps=tbps,
                   pct_copy=100 * tbps / self.copy_tbps if self.copy_tbps else None, spread=t["spread"],
                   steps=t["steps"], calls=self.args.calls, compile_s=compile_s, **check)  # fmt: skip
        self.rows.append(row)
        pct = f"{row['pct_copy']:5.1f}%" if row["pct_copy"] is not None else "   - "
        err = f"err {check['rel_l2']:.1e}" if "rel_l2" in check else "no check"
        self.log(f"{where:38s} splits {splits:3d}  {per_call * 1e6:9.1f} us  {nbytes / 1e6:8.3g} MB  "
                 f"{tbps:5.2f} TB/s {pct} copy  ({err}; NaN {check['nans']}; compile {compile_s:.1f}s; "
                 f"spread {t['spread']:.2f})")  # fmt: skip
        self.write()

    def check(self, pool, arrays, static, out, nbytes) -> dict:
        """First call of the step against the reference (relative L2 and NaN count)."""
        q, ring, comp, picks, seq_lens, clens = arrays
        got = out[0].astype(F32)
        result = dict(nans=int(jnp.isnan(got).sum()))
        b = q.shape[1]
        ref_bytes = b * (nbytes / b) * 4  # the reference materializes the gathered keys and the logits
        if ref_bytes > self.args.check_max_bytes:
            return result
        kw = {k: v for k, v in static.items() if k in ("sliding_window", "scale")}
        extra = {k: pool[k] for k in EXTRA_KEYS if k in pool}
        want = dc.paged_decode_attention_reference(
            q[0], pool["kv_pages"], ring[0], seq_lens, pool["sinks"], compressed_pages=pool["compressed_pages"],
            compressed_block_tables=comp[0], compressed_lens=clens, topk_indices=None if picks is None else picks[0],
            **extra, **kw).astype(F32)  # fmt: skip
        result["rel_l2"] = float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
        return result

    def per_call(self, layer, ctx, batch, dtype_name):
        """The same kernel dispatched one call at a time (what bench_kernels' decode section times)."""
        pool = self.pool(dtype_name)
        _, arrays = self.step_inputs(pool, layer, ctx, batch, self.args.seed + 99)
        q, ring, comp, picks, seq_lens, clens = arrays
        sh = self.sh
        extra = {k: pool[k] for k in EXTRA_KEYS if k in pool}

        def one(q, ring, comp, picks):
            return dc.paged_decode_attention(q, pool["kv_pages"], ring, seq_lens, pool["sinks"],
                                             compressed_pages=pool["compressed_pages"], compressed_block_tables=comp,
                                             compressed_lens=clens, topk_indices=picks, **extra,
                                             sliding_window=sh.window, scale=sh.head_dim**-0.5,
                                             interpret=self.interpret, impl="triton")  # fmt: skip

        fn = jax.jit(one)
        sets = [(q[i], ring[i], comp[i], None if picks is None else picks[i]) for i in range(q.shape[0])]
        t = self.time_step(fn, sets)
        nbytes = decode_bytes(layer, ctx, batch, sh, dtype_name, self.scales)
        self.log(f"per-call dispatch, {layer} ctx={ctx} B={batch} {dtype_name}: {t['s'] * 1e6:.1f} us, "
                 f"{nbytes / t['s'] / 1e12:.2f} TB/s")  # fmt: skip
        self.rows.append(dict(layer=layer, ctx=ctx, batch=batch, dtype=dtype_name, variant="per-call-dispatch",
                              us_per_call=t["s"] * 1e6, tbps=nbytes / t["s"] / 1e12))  # fmt: skip

    def write(self):
        if not self.args.out:
            return
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(argv=sys.argv, jax=jax.__version__, devices=[str(d) for d in jax.devices()],
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), copy_tbps=self.copy_tbps,
                    shapes=dataclasses.asdict(self.sh))  # fmt: skip
        (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=self.rows), indent=1, default=str))

    def table(self):
        print("\n| layer | ctx | B | dtype | variant | splits | µs / call | MB | TB/s | % copy | rel L2 |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in self.rows:
            if "splits" not in r:
                continue
            pct = f"{r['pct_copy']:.0f}%" if r.get("pct_copy") is not None else "-"
            err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else "-"
            print(f"| {r['layer']} | {r['ctx'] // 1024 if r['ctx'] >= 1024 else r['ctx']}"
                  f"{'K' if r['ctx'] >= 1024 else ''} | {r['batch']} | {r['dtype']} | {r['variant']} | {r['splits']} | "
                  f"{r['us_per_call']:.1f} | {r['mbytes']:.3g} | {r['tbps']:.2f} | {pct} | {err} |")  # fmt: skip


def main():
    args = parse_args()
    bench = Bench(args)
    bench.log(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({bench.sm_count} SMs), {len(jax.devices())} "
              f"device(s); calls per step {args.calls}; contexts {args.contexts}, batches {args.batches}, layers "
              f"{args.layers}, dtypes {args.dtypes}, fp8 scales {bench.scales}")  # fmt: skip
    bench.copy_ceiling()
    variants = parse_variants(args.variants)
    main_variant = Variant("default" if args.impl == "triton" else args.impl, impl=args.impl)
    for layer, ctx, batch in args.variant_items:  # the sweep first: it decides the defaults
        if layer in args.layers:
            for dtype_name in args.dtypes:
                for variant in variants:
                    bench.item(layer, ctx, batch, dtype_name, variant)
    if args.per_call and args.variant_items:
        layer, ctx, batch = args.variant_items[0]
        bench.per_call(layer, ctx, batch, args.dtypes[0])
    for layer in args.layers:
        contexts = args.sweep_contexts if layer == "sweep" else args.contexts
        for ctx in contexts:
            for batch in args.batches:
                for dtype_name in args.dtypes:
                    if (layer, ctx, batch) not in args.variant_items:
                        bench.item(layer, ctx, batch, dtype_name, main_variant)
    bench.table()
    bench.write()


if __name__ == "__main__":
    main()
