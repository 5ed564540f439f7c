#!/usr/bin/env python3
"""GPU benchmark for the Pallas kernels: attention, lightning indexer, paged decode, MoE ("Pallas kernels I").

One run gives every number of the sections it runs, each measured in the same run as its ceilings:

    python3 scripts/bench_kernels.py --only ceilings,attention,cudnn,fp8 --out $OUT   # H200, attention (~6–7 min)
    python3 scripts/bench_kernels.py --only indexer,decode,moe --budget 420 --out $OUT  # H200, the others (~7 min)
    python3 scripts/bench_kernels.py --smoke --out /tmp/b   # CPU, tiny shapes, Pallas interpreted (checks the script)

Sections (``--only ceilings,attention,cudnn,fp8,indexer,decode,moe``; all by default, which does not fit one
600 s call: the budget then drops the tail, so run the two groups above separately):

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
indexer    ``dsv4.pallas.indexer.index_topk_two_pass`` (Pallas, the primary path: a scores kernel per query chunk
           + the exact grouped top-k of ``dsv4.topk``) at V4-Flash shapes: B=1, Hi=64 index heads × Di=128, keys
           C = S/4, top-512, S = 32K, 128K, 512K (``--indexer-lengths``); the one-kernel streaming top-k
           ``dsv4.pallas.indexer.index_topk`` (~30× slower) only at S <= ``--indexer-stream-max`` (32K; every S in
           --smoke). fp8: q e4m3 with per (token, head) scales, keys e4m3 with per-entry scales (DeepSeek's
           act_quant, block = Di); bf16: the same random values unquantized. Against
           ``dsv4.attention.index_topk_jnp`` (XLA: einsum → ReLU → weighted sum → mask → lax.top_k, 1024 queries
           per scan step) in bf16, where one call is predicted under ``--indexer-xla-max-call`` (5 s; it is
           quadratic: ~22 s per call at 512K).
           Checks at the smallest S, on the timed calls' outputs: every list valid (indices in [-1, visible),
           distinct, min(visible, 512) valid); per-row set equality of each Pallas path's bf16 output vs XLA bf16,
           and of its fp8 output vs index_topk_jnp on the dequantized float32 inputs (HIGHEST precision); near-tie
           swaps are allowed: the fraction of differing picks and the worst relative score deficit of a differing
           pick against the other list's 512th score are reported.
decode     ``dsv4.pallas.decode.paged_decode_attention`` (flash-decoding over paged caches; impl="auto": on Hopper the
           Mosaic kernel for bf16 hca / sweep items, Triton otherwise), H=64, D=512, window ring
           128, 64 entries per page, at batch 1 and 32 (``--decode-batches``) and contexts 32K, 128K, 512K
           (``--decode-contexts``), bf16 and fp8 pages (``--decode-fp8-scales``: per token and 64-channel tile, or
           per channel). Layer types: hca (ring + all C = ctx/128 entries), csa (ring + 512 distinct random picks
           of C = ctx/4 entries), sweep (ring + all C = ctx/4 entries: what reading the whole CSA cache costs, the
           case where the bytes are large enough to measure bandwidth; bf16 and fp8, ``--decode-sweep-dtypes``).
           Page pools are physical (256 MiB ring, 1.5 GiB compressed in bf16) and block tables map every request's
           pages to random pool pages, with enough distinct request tables per item that the calls rotate through
           >= 512 MiB (no L2 reuse between calls). Time: bursts of back-to-back calls (no sync between), median per
           call ("pipelined"), plus the synchronized latency ("sync" in the note), plus a launch floor per argument
           structure (a trivial executable with the same arguments, dispatched the same way). Checked against
           ``paged_decode_attention_reference`` at the smallest context and largest batch (every layer and dtype),
           and once with NaN-poisoned split partials (csa, bf16).
moe        one V4-Flash MoE layer's routed experts: D=4096, I=2048, E=256, top-6; the shared expert is excluded.
           Tokens 8K, 64K, 512K (``--moe-tokens``); routing: expert popularity ∝ (rank + 1)^-0.3 (``--moe-zipf``,
           0 = uniform; ~3.7× max/mean load at the expert level), 6 distinct experts per token drawn ∝ popularity
           (Gumbel top-k). Random weights, bf16 (12 GiB) and DeepSeek fp8 (128 × 128 block scales).
           ``dsv4.pallas.moe.routed_experts`` (sort + gather + grouped_gate_up + grouped_down + combine) in bf16 and
           W8A8 (``--moe-modes``; w8a16 also possible); a capacity-padded batched einsum (capacity = 1.25 × mean
           pairs per expert, rounded up to 16; overflowing pairs are dropped, the drop fraction is reported; defined
           here: ``capacity_einsum``); ``dsv4.moe.routed_experts_jnp`` (sort + ``lax.ragged_dot``) at the smallest
           N and, if it ran, the middle one. Every executable's temporaries + outputs are read from the compiled
           object and the item is skipped if they exceed the free memory (ragged_dot can ask for ~96 GiB at
           8K tokens). BlockSizes sweep at the middle N (``--moe-variants-bf16``, ``--moe-variants-w8a8``).
           Check at the smallest N: each output's relative L2 against the no-drop einsum (capacity = the largest
           expert load, float32 intermediates), an implementation that shares nothing with the kernels.

FLOPs (useful work; 2 per multiply-add; Q·Kᵀ and P·V are 2·D each, so 4·D per (query, head, key)):
    V4:    FLOPs = 4 · B · H · D · Σ_p [ min(p + 1, W)                                  (window)
                                       + min((p + 1) // 128, C)          for HCA         (visible entries)
                                       + min((p + 1) // 4, C, 512)       for CSA         (valid top-k slots) ]
           over query positions p = 0 … S-1. Both the Pallas and the XLA rows use this count, so XLA's dense
           over-computation (all C HCA entries per chunk, 1151-row window bands) is not credited.
    cuDNN: FLOPs = 4 · H · D · S² / 2 (causal).
    TB/s column: the fewest bytes the op must move (q read, out written, kv + compressed + top-k read once)
           over its time; for the copy, bytes read + written.
    Indexer: useful FLOPs = 2 · Hi · Di · Σ_p visible(p), visible(p) = min((p + 1) // 4, C) (multiply-adds of the
           visible (query, key) pairs × 2); the note also gives the rate on the dense count 2 · Hi · Di · S · C / 2.
           Same count for both Pallas paths and XLA (XLA computes all S · C pairs). The % column: of this run's fp8
           matmul for fp8 rows, of the bf16 matmul for bf16 rows. Bytes: q, keys, weights, positions, scales read
           once, the top-k written once (not counted: the two-pass path's float32 score slabs).
    Decode: bytes = B · (q read + output written, 2 · H · D · 2) + per request: visible ring rows min(ctx, 128)
           and the compressed rows read (hca / sweep: all C; csa: the 512 picks) × (D · itemsize + tile scales
           D/64 · 4 B for fp8), the top-k list (4 B a slot) and the block-table entries dereferenced (4 B each). Not
           counted: the kernel's split partials. The % column: of this run's copy bandwidth.
           FLOPs = 4 · B · H · D · (ring rows + compressed rows read).
    MoE:   useful FLOPs = 2 · 3 · D · I · N · 6 (gate, up, down per token-expert pair), the same for every
           implementation (the einsum computes 1.25× that on padded slots and drops pairs; the note says how much).
           The % column: of the fp8 matmul for W8A8, of the bf16 matmul otherwise. Bytes: every expert weight read
           once (+ fp8 block scales), x read and the output written.

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
Decode calls (microseconds) are timed pipelined instead (above). In --smoke every item runs 2 timed calls.

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
  7. (only when indexer / decode / moe run without ``ceilings``) lite ceilings: bf16 matmul 16384³, fp8 matmul
     16384³ through cuBLASLt only (``xla_gpu_enable_triton_gemm=False``: XLA's Triton autotuning of the fp8 dot
     takes up to minutes at these sizes), the copy;
  8. decode: per context, hca then csa, bf16 then fp8, each batch size; then the sweep, largest context first;
  9. moe: per N below ``--large-from`` (8K, 64K) each mode's baseline variant, the einsum, ragged_dot at 8K; then
     the BlockSizes sweep at 64K; then ragged_dot at 64K if it ran at 8K;
 10. indexer below ``--large-from`` (32K, 128K): per S, two-pass fp8, two-pass bf16, XLA bf16, streaming fp8 and bf16
     (S <= ``--indexer-stream-max``) (+ the checks at 32K);
 11. moe-large (512K tokens);  12. indexer-large (512K: two-pass fp8 and bf16, ~1.7 s and more per call).
The larger lengths come after cudnn and fp8 also because a kernel fault there (an illegal address is a sticky
CUDA error: nothing after it runs on the GPU) then costs only what follows; likewise the 512K MoE and indexer
items (arrays past 2^31 elements, the largest temporaries) run last. Steps 8–12 each have a cap
(``--section-budgets``, GPU default decode=80, moe=100, indexer=100, moe-large=40, indexer-large=70 s) inside the
global budget, so one slow step does not starve the next; time a step leaves unused goes to the next. A watchdog
(``--hard-stop``, default budget + 90 s) prints the table from what was measured and exits if an item runs far
past its prediction (a compile cannot be interrupted otherwise).
Expected totals on one H200: attention group about 6–7 minutes; indexer / decode / moe group about 7 minutes
(docs/BENCHMARKS.md has the per-section estimates).

Memory (S = 512K: q and out are 32 GiB each in bf16): one q set, one output alive at a time (each timed result
is deleted before the next call), XLA outputs kept only as sample rows above 8 GiB, everything deleted between
layers. ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.92 here (JAX's own default, 0.75, is ~104 GiB).

Output: a log line per measurement, SKIP/ERROR lines (one failing item never stops the run), and a compact
final table (decode as a matrix: layer × context against dtype-batch; one summary line per indexer S and MoE
N). ``--out DIR`` also writes DIR/bench_kernels.json (all numbers, every run's times, errors with tracebacks;
rewritten after every section) and DIR/bench_kernels.log (the whole printed log).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path

T_START = time.monotonic()
_SMOKE = "--smoke" in sys.argv
# NOTE: both must be set before jax is imported.
if _SMOKE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Every helper jit compiles for XLA:CPU too: the fast options (see FAST_CPU_COMPILE) for all of them.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
GiB = 1 << 30
SECTIONS = ("ceilings", "attention", "cudnn", "fp8", "indexer", "decode", "moe")
NEW_SECTIONS = ("indexer", "decode", "moe")  # these measure their own (lite) ceilings when "ceilings" is not run
STEPS_EXTRA = ("ceilings-lite", "moe-large", "indexer-large")  # steps run as part of a section (caps by step name)
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
    # lightning indexer (topk and csa_rate above are shared with it)
    index_heads: int = 64
    index_dim: int = 128
    # decode: entries per page (ring and compressed pools), physical pool sizes, bytes to rotate through per item
    page_size: int = 64
    ring_pool_bytes: int = 256 << 20
    compressed_pool_bytes: int = 1536 << 20
    rotate_bytes: int = 512 << 20
    # MoE (V4-Flash routed experts; the shared expert is not part of the benchmark)
    moe_hidden: int = 4096
    moe_inter: int = 2048
    moe_experts: int = 256
    moe_topk: int = 6
    swiglu_limit: float = 10.0


GPU_SHAPES = Shapes(heads=64, head_dim=512, window=128, hca_rate=128, csa_rate=4, topk=512, cudnn_head_dim=256,
                    matmul_sizes=(8192, 16384), copy_bytes=4 * GiB)  # fmt: skip
SMOKE_SHAPES = Shapes(heads=4, head_dim=32, window=16, hca_rate=16, csa_rate=4, topk=16, cudnn_head_dim=32,
                      matmul_sizes=(256, 512), copy_bytes=16 << 20, index_heads=4, index_dim=32, page_size=8,
                      ring_pool_bytes=32 << 10, compressed_pool_bytes=128 << 10, rotate_bytes=64 << 10,
                      moe_hidden=128, moe_inter=128, moe_experts=8, moe_topk=2)  # fmt: skip

# name:spec, spec = comma-separated kv=<block_kv = block_compressed = block_topk>, w=<num_warps>, s=<num_stages>,
# q=<block_q>, h=<block_h>. "default" is the kernel's default (1 token × 64 heads; 128-row KV blocks, 1 stage;
# the fp8 section then takes FP8_BLOCK_SIZES, 64-row blocks and 2 stages).
GPU_VARIANTS = "default;kv32-s3:kv=32,s=3;kv64-s1:kv=64,s=1;kv128-s1:kv=128,s=1"
SMOKE_VARIANTS = "default;kv16:kv=16;kv32-s1:kv=32,s=1"
# MoE BlockSizes variants: m=<block_m>, n=<block_n>, k=<block_k>, w=<num_warps>, s=<num_stages>; "default" is
# BlockSizes() (64 × 128 × 64, 8 warps, 3 stages). The bf16 gate_up tile at block_k = 128 needs 80 KiB of SMEM per
# stage, so the bf16 list keeps block_k = 64; W8A8 tiles are half the bytes.
GPU_MOE_VARIANTS = {"bf16": "default;m128:m=128;n64-s4:n=64,s=4",
                    "w8a8": "default;k128-s4:k=128,s=4;m128k128:m=128,k=128,s=3"}  # fmt: skip
SMOKE_MOE_VARIANTS = {"bf16": "default;m16:m=16", "w8a8": "default"}
# Per-step caps in seconds (each also bounded by --budget): one slow step cannot starve the next.
GPU_SECTION_BUDGETS = "decode=80,moe=100,indexer=100,moe-large=40,indexer-large=70"


def parse_lengths(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return sorted(set(out))


ATTENTION_VARIANT_KEYS = {"kv": ("block_kv", "block_compressed", "block_topk"), "w": ("num_warps",),
                          "s": ("num_stages",), "q": ("block_q",), "h": ("block_h",)}  # fmt: skip
MOE_VARIANT_KEYS = {"m": ("block_m",), "n": ("block_n",), "k": ("block_k",), "w": ("num_warps",),
                    "s": ("num_stages",)}  # fmt: skip


def parse_variants(text: str, block_sizes_cls, on_error, keys=None) -> list[tuple[str, object]]:
    """'name:kv=32,s=3;...' → [(name, BlockSizes)]; a bad entry is reported through on_error and dropped.

    The first entry is the baseline: the poisoned check and the fp8 section use it.
    """
    keys = keys or ATTENTION_VARIANT_KEYS
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
    p.add_argument("--hard-stop", type=float, default=None,
                   help="seconds after the start at which a watchdog prints the table and exits, even mid-item "
                        "(default --budget + 90; 0 = off)")  # fmt: skip
    g = p.add_argument_group("indexer / decode / moe sections")
    g.add_argument("--indexer-lengths", default=None, help="indexer S values (GPU default 32k,128k,512k)")
    g.add_argument("--indexer-xla-fp8", action="store_true",
                   help="also time index_topk_jnp on fp8 inputs (XLA's fp8 dot autotuning can compile for minutes)")
    g.add_argument("--indexer-xla-max-call", type=float, default=None,
                   help="skip the XLA indexer above the smallest S when one call is predicted longer (s, default 5)")
    g.add_argument("--indexer-stream-max", type=int, default=None,
                   help="largest S for the streaming indexer kernel index_topk (~30x slower than the two-pass path; "
                        "GPU default 32768, every S in --smoke)")  # fmt: skip
    g.add_argument("--decode-contexts", default=None, help="decode context lengths (GPU default 32k,128k,512k)")
    g.add_argument("--decode-batches", default=None, help="decode batch sizes (GPU default 1,32)")
    g.add_argument("--decode-fp8-scales", choices=("tile", "channel"), default="tile",
                   help="fp8 page scales: per token and 64-channel tile (default) or per channel")
    g.add_argument("--decode-sweep-dtypes", default=None, help="dtypes of the full-cache sweep (GPU default bf16,fp8)")
    g.add_argument("--moe-tokens", default=None, help="MoE token counts (GPU default 8k,64k,512k)")
    g.add_argument("--moe-modes", default="bf16,w8a8", help="Pallas MoE modes: bf16, w8a8, w8a16")
    g.add_argument("--moe-zipf", type=float, default=0.3,
                   help="routing skew: expert popularity ∝ (rank + 1)^-zipf (0 = uniform; default 0.3)")
    g.add_argument("--moe-variants-bf16", default=None, help=f"GPU default {GPU_MOE_VARIANTS['bf16']!r}")
    g.add_argument("--moe-variants-w8a8", default=None, help=f"GPU default {GPU_MOE_VARIANTS['w8a8']!r}")
    g.add_argument("--large-from", type=int, default=None,
                   help="indexer S and MoE N at or above this run last, after everything else (steps indexer-large, "
                        "moe-large; GPU default 262144, smoke 128)")  # fmt: skip
    g.add_argument("--section-budgets", default=None,
                   help=f"per-section caps in seconds, e.g. {GPU_SECTION_BUDGETS!r} (GPU default; none in --smoke)")
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
    args.indexer_lengths = parse_lengths(args.indexer_lengths or ("96,128" if args.smoke else "32k,128k,512k"))
    args.indexer_xla_max_call = args.indexer_xla_max_call or (1e9 if args.smoke else 5.0)
    if args.indexer_stream_max is None:
        args.indexer_stream_max = max(args.indexer_lengths) if args.smoke else 32768
    args.decode_contexts = parse_lengths(args.decode_contexts or ("256,512" if args.smoke else "32k,128k,512k"))
    args.decode_batches = parse_lengths(args.decode_batches or ("2" if args.smoke else "1,32"))
    args.decode_sweep_dtypes = [d.strip() for d in (args.decode_sweep_dtypes or ("bf16" if args.smoke else
                                                                                  "bf16,fp8")).split(",") if d.strip()]
    args.moe_tokens = parse_lengths(args.moe_tokens or ("32,128" if args.smoke else "8k,64k,512k"))
    args.moe_modes = [m.strip() for m in args.moe_modes.split(",") if m.strip()]
    for m in args.moe_modes:
        if m not in ("bf16", "w8a8", "w8a16"):
            p.error(f"--moe-modes: unknown mode {m!r}; known: bf16, w8a8, w8a16")
    moe_variants = SMOKE_MOE_VARIANTS if args.smoke else GPU_MOE_VARIANTS
    args.moe_variants_bf16 = args.moe_variants_bf16 or moe_variants["bf16"]
    args.moe_variants_w8a8 = args.moe_variants_w8a8 or moe_variants["w8a8"]
    args.large_from = args.large_from or (128 if args.smoke else 262144)
    budgets = args.section_budgets if args.section_budgets is not None else ("" if args.smoke else GPU_SECTION_BUDGETS)
    args.section_budgets = {}
    for item in filter(None, (x.strip() for x in budgets.split(","))):
        name, _, value = item.partition("=")
        if name.strip() not in SECTIONS + STEPS_EXTRA:
            p.error(f"--section-budgets: unknown section {name!r}; known: {SECTIONS + STEPS_EXTRA}")
        args.section_budgets[name.strip()] = float(value)
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
        self.global_deadline = self.deadline
        self.compile_seen: dict[str, list[float]] = {}
        self.compile_guess = {"pallas": 20.0, "xla": 10.0, "cudnn": 8.0, "matmul": 5.0, "indexer": 30.0,
                              "decode": 6.0, "moe": 15.0}  # fmt: skip

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def cap(self, seconds: float | None):
        """Within the block, the deadline is at most `seconds` from now (a per-section cap)."""
        if seconds:
            self.deadline = min(self.global_deadline, time.monotonic() + seconds)
        try:
            yield
        finally:
            self.deadline = self.global_deadline

    def compile_est(self, kind: str) -> float:
        seen = self.compile_seen.get(kind)
        return max(seen[-3:]) if seen else self.compile_guess.get(kind, 20.0)

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
class Rounds:
    """Rows timed in interleaved rounds: `add` calls fn once (compile and warm-up) and returns that output; `run`
    then calls every added fn once a round, synchronized, `reps` rounds, and hands each its median ms, in order."""

    def __init__(self):
        self.items = []

    def add(self, fn, done):
        out = jax.block_until_ready(fn())
        self.items.append((fn, done, []))
        return out

    def run(self, reps: int):
        for _ in range(reps):
            for fn, _, times in self.items:
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times.append((time.perf_counter() - t0) * 1e3)
        for _, done, times in self.items:
            done(statistics.median(times))
        self.items = []


def planned_reps(t_call: float, target_s: float) -> int:
    if _SMOKE:  # the CPU check proves the code paths; interpreted kernels are slow and their times mean nothing
        return 2
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


def aot_compile(fn, kwargs: dict, static: dict | None = None, compiler_options: dict | None = None):
    """→ (compiled, seconds) for jax.jit-wrapped fn traced with kwargs (+ static kwargs)."""
    t0 = time.perf_counter()
    lowered = fn.trace(**kwargs, **(static or {})).lower()
    options = dict(FAST_CPU_COMPILE) if _SMOKE else {}
    options.update(compiler_options or {})
    compiled = lowered.compile(compiler_options=options or None)
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
# Indexer / decode / MoE: timing, inputs, FLOP and byte counts.
# ---------------------------------------------------------------------------------------------
def time_pipelined(fn, arg_sets: list[dict], *, budget: Budget, first_out=None, sample_s: float = 0.05,
                   samples: int = 7, max_calls: int = 400):  # fmt: skip
    """Per-call device time of a short kernel: bursts of n calls dispatched back to back (no sync in between),
    rotating through arg_sets, one sync at the end of each burst; the median burst time over n.

    Also measures the individually synchronized latency (host round trip included) of 5 calls: "sync_ms".
    → dict like time_compiled's, plus sync_ms and calls (per burst).
    """
    t0 = time.perf_counter()
    out = fn(**arg_sets[0])
    jax.block_until_ready(out)
    warm_s = time.perf_counter() - t0
    if first_out is not None:
        first_out(out)
    del out
    sync = []
    for i in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(**arg_sets[(i + 1) % len(arg_sets)]))
        sync.append(time.perf_counter() - t0)
    turn = [6]  # next arg set: the rotation continues across bursts

    def burst(n):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(**arg_sets[turn[0] % len(arg_sets)])
            turn[0] += 1
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    t_est = burst(10) / 10
    n = int(min(max_calls, max(10, sample_s / max(t_est, 1e-7))))
    samples = max(1, min(samples, int((budget.left() - 2.0) / max(n * t_est, 1e-6))))
    times = [burst(n) / n for _ in range(samples)]
    med = statistics.median(times)
    return dict(ms=med * 1e3, times_ms=[t * 1e3 for t in times], warm_s=warm_s, reps=samples, calls=n,
                spread=(max(times) - min(times)) / med if med > 0 else 0.0,
                sync_ms=statistics.median(sync) * 1e3)  # fmt: skip


def memory_need(compiled) -> tuple[float, float] | None:
    """→ (bytes the executable allocates: temporaries + outputs, bytes free on the device), or None if unknown."""
    try:
        ma = compiled.memory_analysis()
        need = float(ma.temp_size_in_bytes + ma.output_size_in_bytes)
        stats = jax.devices()[0].memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        return need, float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    except Exception:
        return None


@functools.partial(jax.jit, static_argnames=("chunks",))
def quantize_last_axis(x, chunks: int = 1):
    """x [N, ..., Di] → (float8_e4m3fn values, float32 scales [N, ...]): absmax / 448 per last-axis row (> 0).

    DeepSeek's act_quant with block = Di (the indexer's q per (token, head) and keys per entry). chunks splits the
    leading axis (lax.map) to bound the float32 temporaries.
    """

    def one(xc):
        xf = xc.astype(F32)
        scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), 1e-12) / 448.0
        return (xf / scale[..., None]).astype(FP8), scale

    if chunks == 1:
        return one(x)
    values, scales = jax.lax.map(one, x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]))
    return values.reshape(x.shape), scales.reshape(x.shape[:-1])


def index_visible_pairs(seq: int, rate: int, count: int) -> int:
    """Σ_p visible(p) over query positions p = 0 … S-1, visible(p) = min((p + 1) // rate, C)."""
    p1 = np.arange(1, seq + 1, dtype=np.int64)
    return int(np.minimum(p1 // rate, count).sum())


def indexer_flops(seq: int, sh: Shapes) -> tuple[float, float]:
    """→ (useful FLOPs = 2·Hi·Di·Σ_p visible(p), dense-count FLOPs = 2·Hi·Di·S·C/2), C = S // rate."""
    count = seq // sh.csa_rate
    per_pair = 2.0 * sh.index_heads * sh.index_dim
    return per_pair * index_visible_pairs(seq, sh.csa_rate, count), per_pair * seq * count / 2


def indexer_min_bytes(seq: int, sh: Shapes, itemsize: int) -> float:
    """q, keys, weights and positions read once, the top-k written once (scales: 4 B per q row and key row)."""
    count = seq // sh.csa_rate
    b = seq * sh.index_heads * sh.index_dim * itemsize + count * sh.index_dim * itemsize
    b += seq * sh.index_heads * 4 + seq * 4 + seq * sh.topk * 4
    if itemsize == 1:
        b += seq * sh.index_heads * 4 + count * 4
    return float(b)


def build_indexer_inputs(seq: int, sh: Shapes, seed: int, *, fp8: bool, bf16: bool) -> dict[str, dict]:
    """{"bf16": kwargs, "fp8": kwargs} for index_topk at B = 1: q [1, S, Hi, Di], keys [1, C, Di] (C = S // rate),
    weights [1, S, Hi] f32 (N(0, 1/Hi)), positions 0 … S-1; fp8: q per (token, head) and keys per entry scaled."""
    keys = jax.random.split(jax.random.key(seed * 1000 + 17 + seq % 991), 3)
    count = seq // sh.csa_rate
    q = randn(keys[0], (seq, sh.index_heads, sh.index_dim), BF16)  # [S, Hi, Di]
    k = randn(keys[1], (count, sh.index_dim), BF16)  # [C, Di]
    weights = jax.random.normal(keys[2], (1, seq, sh.index_heads), F32) * sh.index_heads**-0.5
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    out = {}
    if fp8:
        chunks = 1
        while seq % (chunks * 2) == 0 and seq // chunks > 16384:
            chunks *= 2
        q8, q_scale = quantize_last_axis(q, chunks=chunks)
        k8, k_scale = quantize_last_axis(k)
        out["fp8"] = dict(q=q8[None], keys=k8[None], weights=weights, positions=positions, q_scale=q_scale[None],
                          k_scale=k_scale[None])  # fmt: skip
    if bf16:
        out["bf16"] = dict(q=q[None], keys=k[None], weights=weights, positions=positions)
    del q, k
    jax.block_until_ready(out)
    return out


@functools.partial(jax.jit, static_argnames=("softmax_scale", "chunk"))
def index_pick_scores(q, keys, weights, idx, q_scale=None, k_scale=None, *, softmax_scale: float, chunk: int = 256):
    """float32 scores (HIGHEST precision, dequantized inputs) of the picked entries. idx [1, S, k] → [1, S, k],
    -inf where idx < 0. Row chunks bound the gathered keys ([chunk, k, Di])."""
    hi = jax.lax.Precision.HIGHEST
    qf = q[0].astype(F32)  # [S, Hi, Di]
    if q_scale is not None:
        qf = qf * q_scale[0][..., None]
    kf = keys[0].astype(F32)  # [C, Di]
    if k_scale is not None:
        kf = kf * k_scale[0][:, None]
    s = qf.shape[0]
    chunk = min(chunk, s)
    pad = -s % chunk

    def split(x, fill=0):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])

    def one(args):
        qc, wc, ic = args  # [c, Hi, Di], [c, Hi], [c, k]
        picked = kf[jnp.maximum(ic, 0)]  # [c, k, Di]
        dots = jnp.einsum("chd,ckd->chk", qc, picked, precision=hi)
        scores = jnp.einsum("chk,ch->ck", jnp.maximum(dots, 0.0) * softmax_scale, wc, precision=hi)
        return jnp.where(ic >= 0, scores, -jnp.inf)

    out = jax.lax.map(one, (split(qf), split(weights[0]), split(idx[0], -1)))
    return out.reshape(-1, idx.shape[2])[:s][None]


@jax.jit
def topk_set_compare(got, want, got_scores, want_scores):
    """Per-row set comparison of two top-k lists [1, S, k] (-1 = empty slot) with their picks' exact scores.

    → dict: picks (valid entries in got), missing (valid got entries absent from want's row), rows_differ,
    count_differ (rows whose numbers of valid entries differ), max_rel_deficit (over missing picks: (want's k-th
    score - the pick's score) / the row's largest |score|; <= 0: the pick scores at least as high, a tie or better).
    """
    g, w = got[0], want[0]
    ws = jnp.sort(w, axis=-1)
    pos = jax.vmap(jnp.searchsorted)(ws, g)
    found = jnp.take_along_axis(ws, jnp.clip(pos, 0, ws.shape[1] - 1), axis=-1) == g
    valid = g >= 0
    missing = valid & ~found
    valid_w = w >= 0
    kth = jnp.min(jnp.where(valid_w, want_scores[0], jnp.inf), axis=-1, keepdims=True)  # [S, 1]
    row_scale = jnp.max(jnp.where(valid_w, jnp.abs(want_scores[0]), 0.0), axis=-1, keepdims=True)
    deficit = (kth - got_scores[0]) / jnp.maximum(row_scale, 1e-30)
    return dict(picks=valid.sum(dtype=F32), missing=missing.sum(dtype=F32),
                rows_differ=missing.any(-1).sum(dtype=F32),
                count_differ=(valid.sum(-1) != valid_w.sum(-1)).sum(dtype=F32),
                max_rel_deficit=jnp.max(jnp.where(missing, deficit, -jnp.inf)))  # fmt: skip


@functools.partial(jax.jit, static_argnames=("rate", "count"))
def topk_validity(idx, positions, *, rate: int, count: int):
    """Structural checks of a top-k list [1, S, k]: entries outside [-1, visible), duplicates, and rows whose number
    of valid entries is not min(visible, k). → dict of counts (all 0 when valid)."""
    k = idx.shape[-1]
    visible = jnp.clip((positions + 1) // rate, 0, count)[..., None]  # [1, S, 1]
    out_of_range = ((idx < -1) | (idx >= visible)).sum(dtype=F32)
    s = jnp.sort(idx, axis=-1)
    duplicates = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).sum(dtype=F32)
    wrong_count = ((idx >= 0).sum(-1) != jnp.minimum(visible[..., 0], k)).sum(dtype=F32)
    return dict(out_of_range=out_of_range, duplicates=duplicates, wrong_count=wrong_count)


def decode_entries(layer: str, ctx: int, sh: Shapes) -> tuple[int, int | None, int]:
    """→ (compressed entries present C, top-k width or None, entries one query reads)."""
    if layer == "hca":
        count = ctx // sh.hca_rate
        return count, None, count
    count = ctx // sh.csa_rate  # csa and the full-cache sweep read the CSA pool
    if layer == "csa":
        return count, sh.topk, min(sh.topk, count)
    return count, None, count


def decode_rope_dim(sh: Shapes) -> int:
    """RoPE channels of a row kept in bf16 by the "fp8s" pages (the cache's own FP8 format): V4's 64, or 1/8 of
    the row at smoke shapes."""
    return min(64, sh.head_dim // 8)


def decode_row_bytes(sh: Shapes, dtype_name: str, scales: str) -> int:
    """Bytes of one cached row: values plus, for fp8 with per-token tile scales, 4 B per 64 channels. "fp8s": the
    cache's split rows, e4m3 nope channels (+ their tile scales) and bf16 RoPE channels (448 + 128 B for V4)."""
    if dtype_name == "bf16":
        return sh.head_dim * 2
    rope = decode_rope_dim(sh) if dtype_name == "fp8s" else 0
    nope = sh.head_dim - rope
    return nope + 2 * rope + (-(-nope // 64) * 4 if scales == "tile" else 0)


def decode_bytes(layer: str, ctx: int, batch: int, sh: Shapes, dtype_name: str, scales: str) -> float:
    """Bytes one decode call must move: q read + output written (bf16), per request the visible ring rows and the
    compressed rows it reads (HCA / sweep: all C; CSA: the top-k picks) with their scales, the top-k list and the
    block-table entries it dereferences. Not counted: the kernel's split partials (written and re-read)."""
    count, topk, read = decode_entries(layer, ctx, sh)
    row = decode_row_bytes(sh, dtype_name, scales)
    ring = min(ctx, sh.window)
    per_request = (ring + read) * row + 4 * (-(-ring // sh.page_size))
    per_request += 4 * (topk + read) if topk else 4 * (-(-read // sh.page_size))
    return float(batch * (2 * 2 * sh.heads * sh.head_dim + per_request))


def decode_flops(layer: str, ctx: int, batch: int, sh: Shapes) -> float:
    _, _, read = decode_entries(layer, ctx, sh)
    return 4.0 * batch * sh.heads * sh.head_dim * (min(ctx, sh.window) + read)


@functools.partial(jax.jit, static_argnames=("n_requests", "count", "k"))
def make_request_topk(key, *, n_requests: int, count: int, k: int):
    """[R, k] int32 distinct CSA picks in [0, count): one uniformly random entry per stratum (k strata); -1 padded
    when count <= k (then entries 0 … count-1)."""
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    if count <= k:
        return jnp.broadcast_to(jnp.where(j < count, j, -1), (n_requests, k)).astype(jnp.int32)
    lo, hi = (j * count) // k, ((j + 1) * count) // k
    u = jax.random.uniform(key, (n_requests, k), F32)
    return jnp.minimum(lo + jnp.floor(u * (hi - lo).astype(F32)).astype(jnp.int32), hi - 1)


def make_decode_pool(sh: Shapes, seed: int, dtype_name: str, scales: str) -> dict:
    """Physical page pools shared by every layer, context and batch: a window-ring pool and a compressed pool
    (bf16, or fp8 with per-tile / per-channel scales), random normal, and the sinks. Block tables map each
    request's pages to random pool pages (with replacement), so the pool only has to be much larger than L2, not
    as large as what a batch reads (pools stay < 2^31 elements). Shared with scripts/bench_decode.py."""
    ps, d = sh.page_size, sh.head_dim
    ring_pages = max(4, sh.ring_pool_bytes // (ps * d * 2))
    comp_pages = max(4, min(sh.compressed_pool_bytes // (ps * d * 2), (2**31 - 1) // (ps * d)))
    k1, k2, k3 = jax.random.split(jax.random.key(seed + 4242), 3)
    pool = dict(kv_pages=randn(k1, (ring_pages, ps, d), BF16), compressed_pages=randn(k2, (comp_pages, ps, d), BF16),
                sinks=jax.random.normal(k3, (sh.heads,), F32))  # fmt: skip
    if dtype_name == "fp8":
        pool["kv_pages"], pool["kv_scales"] = quantize_pages(pool["kv_pages"], layout=scales)
        pool["compressed_pages"], pool["compressed_scales"] = quantize_pages(pool["compressed_pages"], layout=scales)
    if dtype_name == "fp8s":  # split rows: the nope channels quantized, the RoPE channels in their own bf16 pages
        n = d - decode_rope_dim(sh)
        for name in ("kv", "compressed"):
            pages = pool.pop(f"{name}_pages")
            pool[f"{name}_rope_pages"] = pages[..., n:]
            pool[f"{name}_pages"], pool[f"{name}_scales"] = quantize_pages(pages[..., :n], layout=scales)
    return jax.block_until_ready(pool)


@functools.partial(jax.jit, static_argnames=("layout",))
def quantize_pages(pages, *, layout: str):
    """bf16 pages [P, ps, D] → (float8_e4m3fn pages, f32 scales): per channel [D] or per token and 64-channel tile
    [P, ps, D // 64] (the decode kernel's two layouts; D a multiple of 64 for tiles)."""
    x = pages.astype(F32)
    if layout == "channel":
        scales = jnp.maximum(jnp.max(jnp.abs(x), axis=(0, 1)), 1e-12) / 448.0  # [D]
        return (x / scales).astype(FP8), scales
    p, ps, d = x.shape
    tiles = x.reshape(p, ps, d // 64, 64)
    scales = jnp.maximum(jnp.max(jnp.abs(tiles), axis=-1), 1e-12) / 448.0  # [P, ps, D // 64]
    return (tiles / scales[..., None]).astype(FP8).reshape(p, ps, d), scales


def moe_flops(tokens: int, sh: Shapes) -> float:
    """Useful MoE FLOPs: 2 per multiply-add · (gate + up + down = 3·D·I) per token-expert pair, top-k pairs."""
    return 2.0 * 3 * sh.moe_hidden * sh.moe_inter * tokens * sh.moe_topk


def moe_min_bytes(tokens: int, sh: Shapes, mode: str) -> float:
    """All expert weights read once (+ fp8 block scales), x read, the output written (bf16)."""
    weights = 3 * sh.moe_hidden * sh.moe_inter * sh.moe_experts
    per_weight = 2 if mode == "bf16" else 1 + 4 / (128 * 128)
    return float(weights * per_weight + 2 * 2 * tokens * sh.moe_hidden)


@functools.partial(jax.jit, static_argnames=("tokens", "experts", "k", "zipf"))
def make_routing(key, *, tokens: int, experts: int, k: int, zipf: float):
    """Random top-k routing with a Zipf-like load: expert popularity p_e ∝ (rank_e + 1)^-zipf (ranks a random
    permutation), k distinct experts per token drawn without replacement ∝ p (Gumbel top-k). Routing weights
    uniform in [0.1, 1], normalized to sum 1.5 per token. → (ids [N, k] int32, weights [N, k] f32)."""
    k1, k2, k3 = jax.random.split(key, 3)
    rank = jax.random.permutation(k1, experts)
    log_p = -zipf * jnp.log1p(rank.astype(F32))
    gumbel = jax.random.gumbel(k2, (tokens, experts), F32)
    _, ids = jax.lax.top_k(log_p[None, :] + gumbel, k)
    w = jax.random.uniform(k3, (tokens, k), F32, 0.1, 1.0)
    return ids.astype(jnp.int32), 1.5 * w / w.sum(-1, keepdims=True)


@jax.jit
def quantize_weight_blocks(w):
    """Expert weights [E, O, I] → (float8_e4m3fn [E, O, I], float32 scales [E, O // 128, I // 128]):
    DeepSeek's 128 × 128 block format (w ≈ fp8 · scale), one expert at a time (bounded temporaries)."""

    def one(we):  # [O, I]
        o, i = we.shape
        blocks = we.astype(F32).reshape(o // 128, 128, i // 128, 128)
        scale = jnp.maximum(jnp.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0  # [O // 128, I // 128]
        return (blocks / scale[:, None, :, None]).astype(FP8).reshape(o, i), scale

    return jax.lax.map(one, w)


@functools.partial(jax.jit, static_argnames=("capacity", "limit", "f32_intermediates"))
def capacity_einsum(x, expert_ids, weights, gate_up, down, *, capacity: int, limit: float,
                    f32_intermediates: bool = False):  # fmt: skip
    """Capacity-padded MoE as two batched einsums over [E, capacity] slots (the usual non-dropless baseline).

    Pairs are sorted by expert (stable); the first `capacity` pairs of each expert get a slot, the rest are dropped
    (they contribute nothing). x [N, D], expert_ids / weights [N, K], gate_up [E, 2I, D], down [E, D, I] (bf16).
    → (out [N, D] in x.dtype, fraction of pairs dropped). f32_intermediates keeps the gate/up products and y in f32
    (the reference use); otherwise they are rounded to x.dtype as a plain bf16 einsum does.
    """
    n, k = expert_ids.shape
    e, two_i, d = gate_up.shape
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = jnp.bincount(flat, length=e)
    rank = jnp.arange(n * k) - (jnp.cumsum(counts) - counts)[sorted_e]  # position within its expert
    keep = rank < capacity
    slot = jnp.where(keep, sorted_e * capacity + rank, e * capacity)  # e · capacity: the dump slot
    token_of_slot = jnp.full((e * capacity + 1,), n, jnp.int32).at[slot].set((order // k).astype(jnp.int32))
    x_pad = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # row n: zeros for empty slots
    dispatched = x_pad[token_of_slot[:-1]].reshape(e, capacity, d)  # [E, cap, D]
    acc = F32 if f32_intermediates else x.dtype
    h = jnp.einsum("ecd,efd->ecf", dispatched, gate_up, preferred_element_type=acc)  # [E, cap, 2I]
    gate, up = h[..., : two_i // 2].astype(F32), h[..., two_i // 2 :].astype(F32)
    h = (jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)).astype(x.dtype)  # [E, cap, I]
    y = jnp.einsum("eci,edi->ecd", h, down, preferred_element_type=acc)  # [E, cap, D]
    y_pad = jnp.concatenate([y.reshape(e * capacity, d), jnp.zeros((1, d), y.dtype)])
    slot_of_pair = jnp.zeros((n * k,), jnp.int32).at[order].set(slot.astype(jnp.int32))
    out = (y_pad[slot_of_pair].reshape(n, k, d).astype(F32) * weights[..., None].astype(F32)).sum(1)
    return out.astype(x.dtype), 1.0 - keep.mean(dtype=F32)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
        self.ceil: dict[str, float] = {}  # this run's ceilings: "bf16" / "fp8" TFLOP/s, "copy" TB/s
        self.pa = None  # dsv4.pallas.attention
        self.ops: dict[str, object] = {}  # indexer / decode / moe kernels and their XLA paths (import_ops)
        self.moe_ragged_state = None  # XLA ragged_dot MoE: None (not tried), "ok", "memory" or "error"
        self.moe_weights_cache = None  # kept from the moe step to the moe-large step
        self.watchdog = None  # threading.Timer (start_watchdog)
        self.decode_scales = args.decode_fp8_scales  # the fp8 page-scale layout decode uses
        self.decode_floors: set[tuple[int, int]] = set()
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

    def import_ops(self):
        """The indexer / decode / MoE kernels and their XLA paths, each on its own (one failing import skips only
        what needs it). Runs after import_dsv4, which installs a bare `dsv4` package if the real one fails."""
        imports = {
            "indexer": ("dsv4.pallas.indexer", None),
            "index_topk_jnp": ("dsv4.attention", "index_topk_jnp"),
            "decode": ("dsv4.pallas.decode", None),
            "moe": ("dsv4.pallas.moe", None),
            "routed_experts_jnp": ("dsv4.moe", "routed_experts_jnp"),
        }
        for name, (module, attr) in imports.items():
            try:
                mod = importlib.import_module(module)
                self.ops[name] = getattr(mod, attr) if attr else mod
            except Exception as exc:
                self.rec.error(f"import {module}{'.' + attr if attr else ''}", exc)

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
                               target_s=self.args.target_s, smoke=self.args.smoke, only=self.args.only,
                               indexer_lengths=self.args.indexer_lengths,
                               indexer_stream_max=self.args.indexer_stream_max,
                               decode_contexts=self.args.decode_contexts,
                               decode_batches=self.args.decode_batches, decode_fp8_scales=self.args.decode_fp8_scales,
                               moe_tokens=self.args.moe_tokens, moe_modes=self.args.moe_modes,
                               moe_zipf=self.args.moe_zipf, moe_variants_bf16=self.args.moe_variants_bf16,
                               moe_variants_w8a8=self.args.moe_variants_w8a8,
                               section_budgets=self.args.section_budgets)  # fmt: skip
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
        self.rec.log("variants: " + "; ".join(f"{n}={_bs_str(b)}" for n, b in self.variants))
        a = self.args
        if any(s in a.only for s in NEW_SECTIONS):
            self.rec.log(f"indexer: Hi={sh.index_heads} Di={sh.index_dim} S {a.indexer_lengths} (streaming S <= "
                         f"{a.indexer_stream_max}); decode: contexts "
                         f"{a.decode_contexts} batches {a.decode_batches} page {sh.page_size}; moe: D={sh.moe_hidden} "
                         f"I={sh.moe_inter} E={sh.moe_experts} top-{sh.moe_topk} tokens {a.moe_tokens} modes "
                         f"{a.moe_modes} zipf {a.moe_zipf}; section caps {a.section_budgets or 'none'}")  # fmt: skip
        self.rec.log("=" * 100)

    # ----- helpers -----
    def pct(self, tflops):
        if tflops is None or not self.mm_bf16:
            return None
        return 100.0 * tflops / self.mm_bf16

    def pct_ref(self, row) -> float | None:
        """% of this run's ceiling named by row["ref"]: TF/s against a matmul ("bf16", "fp8"), TB/s against "copy"."""
        ref = row.get("ref") or "bf16"
        value = row["tbps"] if ref == "copy" else row["tflops"]
        ceiling = self.ceil.get(ref)
        return None if value is None or not ceiling else 100.0 * value / ceiling

    def report(self, section, layer, seq, variant, timing, flops=None, nbytes=None, note="", ref="bf16", **extra):
        ms = timing["ms"]
        tflops = flops / (ms * 1e-3) / 1e12 if flops else None
        tbps = nbytes / (ms * 1e-3) / 1e12 if nbytes else None
        row = self.rec.add(section=section, layer=layer, seq=seq, variant=variant, ms=ms, tflops=tflops,
                           pct_mm=self.pct(tflops), tbps=tbps, note=note, flops=flops, bytes=nbytes,
                           reps=timing["reps"], spread=timing["spread"], times_ms=timing["times_ms"],
                           warm_s=timing["warm_s"], ref=ref, **extra)  # fmt: skip
        row["pct_ref"] = self.pct_ref(row)
        self.measured[(section, layer, seq, variant)] = row
        parts = [f"{section:<9} {layer:<9} S={seq:<7} {variant:<16} {_fmt_ms(ms, 10)} ms"]
        if tflops is not None:
            pct = self.pct(tflops)
            parts.append(f"{tflops:7.1f} TF/s" + (f" ({pct:4.0f}% mm)" if pct is not None else ""))
        if tbps is not None:
            parts.append(f"{tbps:5.2f} TB/s")
        if ref != "bf16" and row["pct_ref"] is not None:
            parts.append(f"({row['pct_ref']:.0f}% of {ref})")
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
    def matmul_ceiling(self, dtype_name: str, n: int, *, label: str = "", compiler_options: dict | None = None):
        where = f"ceilings {dtype_name} matmul {n}^3{' ' + label if label else ''}"
        if not self.budget.fits(where, self.item_cost("matmul", 2 * n**3 / 300e12)):
            return
        key = jax.random.key(self.args.seed + 7)
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
            compiled, cs = aot_compile(fn, sets[0], compiler_options=compiler_options)
            self.budget.saw_compile("matmul", cs)
            t = time_compiled(compiled, sets, target_s=self.args.target_s, budget=self.budget)
            flops = 2.0 * n**3
            tf = flops / (t["ms"] * 1e-3) / 1e12
            if tf > self.ceil.get(dtype_name, 0.0):
                self.ceil[dtype_name] = tf
            if dtype_name == "bf16":
                self.mm_bf16 = self.ceil["bf16"]
            self.report("ceiling", f"mm-{dtype_name}", n, f"{n}^3{' ' + label if label else ''}", t, flops=flops,
                        compile_s=cs, ref=dtype_name)  # fmt: skip
            del sets, compiled
        except Exception as exc:
            self.rec.error(where, exc)
        free()

    def copy_ceiling(self):
        key = jax.random.key(self.args.seed + 7)
        try:
            n = self.sh.copy_bytes // 4
            side = 1 << 15 if n == (1 << 30) else n
            x = jax.random.bits(jax.random.fold_in(key, 99), (side, n // side) if side != n else (n,), jnp.uint32)
            compiled, cs = aot_compile(jax.jit(lambda x: x ^ jnp.uint32(1)), dict(x=x))
            t = time_compiled(compiled, [dict(x=x)], target_s=self.args.target_s, budget=self.budget)
            row = self.report("ceiling", "copy", self.sh.copy_bytes // (1 << 20), "x^1 u32 MiB", t,
                              nbytes=2.0 * self.sh.copy_bytes, compile_s=cs, ref="copy")  # fmt: skip
            self.ceil["copy"] = max(self.ceil.get("copy", 0.0), row["tbps"])
            del x, compiled
        except Exception as exc:
            self.rec.error("ceilings copy", exc)
        free()

    def ceilings(self):
        self.rec.log("--- ceilings (same run) ---")
        for dtype_name in ("bf16", "fp8"):
            for n in self.sh.matmul_sizes:
                self.matmul_ceiling(dtype_name, n)
        self.copy_ceiling()
        self.rec.write_json()

    def ceilings_lite(self):
        """The ceilings the indexer / decode / moe sections compare with, when the full `ceilings` section is not
        run: bf16 matmul at the largest size, fp8 at the largest size through cuBLASLt only (XLA's Triton-GEMM
        autotuning of the fp8 dot takes up to minutes at these sizes), and the copy."""
        self.rec.log("--- ceilings, lite (for the indexer / decode / moe sections) ---")
        n = max(self.sh.matmul_sizes)
        self.matmul_ceiling("bf16", n)
        self.matmul_ceiling("fp8", n, label="cublas", compiler_options={"xla_gpu_enable_triton_gemm": False})
        if self.ceil.get("fp8", 0.0) < 1.2 * self.ceil.get("bf16", 0.0):
            # the cuBLAS-only build failed or fell back to a slow path: XLA's default (autotuned) fp8 dot, smaller
            self.rec.log(f"WARNING: fp8 matmul through cuBLASLt {self.ceil.get('fp8', 0.0):.0f} TF/s, not above the "
                         f"bf16 one; trying XLA's default fp8 dot at {min(self.sh.matmul_sizes)}^3")  # fmt: skip
            self.matmul_ceiling("fp8", min(self.sh.matmul_sizes))
        self.copy_ceiling()
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
                # the kernel's own FP8 default when the baseline is the plain default (its 128-row tiles do not fit
                # in shared memory with FP8 inputs at D = 512, docs/kernels/attention.md); the row records the sizes
                # used
                bs8 = self.pa.default_block_sizes(FP8) if bs == self.pa.BlockSizes() else bs
                row8 = self.run_pallas(fp8_inputs, name, bs8, ref, {}, section="v4-fp8", tag="fp8",
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

    # ----- sections 6–8 (indexer, decode, moe): shared helpers -----
    def op_compiled(self, key: tuple, fn, kwargs: dict, static: dict | None = None, *, kind: str = "xla",
                    compiler_options: dict | None = None):  # fmt: skip
        """AOT-compiles fn once per key (a tuple whose first element names the section). → (compiled, seconds)."""
        if key in self.compiled:
            return self.compiled[key], 0.0
        compiled, cs = aot_compile(fn, kwargs, static, compiler_options)
        self.budget.saw_compile(kind, cs)
        self.compiled[key] = compiled
        return compiled, cs

    def drop_compiled(self, prefix: str, *rest):
        """Forgets the executables whose key starts with (prefix, *rest)."""
        head = (prefix, *rest)
        for k in [k for k in self.compiled if k[: len(head)] == head]:
            del self.compiled[k]

    def predict_from(self, section: str, layer: str, variant: str, size: int, work, default_rate: float) -> float:
        """Seconds per call: the same (section, layer, variant) measured at the largest size so far, scaled by
        work(size) / work(that size); else any variant of (section, layer), fastest at the largest size, × 1.5;
        else work(size) / default_rate."""
        same = [(n, r) for (s, lay, n, v), r in self.measured.items() if s == section and lay == layer and v == variant]
        if same:
            n, r = max(same, key=lambda x: x[0])
            return r["ms"] * 1e-3 * work(size) / work(n)
        other = [(n, r) for (s, lay, n, v), r in self.measured.items() if s == section and lay == layer]
        if other:
            n, r = max(other, key=lambda x: (x[0], -x[1]["ms"]))
            return 1.5 * r["ms"] * 1e-3 * work(size) / work(n)
        return work(size) / default_rate

    def memory_fits(self, compiled, where: str) -> bool:
        """False (with a SKIP line) when the executable's temporaries + outputs exceed 95% of the free memory."""
        mem = memory_need(compiled)
        if mem is not None and mem[0] > 0.95 * mem[1]:
            self.rec.skip(where, f"needs {mem[0] / GiB:.1f} GiB of temporaries + outputs, {mem[1] / GiB:.1f} GiB free")
            return False
        return True

    def add_check(self, section: str, text: str, ok: bool, **fields):
        self.rec.checks.append(dict(section=section, text=text, ok=ok, **fields))
        self.rec.log(f"CHECK {text} -> {'OK' if ok else 'FAIL'}")

    # ----- section 6: lightning indexer -----
    def indexer(self, large: bool = False):
        """large=False: the lengths below --large-from; large=True: the rest (run last, see the order of work)."""
        ix, sh = self.ops.get("indexer"), self.sh
        lengths = [s for s in self.args.indexer_lengths if (s >= self.args.large_from) == large]
        if not lengths:
            return
        if ix is None:
            self.rec.skip("indexer", "dsv4.pallas.indexer did not import")
            return
        self.rec.log(f"--- lightning indexer: B=1, Hi={sh.index_heads} Di={sh.index_dim} top-{sh.topk}, keys C = S/"
                     f"{sh.csa_rate}, S {lengths}; Pallas two-pass fp8 + bf16, XLA bf16, streaming fp8 + bf16 at S <= "
                     f"{self.args.indexer_stream_max} ---")  # fmt: skip
        for seq in lengths:
            where = f"indexer S={seq}"
            if self.budget.left() < 5:
                self.rec.skip(where, "budget spent")
                continue
            if seq // sh.csa_rate < 1:
                self.rec.skip(where, f"no compressed key (rate {sh.csa_rate})")
                continue
            first = seq == self.args.indexer_lengths[0]
            try:
                inputs = build_indexer_inputs(seq, sh, self.args.seed, fp8=True, bf16=True)
            except Exception as exc:
                self.rec.error(f"{where} inputs", exc)
                free()
                continue
            keep = {} if first else None  # outputs kept for the checks at the smallest S
            try:
                self.indexer_pallas(seq, "two-pass", "fp8", inputs["fp8"], keep)
                self.indexer_pallas(seq, "two-pass", "bf16", inputs["bf16"], keep)
                self.indexer_xla(seq, "bf16", inputs["bf16"], keep)
                if seq <= self.args.indexer_stream_max:
                    self.indexer_pallas(seq, "stream", "fp8", inputs["fp8"], keep)
                    self.indexer_pallas(seq, "stream", "bf16", inputs["bf16"], keep)
                else:
                    self.rec.skip(f"indexer stream S={seq}", f"S > --indexer-stream-max {self.args.indexer_stream_max}")
                if first:
                    self.indexer_checks(seq, inputs, keep)
                if self.args.indexer_xla_fp8:
                    self.indexer_xla(seq, "fp8", inputs["fp8"], None)
            except Exception as exc:
                self.rec.error(where, exc)
            finally:
                del inputs, keep
                self.drop_compiled("ix", seq)
                free()
            self.rec.write_json()

    def indexer_static(self) -> dict:
        sh = self.sh
        return dict(rate=sh.csa_rate, k=sh.topk, softmax_scale=sh.index_dim**-0.5)

    def indexer_pallas(self, seq: int, impl: str, dtype_name: str, args: dict, keep: dict | None):
        """impl "two-pass": index_topk_two_pass (scores kernel per query chunk + exact grouped top-k, its default
        query chunk and ScoreBlocks); "stream": index_topk (one kernel, streaming bitonic top-k, default BlockSizes)."""
        ix, sh = self.ops["indexer"], self.sh
        where = f"indexer {impl} {dtype_name} S={seq}"
        flops, dense = indexer_flops(seq, sh)
        rate = 1e9 if self.args.smoke else (100e12 if impl == "two-pass" else 4e12)  # H200 fp8 32K: ~150, ~4 TF/s
        t_pred = self.predict_from("indexer", impl, dtype_name, seq, lambda n: indexer_flops(n, sh)[0], rate)
        if t_pred > 60:
            self.rec.skip(where, f"one call predicted {t_pred:.0f} s (> 60 s)")
            return
        if not self.budget.fits(where, self.item_cost("indexer", t_pred)):
            return
        check = {}

        def on_first(out):
            check.update({k: int(v) for k, v in topk_validity(out, args["positions"], rate=sh.csa_rate,
                                                               count=seq // sh.csa_rate).items()})  # fmt: skip
            if keep is not None:
                keep[f"{impl}-{dtype_name}"] = out

        try:
            extra = {}
            if impl == "two-pass":  # --smoke: 2 key tiles per span, 2 query chunks (the second padded at S=96)
                fn = ix.index_topk_two_pass
                blocks = ix.ScoreBlocks(block_c=16, span=32) if self.args.smoke else ix.ScoreBlocks()
                chunk = 64 if self.args.smoke else None
                static = dict(self.indexer_static(), blocks=blocks, query_chunk=chunk, interpret=self.interpret)
                extra = dict(blocks=dataclasses.asdict(blocks),
                             query_chunk=min(chunk or ix.default_query_chunk(seq // sh.csa_rate), seq))
            else:
                fn = ix.index_topk
                bs = ix.BlockSizes(block_q=4, block_c=16) if self.args.smoke else ix.BlockSizes()
                static = dict(self.indexer_static(), block_sizes=bs, interpret=self.interpret)
            compiled, cs = self.op_compiled(("ix", seq, impl, dtype_name), fn, args, static, kind="indexer")
            pre = jnp.full((1, seq, sh.topk), -7, jnp.int32)  # an impossible index in the block handed out next
            pre.block_until_ready()
            del pre
            t = time_compiled(compiled, [args], target_s=self.args.target_s, budget=self.budget, first_out=on_first)
            bad = sum(check.values())
            note = f"dense {dense / (t['ms'] * 1e-3) / 1e12:.0f}TF/s " + (f"INVALID {check}" if bad else "valid")
            self.report("indexer", impl, seq, dtype_name, t, flops=flops,
                        nbytes=indexer_min_bytes(seq, sh, 1 if dtype_name == "fp8" else 2), note=note,
                        ref="fp8" if dtype_name == "fp8" else "bf16", compile_s=cs, check=check,
                        dense_flops=dense, **extra)  # fmt: skip
            if bad:
                self.rec.log(f"WARNING {where}: invalid top-k lists {check}")
        except Exception as exc:
            self.rec.error(where, exc)
        free()

    def indexer_xla_fn(self, query_chunk: int | None = None):
        chunk = query_chunk or (32 if self.args.smoke else 1024)
        return jax.jit(functools.partial(self.ops["index_topk_jnp"], **self.indexer_static(), query_chunk=chunk))

    def indexer_xla(self, seq: int, dtype_name: str, args: dict, keep: dict | None):
        """index_topk_jnp (einsum → ReLU → weighted sum → mask → lax.top_k, 1024 queries per scan step). fp8: the
        per-(token, head) q scales fold into the weights; the per-entry key scales cannot and are left out (a
        timing of the same work, not the same function)."""
        sh = self.sh
        where = f"indexer xla {dtype_name} S={seq}"
        if "index_topk_jnp" not in self.ops:
            self.rec.skip(where, "dsv4.attention.index_topk_jnp did not import")
            return
        flops, dense = indexer_flops(seq, sh)
        pair_rate = 1e7 if self.args.smoke else 25e12 * 2 / (2 * sh.index_heads * sh.index_dim)  # ~25 TF/s
        t_pred = self.predict_from("indexer", "xla", dtype_name, seq, lambda n: float(n) * (n // sh.csa_rate),
                                   pair_rate)  # fmt: skip  # XLA scores all S·C pairs
        if seq != self.args.indexer_lengths[0] and t_pred > self.args.indexer_xla_max_call:
            self.rec.skip(where, f"one call predicted {t_pred:.1f} s (> {self.args.indexer_xla_max_call:g} s)")
            return
        if not self.budget.fits(where, self.item_cost("xla", t_pred)):
            return
        kw = {k: args[k] for k in ("q", "keys", "weights", "positions")}
        if dtype_name == "fp8":
            kw["weights"] = args["weights"] * args["q_scale"]

        def on_first(out):
            if keep is not None:
                keep[f"xla-{dtype_name}"] = out

        try:
            compiled, cs = self.op_compiled(("ix", seq, "xla", dtype_name), self.indexer_xla_fn(), kw, kind="xla")
            if not self.memory_fits(compiled, where):
                return
            t = time_compiled(compiled, [kw], target_s=self.args.target_s, budget=self.budget, first_out=on_first)
            self.report("indexer", "xla", seq, dtype_name if dtype_name == "bf16" else "fp8-noks", t, flops=flops,
                        nbytes=indexer_min_bytes(seq, sh, 1 if dtype_name == "fp8" else 2),
                        note=f"dense {dense / (t['ms'] * 1e-3) / 1e12:.0f}TF/s",
                        ref="fp8" if dtype_name == "fp8" else "bf16", compile_s=cs)  # fmt: skip
        except Exception as exc:
            self.rec.error(where, exc)
        free()

    def indexer_checks(self, seq: int, inputs: dict, keep: dict):
        """Index sets per row, for each Pallas path (two-pass, stream) that ran: bf16 vs the XLA path (same bf16
        inputs); fp8 vs index_topk_jnp on the dequantized float32 inputs at HIGHEST precision. Near-tie swaps are
        allowed: a pick missing from the other list must score within the tolerance of that list's k-th score (exact
        float32 scores of the picks)."""
        where = f"indexer check S={seq}"
        impls = [impl for impl in ("two-pass", "stream") if f"{impl}-bf16" in keep or f"{impl}-fp8" in keep]
        if not impls:
            self.rec.skip(where, "no Pallas output")
            return
        for impl in impls:
            if f"{impl}-bf16" in keep and "xla-bf16" in keep:
                self.indexer_compare(seq, f"{impl} bf16", keep[f"{impl}-bf16"], keep["xla-bf16"], inputs["bf16"],
                                     against="index_topk_jnp", tol=1e-4, max_frac=1e-3)  # fmt: skip
            else:
                self.rec.skip(f"{where} {impl} bf16", f"the {impl} or XLA bf16 output is missing")
        got8 = [impl for impl in impls if f"{impl}-fp8" in keep]
        if not got8 or "index_topk_jnp" not in self.ops:
            self.rec.skip(f"{where} fp8", "no Pallas fp8 output, or index_topk_jnp is missing")
            return
        try:
            f8 = inputs["fp8"]
            deq = dict(q=f8["q"].astype(F32) * f8["q_scale"][..., None], keys=f8["keys"].astype(F32) *
                       f8["k_scale"][..., None], weights=f8["weights"], positions=f8["positions"])  # fmt: skip
            with jax.default_matmul_precision("highest"):
                want = self.indexer_xla_fn()(**deq)
            del deq
            for impl in got8:
                self.indexer_compare(seq, f"{impl} fp8", keep[f"{impl}-fp8"], want, f8,
                                     against="index_topk_jnp f32 dequantized", tol=2e-2,
                                     max_frac=1e-2)  # fmt: skip
        except Exception as exc:
            self.rec.error(f"{where} fp8", exc)
        free()

    def indexer_compare(self, seq, name, got, want, args, *, against: str, tol: float, max_frac: float):
        try:
            scale = self.sh.index_dim**-0.5
            extra = {k: args[k] for k in ("q_scale", "k_scale") if k in args}
            scores = [index_pick_scores(args["q"], args["keys"], args["weights"], idx, **extra, softmax_scale=scale)
                      for idx in (got, want)]  # fmt: skip
            c = {k: float(v) for k, v in topk_set_compare(got, want, *scores).items()}
            frac = c["missing"] / max(c["picks"], 1.0)
            deficit = c["max_rel_deficit"]
            ok = frac <= max_frac and c["count_differ"] == 0 and (c["missing"] == 0 or deficit <= tol)
            text = (f"indexer S={seq} {name} vs {against}: {frac:.1e} of {c['picks']:.0f} picks differ "
                    f"({c['rows_differ']:.0f} rows), worst rel score deficit "
                    f"{'-' if c['missing'] == 0 else f'{deficit:.1e}'} (tie tol {tol:g}), count mismatches "
                    f"{c['count_differ']:.0f}")  # fmt: skip
            self.add_check("indexer", text, ok, seq=seq, variant=name, frac=frac, **c)
        except Exception as exc:
            self.rec.error(f"indexer compare S={seq} {name}", exc)

    # ----- section 7: paged decode attention -----
    def decode(self):
        dc, sh, args = self.ops.get("decode"), self.sh, self.args
        if dc is None:
            self.rec.skip("decode", "dsv4.pallas.decode did not import")
            return
        # per-token tile scales need D % 64 == 0 (the smoke shapes have D = 32)
        self.decode_scales = args.decode_fp8_scales if sh.head_dim % 64 == 0 else "channel"
        self.rec.log(f"--- paged decode attention: H={sh.heads} D={sh.head_dim}, window/ring {sh.window}, "
                     f"{sh.page_size} entries per page; contexts {args.decode_contexts}, batches "
                     f"{args.decode_batches}; fp8 scales per {self.decode_scales} ---")  # fmt: skip
        pools = {}
        plan = [(ctx, layer, dt) for ctx in args.decode_contexts for layer in ("hca", "csa") for dt in ("bf16", "fp8")]
        # the sweep, largest context first: its bytes (128 MiB a request at 512K) are the bandwidth measurement
        plan += [(ctx, "sweep", dt) for ctx in reversed(args.decode_contexts) for dt in args.decode_sweep_dtypes]
        try:
            for ctx, layer, dtype_name in plan:
                if self.budget.left() < 3:
                    self.rec.skip(f"decode {layer} ctx={ctx} {dtype_name}", "budget spent")
                    continue
                try:
                    if dtype_name not in pools:
                        pools[dtype_name] = self.decode_pool(dtype_name)
                    self.decode_item(pools[dtype_name], layer, ctx, dtype_name)
                except Exception as exc:
                    self.rec.error(f"decode {layer} ctx={ctx} {dtype_name}", exc)
                free()
                self.rec.write_json()
        finally:
            del pools
            self.drop_compiled("dec")
            free()

    def decode_floor(self, sets: list[dict], batch: int):
        """Launch floor of the pipelined timing, once per (argument count, batch): a trivial executable (q · 2) that
        takes the same arguments as the kernel call and is dispatched the same way. A decode time near it is the
        host's dispatch rate, not the kernel (the model would capture decode steps in one graph)."""
        key = (len(sets[0]), batch)
        if key in self.decode_floors:
            return
        self.decode_floors.add(key)
        try:
            compiled, _ = aot_compile(jax.jit(lambda **kw: kw["q"] * 2), sets[0])
            t = time_pipelined(compiled, sets, budget=self.budget)
            self.report("decode", "floor", 0, f"{key[0]}args-B{batch}", t, ref="copy",
                        note=f"launch floor; sync {t['sync_ms'] * 1e3:.0f}us")  # fmt: skip
        except Exception as exc:
            self.rec.error("decode launch floor", exc)

    def decode_pool(self, dtype_name: str) -> dict:
        pool = make_decode_pool(self.sh, self.args.seed, dtype_name, self.decode_scales)
        self.rec.log(f"decode pool {dtype_name}: ring {pool['kv_pages'].shape[0]} pages, compressed "
                     f"{pool['compressed_pages'].shape[0]} pages of {self.sh.page_size} × {self.sh.head_dim} "
                     f"({sum(a.nbytes for a in pool.values()) / GiB:.2f} GiB)")  # fmt: skip
        return pool

    def decode_item(self, pool: dict, layer: str, ctx: int, dtype_name: str):
        """One (layer, context, dtype): block tables, lengths and picks for enough requests to rotate through
        --rotate bytes per batch size, then each batch size timed (pipelined), checked at the smallest context."""
        dc, sh, args = self.ops["decode"], self.sh, self.args
        count, topk, _ = decode_entries(layer, ctx, sh)
        if count < 1:
            self.rec.skip(f"decode {layer} ctx={ctx}", "no compressed entry")
            return
        ps = sh.page_size
        ring_cols = -(-sh.window // ps)
        if layer == "csa":  # one table width for every context: the CSA kernel then compiles once per batch size
            ccols = -(-max(c // sh.csa_rate for c in args.decode_contexts) // ps)
        else:  # HCA's split count follows the table capacity (as in the model): one compile per context
            ccols = -(-count // ps)
        per_request = decode_bytes(layer, ctx, 1, sh, dtype_name, self.decode_scales)
        n_sets = {b: int(min(512 if b == 1 else 64, max(2, -(-sh.rotate_bytes // (b * per_request)))))
                  for b in args.decode_batches}  # fmt: skip
        n_req = max(b * n for b, n in n_sets.items())
        keys = jax.random.split(jax.random.key(args.seed * 1000 + ctx % 9973 + len(layer)), 5)
        ring_tables = jax.random.randint(keys[0], (n_req, ring_cols), 1, pool["kv_pages"].shape[0], jnp.int32)
        comp_tables = jax.random.randint(keys[1], (n_req, ccols), 1, pool["compressed_pages"].shape[0], jnp.int32)
        picks = None if topk is None else make_request_topk(keys[2], n_requests=n_req, count=count, k=topk)
        bmax = max(args.decode_batches)
        q_sets = [randn(keys[3 + i], (bmax, sh.heads, sh.head_dim), BF16) for i in range(2)]
        shared = {k: v for k, v in pool.items()}
        static = dict(sliding_window=sh.window, scale=sh.head_dim**-0.5)
        for b in args.decode_batches:
            where = f"decode {layer} ctx={ctx} {dtype_name} B={b}"
            nbytes = decode_bytes(layer, ctx, b, sh, dtype_name, self.decode_scales)
            t_pred = nbytes / (1e9 if args.smoke else 2e12)
            cost = self.budget.compile_est("decode") + 2.0 + 60 * t_pred
            if not self.budget.fits(where, cost):
                continue
            sets = []
            lens = dict(seq_lens=jnp.full((b,), ctx, jnp.int32), compressed_lens=jnp.full((b,), count, jnp.int32))
            q_b = [q[:b] for q in q_sets]
            for i in range(n_sets[b]):
                rows = slice(i * b, (i + 1) * b)
                s = dict(shared, **lens, q=q_b[i % 2], block_tables=ring_tables[rows],
                         compressed_block_tables=comp_tables[rows])  # fmt: skip
                if picks is not None:
                    s["topk_indices"] = picks[rows]
                sets.append(s)
            check_here = ctx == args.decode_contexts[0] and b == bmax
            check = {}

            def on_first(out, sets=sets, check=check, check_here=check_here):
                check["nans"] = int(nan_count(out))
                if check_here:
                    want = dc.paged_decode_attention_reference(**sets[0], **static)
                    check["rel_l2"] = float(rel_l2_and_nans(out, want)[0])

            try:
                key = ("dec", layer, dtype_name, b, ccols)
                compiled, cs = self.op_compiled(key, dc.paged_decode_attention, sets[0],
                                                dict(static, interpret=self.interpret), kind="decode")  # fmt: skip
                t = time_pipelined(compiled, sets, budget=self.budget, first_out=on_first)
                self.decode_floor(sets, b)
                note = f"sync {t['sync_ms'] * 1e3:.0f}us {nbytes / 1e6:.1f}MB"
                if "rel_l2" in check:
                    note += f" err {check['rel_l2']:.1e}"
                if check["nans"]:
                    note += f" NaN {check['nans']}"
                self.report("decode", layer, ctx, f"{dtype_name}-B{b}", t, flops=decode_flops(layer, ctx, b, sh),
                            nbytes=nbytes, note=note, ref="copy", compile_s=cs, calls=t["calls"], sets=len(sets),
                            sync_ms=t["sync_ms"], check=check)  # fmt: skip
                if "rel_l2" in check:
                    ok = check["nans"] == 0 and check["rel_l2"] < 2e-2
                    self.add_check("decode", f"decode {layer} ctx={ctx} {dtype_name} B={b}: rel L2 "
                                   f"{check['rel_l2']:.2e} vs paged_decode_attention_reference, NaN {check['nans']}",
                                   ok, seq=ctx, variant=f"{dtype_name}-B{b}", **check)  # fmt: skip
                if check_here and layer == "csa" and dtype_name == "bf16":
                    self.decode_poisoned_check(sets[0], static, where)
            except Exception as exc:
                self.rec.error(where, exc)
            del sets
            free()

    def decode_poisoned_check(self, kw: dict, static: dict, where: str):
        """The kernel's split partials start as NaN (out_init): anything it fails to write reaches the output."""
        dc = self.ops["decode"]
        try:
            kw = dict(kw, out_init=jnp.asarray(np.nan, F32))
            compiled, _ = aot_compile(dc.paged_decode_attention, kw, dict(static, interpret=self.interpret))
            got = compiled(**kw)
            kw.pop("out_init")
            want = dc.paged_decode_attention_reference(**kw, **static)
            err, nans = (float(x) for x in rel_l2_and_nans(got, want))
            self.add_check("decode", f"{where} poisoned partials: NaN {nans:.0f}, rel L2 {err:.2e} vs "
                           "paged_decode_attention_reference", nans == 0 and err < 2e-2, rel_l2=err,
                           nans=nans)  # fmt: skip
        except Exception as exc:
            self.rec.error(f"{where} poisoned check", exc)

    # ----- section 8: MoE -----
    def moe(self, large: bool = False):
        """large=False: the token counts below --large-from, then the BlockSizes sweep and ragged_dot at the middle
        count if it is one of them; large=True: the rest (run last, see the order of work). The weights are kept
        between the two calls."""
        pm, sh, args = self.ops.get("moe"), self.sh, self.args
        tokens = args.moe_tokens
        mine = [n for n in tokens if (n >= args.large_from) == large]
        mid = tokens[min(1, len(tokens) - 1)]
        sweep_here = (mid >= args.large_from) == large
        if pm is None:
            if mine:
                self.rec.skip("moe", "dsv4.pallas.moe did not import")
            return
        if not mine and not sweep_here:
            return
        self.rec.log(f"--- MoE routed experts: D={sh.moe_hidden} I={sh.moe_inter} E={sh.moe_experts} "
                     f"top-{sh.moe_topk} (shared expert excluded), routing Zipf {args.moe_zipf}, tokens {mine}, "
                     f"modes {args.moe_modes}{f', BlockSizes sweep at N={mid}' if sweep_here else ''} ---")  # fmt: skip
        try:
            if self.moe_weights_cache is None:
                self.moe_weights_cache = self.moe_weights()
        except Exception as exc:
            self.rec.error("moe weights", exc)
            free()
            return
        weights = self.moe_weights_cache
        variants = {"bf16": parse_variants(args.moe_variants_bf16, pm.BlockSizes, self.rec.error, MOE_VARIANT_KEYS),
                    "w8a8": parse_variants(args.moe_variants_w8a8, pm.BlockSizes, self.rec.error, MOE_VARIANT_KEYS)}
        variants["w8a16"] = variants["w8a8"]
        base = {m: (variants[m][0] if variants[m] else ("default", pm.BlockSizes())) for m in variants}
        try:
            for n in mine:  # main numbers: each mode's baseline variant, the einsum, ragged_dot at the smallest N
                self.moe_at(weights, n, {m: [base[m]] for m in args.moe_modes}, einsum=True,
                            ragged=n == tokens[0], check=n == tokens[0])  # fmt: skip
            rest = {m: variants[m][1:] for m in args.moe_modes if variants[m][1:]}
            if rest and sweep_here:  # BlockSizes sweep
                self.moe_at(weights, mid, rest, einsum=False, ragged=False, check=False)
            if sweep_here and self.moe_ragged_state == "ok" and mid != tokens[0]:
                self.moe_at(weights, mid, {}, einsum=False, ragged=True, check=False)
            if not large and self.moe_ragged_state == "memory" and not args.smoke:  # the small case: runs at all?
                self.moe_at(weights, 512, {"bf16": [base["bf16"]]}, einsum=False, ragged=True, check=True)
        finally:
            del weights
            if large or all(n < args.large_from for n in tokens):
                self.moe_weights_cache = None  # the last MoE step: free the weights
            self.drop_compiled("moe")
            free()

    def moe_weights(self) -> dict:
        """Random V4-Flash expert weights: gate_up [E, 2I, D] ~ N(0, 1/D), down [E, D, I] ~ N(0, 1/I) in bf16, and
        DeepSeek's fp8 format of the same (128 × 128 block scales) when an fp8 mode is asked for."""
        sh = self.sh
        e, d, i = sh.moe_experts, sh.moe_hidden, sh.moe_inter
        k1, k2 = jax.random.split(jax.random.key(self.args.seed + 777))
        scale = jax.jit(lambda a, s: (a.astype(F32) * s).astype(BF16), static_argnums=1)
        gate_up = scale(randn(k1, (e, 2 * i, d), BF16), d**-0.5)
        down = scale(randn(k2, (e, d, i), BF16), i**-0.5)
        out = dict(bf16=dict(gate_up=gate_up, down=down))
        if any(m != "bf16" for m in self.args.moe_modes):
            gu8, gu_s = quantize_weight_blocks(gate_up)
            dn8, dn_s = quantize_weight_blocks(down)
            out["fp8"] = dict(gate_up=gu8, down=dn8, gate_up_scales=gu_s, down_scales=dn_s)
        jax.block_until_ready(out)
        self.rec.log(f"moe weights: {sum(a.nbytes for w in out.values() for a in w.values()) / GiB:.1f} GiB "
                     f"({', '.join(out)})")  # fmt: skip
        return out

    def moe_inputs(self, n: int) -> dict:
        sh = self.sh
        k1, k2 = jax.random.split(jax.random.key(self.args.seed * 1000 + 31 + n % 997))
        x = randn(k1, (n, sh.moe_hidden), BF16)
        ids, w = make_routing(k2, tokens=n, experts=sh.moe_experts, k=sh.moe_topk, zipf=self.args.moe_zipf)
        counts = np.asarray(jnp.bincount(ids.reshape(-1), length=sh.moe_experts))
        mean = n * sh.moe_topk / sh.moe_experts
        self.rec.log(f"moe N={n}: pairs per expert mean {mean:.0f}, max {counts.max()} ({counts.max() / mean:.2f}x), "
                     f"min {counts.min()}, empty experts {(counts == 0).sum()}")  # fmt: skip
        return dict(x=x, expert_ids=ids, weights=w, counts=counts)

    def moe_at(self, weights: dict, n: int, pallas: dict, *, einsum: bool, ragged: bool, check: bool):
        """One token count: inputs, the no-drop reference (check), Pallas per mode and variant, the 1.25× capacity
        einsum, XLA ragged_dot."""
        where = f"moe N={n}"
        if self.budget.left() < 5:
            self.rec.skip(where, "budget spent")
            return
        try:
            inputs = self.moe_inputs(n)
        except Exception as exc:
            self.rec.error(f"{where} inputs", exc)
            free()
            return
        ref = {}
        try:
            if check:
                self.moe_reference(weights, inputs, n, ref)
            for mode, vs in pallas.items():
                for name, bs in vs:
                    self.moe_pallas(weights, inputs, n, mode, name, bs, ref)
            if einsum:
                self.moe_einsum(weights, inputs, n, 1.25)
            if ragged:
                self.moe_ragged(weights, inputs, n, ref)
        finally:
            del inputs, ref
            self.drop_compiled("moe", n)
            free()
        self.rec.write_json()

    def moe_reference(self, weights: dict, inputs: dict, n: int, ref: dict):
        """No-drop reference: the capacity einsum with capacity = the largest expert load (nothing dropped), f32
        intermediates. An implementation independent of both kernels' sort / tile logic."""
        sh = self.sh
        where = f"moe reference N={n}"
        try:
            cap = round_up(int(inputs["counts"].max()), 16)
            kw = {k: inputs[k] for k in ("x", "expert_ids", "weights")}
            kw.update(self.moe_weights_for("bf16", weights))
            compiled, _ = aot_compile(capacity_einsum, kw, dict(capacity=cap, limit=sh.swiglu_limit,
                                                               f32_intermediates=True))  # fmt: skip
            if not self.memory_fits(compiled, where):
                return
            out, dropped = compiled(**kw)
            ref["out"] = out
            self.rec.log(f"moe reference N={n}: capacity {cap}, dropped {float(dropped):.1e}")
        except Exception as exc:
            self.rec.error(where, exc)

    @staticmethod
    def moe_weights_for(mode: str, weights: dict) -> dict:
        return dict(weights["bf16"]) if mode == "bf16" else dict(weights["fp8"])

    def moe_check(self, name: str, n: int, out, ref: dict, tol: float) -> str:
        """rel L2 and NaN count of a warm-up output against the no-drop reference → note; also a check entry."""
        nans = int(nan_count(out))
        if "out" not in ref:
            return f"NaN {nans}" if nans else ""
        err = float(rel_l2_and_nans(out, ref["out"])[0])
        self.add_check("moe", f"moe N={n} {name}: rel L2 {err:.2e} vs the no-drop einsum (tol {tol:g}), NaN {nans}",
                       nans == 0 and err <= tol, seq=n, variant=name, rel_l2=err, nans=nans)  # fmt: skip
        return f"err {err:.1e}" + (f" NaN {nans}" if nans else "")

    def moe_pallas(self, weights, inputs, n, mode, name, bs, ref):
        pm, sh = self.ops["moe"], self.sh
        label = f"{mode}-{name}"
        where = f"moe pallas {label} N={n}"
        flops = moe_flops(n, sh)
        rate = 1e9 if self.args.smoke else (600e12 if mode == "w8a8" else 300e12)
        t_pred = self.predict_from("moe", "pallas", label, n, lambda m: moe_flops(m, sh), rate)
        if t_pred > 30:
            self.rec.skip(where, f"one call predicted {t_pred:.0f} s (> 30 s)")
            return
        if not self.budget.fits(where, self.item_cost("moe", t_pred)):
            return
        kw = {k: inputs[k] for k in ("x", "expert_ids", "weights")}
        kw.update(self.moe_weights_for(mode, weights))
        static = dict(limit=self.sh.swiglu_limit, block_sizes=bs, interpret=self.interpret)
        if mode != "bf16":
            static["fp8_activations"] = mode == "w8a8"
        note = {}
        # fp8 modes against the bf16-weight reference: the weights' e4m3 rounding alone is a few % (W8A8 adds x, h)
        tol = {"bf16": 1e-2, "w8a16": 0.1, "w8a8": 0.1}[mode]

        def on_first(out):
            note["text"] = self.moe_check(f"pallas {label}", n, out, ref, tol)

        try:
            compiled, cs = self.op_compiled(("moe", n, "pallas", label), pm.routed_experts, kw, static, kind="moe")
            if not self.memory_fits(compiled, where):
                return
            t = time_compiled(compiled, [kw], target_s=self.args.target_s, budget=self.budget, first_out=on_first)
            self.report("moe", "pallas", n, label, t, flops=flops, nbytes=moe_min_bytes(n, sh, mode),
                        note=note.get("text", ""), ref="fp8" if mode == "w8a8" else "bf16", compile_s=cs,
                        block_sizes=dataclasses.asdict(bs))  # fmt: skip
        except Exception as exc:
            self.rec.error(where, exc)
        free()

    def moe_einsum(self, weights, inputs, n, factor: float):
        sh = self.sh
        where = f"moe einsum cap{factor:g} N={n}"
        cap = round_up(math.ceil(factor * n * sh.moe_topk / sh.moe_experts), 16)
        computed = sh.moe_experts * cap / (n * sh.moe_topk)
        t_pred = self.predict_from("moe", "einsum", f"cap{factor:g}", n, lambda m: moe_flops(m, sh),
                                   (1e9 if self.args.smoke else 300e12) / computed)  # fmt: skip
        if not self.budget.fits(where, self.item_cost("xla", t_pred)):
            return
        kw = {k: inputs[k] for k in ("x", "expert_ids", "weights")}
        kw.update(self.moe_weights_for("bf16", weights))
        dropped = {}
        try:
            compiled, cs = self.op_compiled(("moe", n, "einsum", factor), capacity_einsum, kw,
                                            dict(capacity=cap, limit=sh.swiglu_limit), kind="xla")  # fmt: skip
            if not self.memory_fits(compiled, where):
                return
            t = time_compiled(compiled, [kw], target_s=self.args.target_s, budget=self.budget,
                              first_out=lambda out: dropped.update(frac=float(out[1])))  # fmt: skip
            self.report("moe", "einsum", n, f"cap{factor:g}", t, flops=moe_flops(n, sh),
                        nbytes=moe_min_bytes(n, sh, "bf16"),
                        note=f"drops {100 * dropped.get('frac', float('nan')):.1f}% of pairs, computes {computed:.2f}x",
                        ref="bf16", compile_s=cs, capacity=cap, dropped=dropped.get("frac"))  # fmt: skip
        except Exception as exc:
            self.rec.error(where, exc)
        free()

    def moe_ragged(self, weights, inputs, n, ref):
        """dsv4.moe.routed_experts_jnp: sort, gather, two lax.ragged_dot calls, scatter-add. Guarded: its memory
        need is read from the compiled executable before it runs (it can ask for ~96 GiB at 8K tokens)."""
        sh = self.sh
        where = f"moe xla-ragged N={n}"
        fn = self.ops.get("routed_experts_jnp")
        if fn is None:
            self.rec.skip(where, "dsv4.moe.routed_experts_jnp did not import")
            return
        dense = moe_flops(n, sh) * sh.moe_experts / sh.moe_topk  # if it computes every expert for every row
        t_pred = self.predict_from("moe", "xla-ragged", "bf16", n, lambda m: moe_flops(m, sh),
                                   (1e9 if self.args.smoke else 400e12) * moe_flops(n, sh) / dense)  # fmt: skip
        if not self.budget.fits(where, self.item_cost("xla", t_pred)):
            return
        kw = {k: inputs[k] for k in ("x", "expert_ids", "weights")}
        kw.update(self.moe_weights_for("bf16", weights))
        note = {}
        try:
            jf = jax.jit(functools.partial(fn, limit=sh.swiglu_limit))
            compiled, cs = self.op_compiled(("moe", n, "ragged"), jf, kw, kind="xla")
            if not self.memory_fits(compiled, where):
                self.moe_ragged_state = self.moe_ragged_state or "memory"
                return
            t = time_compiled(compiled, [kw], target_s=self.args.target_s, budget=self.budget,
                              first_out=lambda out: note.update(text=self.moe_check("xla-ragged", n, out, ref, 1e-2)))
            self.report("moe", "xla-ragged", n, "bf16", t, flops=moe_flops(n, sh), nbytes=moe_min_bytes(n, sh, "bf16"),
                        note=note.get("text", ""), ref="bf16", compile_s=cs)  # fmt: skip
            self.moe_ragged_state = self.moe_ragged_state or "ok"
        except Exception as exc:
            self.rec.error(where, exc)
            self.moe_ragged_state = self.moe_ragged_state or "error"
        free()

    # ----- final table -----
    def table(self):
        rec = self.rec
        log = functools.partial(rec.log, stamp=False)  # the table is what the device tool's 12,000-char tail keeps
        order = {"ceiling": 0, "v4-pallas": 1, "v4-xla": 2, "v4-fp8": 3, "cudnn": 4, "indexer": 5, "decode": 6,
                 "moe": 7}  # fmt: skip
        layer_order = {k: i for i, k in enumerate(LAYERS + ("sweep", "floor", "pallas", "two-pass", "xla", "stream",
                                                             "einsum", "xla-ragged"))}  # fmt: skip
        best = {}
        for r in rec.rows:
            if r["section"] == "v4-pallas":
                k = (r["layer"], r["seq"])
                if k not in best or r["ms"] < best[k]["ms"]:
                    best[k] = r

        def sort_key(r):
            sec, lay = order.get(r["section"], 9), layer_order.get(r["layer"], 99)
            if r["section"] == "ceiling":
                return (sec, 0, lay, r["layer"], r["ms"], "")
            if r["section"] == "decode":  # by layer type, context, then dtype and batch
                return (sec, lay, r["seq"], "", 0.0, r["variant"])
            if r["section"] in NEW_SECTIONS:
                return (sec, r["seq"], lay, r["layer"], 0.0, r["variant"])
            return (sec, r["seq"], lay, r["layer"], r["ms"], "")

        rows = sorted(rec.rows, key=sort_key)
        tags = {"bf16": "b", "fp8": "f", "copy": "c"}
        log("")
        log("=" * 100)
        ceil = ", ".join(f"{k} {v:.0f} TF/s" if k != "copy" else f"copy {v:.2f} TB/s" for k, v in self.ceil.items())
        log(f"RESULTS  {rec.header.get('device_kind')}  jax {rec.header.get('jax')}  {rec.header.get('date')}  "
            f"ceilings: {ceil or 'none'}")  # fmt: skip
        log(f"{'section':<9} {'layer':<9} {'S':>7} {'variant':<14} {'ms':>9} {'TF/s':>6} {'%ceil':>5} "
            f"{'TB/s':>5}  note")  # fmt: skip
        decode_rows = [r for r in rows if r["section"] == "decode" and r["layer"] != "floor"]
        for r in rows:
            if r["section"] == "decode":  # a matrix below (36 rows would not fit the output tail); floors: summary
                continue
            tf = f"{r['tflops']:6.1f}" if r["tflops"] is not None else f"{'-':>6}"
            pct_ref = self.pct_ref(r)
            pct = f"{pct_ref:4.0f}{tags.get(r.get('ref'), '?')}" if pct_ref is not None else f"{'-':>5}"
            tb = f"{r['tbps']:5.2f}" if r["tbps"] is not None else f"{'-':>5}"
            mark = "*" if best.get((r["layer"], r["seq"])) is r else " "
            note = r["note"] if r["section"] not in NEW_SECTIONS else r["note"][:48]
            log(f"{r['section']:<9} {r['layer']:<9} {r['seq']:>7} {r['variant'][:13]:<13}{mark} {_fmt_ms(r['ms'], 9)} "
                f"{tf} {pct} {tb}  {note}")  # fmt: skip
        log("* = fastest Pallas attention variant for (layer, S); %ceil = % of this run's ceiling: b = best bf16 "
            "matmul, f = best fp8 matmul (TF/s), c = copy (TB/s); TB/s = fewest bytes / time; err = rel L2 of the "
            "warm-up output vs the named reference")  # fmt: skip
        if decode_rows:
            variants = sorted({r["variant"] for r in decode_rows},
                              key=lambda v: (v.split("-")[0], int(v[v.index("B") + 1 :])))  # bf16-B1, bf16-B32, …
            cells = {(r["layer"], r["seq"], r["variant"]): r for r in decode_rows}
            log("decode: per call (pipelined) us | TB/s of the bytes needed | % of copy; S = context")
            log(f"{'layer':<6} {'S':>7}  " + "".join(f"{v:>20}" for v in variants))
            for layer, seq in sorted({(r["layer"], r["seq"]) for r in decode_rows},
                                     key=lambda x: (layer_order.get(x[0], 99), x[1])):  # fmt: skip
                line = f"{layer:<6} {seq:>7}  "
                for v in variants:
                    r = cells.get((layer, seq, v))
                    pct_ref = self.pct_ref(r) if r else None
                    line += (f"{r['ms'] * 1e3:9.1f} {r['tbps']:5.2f} {pct_ref or 0:3.0f}%" if r else f"{'-':>20}")
                log(line)
        decode_checks = [c for c in rec.checks if c.get("section") == "decode"]
        if decode_checks:
            worst = max(decode_checks, key=lambda c: c.get("rel_l2", 0.0))
            bad = [c["text"] for c in decode_checks if not c["ok"]]
            log(f"check decode: {len(decode_checks) - len(bad)} OK, {len(bad)} FAIL (rel L2 vs "
                f"paged_decode_attention_reference, NaN, poisoned partials); worst: {worst['text']}")  # fmt: skip
            for text in bad:
                log(f"check {text} -> FAIL")
        for c in rec.checks:
            if c.get("section") == "decode":
                continue
            if "text" in c:
                log(f"check {c['text']} -> {'OK' if c['ok'] else 'FAIL'}")
            else:
                log(f"check {c['layer']} S={c['seq']} {c['variant']} poisoned: NaN {c['nans']}, rel L2 "
                    f"{c['rel_l2']:.2e} vs {c['against']} -> {'OK' if c['ok'] else 'FAIL'}")  # fmt: skip
        xla = {(r["layer"], r["seq"]): r for r in rec.rows if r["section"] == "v4-xla"}
        for (layer, seq), r in sorted(best.items(), key=lambda x: (x[0][1], layer_order.get(x[0][0], 9))):
            x = xla.get((layer, seq))
            vs = f" | xla {x['ms']:.2f} ms, speedup {x['ms'] / r['ms']:.2f}x" if x else ""
            log(f"summary {layer:<8} S={seq:<7} pallas best {r['variant']} {r['ms']:.2f} ms "
                f"({r['tflops'] or 0:.0f} TF/s, {r['tbps'] or 0:.2f} TB/s){vs}")  # fmt: skip
        for line in self.summaries_ops():
            log(line)
        log(f"{len(rec.errors)} error(s), {len(rec.skips)} skip(s); elapsed {time.monotonic() - T_START:.0f} s"
            + (f"; full numbers in {rec.out_dir / 'bench_kernels.json'}" if rec.out_dir else ""))  # fmt: skip
        for e in rec.errors[:8]:
            log(f"  error: {e['where']}: {e['type']}: {(e['message'].splitlines() or [''])[0][:100]}")
        for s in rec.skips[:8]:
            log(f"  skip: {s['where']}: {s['why']}"[:120])
        if len(rec.errors) > 8 or len(rec.skips) > 8:
            log("  (more errors/skips in the log and the JSON)")
        log("=" * 100)
        rec.write_json()

    def summaries_ops(self) -> list[str]:
        """One line per indexer S and MoE token count: the headline numbers and speedups."""
        rows = self.rec.rows
        get = {(r["section"], r["layer"], r["seq"], r["variant"]): r for r in rows}

        def fmt(r, what=""):
            pct = self.pct_ref(r)
            pct_s = f", {pct:.0f}% {r['ref']} mm" if pct is not None else ""
            return f"{what}{_fmt_ms(r['ms'], 0)} ms ({r['tflops'] or 0:.0f} TF/s{pct_s})"

        out = []
        for seq in sorted({r["seq"] for r in rows if r["section"] == "indexer"}):
            p8, p16 = get.get(("indexer", "two-pass", seq, "fp8")), get.get(("indexer", "two-pass", seq, "bf16"))
            x16 = get.get(("indexer", "xla", seq, "bf16"))
            parts = [fmt(p8, "two-pass fp8 ") if p8 else "two-pass fp8 -", fmt(p16, "bf16 ") if p16 else "bf16 -",
                     fmt(x16, "xla bf16 ") if x16 else "xla bf16 -"]  # fmt: skip
            if x16 and (p8 or p16):
                parts.append(f"speedup vs xla: {'fp8 %.1fx' % (x16['ms'] / p8['ms']) if p8 else ''}"
                             f"{' bf16 %.1fx' % (x16['ms'] / p16['ms']) if p16 else ''}")  # fmt: skip
            s8 = get.get(("indexer", "stream", seq, "fp8"))
            if s8:  # the streaming kernel (secondary): its fp8 time and how much faster the two-pass fp8 is
                parts.append(f"stream fp8 {_fmt_ms(s8['ms'], 0)} ms" + (f" ({s8['ms'] / p8['ms']:.1f}x two-pass)" if p8
                                                                         else ""))  # fmt: skip
            out.append(f"summary indexer S={seq:<7} " + " | ".join(parts))
        floor = [r for r in rows if r["section"] == "decode" and r["layer"] == "floor"]
        if floor:
            out.append("summary decode launch floor (pipelined dispatch, same arguments): "
                       + ", ".join(f"{r['variant']} {r['ms'] * 1e3:.1f}us" for r in floor)
                       + "; decode rows near it measure the host, not the kernel")  # fmt: skip
        for n in sorted({r["seq"] for r in rows if r["section"] == "moe"}):
            parts = []
            for mode in ("bf16", "w8a16", "w8a8"):
                cands = [r for r in rows if r["section"] == "moe" and r["layer"] == "pallas" and r["seq"] == n
                         and r["variant"].startswith(mode + "-")]  # fmt: skip
                if cands:
                    r = min(cands, key=lambda r: r["ms"])
                    parts.append(fmt(r, f"pallas {r['variant']} "))
            for layer in ("einsum", "xla-ragged"):
                for r in [r for r in rows if r["section"] == "moe" and r["layer"] == layer and r["seq"] == n]:
                    parts.append(fmt(r, f"{layer} {r['variant']} "))
            out.append(f"summary moe N={n:<7} " + " | ".join(parts))
        return out

    def start_watchdog(self):
        """If the run is still busy --hard-stop seconds after its start (a compile or call far over its prediction:
        the budget cannot interrupt one), print the table from what was measured and exit, so the result survives
        the device tool's kill at 600 s."""
        limit = self.args.hard_stop if self.args.hard_stop is not None else self.args.budget + 90.0
        if limit <= 0 or limit > 1e6:
            return

        def fire():
            self.rec.log(f"WATCHDOG: still busy {time.monotonic() - T_START:.0f} s after the start (--hard-stop "
                         f"{limit:.0f} s): the table from what was measured, then exit")  # fmt: skip
            try:
                self.table()
            finally:
                sys.stdout.flush()
                os._exit(3)

        timer = threading.Timer(max(1.0, limit - (time.monotonic() - T_START)), fire)
        timer.daemon = True
        timer.start()
        self.watchdog = timer

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
        only = self.args.only
        if any(s in only for s in NEW_SECTIONS):
            self.import_ops()
        self.header()
        self.start_watchdog()
        # The larger lengths come after cudnn and fp8: a kernel fault there (a sticky CUDA error ends the process's
        # GPU work) then costs only what follows it. The new sections come last, decode (cheap) first and the
        # indexer (least known: its Triton compile and sort network speed are unmeasured) last, each under its cap.
        lengths = self.args.lengths
        steps = [("ceilings", self.ceilings), ("attention", functools.partial(self.attention_baseline, lengths[:1])),
                 ("cudnn", self.cudnn), ("fp8", self.fp8),
                 ("attention", functools.partial(self.attention_baseline, lengths[1:])),
                 ("attention", self.attention_variants), ("ceilings-lite", self.ceilings_lite),
                 ("decode", self.decode), ("moe", self.moe), ("indexer", self.indexer),
                 ("moe-large", functools.partial(self.moe, large=True)),
                 ("indexer-large", functools.partial(self.indexer, large=True))]  # fmt: skip
        for step_name, step in steps:
            section = step_name.removesuffix("-large")
            if step_name == "ceilings-lite":
                if "ceilings" in only or not any(s in only for s in NEW_SECTIONS):
                    continue
            elif section not in only:
                continue
            if section in ("attention", "fp8") and (self.pa is None or not self.variants):
                self.rec.skip(section, "dsv4.pallas.attention did not import, or no valid --variants")
                continue
            try:
                with self.budget.cap(self.args.section_budgets.get(step_name)):
                    step()
            except Exception as exc:  # a section's own bookkeeping failed; the next section still runs
                self.rec.error(f"section {step_name}", exc)
            free()
        if self.watchdog is not None:
            self.watchdog.cancel()
        self.table()


def _check_note(check: dict) -> str:
    parts = []
    if "rel_l2" in check:
        parts.append(f"err {check['rel_l2']:.1e} {check['against']}")
    if check.get("nans"):
        parts.append(f"NaN {check['nans']}")
    return " ".join(parts)


def _fmt_ms(ms: float, width: int) -> str:
    """Milliseconds with 3 decimals, 4 below 1 ms (decode calls take microseconds)."""
    return f"{ms:{width}.{4 if ms < 1 else 3}f}"


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
