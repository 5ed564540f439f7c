#!/usr/bin/env python3
"""GPU benchmark for the Pallas attention kernel (issue "Pallas kernels I", attention part).

One call gives every number, each measured in the same run as its ceilings:

    python3 scripts/bench_kernels.py --out $OUT            # H200 (the default lengths 32K, 128K, 512K)
    python3 scripts/bench_kernels.py --smoke --out /tmp/b   # CPU, tiny shapes, Pallas interpreted (checks the script)

Sections (``--only ceilings,attention,cudnn,fp8``; all by default):

ceilings   bf16 matmul 8192³ and 16384³, fp8 e4m3 matmul (``jnp.dot(..., preferred_element_type=f32)``) at the
           same sizes, and device-to-device copy bandwidth (``x ^ 1`` over a 4 GiB uint32 buffer, bytes read +
           written). All on random data. The best bf16 figure is the "% mm" column's 100%.
attention  DeepSeek-V4-Flash prefill attention core, B=1, H=64 query heads, D=512, one shared KV head (K = V),
           bf16, sliding window 128, random sinks, three layer types:
             sliding  window only;
             hca      + compressed entries C = S // 128 (query at p sees c < (p + 1) // 128);
             csa      + compressed entries C = S // 4 and top-k indices [1, S, 512] (scheme below).
           For each S: the Pallas kernel ``v4_attention`` (compiled, interpret=False) at its default BlockSizes
           and alternative BlockSizes variants (``--variants``; the first is the baseline), and the model's XLA
           path ``core_attention_jnp`` (kv_aligned=True, ``--xla-query-chunks``). At the smallest S, before any
           Pallas timing, the baseline variant runs with its output buffer poisoned (NaN ``out_init``) and is
           compared with ``core_attention_jnp`` over the whole output (relative L2, NaN count). Every timed
           Pallas run is checked on its warm-up output: NaN count over the whole output, and relative L2 against
           the XLA output: the whole output for the baseline while q <= 8 GiB, else 768 sample rows (first,
           middle and last 256 query positions, kept from the XLA run; "xla-rows"), or, where the XLA path did
           not run, the baseline's sample rows ("default-rows"). Before each warm-up call a NaN buffer the size
           of the output is allocated and freed, so the allocator most likely hands the kernel NaN-filled memory
           (best effort; the poisoned check is the real one).
cudnn      ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`` at head dim 256 (its maximum),
           bf16, B=1: its best shape (16 heads up to 128K, 4 above) and, per V4 layer type, the head count whose
           causal FLOPs match that layer's useful FLOPs at the same S (where that is >= 1 head).
fp8        the Pallas kernel with kv and compressed entries in float8_e4m3fn with per-channel scales, against
           the bf16 kernel on the dequantized values (same function, so the relative L2 should be ~0), at one
           length (``--fp8-length``, default the middle of ``--lengths``).

FLOPs (useful work; 2 per multiply-add; Q·Kᵀ and P·V are 2·D each, so 4·D per (query, head, key)):
    V4:    FLOPs = 4 · B · H · D · Σ_p [ min(p + 1, W)                                  (window)
                                       + min((p + 1) // 128, C)          for HCA         (visible entries)
                                       + min((p + 1) // 4, C, 512)       for CSA         (valid top-k slots) ]
           over query positions p = 0 … S-1. Both the Pallas and the XLA rows use this count, so XLA's dense
           over-computation (all C HCA entries per chunk, 1151-row window bands) is not credited.
    cuDNN: FLOPs = 4 · H · D · S² / 2 (causal).
    TB/s column: the fewest bytes the op must move (q read, out written, kv + compressed + top-k read once)
           over its time; for the copy, bytes read + written.

CSA top-k scheme (cheap on device: one fused elementwise pass over [S, 512]): query p has
n = min((p + 1) // 4, C) visible entries. If n <= 512, slot j lists entry j for j < n, -1 after. Otherwise the
prefix [0, n) is cut into 512 integer strata [⌊j·n/512⌋, ⌊(j+1)·n/512⌋) (each >= 1 wide since n >= 512) and
slot j takes one uniformly random entry of stratum j. Strata are disjoint, so the 512 picks are distinct and all valid.
The picks spread over the whole visible prefix with no locality between neighbouring queries (fresh random draws
per query): a pessimistic L2 pattern. ``--topk-scheme shared`` draws one offset per slot for all queries, so
neighbours with the same n list the same entries (an optimistic, high-reuse pattern).

Timing: AOT compile (``.trace().lower().compile()``, reported separately), one or two warm-up calls, then the
median of individually synchronized calls (``jax.block_until_ready`` + ``time.perf_counter``): as many as fit
in ``--target-s`` seconds, clamped to 5–10 (up to 50 for calls under 1 ms; 3 for calls over 2 s). Small inputs
rotate between 2 input sets; attention q above 4 GiB (S > 64K) does not (it is far beyond the 60 MB L2 anyway).

Budget (``--budget``, 450 s by default, counted from the script's start; the device tool kills a command at
600 s): before each item the script predicts its cost, compile (the largest recent compile time of that kind;
20 s for a first Pallas compile) + (2 + reps) × predicted call time (scaled from the same layer's measurement at
a smaller S by the FLOP ratio, ×1.5 for an untried variant; XLA by its own dense-work ratio, quadratic for
HCA), and skips the item, with a "SKIP" line, if that does not fit in the time left. A single call predicted
over 60 s (Pallas) or 30 s (XLA, above the smallest S) is skipped outright. Reps shrink to fit the time left.
Order of work (a slow Triton compile, ~40 of them in all, must not starve the main numbers):
  1. ceilings;
  2. attention at the smallest S: XLA path, poisoned check, baseline (first) variant, per layer type;
  3. cudnn;  4. fp8 (baseline variant);
  5. attention at the larger S: XLA path + baseline variant;
  6. the other variants: all at the smallest S; at each larger S, first each layer's fastest variant at the
     smallest S, then the rest, in order of S (the budget drops the tail).
The larger lengths come after cudnn and fp8 also because a kernel fault there (an illegal address is a sticky
CUDA error: nothing after it runs on the GPU) then costs only what follows.
Expected total on one H200: about 6–7 minutes (docs/BENCHMARKS.md has the per-section estimate).

Memory (S = 512K: q and out are 32 GiB each in bf16): one q set, one output alive at a time (each timed result
is deleted before the next call), XLA outputs kept only as sample rows above 8 GiB, everything deleted between
layers. ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.92 here (JAX's own default, 0.75, is ~104 GiB).

Output: a log line per measurement, SKIP/ERROR lines (one failing item never stops the run), and a compact
final table. ``--out DIR`` also writes DIR/bench_kernels.json (all numbers, every run's times, errors with
tracebacks; rewritten after every section) and DIR/bench_kernels.log (the whole printed log).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

T_START = time.monotonic()
_SMOKE = "--smoke" in sys.argv
# NOTE: both must be set before jax is imported.
if _SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
GiB = 1 << 30
SECTIONS = ("ceilings", "attention", "cudnn", "fp8")
LAYERS = ("sliding", "hca", "csa")
# Interpret mode compiles a large HLO while loop; these options halve XLA:CPU's compile time (as in the tests).
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ---------------------------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Shapes:
    heads: int
    head_dim: int
    window: int
    hca_rate: int
    csa_rate: int
    topk: int
    cudnn_head_dim: int
    matmul_sizes: tuple[int, ...]
    copy_bytes: int


GPU_SHAPES = Shapes(heads=64, head_dim=512, window=128, hca_rate=128, csa_rate=4, topk=512, cudnn_head_dim=256,
                    matmul_sizes=(8192, 16384), copy_bytes=4 * GiB)  # fmt: skip
SMOKE_SHAPES = Shapes(heads=4, head_dim=32, window=16, hca_rate=16, csa_rate=4, topk=16, cudnn_head_dim=32,
                      matmul_sizes=(256, 512), copy_bytes=16 << 20)  # fmt: skip

# name:spec, spec = comma-separated kv=<block_kv = block_compressed = block_topk>, w=<num_warps>, s=<num_stages>,
# q=<block_q>, h=<block_h>. "default" is BlockSizes() (1 token × 64 heads, 64-row KV blocks, 8 warps, 2 stages).
GPU_VARIANTS = "default;kv32-s3:kv=32,s=3;kv64-s1:kv=64,s=1;kv128-s1:kv=128,s=1"
SMOKE_VARIANTS = "default;kv16:kv=16;kv32-s1:kv=32,s=1"


def parse_lengths(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return sorted(set(out))


def parse_variants(text: str, block_sizes_cls, on_error) -> list[tuple[str, object]]:
    """'name:kv=32,s=3;...' → [(name, BlockSizes)]; a bad entry is reported through on_error and dropped.

    The first entry is the baseline: the poisoned check and the fp8 section use it.
    """
    keys = {"kv": ("block_kv", "block_compressed", "block_topk"), "w": ("num_warps",), "s": ("num_stages",),
            "q": ("block_q",), "h": ("block_h",)}  # fmt: skip
    out = []
    for item in text.split(";"):
        item = item.strip()
        if not item:
            continue
        name, _, spec = item.partition(":")
        try:
            fields = {}
            for kv in filter(None, spec.split(",")):
                k, _, v = kv.partition("=")
                for field in keys[k.strip()]:
                    fields[field] = int(v)
            out.append((name.strip(), block_sizes_cls(**fields)))
        except Exception as exc:
            on_error(f"variant {item!r}", exc)
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, Pallas in interpret mode")
    p.add_argument("--out", type=Path, help="also write bench_kernels.json and bench_kernels.log here")
    p.add_argument("--lengths", default=None, help="sequence lengths, e.g. 32768,131072,524288 (or 32k,128k,512k)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--layers", default=",".join(LAYERS), help="comma-separated subset of sliding,hca,csa")
    p.add_argument("--variants", default=None, help=f"Pallas BlockSizes variants (GPU default: {GPU_VARIANTS!r})")
    p.add_argument("--xla-query-chunks", default=None, help="query_chunk values for core_attention_jnp (default 1024)")
    p.add_argument("--fp8-length", type=int, default=None, help="S for the fp8 section (default: middle length)")
    p.add_argument("--topk-scheme", choices=("random", "shared"), default="random")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (GPU default 450)")
    p.add_argument("--target-s", type=float, default=None, help="seconds of timed calls per item (default 1.5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    args.layers = [s.strip() for s in args.layers.split(",") if s.strip()]
    for s in args.only:
        if s not in SECTIONS:
            p.error(f"--only: unknown section {s!r}; known: {SECTIONS}")
    for s in args.layers:
        if s not in LAYERS:
            p.error(f"--layers: unknown layer type {s!r}; known: {LAYERS}")
    args.lengths = parse_lengths(args.lengths or ("160,300" if args.smoke else "32768,131072,524288"))
    args.variants = args.variants or (SMOKE_VARIANTS if args.smoke else GPU_VARIANTS)
    args.xla_query_chunks = [int(x) for x in (args.xla_query_chunks or ("64" if args.smoke else "1024")).split(",")]
    args.fp8_length = args.fp8_length or args.lengths[len(args.lengths) // 2]
    args.budget = args.budget or (1e9 if args.smoke else 450.0)
    args.target_s = args.target_s or (0.05 if args.smoke else 1.5)
    return args


# ---------------------------------------------------------------------------------------------
# Log, results, budget.
# ---------------------------------------------------------------------------------------------
class Recorder:
    """Printed log (mirrored to a file), result rows, checks, errors and skips; the JSON under --out."""

    def __init__(self, out_dir: Path | None):
        self.out_dir = out_dir
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.errors: list[dict] = []
        self.skips: list[dict] = []
        self.header: dict = {}
        self.config: dict = {}
        self._log = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(out_dir / "bench_kernels.log", "w", buffering=1)

    def log(self, msg: str = "", *, stamp: bool = True):
        line = f"[{time.monotonic() - T_START:6.1f}s] {msg}" if msg and stamp else msg
        print(line, flush=True)
        if self._log:
            self._log.write(line + "\n")

    def error(self, where: str, exc: BaseException):
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.log(f"ERROR {where}: {type(exc).__name__}: {first}")
        self.errors.append(dict(where=where, type=type(exc).__name__, message=str(exc)[:4000],
                                traceback=traceback.format_exc()[-6000:]))  # fmt: skip

    def skip(self, where: str, why: str):
        self.log(f"SKIP {where}: {why}")
        self.skips.append(dict(where=where, why=why))

    def add(self, **row):
        self.rows.append(row)
        return row

    def write_json(self):
        if self.out_dir is None:
            return
        data = dict(header=self.header, config=self.config, rows=self.rows, checks=self.checks, errors=self.errors,
                    skips=self.skips, elapsed_s=time.monotonic() - T_START)  # fmt: skip
        tmp = self.out_dir / "bench_kernels.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=_json_default))
        tmp.replace(self.out_dir / "bench_kernels.json")


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


class Budget:
    def __init__(self, total_s: float, rec: Recorder):
        self.deadline = T_START + total_s
        self.rec = rec
        self.compile_seen: dict[str, list[float]] = {}
        self.compile_guess = {"pallas": 20.0, "xla": 10.0, "cudnn": 8.0, "matmul": 5.0}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def compile_est(self, kind: str) -> float:
        seen = self.compile_seen.get(kind)
        return max(seen[-3:]) if seen else self.compile_guess[kind]

    def saw_compile(self, kind: str, seconds: float):
        if seconds < 0.05:  # a hit in jax's own compilation cache says nothing about the next compile
            return
        self.compile_seen.setdefault(kind, []).append(seconds)

    def fits(self, where: str, cost: float) -> bool:
        if cost > self.left():
            self.rec.skip(where, f"predicted {cost:.0f} s > {max(self.left(), 0):.0f} s left of the budget")
            return False
        return True


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------
def planned_reps(t_call: float, target_s: float) -> int:
    if t_call > 2.0:
        return 3
    hi = 50 if t_call < 1e-3 else 10
    return int(min(hi, max(5, target_s / max(t_call, 1e-6))))


def time_compiled(fn, arg_sets: list[dict], *, target_s: float, budget: Budget, first_out=None):
    """Warm-up, then the median of individually synchronized calls, rotating through arg_sets.

    first_out: optional callback(out) run on the first (warm-up) call's result, e.g. a correctness check.
    → dict(ms, times_ms, warm_s, reps).
    """
    t0 = time.perf_counter()
    out = fn(**arg_sets[0])
    jax.block_until_ready(out)
    warm_s = time.perf_counter() - t0
    if first_out is not None:
        first_out(out)
    del out
    t_est = warm_s
    if warm_s < 0.5:  # a second warm-up call: cheap, and a better estimate than the first
        t0 = time.perf_counter()
        out = fn(**arg_sets[1 % len(arg_sets)])
        jax.block_until_ready(out)
        t_est = time.perf_counter() - t0
        del out
    reps = planned_reps(t_est, target_s)
    reps = max(1, min(reps, int((budget.left() - 5.0) / max(t_est, 1e-6))))  # shrink to fit the time left
    times = []
    for i in range(reps):
        args = arg_sets[(i + 1) % len(arg_sets)]
        t0 = time.perf_counter()
        out = fn(**args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        del out
    med = statistics.median(times)
    return dict(ms=med * 1e3, times_ms=[t * 1e3 for t in times], warm_s=warm_s, reps=reps,
                spread=(max(times) - min(times)) / med if med > 0 else 0.0)  # fmt: skip


def aot_compile(fn, kwargs: dict, static: dict | None = None):
    """→ (compiled, seconds) for jax.jit-wrapped fn traced with kwargs (+ static kwargs)."""
    t0 = time.perf_counter()
    lowered = fn.trace(**kwargs, **(static or {})).lower()
    compiled = lowered.compile(compiler_options=FAST_CPU_COMPILE if _SMOKE else None)
    return compiled, time.perf_counter() - t0


def free():
    gc.collect()


def live_gib() -> float:
    try:
        return sum(a.nbytes for a in jax.live_arrays()) / GiB
    except Exception:
        return float("nan")


# ---------------------------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def randn(key, shape, dtype):
    """Standard normal `shape` in `dtype`, generated in row chunks of <= 2^28 elements (bounded temporaries)."""
    lead, rest = shape[0], shape[1:]
    per_row = math.prod(rest) if rest else 1
    chunks = 1
    while lead % (chunks * 2) == 0 and (lead // chunks) * per_row > (1 << 28):
        chunks *= 2
    if chunks == 1:
        return jax.random.normal(key, shape, dtype)
    keys = jax.random.split(key, chunks)
    out = jax.lax.map(lambda k: jax.random.normal(k, (lead // chunks, *rest), dtype), keys)
    return out.reshape(shape)


@functools.partial(jax.jit, static_argnames=("seq", "rate", "count", "k", "shared"))
def make_topk(key, *, seq, rate, count, k, shared):
    """[1, seq, k] int32 CSA picks, distinct and visible (c < (p + 1) // rate, c < count), -1 padded.

    n = visible count. n <= k: slots j < n list entry j. n > k: slot j takes a uniformly random entry of the
    integer stratum [j·n // k, (j + 1)·n // k), which is >= 1 wide and disjoint from the others.
    """
    p = jnp.arange(seq, dtype=jnp.int32)[:, None]  # [S, 1]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]  # [1, K]
    n = jnp.minimum((p + 1) // rate, count)  # [S, 1]
    lo = (j * n) // k
    hi = ((j + 1) * n) // k
    u = jax.random.uniform(key, (1 if shared else seq, k), F32)
    pick = jnp.minimum(lo + jnp.floor(u * (hi - lo).astype(F32)).astype(jnp.int32), hi - 1)
    idx = jnp.where(n >= k, pick, jnp.where(j < n, j, -1))
    return idx[None].astype(jnp.int32)


def useful_keys(layer: str, seq: int, sh: Shapes) -> int:
    """Σ over query positions of the keys each query attends (window + visible HCA / valid CSA entries)."""
    p1 = np.arange(1, seq + 1, dtype=np.int64)
    total = int(np.minimum(p1, sh.window).sum())
    if layer == "hca":
        total += int(np.minimum(p1 // sh.hca_rate, seq // sh.hca_rate).sum())
    elif layer == "csa":
        total += int(np.minimum(np.minimum(p1 // sh.csa_rate, seq // sh.csa_rate), sh.topk).sum())
    return total


def v4_flops(layer: str, seq: int, sh: Shapes) -> float:
    return 4.0 * sh.heads * sh.head_dim * useful_keys(layer, seq, sh)


def v4_min_bytes(layer: str, seq: int, sh: Shapes, kv_itemsize: int = 2) -> float:
    b = 2 * seq * sh.heads * sh.head_dim * 2 + seq * sh.head_dim * kv_itemsize + 2 * seq * 4  # q, out, kv, pos
    if layer == "hca":
        b += (seq // sh.hca_rate) * sh.head_dim * kv_itemsize
    elif layer == "csa":
        b += (seq // sh.csa_rate) * sh.head_dim * kv_itemsize + seq * sh.topk * 4
    return float(b)


def xla_work(layer: str, seq: int, sh: Shapes, chunk: int) -> float:
    """Keys per query the XLA path computes densely (for scaling its time between lengths)."""
    keys = min(chunk, seq) + sh.window - 1
    if layer == "hca":
        keys += seq // sh.hca_rate
    elif layer == "csa":
        keys += sh.topk
    return float(seq) * keys


@dataclasses.dataclass
class LayerInputs:
    layer: str
    seq: int
    q_sets: list  # one or two [1, S, H, D] arrays
    base: dict  # kv, q_pos, kv_pos, sinks, (compressed), (topk_indices)
    static: dict  # sliding_window, scale, (compress_rate)
    rate: int | None  # compress rate for CompressedKeys

    def arg_sets(self) -> list[dict]:
        return [dict(self.base, q=q) for q in self.q_sets]

    def q_bytes(self) -> int:
        return self.q_sets[0].nbytes


def build_inputs(layer: str, seq: int, sh: Shapes, seed: int, *, topk_scheme: str, max_sets: int = 2) -> LayerInputs:
    keys = jax.random.split(jax.random.key(seed * 1000 + seq % 997), 8)
    q_bytes = seq * sh.heads * sh.head_dim * 2
    n_sets = max_sets if q_bytes <= 4 * GiB else 1
    q_sets = [randn(keys[i], (seq, sh.heads, sh.head_dim), BF16)[None] for i in range(n_sets)]
    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    base = dict(kv=randn(keys[2], (seq, sh.head_dim), BF16)[None], q_pos=pos, kv_pos=pos,
                sinks=jax.random.normal(keys[3], (sh.heads,), F32))  # fmt: skip
    static = dict(sliding_window=sh.window, scale=sh.head_dim**-0.5)
    rate = None
    if layer == "hca":
        rate = sh.hca_rate
        count = seq // rate
        if count < 1:
            raise ValueError(f"S={seq} has no complete HCA entry (rate {rate})")
        base["compressed"] = randn(keys[4], (count, sh.head_dim), BF16)[None]
        static["compress_rate"] = rate
    elif layer == "csa":
        rate = sh.csa_rate
        count = seq // rate
        if count < 1:
            raise ValueError(f"S={seq} has no complete CSA entry (rate {rate})")
        base["compressed"] = randn(keys[4], (count, sh.head_dim), BF16)[None]
        base["topk_indices"] = make_topk(keys[5], seq=seq, rate=rate, count=count, k=sh.topk,
                                         shared=topk_scheme == "shared")  # fmt: skip
    jax.block_until_ready((q_sets, base))
    return LayerInputs(layer, seq, q_sets, base, static, rate)


@jax.jit
def rel_l2_and_nans(got, want):
    g, w = got.astype(F32), want.astype(F32)
    diff = jnp.where(jnp.isnan(g), 0.0, g - w)
    return jnp.sqrt(jnp.sum(diff * diff) / jnp.sum(w * w)), jnp.sum(jnp.isnan(g), dtype=F32)


@jax.jit
def nan_count(x):
    return jnp.sum(jnp.isnan(x), dtype=F32)  # NOTE: not int32: 2^34 output elements at S = 512K would wrap


def sample_rows(seq: int) -> np.ndarray:
    if seq <= 768:
        return np.arange(seq)
    return np.concatenate([np.arange(256), seq // 2 + np.arange(256), seq - 256 + np.arange(256)])


def take_rows(x, rows):
    return jnp.take(x, jnp.asarray(rows), axis=1)


# ---------------------------------------------------------------------------------------------
# The benchmark.
# ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        self.args = args
        self.sh = SMOKE_SHAPES if args.smoke else GPU_SHAPES
        self.rec = Recorder(args.out)
        self.budget = Budget(args.budget, self.rec)
        self.interpret = args.smoke
        self.mm_bf16 = None  # best bf16 matmul TFLOP/s of this run
        self.pa = None  # dsv4.pallas.attention
        self.core_jnp = None
        self.CompressedKeys = None
        self.variants = []
        self.compiled: dict[tuple, object] = {}
        # measured: (section, layer, seq, variant) → row
        self.measured: dict[tuple, dict] = {}
        self.samples: dict[tuple[str, int], dict] = {}  # (layer, seq) → sample rows of the XLA / default output

    # ----- setup -----
    def import_dsv4(self):
        try:
            from dsv4.pallas import attention as pa
        except Exception as exc:  # dsv4/__init__ pulls in the model and checkpoint deps; the kernel needs jax only
            self.rec.error("import dsv4 (retrying with a bare package stub)", exc)
            for name in [m for m in sys.modules if m == "dsv4" or m.startswith("dsv4.")]:
                del sys.modules[name]
            pkg = types.ModuleType("dsv4")
            pkg.__path__ = [str(ROOT / "dsv4")]
            sys.modules["dsv4"] = pkg
            from dsv4.pallas import attention as pa
        self.pa = pa
        self.variants = parse_variants(self.args.variants, pa.BlockSizes, self.rec.error)
        try:
            from dsv4.attention import CompressedKeys, core_attention_jnp

            self.core_jnp, self.CompressedKeys = core_attention_jnp, CompressedKeys
        except Exception as exc:
            self.rec.error("import dsv4.attention (the XLA path will be missing)", exc)

    def header(self):
        dev = jax.devices()[0]
        h = dict(device_kind=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
                 jax=jax.__version__, jaxlib=_jaxlib_version(),
                 python=platform.python_version(),
                 date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                 argv=" ".join(sys.argv), host=platform.node(),
                 mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                 xla_flags=os.environ.get("XLA_FLAGS"))  # fmt: skip
        try:
            h["platform_version"] = dev.client.platform_version
        except Exception:
            pass
        try:
            stats = dev.memory_stats() or {}
            h["bytes_limit_gib"] = round(stats.get("bytes_limit", 0) / GiB, 1)
        except Exception:
            pass
        if dev.platform == "gpu":
            try:  # read-only query of the card's state (clocks, power, temperature)
                q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
                r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=15)  # fmt: skip
                h["nvidia_smi"] = r.stdout.strip()
            except Exception as exc:
                h["nvidia_smi"] = f"unavailable: {exc}"
        self.rec.header = h
        self.rec.config = dict(shapes=dataclasses.asdict(self.sh), lengths=self.args.lengths, layers=self.args.layers,
                               variants=[(n, dataclasses.asdict(b)) for n, b in self.variants],
                               xla_query_chunks=self.args.xla_query_chunks, fp8_length=self.args.fp8_length,
                               topk_scheme=self.args.topk_scheme, budget_s=self.args.budget,
                               target_s=self.args.target_s, smoke=self.args.smoke)  # fmt: skip
        self.rec.log("=" * 100)
        self.rec.log(f"bench_kernels: {h['device_kind']} ({h['platform']}, {h['device_count']} device(s)); "
                     f"jax {h['jax']}, jaxlib {h['jaxlib']}, python {h['python']}")  # fmt: skip
        self.rec.log(f"date {h['date']}  host {h['host']}  platform_version {h.get('platform_version')}")
        self.rec.log(f"command: {h['argv']}")
        self.rec.log(f"mem_fraction {h['mem_fraction']}  bytes_limit {h.get('bytes_limit_gib')} GiB  "
                     f"XLA_FLAGS {h['xla_flags']}")  # fmt: skip
        if "nvidia_smi" in h:
            self.rec.log(f"nvidia-smi: {h['nvidia_smi']}")
        sh = self.sh
        self.rec.log(f"shapes: H={sh.heads} D={sh.head_dim} W={sh.window} HCA rate {sh.hca_rate} CSA rate "
                     f"{sh.csa_rate} top-k {sh.topk} ({self.args.topk_scheme}); lengths {self.args.lengths}; "
                     f"layers {self.args.layers}; "
                     f"sections {self.args.only}; budget {self.args.budget:.0f} s")  # fmt: skip
        self.rec.log(f"variants: " + "; ".join(f"{n}={_bs_str(b)}" for n, b in self.variants))
        self.rec.log("=" * 100)

    # ----- helpers -----
    def pct(self, tflops):
        if tflops is None or not self.mm_bf16:
            return None
        return 100.0 * tflops / self.mm_bf16

    def report(self, section, layer, seq, variant, timing, flops=None, nbytes=None, note="", **extra):
        ms = timing["ms"]
        tflops = flops / (ms * 1e-3) / 1e12 if flops else None
        tbps = nbytes / (ms * 1e-3) / 1e12 if nbytes else None
        row = self.rec.add(section=section, layer=layer, seq=seq, variant=variant, ms=ms, tflops=tflops,
                           pct_mm=self.pct(tflops), tbps=tbps, note=note, flops=flops, bytes=nbytes,
                           reps=timing["reps"], spread=timing["spread"], times_ms=timing["times_ms"],
                           warm_s=timing["warm_s"], **extra)  # fmt: skip
        self.measured[(section, layer, seq, variant)] = row
        parts = [f"{section:<9} {layer:<9} S={seq:<7} {variant:<16} {ms:10.3f} ms"]
        if tflops is not None:
            pct = self.pct(tflops)
            parts.append(f"{tflops:7.1f} TF/s" + (f" ({pct:4.0f}% mm)" if pct is not None else ""))
        if tbps is not None:
            parts.append(f"{tbps:5.2f} TB/s")
        parts.append(f"[{timing['reps']} runs, spread {100 * timing['spread']:.1f}%"
                     + (f", compile {extra['compile_s']:.1f} s" if "compile_s" in extra else "") + "]")  # fmt: skip
        if note:
            parts.append(note)
        self.rec.log("  ".join(parts))
        self.rec.write_json()
        return row

    def predict_pallas(self, layer, seq, variant) -> float:
        """Predicted seconds per call of the Pallas kernel."""
        flops = v4_flops(layer, seq, self.sh)
        same_len = [r for (s, lay, n, v), r in self.measured.items() if s == "v4-pallas" and lay == layer and n == seq]
        if same_len:
            return 1.5 * max(r["ms"] for r in same_len) * 1e-3
        smaller = [(n, v, r) for (s, lay, n, v), r in self.measured.items() if s == "v4-pallas" and lay == layer]
        exact = [(n, r) for n, v, r in smaller if v == variant]
        if exact:
            n, r = max(exact, key=lambda x: x[0])
            return r["ms"] * 1e-3 * flops / v4_flops(layer, n, self.sh)
        if smaller:
            n, _, r = max(smaller, key=lambda x: (x[0], -x[2]["ms"]))
            return 1.5 * r["ms"] * 1e-3 * flops / v4_flops(layer, n, self.sh)
        return flops / (1e12 if self.args.smoke else 30e12)

    def item_cost(self, kind, t_call) -> float:
        return self.budget.compile_est(kind) + t_call * (2 + planned_reps(t_call, self.args.target_s))

    # ----- section 1: ceilings -----
    def ceilings(self):
        self.rec.log("--- ceilings (same run) ---")
        key = jax.random.key(self.args.seed + 7)
        best = None
        for dtype_name in ("bf16", "fp8"):
            for n in self.sh.matmul_sizes:
                where = f"ceilings {dtype_name} matmul {n}^3"
                if not self.budget.fits(where, self.item_cost("matmul", 2 * n**3 / 300e12)):
                    continue
                try:
                    k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, n), 4)
                    sets = [dict(a=randn(k1, (n, n), BF16), b=randn(k2, (n, n), BF16))]
                    if 2 * n * n * 2 * 2 <= 2 * GiB:
                        sets.append(dict(a=randn(k3, (n, n), BF16), b=randn(k4, (n, n), BF16)))
                    if dtype_name == "fp8":
                        sets = [{k: v.astype(FP8) for k, v in s.items()} for s in sets]
                        fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32))
                    else:
                        fn = jax.jit(lambda a, b: a @ b)
                    compiled, cs = aot_compile(fn, sets[0])
                    self.budget.saw_compile("matmul", cs)
                    t = time_compiled(compiled, sets, target_s=self.args.target_s, budget=self.budget)
                    flops = 2.0 * n**3
                    tf = flops / (t["ms"] * 1e-3) / 1e12
                    if dtype_name == "bf16" and (best is None or tf > best):
                        best = tf
                        self.mm_bf16 = best
                    self.report("ceiling", f"mm-{dtype_name}", n, f"{n}^3", t, flops=flops, compile_s=cs)
                    del sets, compiled
                except Exception as exc:
                    self.rec.error(where, exc)
                free()
        where = "ceilings copy"
        try:
            n = self.sh.copy_bytes // 4
            side = 1 << 15 if n == (1 << 30) else n
            x = jax.random.bits(jax.random.fold_in(key, 99), (side, n // side) if side != n else (n,), jnp.uint32)
            compiled, cs = aot_compile(jax.jit(lambda x: x ^ jnp.uint32(1)), dict(x=x))
            t = time_compiled(compiled, [dict(x=x)], target_s=self.args.target_s, budget=self.budget)
            self.report("ceiling", "copy", self.sh.copy_bytes // (1 << 20), "x^1 u32 MiB", t,
                        nbytes=2.0 * self.sh.copy_bytes, compile_s=cs)  # fmt: skip
            del x, compiled
        except Exception as exc:
            self.rec.error(where, exc)
        free()
        self.rec.write_json()

    # ----- section 2: V4 attention -----
    def pallas_compiled(self, inputs: LayerInputs, variant: str, bs, *, poison: bool = False, tag: str = ""):
        key = (inputs.layer, inputs.seq, variant, poison, tag)
        if key in self.compiled:
            return self.compiled[key], 0.0
        kw = dict(inputs.arg_sets()[0])
        if poison:
            kw["out_init"] = jax.ShapeDtypeStruct(kw["q"].shape, kw["q"].dtype)
        compiled, cs = aot_compile(self.pa.v4_attention, kw, dict(inputs.static, block_sizes=bs,
                                   interpret=self.interpret))  # fmt: skip
        self.budget.saw_compile("pallas", cs)
        self.compiled[key] = compiled
        return compiled, cs

    def xla_compiled(self, inputs: LayerInputs, chunk: int):
        key = ("xla", inputs.layer, inputs.seq, chunk)
        if key in self.compiled:
            return self.compiled[key], 0.0
        ck_cls, core = self.CompressedKeys, self.core_jnp
        rate = inputs.rate

        def xla_fn(q, kv, q_pos, kv_pos, sinks, compressed=None, topk_indices=None):
            ck = None if compressed is None else ck_cls(compressed, rate, topk_indices)
            return core(q, kv, q_pos, kv_pos, sinks, sliding_window=inputs.static["sliding_window"],
                        scale=inputs.static["scale"], compressed=ck, kv_aligned=True, query_chunk=chunk)  # fmt: skip

        compiled, cs = aot_compile(jax.jit(xla_fn), inputs.arg_sets()[0])
        self.budget.saw_compile("xla", cs)
        self.compiled[key] = compiled
        return compiled, cs

    def run_xla(self, inputs: LayerInputs, chunk: int, *, keep_ref: bool):
        """Times core_attention_jnp; → reference output (full or sample rows) or None."""
        layer, seq = inputs.layer, inputs.seq
        where = f"v4-xla {layer} S={seq} qc={chunk}"
        if self.core_jnp is None:
            self.rec.skip(where, "dsv4.attention did not import")
            return None
        smaller = [(n, r) for (s, lay, n, v), r in self.measured.items()
                   if s == "v4-xla" and lay == layer and v == f"xla-qc{chunk}"]  # fmt: skip
        if smaller:
            n, r = max(smaller, key=lambda x: x[0])
            t_pred = r["ms"] * 1e-3 * xla_work(layer, seq, self.sh, chunk) / xla_work(layer, n, self.sh, chunk)
        else:
            t_pred = xla_work(layer, seq, self.sh, chunk) * 4 * self.sh.heads * self.sh.head_dim / (
                1e12 if self.args.smoke else 100e12)
        if seq != self.args.lengths[0] and t_pred > 30:
            self.rec.skip(where, f"one call predicted {t_pred:.0f} s (> 30 s)")
            return None
        if not self.budget.fits(where, self.item_cost("xla", t_pred)):
            return None
        ref = {}
        full = inputs.q_bytes() <= 8 * GiB

        def keep(out):
            if keep_ref:
                ref["out"] = out if full else take_rows(out, sample_rows(seq))
                ref["full"] = full

        try:
            compiled, cs = self.xla_compiled(inputs, chunk)
            t = time_compiled(compiled, inputs.arg_sets(), target_s=self.args.target_s, budget=self.budget,
                              first_out=keep)  # fmt: skip
            self.report("v4-xla", layer, seq, f"xla-qc{chunk}", t, flops=v4_flops(layer, seq, self.sh),
                        nbytes=v4_min_bytes(layer, seq, self.sh), compile_s=cs)  # fmt: skip
        except Exception as exc:
            self.rec.error(where, exc)
            ref.clear()
        free()
        return ref or None

    def poisoned_check(self, inputs: LayerInputs, ref: dict):
        """Default variant, NaN-poisoned out_init, against core_attention_jnp."""
        layer, seq = inputs.layer, inputs.seq
        where = f"check v4-pallas {layer} S={seq} default (poisoned)"
        try:
            name, bs = self.variants[0]
            compiled, cs = self.pallas_compiled(inputs, name, bs, poison=True)
            kw = dict(inputs.arg_sets()[0])
            kw["out_init"] = jnp.full(kw["q"].shape, jnp.nan, kw["q"].dtype)
            out = compiled(**kw)
            del kw["out_init"]
            got = out if ref["full"] else take_rows(out, sample_rows(seq))
            del out
            err, nans = (float(x) for x in rel_l2_and_nans(got, ref["out"]))
            ok = nans == 0 and err < 2e-2
            self.rec.checks.append(dict(layer=layer, seq=seq, variant=name, poisoned=True, nans=int(nans), rel_l2=err,
                                        against="core_attention_jnp" + ("" if ref["full"] else " (sample rows)"),
                                        ok=ok, compile_s=cs))  # fmt: skip
            self.rec.log(f"CHECK {layer:<8} S={seq} {name}: poisoned out_init, NaN left {int(nans)}, rel L2 vs "
                         f"core_attention_jnp {err:.2e} ({'full output' if ref['full'] else 'sample rows'}) "
                         f"-> {'OK' if ok else 'FAIL'}")  # fmt: skip
            del got
        except Exception as exc:
            self.rec.error(where, exc)
        self.compiled.pop((layer, seq, self.variants[0][0], True, ""), None)
        free()

    def run_pallas(self, inputs: LayerInputs, name: str, bs, ref: dict | None, default_sample: dict,
                   *, section="v4-pallas", tag="", label=None, kv_itemsize=2) -> dict | None:  # fmt: skip
        """Times one Pallas variant; checks its warm-up output against ref (XLA) or default_sample["out"].

        The default variant (untagged) stores its sample rows in default_sample when none is there yet.
        """
        layer, seq = inputs.layer, inputs.seq
        label = label or name
        where = f"{section} {layer} S={seq} {label}"
        t_pred = self.predict_pallas(layer, seq, name)
        if t_pred > 60:
            self.rec.skip(where, f"one call predicted {t_pred:.0f} s (> 60 s)")
            return None
        if not self.budget.fits(where, self.item_cost("pallas", t_pred)):
            return None
        check = {}

        def on_first(out):
            check["nans"] = int(nan_count(out))
            rows = sample_rows(seq)
            sample = take_rows(out, rows)
            if ref is not None:
                got = out if ref["full"] else sample
                check["rel_l2"] = float(rel_l2_and_nans(got, ref["out"])[0])
                check["against"] = ref.get("name", "xla") + ("" if ref["full"] else "-rows")
            elif "out" in default_sample:
                check["rel_l2"] = float(rel_l2_and_nans(sample, default_sample["out"])[0])
                check["against"] = "default-rows"
            if name == self.variants[0][0] and not tag and "out" not in default_sample:
                default_sample["out"] = sample

        try:
            compiled, cs = self.pallas_compiled(inputs, name, bs, tag=tag)
            out_shape = inputs.q_sets[0].shape
            pre = jnp.full(out_shape, jnp.nan, BF16)  # leaves NaNs in the block the allocator hands out next
            pre.block_until_ready()
            del pre
            t = time_compiled(compiled, inputs.arg_sets(), target_s=self.args.target_s, budget=self.budget,
                              first_out=on_first)  # fmt: skip
            note = _check_note(check)
            row = self.report(section, layer, seq, label, t, flops=v4_flops(layer, seq, self.sh),
                              nbytes=v4_min_bytes(layer, seq, self.sh, kv_itemsize), note=note, compile_s=cs,
                              check=check, block_sizes=dataclasses.asdict(bs))  # fmt: skip
            if check.get("nans"):
                self.rec.log(f"WARNING {where}: {check['nans']} NaN in the output")
            return row
        except Exception as exc:
            self.rec.error(where, exc)
            return None
        finally:
            free()

    def best_variant(self, layer, seq) -> str | None:
        rows = [(r["ms"], v) for (s, lay, n, v), r in self.measured.items()
                if s == "v4-pallas" and lay == layer and n == seq]  # fmt: skip
        return min(rows)[1] if rows else None

    def attention_length(self, layer: str, seq: int, variant_names: list[str], *, with_xla: bool, check: bool):
        """One (layer, S): build inputs, optionally time the XLA path and run the poisoned check, then time the
        listed Pallas variants. Inputs are regenerated from the same seed on every visit, so sample rows stored
        on the first visit (XLA output, default variant's output) check the variants timed on later visits."""
        where = f"v4 attention {layer} S={seq}"
        if self.budget.left() < 5:
            self.rec.skip(where + " " + ",".join(variant_names), "budget spent")
            return
        self.rec.log(f"--- {where}: {'xla, ' if with_xla else ''}{'check, ' if check else ''}"
                     f"{', '.join(variant_names)} (live arrays {live_gib():.1f} GiB) ---")  # fmt: skip
        try:
            inputs = build_inputs(layer, seq, self.sh, self.args.seed, topk_scheme=self.args.topk_scheme)
        except Exception as exc:
            self.rec.error(f"inputs {layer} S={seq}", exc)
            free()
            return
        try:
            ref = None
            if with_xla:
                for chunk in self.args.xla_query_chunks:
                    r = self.run_xla(inputs, chunk, keep_ref=ref is None)
                    ref = ref or r
            if check and ref is not None:
                self.poisoned_check(inputs, ref)
            elif check:
                self.rec.skip(f"check {layer} S={seq}", "no core_attention_jnp output to compare with")
            stored = self.samples.setdefault((layer, seq), {})
            if ref is None and "xla" in stored:
                ref = {"out": stored["xla"], "full": False}
            default_sample = {"out": stored["default"]} if "default" in stored else {}
            for name in variant_names:
                self.run_pallas(inputs, name, dict(self.variants)[name], ref, default_sample)
            if ref is not None and "xla" not in stored:
                stored["xla"] = take_rows(ref["out"], sample_rows(seq)) if ref["full"] else ref["out"]
            if "out" in default_sample:
                stored.setdefault("default", default_sample["out"])
            del ref, default_sample
        finally:
            del inputs
            free()

    def attention_baseline(self, lengths):
        """XLA path + the first (baseline) variant at each length; the poisoned check at the smallest."""
        base = self.variants[0][0]
        for seq in lengths:
            for layer in self.args.layers:
                self.attention_length(layer, seq, [base], with_xla=True, check=seq == self.args.lengths[0])
            self.rec.write_json()

    def attention_variants(self):
        """The other variants: all at the smallest S; then, at each larger S, each layer's fastest variant at the
        smallest S; then the rest, in order of S (the budget drops the tail)."""
        names = [n for n, _ in self.variants[1:]]
        if not names:
            return
        first, larger = self.args.lengths[0], self.args.lengths[1:]
        self.rec.log("--- v4 attention: BlockSizes variants ---")
        for layer in self.args.layers:
            self.attention_length(layer, first, names, with_xla=False, check=False)
        self.rec.write_json()
        best = {layer: self.best_variant(layer, first) for layer in self.args.layers}
        for seq in larger:
            for layer in self.args.layers:
                if best[layer] in names:
                    self.attention_length(layer, seq, [best[layer]], with_xla=False, check=False)
            self.rec.write_json()
        for seq in larger:
            for layer in self.args.layers:
                rest = [n for n in names if n != best[layer]]
                if rest:
                    self.attention_length(layer, seq, rest, with_xla=False, check=False)
            self.rec.write_json()

    # ----- section 4: cuDNN -----
    def cudnn(self):
        self.rec.log("--- cuDNN causal attention (comparator) ---")
        impl = "xla" if self.args.smoke else "cudnn"  # CPU has no cuDNN: the smoke run exercises the code path
        d = self.sh.cudnn_head_dim
        per_head = lambda seq: 4.0 * d * seq * seq / 2  # noqa: E731  # causal FLOPs of one head
        plan: dict[tuple[int, int], list[str]] = {}
        for seq in self.args.lengths:
            best = 16 if seq <= 131072 else 4
            if self.args.smoke:
                best = 2
            plan.setdefault((seq, best), []).append("best")
            for layer in self.args.layers:
                n = round(v4_flops(layer, seq, self.sh) / per_head(seq))
                if n >= 1:
                    plan.setdefault((seq, n), []).append(f"={layer}")
                else:
                    self.rec.log(f"cudnn: no head count matches {layer} at S={seq} "
                                 f"({v4_flops(layer, seq, self.sh) / per_head(seq):.2f} heads' worth)")  # fmt: skip
        for (seq, heads), tags in sorted(plan.items()):
            where = f"cudnn S={seq} H={heads}"
            flops = heads * per_head(seq)
            if not self.budget.fits(where, self.item_cost("cudnn", flops / (2e12 if self.args.smoke else 400e12))):
                continue
            try:
                keys = jax.random.split(jax.random.key(self.args.seed + seq + heads), 6)
                shape = (seq, heads, d)
                n_sets = 2 if 3 * seq * heads * d * 2 <= GiB else 1
                sets = [dict(q=randn(keys[3 * i], shape, BF16)[None], k=randn(keys[3 * i + 1], shape, BF16)[None],
                             v=randn(keys[3 * i + 2], shape, BF16)[None]) for i in range(n_sets)]  # fmt: skip
                fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl))
                compiled, cs = aot_compile(fn, sets[0])
                self.budget.saw_compile("cudnn", cs)
                t = time_compiled(compiled, sets, target_s=self.args.target_s, budget=self.budget)
                matched = [t_[1:] for t_ in tags if t_ != "best"]
                note = " ".join((["best shape"] if "best" in tags else [])
                                + (["FLOPs of " + ",".join(matched)] if matched else []))
                self.report("cudnn", f"d{d}-H{heads}", seq, impl, t, flops=flops, note=note.strip(), compile_s=cs)
                del sets, compiled
            except Exception as exc:
                self.rec.error(where, exc)
            free()
        self.rec.write_json()

    # ----- section 5: FP8 KV -----
    def fp8(self):
        seq = self.args.fp8_length
        self.rec.log(f"--- FP8 KV (per-channel scales) vs bf16, S={seq} ---")
        name, bs = self.variants[0]
        for layer in self.args.layers:
            try:
                inputs = build_inputs(layer, seq, self.sh, self.args.seed + 1, topk_scheme=self.args.topk_scheme,
                                      max_sets=1)  # fmt: skip
            except Exception as exc:
                self.rec.error(f"fp8 inputs {layer} S={seq}", exc)
                continue
            try:
                quant = {}
                for field in ("kv", "compressed"):
                    if field in inputs.base:
                        x = inputs.base[field].astype(F32)
                        scales = jnp.maximum(jnp.max(jnp.abs(x), axis=(0, 1)) / 448.0, 1e-12).astype(F32)  # [D]
                        x8 = (x / scales).astype(FP8)
                        inputs.base[field] = (x8.astype(F32) * scales).astype(BF16)  # what the fp8 kernel computes with
                        quant[field] = (x8, scales)
                        del x
                bf16_out = {}
                row = self.run_pallas(inputs, name, bs, None, {}, section="v4-fp8", tag="bf16-deq",
                                      label=f"bf16deq-{name}")  # fmt: skip
                if row is not None:
                    # keep the bf16 output for the comparison: one extra call (same compiled kernel)
                    bf16_out["out"] = self.compiled[(layer, seq, name, False, "bf16-deq")](**inputs.arg_sets()[0])
                fp8_inputs = dataclasses.replace(inputs, base=dict(inputs.base))
                fp8_inputs.base["kv"], fp8_inputs.base["kv_scales"] = quant["kv"]
                if "compressed" in quant:
                    fp8_inputs.base["compressed"], fp8_inputs.base["compressed_scales"] = quant["compressed"]
                ref = None
                if "out" in bf16_out:
                    ref = {"out": bf16_out["out"], "full": True, "name": "bf16deq"}
                row8 = self.run_pallas(fp8_inputs, name, bs, ref, {}, section="v4-fp8", tag="fp8",
                                       label=f"fp8ch-{name}", kv_itemsize=1)  # fmt: skip
                if row8 is not None:
                    if row is not None:
                        row8["note"] = (row8["note"] + f" speed {row['ms'] / row8['ms']:.2f}x of bf16").strip()
                    self.rec.log(f"fp8 {layer} S={seq}: {row8['note']} (err: fp8 kernel vs bf16 kernel on the "
                                 "dequantized values)")  # fmt: skip
                del bf16_out, ref, fp8_inputs, quant
            except Exception as exc:
                self.rec.error(f"fp8 {layer} S={seq}", exc)
            finally:
                del inputs
                for k in [k for k in self.compiled if len(k) == 5 and k[4] in ("fp8", "bf16-deq")]:
                    del self.compiled[k]
                free()
        self.rec.write_json()

    # ----- final table -----
    def table(self):
        rec = self.rec
        log = functools.partial(rec.log, stamp=False)  # the table is what the device tool's 12,000-char tail keeps
        order = {"ceiling": 0, "v4-pallas": 1, "v4-xla": 2, "v4-fp8": 3, "cudnn": 4}
        layer_order = {k: i for i, k in enumerate(LAYERS)}
        best = {}
        for r in rec.rows:
            if r["section"] == "v4-pallas":
                k = (r["layer"], r["seq"])
                if k not in best or r["ms"] < best[k]["ms"]:
                    best[k] = r
        rows = sorted(rec.rows, key=lambda r: (order.get(r["section"], 9), r["seq"] if r["section"] != "ceiling" else 0,
                                               layer_order.get(r["layer"], 9), r["layer"], r["ms"]))  # fmt: skip
        log("")
        log("=" * 100)
        log(f"RESULTS  {rec.header.get('device_kind')}  jax {rec.header.get('jax')}  {rec.header.get('date')}  "
            f"bf16 mm = {self.mm_bf16 and round(self.mm_bf16)} TF/s = 100%")  # fmt: skip
        log(f"{'section':<9} {'layer':<9} {'S':>7} {'variant':<14} {'ms':>9} {'TF/s':>6} {'%mm':>4} "
            f"{'TB/s':>5}  note")  # fmt: skip
        for r in rows:
            tf = f"{r['tflops']:6.1f}" if r["tflops"] is not None else f"{'-':>6}"
            pct = f"{r['pct_mm']:4.0f}" if r["pct_mm"] is not None else f"{'-':>4}"
            tb = f"{r['tbps']:5.2f}" if r["tbps"] is not None else f"{'-':>5}"
            mark = "*" if best.get((r["layer"], r["seq"])) is r else " "
            log(f"{r['section']:<9} {r['layer']:<9} {r['seq']:>7} {r['variant'][:13]:<13}{mark} {r['ms']:9.3f} "
                f"{tf} {pct} {tb}  {r['note']}")  # fmt: skip
        log("* = fastest Pallas variant for (layer, S); %mm = TF/s over this run's best bf16 matmul; TB/s = "
            "fewest bytes / time; err = rel L2 of the warm-up output vs the named reference")  # fmt: skip
        for c in rec.checks:
            log(f"check {c['layer']} S={c['seq']} {c['variant']} poisoned: NaN {c['nans']}, rel L2 "
                f"{c['rel_l2']:.2e} vs {c['against']} -> {'OK' if c['ok'] else 'FAIL'}")  # fmt: skip
        xla = {(r["layer"], r["seq"]): r for r in rec.rows if r["section"] == "v4-xla"}
        for (layer, seq), r in sorted(best.items(), key=lambda x: (x[0][1], layer_order.get(x[0][0], 9))):
            x = xla.get((layer, seq))
            vs = f" | xla {x['ms']:.2f} ms, speedup {x['ms'] / r['ms']:.2f}x" if x else ""
            log(f"summary {layer:<8} S={seq:<7} pallas best {r['variant']} {r['ms']:.2f} ms "
                f"({r['tflops'] or 0:.0f} TF/s, {r['tbps'] or 0:.2f} TB/s){vs}")  # fmt: skip
        log(f"{len(rec.errors)} error(s), {len(rec.skips)} skip(s); elapsed {time.monotonic() - T_START:.0f} s"
            + (f"; full numbers in {rec.out_dir / 'bench_kernels.json'}" if rec.out_dir else ""))  # fmt: skip
        for e in rec.errors[:12]:
            log(f"  error: {e['where']}: {e['type']}: {(e['message'].splitlines() or [''])[0][:120]}")
        for s in rec.skips[:12]:
            log(f"  skip: {s['where']}: {s['why']}"[:130])
        if len(rec.errors) > 12 or len(rec.skips) > 12:
            log("  (more errors/skips in the log and the JSON)")
        log("=" * 100)
        rec.write_json()

    def run(self):
        if not self.args.smoke and jax.default_backend() != "gpu":
            self.rec.log(f"ERROR: jax's default backend is {jax.default_backend()!r}, not 'gpu' "
                         f"(devices: {jax.devices()}); "
                         "run with --smoke for the CPU check")  # fmt: skip
            sys.exit(2)
        try:
            self.import_dsv4()
        except Exception as exc:
            self.rec.error("import dsv4.pallas.attention", exc)
        self.header()
        # The larger lengths come after cudnn and fp8: a kernel fault there (a sticky CUDA error ends the process's
        # GPU work) then costs only what follows it.
        lengths = self.args.lengths
        steps = [("ceilings", self.ceilings), ("attention", functools.partial(self.attention_baseline, lengths[:1])),
                 ("cudnn", self.cudnn), ("fp8", self.fp8),
                 ("attention", functools.partial(self.attention_baseline, lengths[1:])),
                 ("attention", self.attention_variants)]  # fmt: skip
        for section, step in steps:
            if section not in self.args.only:
                continue
            if section in ("attention", "fp8") and (self.pa is None or not self.variants):
                self.rec.skip(section, "dsv4.pallas.attention did not import, or no valid --variants")
                continue
            try:
                step()
            except Exception as exc:  # a section's own bookkeeping failed; the next section still runs
                self.rec.error(f"section {section}", exc)
            free()
        self.table()


def _check_note(check: dict) -> str:
    parts = []
    if "rel_l2" in check:
        parts.append(f"err {check['rel_l2']:.1e} {check['against']}")
    if check.get("nans"):
        parts.append(f"NaN {check['nans']}")
    return " ".join(parts)


def _bs_str(bs) -> str:
    return (f"q{bs.block_q or 'auto'}/h{bs.block_h}/kv{bs.block_kv}/c{bs.block_compressed}/t{bs.block_topk}/"
            f"w{bs.num_warps or 'auto'}/s{bs.num_stages}")  # fmt: skip


def _jaxlib_version():
    try:
        import jaxlib

        return jaxlib.__version__
    except Exception:
        return None


def main():
    args = parse_args()
    Bench(args).run()


if __name__ == "__main__":
    main()
