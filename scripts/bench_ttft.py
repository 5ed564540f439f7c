#!/usr/bin/env python3
"""TTFT benchmark: prefill of a long prompt on a DeepSeek-V4-Flash-shaped model, first token's logits only.

One run measures, on one GPU and in one process, every variant of the ablation the code has, the components of
each layer type, and the ceilings they are compared with:

    python3 scripts/bench_ttft.py --out $OUT                              # H200: 32K and 128K (see docs/BENCHMARKS.md)
    python3 scripts/bench_ttft.py --lengths 512k --out $OUT               # H200: 512K in a run of its own
    python3 scripts/bench_ttft.py --lengths 512k --chunk 16384 --variants chunked,chunked-fp8idx \
        --weights bf16,fp8,fp8-fp4-experts --no-breakdown --no-chunk-split --no-whole-check --budget 560 --out $OUT
                                                                          # H200: the weights formats side by side
    python3 scripts/bench_ttft.py --lengths 512k --chunk 16384 --variants xla-cap,chunked,chunked-2x \
        --weights fp8,bf16=xla-cap --no-breakdown --no-chunk-split --no-whole-check --ceiling-sizes 8192 --budget 400 \
        --out $OUT                                                        # H200: released weights against the baseline
    python3 scripts/bench_ttft.py --smoke --out /tmp/ttft_smoke           # CPU: tiny + small flash-like configs

Model: `Config.preset("v4-flash")` at its real widths (hidden 4096, 64 heads × 512, q LoRA 1024, 8 output groups ×
1024, 256 experts top-6 + 1 shared of 2048, indexer 64 × 128 keeping 512, window 128, CSA 4:1, HCA 128:1), bf16
weights and activations, B = 1, random weights (normal, std 0.02; norms and scales 1; biases, sinks 0), random
token ids. Depth: ``--layers 3`` (default) = one sliding + one CSA + one HCA layer; more layers alternate CSA and HCA
(``--layer-types sliding,csa,hca,...`` sets any mix). All MoE layers route with the learned router ("moe"; V4's 3
hash-routed layers do the same expert work). Full depth does not fit: one layer's experts are 12.9 GB in bf16.
The weights are generated on the device (one jitted normal draw per distinct shape, ``nnx.eval_shape`` for the
tree), not through `init_random`'s host-side numpy draw (~40 GB of normals would take minutes of host time).

Variants (``--variants``, keys below), all on the same model, weights and token ids:
    xla              (1)  full-sequence forward, `Kernels.all("jnp")` (XLA everywhere; MoE = lax.ragged_dot)
    pallas-attn      (2)  + Kernels(attention="pallas", indexer="pallas", moe="jnp"): the Pallas attention core and
                          the two-pass Pallas indexer (scores kernel + exact grouped top-k)
    pallas           (3)  + Pallas grouped-GEMM MoE (moe="pallas")
    chunked          (4)  chunked prefill: `DeepseekV4.forward_chunk` over ``--chunk`` (8192) token chunks, both
                          kernels (cache writes by the kv_write kernel too); TTFT = the sum of the chunk calls
                          (cache of max_len = S, made before the clock)
    chunked-fp8      (5)  as (4) with the cache stored in fp8-channel and paged (256-token pages, one request
                          holding pages 1..n)
    chunked-fp8idx   (4f) as (4) with Kernels.indexer="pallas-fp8": q and keys of the lightning indexer in e4m3, the
                          scores by the Mosaic FP8 kernel (`dsv4.pallas.indexer_mgpu`) on Hopper
    chunked-tritonidx (4t) as (4) with Kernels.indexer="pallas-triton": the bf16 indexer's scores by the Triton
                          kernel instead of the Mosaic one (bf16 operands) that (4) takes on Hopper
    chunked-w8a8     (4w) as (4f) with Kernels.dense="pallas": the dense matrices a release stores in FP8 run W8A8 on
                          the stored values (`dsv4.layers.project`); the same as (4f) with bf16 weights, and on
                          Hopper, where W8A8 is the default
    chunked-dequant  (4d) as (4) with Kernels.dense="jnp": the dense FP8 matrices dequantized in the step and run as
                          bf16 dots, where (4) on Hopper runs them W8A8 on the stored values
    chunked-loop     (4l) as (4) with the mHC Sinkhorn normalization as XLA's while loop (Kernels.sinkhorn="jnp")
    chunked-2x       (4x) as (4) in chunks of twice ``--chunk`` (the chunk size's effect, side by side in one process)
    chunked-4x       (4xx) as (4) in chunks of four times ``--chunk``
    chunked-qnorm    (4n) as (4) with Kernels.q_norm="jnp": q normalized by XLA before the core, where (4) on Hopper
                          only rotates q and folds its inverse RMS into the attention kernels' logit scale
    chunked-csatriton (4c) as (4) with Kernels.csa="pallas-triton": CSA layers' attention on the Triton kernel
                          instead of the Mosaic kernel's CSA mode (the default on Hopper: each listed row gathered by
                          its own TMA)
    engine           (4e) the prompt through `dsv4.LLM(model)` with default arguments (kernels "auto", the paged cache)
                          but ``--chunk``; TTFT = the request's own, arrival to first sampled token
    xla-cap          (1c) as (1) with a capacity-padded batched-einsum MoE (defined in this script, not in dsv4:
                          XLA's `lax.ragged_dot` can ask for ~96 GiB at 8K tokens, so (1) is not
                          expected to fit at 32K+; (1c) is "what a straightforward XLA port gets"). Capacity
                          1.25 × the mean expert load; a pair past its expert's capacity is dropped (counted in
                          the breakdown's routing check).
    pallas-attn-cap  (2c) as (2) with the capacity MoE.
Order of work: every length's variants (in the order pallas, chunked, xla-cap, pallas-attn-cap, chunked-fp8, xla,
pallas-attn, chunked-fp8idx), then the chunked variant's layer-split passes, then the breakdowns (largest length
first), then the whole-model check;
the budget drops the tail. A variant that did not fit (OOM) or failed at a length is not tried at larger lengths; its
row says how much XLA's buffer assignment asked for against what was free.

How a full-sequence variant is timed: embed → each layer → last-token head, each its own jitted (AOT-compiled) call,
synchronized after each, so the per-layer times come out of the same pass; TTFT = their sum (the layer boundary is
the only fusion given up: each layer is >= 100 ms of work at 32K). At the first length, variant (3) is also timed as
one jitted whole-model call (`DeepseekV4.hidden_states` + last-token logits) to check the split (``whole`` row). The
chunked variant is timed as `forward_chunk` calls of the whole model (one jitted step, cache donated); a second,
"split" pass runs the same chunks layer by layer (`DecoderLayer.forward_chunk`) for its per-layer-type times.
Timing: AOT compile (reported apart), one warm-up pass, then the median of 2–5 timed passes (1 when a pass takes
over 8 s; none, and the warm-up pass is reported with a flag, when the budget has no room left). The chunked paths
warm up with one chunk (their executables are the same for every chunk) and time at least one whole pass.

Breakdown (on by default; ``--no-breakdown``; with several ``--weights``, for the first format only, as the chunked
layer-split pass and the whole-model check) on the same kind of inputs (random bf16 hidden states [1, S, 4096], random
residual streams, the model's own weights), each piece its own jitted call:
    qkv          q LoRA (q_a, norm, q_b), per-head RMSNorm, RoPE; K=V projection, norm, RoPE (same for every layer)
    out-proj     un-RoPE of the output, grouped o_a, o_b
    compressor   CSA (4:1 overlapping, 2 × 512 wide) and HCA (128:1, 512 wide) compressors
    idx-keys     the indexer's own compressor (4:1, 2 × 128 wide)
    idx-topk     indexer q projection + weights + scores + top-512: XLA (`index_topk_jnp`, Kernels.indexer="jnp")
                 and the two-pass Pallas path (`dsv4.pallas.indexer.index_topk_two_pass`, Kernels.indexer="pallas")
    core         the attention core per layer type, jnp and Pallas (`core_attention_*`, kv_aligned as in the model)
    moe          router + routed + shared experts: Pallas, the capacity MoE, XLA (Kernels.moe / this script)
    mhc          both hyper-connections (mix, Sinkhorn, collapse, merge) + both RMSNorms of a layer
Per layer type and variant: layer time (from the variant's split pass) = attention (qkv + out-proj + compressors +
indexer + core) + moe + mhc + unattributed (the difference: fusion across pieces, and what the pieces leave out).

FLOPs: useful work by part, from `dsv4.flops` (2 per multiply-add, summed exactly over query positions p = 0..S-1;
the formulas are in its docstring). Per token and layer at V4-Flash widths: attention projections 214 M, MoE + router
354 M, window core 17 M, CSA core ≤ 67 M, CSA compressor + indexer projections 38 M, indexer scores 1,074 M and HCA
core 268 M averaged over 512K, mHC 1.6 M; the head for the last token only. XLA's dense over-computation (all C
indexer keys per query, the full HCA entry set per query chunk) is not credited.

Ceilings, measured first, in the same interleaved rounds (10 on a GPU, each ~25 ms of back-to-back calls; medians),
random operands at 8192³ and 16384³ (``--ceiling-sizes``): the bf16 matmul (``a @ b``) with XLA's defaults and through
cuBLAS only (compiler option ``xla_gpu_enable_triton_gemm=False``), the FP8 e4m3 dot (``jnp.dot(...,
preferred_element_type=f32)``) the same two ways, and the float32 matmul (XLA's default precision, what the
hyper-connection mixes run in). Each build's GEMM kernels are read from its compiled HLO; on a GPU the cuBLAS-only FP8
build must be a ``__cublas$lt$matmul$f8`` custom call (recorded as ``fp8_cublaslt_verified``). A precision's rate is its
faster build at its best size.
MFU, two ways: "MFU" = useful FLOPs / time / the bf16 rate (every FLOP at the bf16 rate, as before); "MFUx" = the
mixed-precision floor / time, where the floor puts each part's FLOPs at the rate of the precision that row runs it in
(`dsv4.flops.by_precision` of the variant's resolved kernels and the weights format: FP8 indexer scores under
Kernels.indexer="pallas-fp8", FP8 routed experts with FP8 weights on the Pallas MoE, the FP8-stored dense layers under
Kernels.dense="pallas", float32 mHC mixes, the rest bf16). ``--weights bf16,fp8,fp8-fp4-experts`` runs every format in
turn in the same process (the model rebuilt from the same seed, then quantized) and ends with one table of the formats
side by side, with each format's speed-up over the XLA baseline of the same run. The baselines (xla, xla-cap) keep their
plain form, bf16 weights: with quantized weights they would dequantize them in every call, a slower baseline and a
flattering ratio.

Projection to full depth (labelled PROJECTION everywhere): T_43 = T_measured + Σ_type (n43_type − n_measured_type) ·
t_type, with n43 from `Config.preset("v4-flash")` (2 sliding + 21 CSA + 20 HCA) and t_type the mean measured time of
a layer of that type in the same variant and length. 8 GPUs: T_43 / 8 (ideal scaling, no communication). 43 layers'
weights (~560 GB bf16) do not fit one GPU: the 1-GPU figure is compute time only.

Memory, per variant (there is no way to reset the allocator's peak counter, so two figures):
    est peak  max over the variant's calls of (bytes in use just before the call + XLA's buffer assignment for it:
              temp + outputs − aliased), from `compiled.memory_analysis()` and `memory_stats()["bytes_in_use"]`;
    proc peak `memory_stats()["peak_bytes_in_use"]` after the variant: the process-wide high-water mark so far
              (monotone: it shows a variant's own peak only where that exceeds every earlier one).
"Does not fit" is a result: an out-of-memory error at compile or run time is caught, printed as OOM, and the run goes
on. Weights: ~39 GiB for 3 layers; ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.92 here (~128 GiB usable).

Budget (``--budget`` seconds from the script's start, 420 by default): before each item the script predicts its cost
(compile: the largest recent compile of that kind, else a guess; passes: scaled from the same item at a smaller
length by the FLOP model with the XLA indexer counted dense, else FLOPs at 50 TFLOP/s) and skips it with a SKIP line
if it does not fit. Output: a log line per measurement, ERROR/SKIP lines, and compact tables last. ``--out DIR``
writes DIR/bench_ttft.json (every number) and DIR/bench_ttft.log.
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
import re
import statistics
import subprocess
import sys
import time
import traceback
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
from flax import nnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4 import moe as dsv4_moe  # noqa: E402
from dsv4.attention import CompressedKeys, attention_core  # noqa: E402
from dsv4.config import CSA, HCA, SLIDING, Config  # noqa: E402
from dsv4.engine import LLM  # noqa: E402
from dsv4.flops import by_precision, floor_seconds, layer_flops, part_precisions, prefill_flops  # noqa: E402
from dsv4.kernels import Kernels  # noqa: E402
from dsv4.layers import apply_rope, hc_merge, linear  # noqa: E402
from dsv4.model import DeepseekV4  # noqa: E402
from dsv4.quantization import reblock_fp4_experts  # noqa: E402
from dsv4.random_weights import WEIGHT_FORMATS, init_kinds, quantize_released, random_model  # noqa: E402

# FP4 experts re-blocked as FP8 once, when the model is built (`LLM(fp4_experts="fp8")`), beside the release's
# formats: the same numbers as fp8-fp4-experts, no per-step pass, FP8's memory.
REBLOCKED = "fp8-fp4-experts-fp8"
BENCH_WEIGHTS = (*WEIGHT_FORMATS, REBLOCKED)


def released(weights: str) -> str:
    """The release's format a --weights entry starts from (and whose FLOP precisions it runs)."""
    return "fp8-fp4-experts" if weights == REBLOCKED else weights

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
GiB = 1 << 30
SHORT = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
LONG = {v: k for k, v in SHORT.items()}
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ---------------------------------------------------------------------------------------------
# Variants and configs.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    tag: str  # "(1)", ...
    label: str
    mode: str  # "full" | "chunked"
    attention: str  # "jnp": every part on XLA (Kernels.all("jnp")); "pallas": the Pallas attention core
    moe: str  # "jnp" | "pallas" | "xla_cap" (this script's capacity MoE)
    kv: str | None = None  # chunked only: the cache's storage format, paged (None: dense, the model's dtype)
    indexer: str | None = None  # Kernels.indexer (None: "jnp" under the jnp attention, "pallas" otherwise)
    dense: str | None = None  # Kernels.dense (None: "auto", W8A8 on Hopper)
    sinkhorn_loop: bool = False  # the mHC Sinkhorn as XLA's while loop (Kernels.sinkhorn="jnp")
    q_norm: str | None = None  # Kernels.q_norm (None: "auto", "fold" under the Pallas core on Hopper)
    csa: str | None = None  # Kernels.csa (None: "auto", the Mosaic kernel's CSA mode on Hopper)
    chunks_of: int = 1  # chunked only: chunks of this many times --chunk

    def kernel_parts(self) -> dict:
        """The Kernels fields this variant sets beyond attention, moe, indexer and the Sinkhorn (None: left)."""
        return {k: v for k, v in (("dense", self.dense), ("q_norm", self.q_norm), ("csa", self.csa)) if v}


def variant_kernels(attention: str, moe: str, indexer: str | None = None, sinkhorn_loop: bool = False,
                    **parts: str) -> Kernels:  # fmt: skip
    """The Kernels value a variant builds its model with. "jnp" attention: XLA everywhere (`Kernels.all("jnp")`);
    "pallas": the Pallas attention core, the paged decode kernel and the kv_write kernel, the indexer's `indexer`
    path (default the two-pass Pallas one); `parts`: other Kernels fields. moe "xla_cap" builds the jnp MoE,
    swapped for `CapacityMoE` after."""
    moe = "jnp" if moe == "xla_cap" else moe
    if attention == "auto":
        return Kernels()
    if attention == "jnp":
        base = Kernels.all("jnp")
    else:
        base = Kernels(attention=attention, decode=attention, kv_write=attention, indexer="pallas")
    changes = dict(moe=moe)
    if indexer:
        changes["indexer"] = indexer
    if sinkhorn_loop:
        changes["sinkhorn"] = "jnp"
    return dataclasses.replace(base, **changes, **parts)


VARIANTS = {v.key: v for v in [
    Variant("xla", "(1)", "XLA baseline", "full", "jnp", "jnp"),
    Variant("pallas-attn", "(2)", "+ Pallas attention + indexer", "full", "pallas", "jnp"),
    Variant("pallas", "(3)", "+ Pallas MoE", "full", "pallas", "pallas"),
    Variant("chunked", "(4)", "chunked prefill, both kernels", "chunked", "pallas", "pallas"),
    Variant("chunked-fp8", "(5)", "+ FP8 paged KV cache (fp8-channel)", "chunked", "pallas", "pallas", "fp8-channel"),
    Variant("chunked-fp8idx", "(4f)", "(4) + FP8 indexer (Mosaic scores)", "chunked", "pallas", "pallas",
            indexer="pallas-fp8"),
    Variant("chunked-tritonidx", "(4t)", "(4) with Triton indexer scores", "chunked", "pallas", "pallas",
            indexer="pallas-triton"),
    Variant("chunked-w8a8", "(4w)", "(4f) + W8A8 dense layers (FP8 weights)", "chunked", "pallas", "pallas",
            indexer="pallas-fp8", dense="pallas"),
    Variant("chunked-dequant", "(4d)", "(4) with dense weights dequantized", "chunked", "pallas", "pallas",
            dense="jnp"),
    Variant("chunked-loop", "(4l)", "(4) with the mHC Sinkhorn as XLA's loop", "chunked", "pallas", "pallas",
            sinkhorn_loop=True),
    Variant("chunked-2x", "(4x)", "(4) in chunks of 2 x --chunk", "chunked", "pallas", "pallas", chunks_of=2),
    Variant("chunked-4x", "(4xx)", "(4) in chunks of 4 x --chunk", "chunked", "pallas", "pallas", chunks_of=4),
    Variant("chunked-qnorm", "(4n)", "(4) with q normalized before the core", "chunked", "pallas", "pallas",
            q_norm="jnp"),
    Variant("chunked-csatriton", "(4c)", "(4) with CSA on the Triton kernel", "chunked", "pallas", "pallas",
            csa="pallas-triton"),
    Variant("engine", "(4e)", "(4) through dsv4.LLM, default arguments", "engine", "auto", "auto"),
    Variant("xla-cap", "(1c)", "XLA, capacity MoE", "full", "jnp", "xla_cap"),
    Variant("pallas-attn-cap", "(2c)", "+ Pallas attn + idx, capacity MoE", "full", "pallas", "xla_cap"),
]}  # fmt: skip
PRIORITY = ["pallas", "chunked", "engine", "xla-cap", "pallas-attn-cap", "chunked-fp8", "xla", "pallas-attn",
            "chunked-fp8idx", "chunked-tritonidx", "chunked-w8a8", "chunked-dequant", "chunked-loop", "chunked-2x",
            "chunked-4x", "chunked-qnorm", "chunked-csatriton"]  # fmt: skip
TABLE_ORDER = ["xla", "xla-cap", "pallas-attn", "pallas-attn-cap", "pallas", "chunked-loop", "chunked", "chunked-2x",
               "chunked-4x", "chunked-qnorm", "chunked-csatriton", "chunked-dequant", "engine", "chunked-tritonidx",
               "chunked-fp8idx", "chunked-w8a8", "chunked-fp8"]  # fmt: skip
# --variants runs PRIORITY's order and the table prints TABLE_ORDER's: a variant missing from either would be dropped
if set(PRIORITY) != set(VARIANTS) or set(TABLE_ORDER) != set(VARIANTS):
    raise AssertionError(f"bench_ttft: PRIORITY and TABLE_ORDER must each list every variant of {sorted(VARIANTS)}")
BASELINES = ("xla", "xla-cap")  # plain XLA: the speed-ups' denominators
PAGE_TOKENS = 256  # (5)'s page size: a multiple of both compress rates


def default_mix(n: int) -> list[str]:
    """sliding, csa, hca, then csa / hca alternating (V4-Flash's pattern after its two sliding layers)."""
    out = [SLIDING, CSA, HCA]
    while len(out) < n:
        out.append(CSA if len(out) % 2 == 1 else HCA)
    return out[:n]


def with_layers(base: Config, types: list[str]) -> Config:
    return base.replace(num_hidden_layers=len(types), layer_types=tuple(types), mlp_layer_types=("moe",) * len(types))


def flash_small_config() -> Config:
    """A small config with V4-Flash's structure (top-6 routing, CSA 4:1 with the indexer, HCA, window), for --smoke."""
    return Config.from_hf({
        "vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "head_dim": 64, "q_lora_rank": 128, "qk_rope_head_dim": 16,
        "n_routed_experts": 32, "num_experts_per_tok": 6, "o_groups": 2, "o_lora_rank": 64,
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 32, "sliding_window": 32,
        "compress_rates": {CSA: 4, HCA: 32}, "layer_types": [SLIDING, CSA, HCA], "mlp_layer_types": ["moe"] * 3,
        "routed_scaling_factor": 1.5, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1 << 20,
    })  # fmt: skip


@dataclasses.dataclass
class Setup:
    name: str
    config: Config
    lengths: list[int]
    chunk: int
    variants: list[str] | None = None  # None: --variants
    breakdown: bool = True
    chunk_split: bool = True
    whole_check: bool = True


def parse_lengths(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return sorted(set(out))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU: tiny + small flash-like config, Pallas interpreted")
    p.add_argument("--smoke-all", action="store_true", help="with --smoke: every variant and check (~12 min, 2 cores)")
    p.add_argument("--out", type=Path, help="write bench_ttft.json and bench_ttft.log here")
    p.add_argument("--lengths", default=None, help="prompt lengths, e.g. 32k,128k (GPU default 32k,128k)")
    p.add_argument("--layers", type=int, default=3, help="measured depth (default 3: sliding + csa + hca)")
    p.add_argument("--layer-types", default=None, help="explicit mix, e.g. sliding,csa,hca,csa (overrides --layers)")
    p.add_argument("--variants", default=",".join(PRIORITY), help=f"subset of {','.join(PRIORITY)} (run in that order)")
    p.add_argument("--chunk", type=int, default=None, help="chunked-prefill chunk (default 8192; smoke 32 / 64)")
    p.add_argument("--weights", default="bf16",
                   help="bf16 (default), or as V4 releases store them, kept quantized on the device: fp8 (e4m3, "
                        "128x128 block scales; the experts on the W8A8 kernels), fp8-fp4-experts (routed experts "
                        "e2m1 with per-32 scales, re-blocked as FP8 each step for the same kernels), "
                        "fp8-fp4-experts-fp8 (those experts re-blocked once, at build: LLM(fp4_experts='fp8')); a "
                        "comma list (bf16,fp8,fp8-fp4-experts) runs each in turn, in this process, and tabulates "
                        "them side by side; FORMAT=V1+V2 runs only those of --variants in that format "
                        "(fp8,bf16=xla-cap: the bf16 model is built for the baseline alone)")  # fmt: skip
    p.add_argument("--ceiling-sizes", default=None, help="n of the n³ matmul ceilings (GPU default 8192,16384)")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-component breakdown")
    p.add_argument("--no-chunk-split", action="store_true", help="skip the layer-by-layer pass of the chunked variant")
    p.add_argument("--no-whole-check", action="store_true", help="skip the whole-model jit check of variant (3)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity of the (1c)/(2c) MoE, × mean load")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (GPU default 420)")
    p.add_argument("--target-s", type=float, default=None, help="seconds of timed passes per item (default 3)")
    p.add_argument("--max-pass-s", type=float, default=120.0, help="skip an item whose one pass is predicted longer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", default=None, help="jax persistent compilation cache directory (off by default)")
    args = p.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown {v!r}; known: {PRIORITY}")
    args.variants = [v for v in PRIORITY if v in args.variants]
    args.weight_variants = {}  # format → the variants it runs (None: every one of --variants)
    for spec in (w.strip() for w in args.weights.split(",")):
        if not spec:
            continue
        w, _, only = spec.partition("=")
        if w not in BENCH_WEIGHTS:
            p.error(f"--weights: unknown format {w!r}; known: {','.join(BENCH_WEIGHTS)}")
        only = [v.strip() for v in only.split("+") if v.strip()] if only else None
        for v in only or ():
            if v not in args.variants:
                p.error(f"--weights {spec}: {v!r} is not among --variants ({','.join(args.variants)})")
        args.weight_variants.setdefault(w, only)
    args.weights = list(args.weight_variants)
    if not args.weights:
        p.error("--weights: name at least one format")
    args.ceiling_sizes = parse_lengths(args.ceiling_sizes or ("256,512" if args.smoke else "8192,16384"))
    if args.layer_types:
        try:
            args.layer_types = [LONG[t.strip()] for t in args.layer_types.split(",") if t.strip()]
        except KeyError as e:
            p.error(f"--layer-types: unknown type {e}; known: sliding, csa, hca")
    else:
        args.layer_types = default_mix(args.layers)
    args.budget = args.budget or (1e9 if args.smoke else 420.0)
    args.target_s = args.target_s or (0.02 if args.smoke else 3.0)
    if args.smoke:
        tiny = with_layers(Config.preset("tiny"), args.layer_types)
        small = with_layers(flash_small_config(), args.layer_types)
        # XLA:CPU compiles each layer in ~5-15 s and Pallas runs interpreted, so the default smoke covers each code
        # path once in ~3 minutes: tiny preset (variants (3), (4), (1c), the breakdown), and the flash-like config
        # (1c) only. --smoke-all: every variant at two lengths, both checks, and (3)/(4)/(1c) on the flash-like config.
        if args.smoke_all:
            tiny_v, small_v, lengths_t, checks = None, ["pallas", "chunked", "xla-cap"], "64,128", True
        else:
            tiny_v, small_v = ["pallas", "chunked", "engine", "chunked-fp8", "xla-cap"], ["xla-cap"]
            lengths_t, checks = "64", False
        pick = lambda vs: None if vs is None else [v for v in vs if v in args.variants]  # noqa: E731
        args.setups = [Setup("tiny", tiny, parse_lengths(args.lengths or lengths_t), args.chunk or 32,
                             variants=pick(tiny_v), chunk_split=checks, whole_check=checks),
                       Setup("flash-small", small, parse_lengths(args.lengths or "128"), args.chunk or 64,
                             variants=pick(small_v), breakdown=False, chunk_split=checks,
                             whole_check=checks)]  # fmt: skip
    else:
        cfg = with_layers(Config.preset("v4-flash"), args.layer_types)
        args.setups = [Setup("v4-flash", cfg, parse_lengths(args.lengths or "32k,128k"), args.chunk or 8192)]
    return args


# ---------------------------------------------------------------------------------------------
# FLOP model (useful work: `dsv4.flops`) and the mixed-precision floor.
# ---------------------------------------------------------------------------------------------
def model_flops(cfg: Config, types, seq: int) -> float:
    """Useful FLOPs of a `seq`-token prefill through `types` and the last token's head."""
    return sum(prefill_flops(cfg, seq, types).values())


def model_work(cfg: Config, types, seq: int) -> float:
    """Time-scaling proxy between lengths: useful FLOPs with the XLA indexer's dense scores (all C keys) added."""
    return model_flops(cfg, types, seq) + prefill_flops(cfg, seq, types)["indexer-scores"]


def mixed_floor(cfg: Config, types, seq: int, kernels, weights: str, rates_tflops: dict, *,
                fp8_activations: bool = True) -> dict | None:  # fmt: skip
    """The mixed-precision floor of a prefill: each part's FLOPs at the rate of the precision it runs in (resolved
    `kernels`, `weights` format), rates in TFLOP/s. → {"floor_s", "flops_by_precision"}; None without the rates."""
    prec = by_precision(prefill_flops(cfg, seq, types), kernels, weights, config=cfg, fp8_activations=fp8_activations)
    try:
        floor = floor_seconds(prec, {p: r * 1e12 for p, r in rates_tflops.items() if r})
    except ValueError:  # a ceiling this row needs was not measured (failed or skipped)
        return None
    return dict(floor_s=floor, flops_by_precision=prec)


def fp8_parts(cfg: Config, kernels, weights: str, fp8_activations: bool = True) -> list[str]:
    """The parts a row runs in FP8, for the tables' legend."""
    where = part_precisions(kernels, weights, config=cfg, fp8_activations=fp8_activations)
    return [p for p, v in where.items() if v == "fp8"]


def layer_counts(types) -> dict[str, int]:
    return {t: sum(1 for x in types if x == t) for t in (SLIDING, CSA, HCA)}


# ---------------------------------------------------------------------------------------------
# The capacity-padded XLA MoE of variants (1c) / (2c) (script-local: `CapacityMoE` replaces a model's MoE layers).
# ---------------------------------------------------------------------------------------------
CAPACITY = {"factor": 1.25}


def expert_capacity(n_pairs: int, n_experts: int, factor: float) -> int:
    return int(-(-math.ceil(factor * n_pairs / n_experts) // 8) * 8)


def routed_experts_capacity(x, expert_ids, weights, gate_up, down, limit, out_dtype=None):
    """Routed experts as a batched einsum over a [E, capacity, D] buffer, in expert groups of bounded size.

    Pairs beyond an expert's capacity (factor × the mean load) are dropped. x [N, D] → [N, D]. The baselines run
    on one device: every id must be in [0, E) (no expert-parallel remapping).
    """
    n, k = expert_ids.shape
    e, two_i, d = gate_up.shape
    inter = two_i // 2
    cap = expert_capacity(n * k, e, CAPACITY["factor"])
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=e)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n * k) - starts[flat[order]]
    rank = jnp.zeros((n * k,), jnp.int32).at[order].set(rank_sorted.astype(jnp.int32))
    slot = jnp.where(rank < cap, flat * cap + rank, e * cap)  # e·cap = dropped
    # Token of each buffer slot; n (out of range) marks an empty slot: gathered as zeros, dropped by the scatter.
    token = jnp.full((e * cap,), n, jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32) // k, mode="drop")
    row_w = jnp.zeros((e * cap,), F32).at[slot].set(weights.reshape(-1).astype(F32), mode="drop")
    # Expert groups: the f32 gate/up product of one group stays <= ~4 GiB.
    group = e
    while group > 1 and group * cap * two_i * 4 > 4 * GiB and e % (group // 2) == 0:
        group //= 2
    n_groups = e // group

    def body(gi, out):
        tok = jax.lax.dynamic_slice_in_dim(token, gi * group * cap, group * cap)
        wts = jax.lax.dynamic_slice_in_dim(row_w, gi * group * cap, group * cap)
        xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0).reshape(group, cap, d)
        w1 = jax.lax.dynamic_slice_in_dim(gate_up, gi * group, group)
        w2 = jax.lax.dynamic_slice_in_dim(down, gi * group, group)
        hh = jnp.einsum("gcd,gnd->gcn", xs, w1, preferred_element_type=F32)
        hh = dsv4_moe.swiglu(hh[..., :inter], hh[..., inter:], limit).astype(x.dtype)
        y = jnp.einsum("gci,gdi->gcd", hh, w2, preferred_element_type=F32).reshape(group * cap, d)
        return out.at[tok].add(y * wts[:, None], mode="drop")

    out = jax.lax.fori_loop(0, n_groups, body, jnp.zeros((n, d), F32))
    return out.astype(out_dtype or x.dtype)


class CapacityMoE(dsv4_moe.MoE):
    """`MoE` with the routed experts by `routed_experts_capacity` (one device, weights in the model's dtype). The
    variants' models get it by `use_capacity_moe` on the same parameters; nothing in dsv4 is changed."""

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        ids, weights = self.route(flat, token_ids.reshape(-1))
        gate_up, down, _ = self.expert_weights()
        routed = routed_experts_capacity(flat, ids, weights, gate_up, down, self.limit)
        sh = self.shared_experts
        shared = linear(dsv4_moe.swiglu(linear(flat, sh["gate_proj"]["weight"][...]),
                                        linear(flat, sh["up_proj"]["weight"][...]), self.limit),
                        sh["down_proj"]["weight"][...])  # fmt: skip
        return (routed + shared).reshape(b, s, d)


def use_capacity_moe(model: DeepseekV4) -> DeepseekV4:
    """The model's MoE layers as `CapacityMoE` (same parameters, same tree): for the graphdef of (1c) / (2c)."""
    for layer in model.layers:
        if type(layer.mlp) is dsv4_moe.MoE:
            object.__setattr__(layer.mlp, "__class__", CapacityMoE)
    return model


# ---------------------------------------------------------------------------------------------
# Log, results, budget.
# ---------------------------------------------------------------------------------------------
class Recorder:
    def __init__(self, out_dir: Path | None):
        self.out_dir = out_dir
        self.data: dict = {"header": {}, "setups": {}, "errors": [], "skips": []}
        self._log = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(out_dir / "bench_ttft.log", "w", buffering=1)

    def log(self, msg: str = "", *, stamp: bool = True):
        line = f"[{time.monotonic() - T_START:6.1f}s] {msg}" if msg and stamp else msg
        print(line, flush=True)
        if self._log:
            self._log.write(line + "\n")

    def error(self, where: str, exc: BaseException) -> str:
        kind = "OOM" if is_oom(exc) else "ERROR"
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.log(f"{kind} {where}: {type(exc).__name__}: {first}")
        self.data["errors"].append(dict(where=where, kind=kind, type=type(exc).__name__, message=str(exc)[:4000],
                                        traceback=traceback.format_exc()[-6000:]))  # fmt: skip
        return kind

    def skip(self, where: str, why: str):
        self.log(f"SKIP {where}: {why}")
        self.data["skips"].append(dict(where=where, why=why))

    def write_json(self):
        if self.out_dir is None:
            return
        self.data["elapsed_s"] = time.monotonic() - T_START
        tmp = self.out_dir / "bench_ttft.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        tmp.replace(self.out_dir / "bench_ttft.json")


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemory"))


class Budget:
    GUESS = {"full": 30.0, "chunk": 60.0, "small": 10.0}  # seconds per compile: one layer / a whole model / a piece

    def __init__(self, total_s: float, rec: Recorder, smoke: bool):
        self.deadline = T_START + total_s
        self.rec = rec
        self.seen: dict[str, list[float]] = {}
        self.smoke = smoke

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def compile_est(self, kind: str) -> float:
        seen = self.seen.get(kind)
        return max(seen[-3:]) if seen else (2.0 if self.smoke else self.GUESS[kind])

    def saw_compile(self, kind: str, seconds: float):
        if seconds >= 0.05:
            self.seen.setdefault(kind, []).append(seconds)

    def fits(self, where: str, cost: float) -> bool:
        if cost > self.left():
            self.rec.skip(where, f"predicted {cost:.0f} s > {max(self.left(), 0):.0f} s left of the budget")
            return False
        return True


# ---------------------------------------------------------------------------------------------
# Device helpers.
# ---------------------------------------------------------------------------------------------
def free():
    gc.collect()


def mem_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats() or None
    except Exception:
        return None


def bytes_in_use() -> int:
    s = mem_stats()
    if s and "bytes_in_use" in s:
        return int(s["bytes_in_use"])
    try:
        return int(sum(a.nbytes for a in jax.live_arrays()))
    except Exception:
        return 0


def peak_in_use() -> int | None:
    s = mem_stats()
    return int(s["peak_bytes_in_use"]) if s and "peak_bytes_in_use" in s else None


def gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.1f}"


class Exe:
    """An AOT-compiled jitted function (static args bound) with its compile time and XLA memory analysis."""

    def __init__(self, jitted, args: tuple, *, smoke: bool, options: dict | None = None):
        t0 = time.perf_counter()
        lowered = jitted.trace(*args).lower()
        options = {**(FAST_CPU_COMPILE if smoke else {}), **(options or {})}
        self.exe = lowered.compile(compiler_options=options or None)
        self.compile_s = time.perf_counter() - t0
        self.temp = self.out = self.alias = 0
        try:
            m = self.exe.memory_analysis()
            self.temp = int(getattr(m, "temp_size_in_bytes", 0) or 0)
            self.out = int(getattr(m, "output_size_in_bytes", 0) or 0)
            self.alias = int(getattr(m, "alias_size_in_bytes", 0) or 0)
        except Exception:
            pass

    def need(self) -> int:
        """Bytes this call adds on top of what is in use before it (XLA's buffer assignment)."""
        return self.temp + max(self.out - self.alias, 0)

    def __call__(self, *args):
        return self.exe(*args)


class MemTrack:
    """Estimated peak of a sequence of calls: max(bytes in use before + the call's own buffers)."""

    def __init__(self):
        self.est_peak = 0

    def before(self, exe: Exe):
        self.est_peak = max(self.est_peak, bytes_in_use() + exe.need())


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "std"))
def _normal(key, shape, dtype, std):
    """std · N(0, 1) in `dtype`, drawn in leading-axis chunks of <= 2^28 elements (bounded f32 temporaries)."""
    if not shape:
        return (std * jax.random.normal(key, shape, F32)).astype(dtype)
    lead, rest = shape[0], shape[1:]
    per_row = math.prod(rest) if rest else 1
    chunks = 1
    while lead % (chunks * 2) == 0 and (lead // chunks) * per_row > (1 << 28):
        chunks *= 2
    if chunks == 1:
        return (std * jax.random.normal(key, shape, F32)).astype(dtype)
    keys = jax.random.split(key, chunks)
    out = jax.lax.map(lambda k: (std * jax.random.normal(k, (lead // chunks, *rest), F32)).astype(dtype), keys)
    return out.reshape(shape)


def _path_names(path) -> list[str]:
    names = []
    for k in path:
        v = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        names.append(str(v))
    return [n for n in names if n != "value"]


def build_model_on_device(config: Config, seed: int, dtype) -> tuple[DeepseekV4, dict]:
    """The model with random weights made on the device, leaf by leaf (`dsv4.random_weights.random_model`), in
    `dtype`; `quantize_released` then puts it in a released format. → (model, info)."""
    t0 = time.perf_counter()
    model = random_model(config, seed, dtype=dtype)
    values = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(values)
    return model, dict(init_s=time.perf_counter() - t0, param_bytes=sum(int(v.nbytes) for v in values),
                       n_leaves=len(values), kinds=init_kinds(config))  # fmt: skip


# ---- jitted pieces (static graphdefs) ---------------------------------------------------------
def _embed(embed_w, ids, hc):
    x = embed_w[ids]
    return jnp.broadcast_to(x[:, :, None, :], (*ids.shape, hc, x.shape[-1]))


def _layer(gd, st, streams, positions, ids):
    return nnx.merge(gd, st)(streams, positions, ids)


def _head(gd_h, st_h, gd_n, st_n, streams, lm_w):
    h = nnx.merge(gd_n, st_n)(nnx.merge(gd_h, st_h)(streams[:, -1:]))[:, 0]
    return jnp.einsum("bd,vd->bv", h, lm_w, preferred_element_type=F32)


def _whole(gd, st, ids):
    model = nnx.merge(gd, st)
    h = model.hidden_states(ids)[:, -1]
    return jnp.einsum("bd,vd->bv", h, model.lm_head["weight"][...], preferred_element_type=F32)


def _chunk_step(gd, st, cache, ids, valid):
    return nnx.merge(gd, st).forward_chunk(cache, ids, valid)


def _layer_chunk(gd, st, streams, start, valid, ids, state):
    return nnx.merge(gd, st).forward_chunk(streams, start, valid, ids, state)


def _chunk_head(gd_h, st_h, gd_n, st_n, streams, valid, lm_w):
    last = jnp.take_along_axis(streams, jnp.maximum(valid - 1, 0)[:, None, None, None], axis=1)
    h = nnx.merge(gd_n, st_n)(nnx.merge(gd_h, st_h)(last))[:, 0]
    return jnp.einsum("bd,vd->bv", h, lm_w, preferred_element_type=F32)


def jits(donate: bool) -> dict:
    d = (lambda *n: dict(donate_argnums=n)) if donate else (lambda *n: {})
    return dict(
        embed=jax.jit(_embed, static_argnums=2),
        layer=jax.jit(_layer, static_argnums=0, **d(2)),
        head=jax.jit(_head, static_argnums=(0, 2)),
        whole=jax.jit(_whole, static_argnums=0),
        chunk=jax.jit(_chunk_step, static_argnums=0, **d(2)),
        layer_chunk=jax.jit(_layer_chunk, static_argnums=0, **d(6)),
        chunk_head=jax.jit(_chunk_head, static_argnums=(0, 2)),
    )  # fmt: skip


# ---- breakdown pieces -----------------------------------------------------------------------
def _qkv(gd, st, x, positions):
    return nnx.merge(gd, st).project_qkv(x, positions)[:3]  # q, kv, q_residual


def _out_proj(gd, st, o, positions):
    attn = nnx.merge(gd, st)
    cos, sin = attn.rope.cos_sin(positions)
    return attn.project_out(o, cos.astype(o.dtype), sin.astype(o.dtype))


def _compressor(gd, st, x):
    attn = nnx.merge(gd, st)
    return attn.compressor(x, attn.rope)


def _idx_keys(gd, st, x):
    attn = nnx.merge(gd, st)
    return attn.compressor.indexer.keys(x, attn.rope)


def _idx_topk(gd, st, x, q_residual, positions, keys, impl, interpret):
    """The indexer's selection (q projection, RoPE, head weights, scores, top-k) as `Indexer.select` does it, with
    the top-k by `impl`: "jnp" = `index_topk_jnp` (XLA), "pallas" = `index_topk_two_pass` (Kernels.indexer="pallas"),
    whatever the model's Kernels say."""
    from dsv4.attention import index_topk_jnp
    from dsv4.pallas.indexer import index_topk_two_pass

    attn = nnx.merge(gd, st)
    indexer = attn.compressor.indexer
    b, s, _ = x.shape
    q = linear(q_residual, indexer.q_b_proj["weight"][...]).reshape(b, s, indexer.n_heads, indexer.head_dim)
    cos, sin = attn.rope.cos_sin(positions)
    q = apply_rope(q, cos.astype(q.dtype), sin.astype(q.dtype))
    weights = linear(x, indexer.scorer["weights_proj"]["weight"][...]).astype(F32) * indexer.n_heads**-0.5
    k = min(indexer.topk, keys.shape[1])
    kw = dict(rate=indexer.rate, k=k, softmax_scale=indexer.head_dim**-0.5)
    if impl == "jnp":
        return index_topk_jnp(q, keys, weights, positions, **kw)
    return index_topk_two_pass(q, keys, weights, positions, interpret=interpret, **kw)


def _core(gd, st, q, kv, positions, entries, topk, impl, rate):
    attn = nnx.merge(gd, st)
    compressed = None if entries is None else CompressedKeys(entries, rate, topk)
    return attention_core(impl)(q, kv, positions, positions, attn.sinks[...], sliding_window=attn.sliding_window,
                                scale=attn.head_dim**-0.5, compressed=compressed, kv_aligned=True)  # fmt: skip


def _moe(gd, st, x, ids):
    return nnx.merge(gd, st)(x, ids)


def _mhc(gd, st, streams):
    layer = nnx.merge(gd, st)
    post, comb, collapsed = layer.attn_hc(streams)
    streams = hc_merge(layer.input_layernorm(collapsed), streams, post, comb)
    post, comb, collapsed = layer.ffn_hc(streams)
    return hc_merge(layer.post_attention_layernorm(collapsed), streams, post, comb)


def _route_load(gd, st, x, ids):
    """Max and mean expert load of the router on x (for the capacity MoE's drop check)."""
    mlp = nnx.merge(gd, st)
    eids, _ = mlp.route(x.reshape(-1, x.shape[-1]), ids.reshape(-1))
    counts = jnp.bincount(eids.reshape(-1), length=mlp.experts["gate_up_proj"].shape[0])
    return counts.max(), counts.sum()


BREAKDOWN_JITS = dict(
    qkv=jax.jit(_qkv, static_argnums=0),
    out_proj=jax.jit(_out_proj, static_argnums=0),
    compressor=jax.jit(_compressor, static_argnums=0),
    idx_keys=jax.jit(_idx_keys, static_argnums=0),
    idx_topk=jax.jit(_idx_topk, static_argnums=(0, 6, 7)),
    core=jax.jit(_core, static_argnums=(0, 7, 8)),
    moe=jax.jit(_moe, static_argnums=0),
    mhc=jax.jit(_mhc, static_argnums=0),
    route_load=jax.jit(_route_load, static_argnums=0),
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _randn(key, shape, dtype):
    """N(0, 1) input of any shape: drawn as [rows, last dim] so the row chunks of `_normal` bound the temporaries."""
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return _normal(key, shape=(rows, shape[-1]), dtype=dtype, std=1.0).reshape(shape)


def fmt_len(s: int) -> str:
    return f"{s // 1024}K" if s % 1024 == 0 and s >= 1024 else str(s)


# ---------------------------------------------------------------------------------------------
# The benchmark of one setup (config + lengths).
# ---------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args, setup: Setup, rec: Recorder, budget: Budget, rates: dict[str, float | None],
                 weights: str = "bf16", first: bool = True):  # fmt: skip
        """rates: this run's matmul ceilings, TFLOP/s by precision (`measure_ceilings`); weights: the format this
        bench's model is stored in; first: the first format of the run (the breakdown and the checks run there)."""
        self.args, self.setup, self.rec, self.budget = args, setup, rec, budget
        self.cfg = setup.config
        self.types = list(self.cfg.layer_types)
        self.rates = rates
        self.mm_bf16 = rates.get("bf16")
        self.weights, self.first = weights, first
        self.smoke = args.smoke
        self.interpret = jax.default_backend() != "gpu"
        self.j = jits(donate=not self.smoke)
        self.model = None
        self.results: dict[int, dict[str, dict]] = {}  # S → variant → row
        self.breakdown: dict[int, dict[str, dict]] = {}  # S → piece → row
        self.failed: dict[str, str] = {}  # variant → why it is not tried at larger S
        self._pending_mem = None
        self.state = None  # the weights (nnx.State), shared by every variant's model
        self.graphdefs: dict[tuple[str, str], object] = {}
        self.exe_cache: dict = {}
        # one entry per setup, or per setup and format when several formats run (the key names both)
        key = setup.name if len(args.weights) == 1 else f"{setup.name}/{weights}"
        self.out = rec.data["setups"].setdefault(key, {})
        self.out["weights"] = weights
        ref = Config.preset("v4-flash")
        self.n43 = layer_counts(ref.layer_types)
        self.n_meas = layer_counts(self.types)

    @property
    def name(self) -> str:
        """The setup's name, and the weights format when it is not bf16 (log lines, tables)."""
        return self.setup.name if self.weights == "bf16" else f"{self.setup.name} [{self.weights} weights]"

    # ----- helpers -----
    def exe(self, name: str, jitted, args: tuple, kind: str, cache_key=None) -> tuple[Exe, float]:
        """AOT-compiles (or reuses) → (Exe, seconds spent compiling now)."""
        if cache_key is not None and cache_key in self.exe_cache:
            return self.exe_cache[cache_key], 0.0
        e = Exe(jitted, args, smoke=self.smoke)
        self.budget.saw_compile(kind, e.compile_s)
        if cache_key is not None:
            self.exe_cache[cache_key] = e
        return e, e.compile_s

    def inputs(self, seq: int):
        key = jax.random.key(self.args.seed * 7919 + seq)
        ids = jax.random.randint(key, (1, seq), 0, self.cfg.vocab_size, jnp.int32)
        positions = jnp.arange(seq, dtype=jnp.int32)[None]
        return ids, positions

    def passes_plan(self, t_pass: float) -> int:
        if self.smoke:
            return 2
        if t_pass > 8.0:
            reps = 1
        else:
            reps = int(min(5, max(2, self.args.target_s / max(t_pass, 1e-6))))
        return max(0, min(reps, int((self.budget.left() - 10.0) / max(t_pass, 1e-6))))

    def predict_pass(self, vkey: str, seq: int) -> float:
        """Predicted seconds of one pass of a variant at seq."""
        work = model_work(self.cfg, self.types, seq)
        rows = [(s, r[vkey]) for s, r in self.results.items()
                if vkey in r and r[vkey].get("status") == "ok" and s < seq]  # fmt: skip
        if rows:
            s, r = max(rows, key=lambda x: x[0])
            return r["ttft_s"] * work / model_work(self.cfg, self.types, s)
        same = [r["ttft_s"] for r in self.results.get(seq, {}).values() if r.get("status") == "ok"]
        if same:
            return 2.0 * max(same)
        return work / (1e10 if self.smoke else 50e12)

    def use_impls(self, attention: str, moe: str, indexer: str | None = None, sinkhorn_loop: bool = False,
                  **parts: str) -> DeepseekV4:  # fmt: skip
        """self.model ← the model built with `variant_kernels(...)` (abstractly, so whatever the constructor derives
        from the Kernels value is as in dsv4; moe "xla_cap": its MoE layers swapped for `CapacityMoE`), on the same
        weights (no copy). indexer None: XLA's for the jnp baseline, the two-pass Pallas path otherwise."""
        kernels = variant_kernels(attention, moe, indexer, sinkhorn_loop, **parts)
        key = (kernels, moe == "xla_cap")
        if key not in self.graphdefs:
            make = lambda: DeepseekV4(self.cfg, rngs=nnx.Rngs(0), dtype=BF16, kernels=kernels)  # noqa: E731
            abstract = nnx.eval_shape(make)
            if moe == "xla_cap":
                use_capacity_moe(abstract)
            self.graphdefs[key] = nnx.split(abstract)[0]
        self.model = nnx.merge(self.graphdefs[key], self.state)
        return self.model

    # ----- init -----
    def init(self):
        where = f"{self.name}: init"
        self.rec.log(f"--- {self.name}: building the model on the device "
                     f"({len(self.types)} layers: {','.join(SHORT[t] for t in self.types)}) ---")  # fmt: skip
        before = bytes_in_use()
        try:
            self.model, info = build_model_on_device(self.cfg, self.args.seed, BF16)
        except Exception as exc:  # fallback: the model's own constructor, jitted (slower compile, same distribution)
            self.rec.error(f"{where} (per-leaf device init; falling back to a jitted constructor)", exc)
            free()
            t0 = time.perf_counter()
            make = lambda: DeepseekV4(self.cfg, rngs=nnx.Rngs(self.args.seed), dtype=BF16)  # noqa: E731
            graphdef = nnx.split(nnx.eval_shape(make))[0]
            state = jax.jit(lambda: nnx.split(make())[1])()
            jax.block_until_ready(state)
            self.model = nnx.merge(graphdef, state)
            info = dict(init_s=time.perf_counter() - t0, n_leaves=len(jax.tree.leaves(state)), kinds={},
                        param_bytes=sum(int(x.nbytes) for x in jax.tree.leaves(state)), fallback=True)  # fmt: skip
        if self.weights != "bf16":
            info.update(quantize_released(self.model, released(self.weights)))
            if self.weights == REBLOCKED:
                info["reblocked"] = reblock_fp4_experts(self.model)
            free()
        self.state = nnx.split(self.model)[1]
        info["bytes_in_use_after_gib"] = bytes_in_use() / GiB
        info["weights_gib"] = (bytes_in_use() - before) / GiB
        kinds = info.pop("kinds")
        info["init_counts"] = {k: sum(1 for v in kinds.values() if v == k) for k in set(kinds.values())}
        self.out["init"] = info
        self.rec.log(f"{where}: {info['init_s']:.1f} s, {info['n_leaves']} tensors, {info['param_bytes'] / 1e9:.2f} GB "
                     f"of parameters; in use {info['bytes_in_use_after_gib']:.1f} GiB; "
                     f"inits {info['init_counts']}")  # fmt: skip
        if self.smoke and kinds:
            self.check_init_kinds(kinds)

    def check_init_kinds(self, kinds: dict):
        """Smoke: the device init's ones/zeros pattern matches dsv4.api.init_random's on the same config."""
        from dsv4.api import init_random

        ref = init_random(self.cfg, seed=0, dtype=BF16)
        leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.split(ref)[1])
        bad = []
        for path, leaf in leaves:
            name = ".".join(_path_names(path))
            a = np.asarray(leaf, np.float32)
            want = "ones" if np.all(a == 1) else "zeros" if np.all(a == 0) else "normal"
            got = kinds.get(name)
            if got == "hash":
                got = "zeros" if want == "zeros" else "normal"  # a hash table is zeros only in init_random's default
            if got != want:
                bad.append(f"{name}: {got} vs init_random {want}")
        self.out["init_check"] = bad or "ok"
        verdict = "OK" if not bad else f"MISMATCH {bad[:5]}"
        self.rec.log(f"init check vs init_random ({len(leaves)} tensors): {verdict}")

    # ----- variants -----
    def run_variant(self, vkey: str, seq: int):
        v = VARIANTS[vkey]
        where = f"{self.name} S={fmt_len(seq)} {v.tag} {vkey}"
        if vkey in self.failed:
            self.record(seq, vkey, status="skip", note=self.failed[vkey])
            self.rec.skip(where, self.failed[vkey])
            return
        if vkey in BASELINES and self.weights != "bf16":
            # The baseline keeps its plain XLA form: bf16 weights. Quantized weights would be dequantized in every
            # call there, a slower baseline and a flattering ratio; the weights table divides by the bf16 row.
            self.rec.skip(where, "the XLA baselines run bf16 weights only")
            return
        chunk = self.setup.chunk * v.chunks_of
        if v.mode in ("chunked", "engine") and seq < chunk:
            self.rec.skip(where, f"S < chunk {chunk}")
            return
        t_pred = self.predict_pass(vkey, seq)
        kind = "chunk" if v.mode == "chunked" else "full"
        if t_pred > self.args.max_pass_s:
            self.rec.skip(where, f"one pass predicted {t_pred:.0f} s > --max-pass-s {self.args.max_pass_s:.0f}")
            self.record(seq, vkey, status="skip", note="predicted too slow")
            return
        n_compiles = len(self.types) if v.mode == "full" else 1
        if not self.budget.fits(where, n_compiles * self.budget.compile_est(kind) + 2 * t_pred):
            self.record(seq, vkey, status="skip", note="budget")
            return
        model = self.use_impls(v.attention, v.moe, v.indexer, v.sinkhorn_loop, **v.kernel_parts())
        kernels = model.kernels  # resolved: what this row runs, for its floor
        fp8_act = all(getattr(layer.mlp, "fp8_activations", True) for layer in model.layers)
        peak_before = peak_in_use()
        self._pending_mem = None
        try:
            if v.mode == "engine":
                row = self.measure_engine(seq)
            else:
                row = self.measure_full(seq) if v.mode == "full" else self.measure_chunked(seq, v.kv, chunk)
        except Exception as exc:
            kind_ = self.rec.error(where, exc)
            status = "oom" if kind_ == "OOM" else "error"
            note = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            pm = self._pending_mem
            if pm:  # what XLA's buffer assignment asked for, against what was free
                note = (f"largest call needs {pm['need'] / GiB:.1f} GiB on top of {pm['in_use'] / GiB:.1f} GiB in use "
                        f"(limit {gib(pm['limit'])} GiB); " + note)  # fmt: skip
            self.record(seq, vkey, status=status, note=note, proc_peak=peak_in_use(), mem_need=pm)
            self.failed[vkey] = f"{'did not fit' if status == 'oom' else 'failed'} at S={fmt_len(seq)}"
            free()
            return
        finally:
            free()
        row["proc_peak"] = peak_in_use()
        row["proc_peak_before"] = peak_before
        flops = model_flops(self.cfg, self.types, seq)
        row["flops"] = flops
        row["tflops"] = flops / row["ttft_s"] / 1e12
        row["mfu"] = row["tflops"] / self.mm_bf16 if self.mm_bf16 else None
        floor = mixed_floor(self.cfg, self.types, seq, kernels, released(self.weights), self.rates,
                            fp8_activations=fp8_act)  # fmt: skip
        row["kernels"] = str(kernels)
        row["fp8_parts"] = fp8_parts(self.cfg, kernels, released(self.weights), fp8_act)
        row["flops_by_precision"] = floor["flops_by_precision"] if floor else None
        row["floor_s"] = floor["floor_s"] if floor else None
        row["mfu_mixed"] = floor["floor_s"] / row["ttft_s"] if floor else None
        self.record(seq, vkey, status="ok", **row)
        per_layer = ", ".join(f"{SHORT[t]} {x * 1e3:.1f}" for t, x in zip(self.types, row["layer_s"]) if x is not None)
        shape = f"layers [{per_layer}] ms" if per_layer else f"{row.get('n_chunks')} chunks of {row.get('chunk')}"
        warm_only = ", WARM-UP ONLY" if row["warm_only"] else ""
        self.rec.log(f"{where}: TTFT {row['ttft_s'] * 1e3:10.1f} ms  {row['tflops']:6.1f} TF/s"
                     + (f" (MFU {100 * row['mfu']:.0f}%)" if row["mfu"] else "")
                     + (f"  floor {row['floor_s'] * 1e3:.1f} ms (MFUx {100 * row['mfu_mixed']:.0f}%)"
                        if row["floor_s"] else "")
                     + f"  {shape}  compile {row['compile_s']:.1f} s  est peak {gib(row['est_peak'])} GiB  proc peak "
                     + f"{gib(row['proc_peak'])} GiB  [{row['passes']} pass(es){warm_only}]")  # fmt: skip

    def note_need(self, exes):
        s = mem_stats() or {}
        self._pending_mem = dict(need=max(e.need() for e in exes), in_use=bytes_in_use(), limit=s.get("bytes_limit"))

    def record(self, seq, vkey, **row):
        row["variant"] = vkey
        self.results.setdefault(seq, {})[vkey] = row
        self.out.setdefault("variants", {}).setdefault(str(seq), {})[vkey] = row
        self.rec.write_json()

    def _passes(self, one_pass, warm=None) -> dict:
        """Warm-up + timed passes of `one_pass() → (total_s, layer_s list, extra dict)`.

        warm: optional cheaper warm-up (→ predicted seconds of one pass), e.g. one chunk for the chunked paths, whose
        executables are the same for every chunk; then at least one pass is timed. Default: a whole warm-up pass.
        """
        if warm is not None:
            t_est = warm()
            warm_total, warm_layers, warm_extra = t_est, None, None
            reps = max(1, self.passes_plan(t_est))
        else:
            warm_total, warm_layers, warm_extra = one_pass()
            reps = self.passes_plan(warm_total)
        totals, layers, extras = [], [], []
        for _ in range(reps):
            t, lay, ex = one_pass()
            totals.append(t)
            layers.append(lay)
            extras.append(ex)
        warm_only = reps == 0
        if warm_only:
            totals, layers, extras = [warm_total], [warm_layers], [warm_extra]
        med = statistics.median(totals)
        layer_med = [statistics.median(x[i] for x in layers) for i in range(len(layers[0]))]
        extra_med = {k: statistics.median(e[k] for e in extras) for k in extras[0]}
        spread = (max(totals) - min(totals)) / med if med else 0.0
        return dict(ttft_s=med, times_s=totals, warm_s=warm_total, layer_s=layer_med, passes=len(totals),
                    warm_only=warm_only, spread=spread, **extra_med)  # fmt: skip

    def measure_full(self, seq: int) -> dict:
        m, j = self.model, self.j
        ids, positions = self.inputs(seq)
        embed_w = m.embed_tokens["weight"][...]
        lm_w = m.lm_head["weight"][...]
        gd_h, st_h = nnx.split(m.hc_head)
        gd_n, st_n = nnx.split(m.norm)
        compile_s = 0.0
        e_embed, c = self.exe("embed", j["embed"], (embed_w, ids, self.cfg.hc_mult), "small", ("embed", seq))
        compile_s += c
        streams_abs = jax.ShapeDtypeStruct((1, seq, self.cfg.hc_mult, self.cfg.hidden_size), BF16)
        layer_exes, splits = [], []
        for layer in m.layers:
            gd, st = nnx.split(layer)
            e, c = self.exe("layer", j["layer"], (gd, st, streams_abs, positions, ids), "full", ("layer", gd, seq))
            compile_s += c
            layer_exes.append(e)
            splits.append(st)
        e_head, c = self.exe("head", j["head"], (gd_h, st_h, gd_n, st_n, streams_abs, lm_w), "small", ("head", seq))
        compile_s += c
        self.note_need([e_embed, *layer_exes, e_head])
        track = MemTrack()

        def one_pass():
            t0 = time.perf_counter()
            track.before(e_embed)
            streams = e_embed(embed_w, ids)
            jax.block_until_ready(streams)
            t_embed = time.perf_counter() - t0
            lay = []
            for e, st in zip(layer_exes, splits):
                track.before(e)
                t1 = time.perf_counter()
                streams = e(st, streams, positions, ids)
                jax.block_until_ready(streams)
                lay.append(time.perf_counter() - t1)
            track.before(e_head)
            t1 = time.perf_counter()
            logits = e_head(st_h, st_n, streams, lm_w)
            jax.block_until_ready(logits)
            t_head = time.perf_counter() - t1
            del streams, logits
            return t_embed + sum(lay) + t_head, lay, dict(embed_s=t_embed, head_s=t_head)

        row = self._passes(one_pass)
        row.update(compile_s=compile_s, est_peak=track.est_peak, mode="full-split")
        return row

    def measure_whole(self, seq: int):
        """Variant (3) as one jitted whole-model call: checks the layer-split timing."""
        where = f"{self.name} S={fmt_len(seq)} (3) whole-model jit"
        ref = self.results.get(seq, {}).get("pallas")
        if not ref or ref.get("status") != "ok":
            self.rec.skip(where, "variant (3) did not run at this length")
            return
        if not self.budget.fits(where, self.budget.compile_est("full") * len(self.types) + 3 * ref["ttft_s"]):
            return
        self.use_impls("pallas", "pallas")
        try:
            ids, _ = self.inputs(seq)
            gd, st = nnx.split(self.model)
            e, c = self.exe("whole", self.j["whole"], (gd, st, ids), "chunk")  # a whole model, like the chunk step
            track = MemTrack()

            def one_pass():
                track.before(e)
                t0 = time.perf_counter()
                out = e(st, ids)
                jax.block_until_ready(out)
                return time.perf_counter() - t0, [], {}

            r = self._passes(one_pass)
            r.pop("layer_s", None)
            r.update(compile_s=c, est_peak=track.est_peak, ratio_vs_split=r["ttft_s"] / ref["ttft_s"])
            self.out.setdefault("whole_check", {})[str(seq)] = r
            self.rec.log(f"{where}: {r['ttft_s'] * 1e3:.1f} ms vs split {ref['ttft_s'] * 1e3:.1f} ms "
                         f"(whole / split = {r['ratio_vs_split']:.3f}); compile {c:.1f} s")  # fmt: skip
        except Exception as exc:
            self.rec.error(where, exc)
        finally:
            free()

    def chunk_plan(self, seq: int, n: int | None = None):
        n = n or self.setup.chunk
        ids, _ = self.inputs(seq)
        n_chunks = -(-seq // n)
        pad = n_chunks * n - seq
        ids_p = jnp.pad(ids, [(0, 0), (0, pad)]) if pad else ids
        chunks = [ids_p[:, i * n : (i + 1) * n] for i in range(n_chunks)]
        valids = [jnp.full((1,), min(n, seq - i * n), jnp.int32) for i in range(n_chunks)]
        starts = [jnp.full((1,), i * n, jnp.int32) for i in range(n_chunks)]
        jax.block_until_ready((chunks, valids, starts))
        return chunks, valids, starts

    def measure_chunked(self, seq: int, kv: str | None = None, chunk: int | None = None) -> dict:
        m = self.model

        def new_cache():
            """Dense in the model's dtype, or (kv given) stored in `kv` and paged: one request holding pages 1..n."""
            if kv is None:
                return m.init_cache(1, seq)
            n_pages = -(-seq // PAGE_TOKENS)
            cache = m.init_cache(1, seq, kv_format=kv, page_tokens=PAGE_TOKENS, num_pages=n_pages + 1)
            return cache.replace(block_table=jnp.arange(1, n_pages + 1, dtype=jnp.int32)[None])

        chunk = chunk or self.setup.chunk
        chunks, valids, _ = self.chunk_plan(seq, chunk)
        gd, st = nnx.split(m)
        cache_abs = jax.eval_shape(new_cache)
        e, compile_s = self.exe("chunk", self.j["chunk"], (gd, st, cache_abs, chunks[0], valids[0]), "chunk")
        self.note_need([e])
        track = MemTrack()

        def warm():  # one chunk on a scratch cache: the executable is the same for every chunk
            cache = new_cache()
            t0 = time.perf_counter()
            out = e(st, cache, chunks[0], valids[0])
            jax.block_until_ready(out)
            return (time.perf_counter() - t0) * len(chunks)

        def one_pass():
            cache = new_cache()
            jax.block_until_ready(cache)
            per = []
            for ids, valid in zip(chunks, valids):
                track.before(e)
                t0 = time.perf_counter()
                logits, cache = e(st, cache, ids, valid)
                jax.block_until_ready((logits, cache))
                per.append(time.perf_counter() - t0)
            del cache, logits
            return sum(per), [], dict(first_chunk_s=per[0], last_chunk_s=per[-1])

        row = self._passes(one_pass, warm)
        row.update(compile_s=compile_s, est_peak=track.est_peak, mode="chunked-whole", n_chunks=len(chunks),
                   chunk=chunk, layer_s=[None] * len(self.types))  # fmt: skip
        return row

    def measure_engine(self, seq: int) -> dict:
        """The prompt through the engine as a user runs it: `dsv4.LLM(model)` with default arguments (the model's
        kernels "auto", the paged cache in its dtype) but the chunk size, compiled up front by `warmup`; TTFT is
        the request's own (`RequestOutput.metrics.ttft_s`: arrival to first sampled token, the host's scheduling,
        paging and sampling included)."""
        llm = LLM(self.model, max_slots=1, max_model_len=seq + 1, chunk_size=self.setup.chunk)
        ids, _ = self.inputs(seq)
        prompt = np.asarray(ids)[0].tolist()
        compile_s = llm.warmup([seq])

        def one_pass():
            out = llm.generate([prompt], max_new_tokens=1)[0]
            return out.metrics.ttft_s, [], {}

        row = self._passes(one_pass)
        row.update(compile_s=compile_s, est_peak=None, mode="engine", n_chunks=-(-seq // self.setup.chunk),
                   chunk=self.setup.chunk, layer_s=[None] * len(self.types),
                   kernels=str(self.model.kernels))  # fmt: skip
        return row

    def measure_chunk_split(self, seq: int):
        """The chunked variant layer by layer (DecoderLayer.forward_chunk per layer per chunk): per-layer-type times."""
        where = f"{self.name} S={fmt_len(seq)} (4) chunked, layer-split pass"
        ref = self.results.get(seq, {}).get("chunked")
        if not ref or ref.get("status") != "ok":
            self.rec.skip(where, "variant (4) did not run at this length")
            return
        if not self.budget.fits(where, self.budget.compile_est("full") * len(self.types) + 2.5 * ref["ttft_s"]):
            return
        m, j = self.use_impls("pallas", "pallas"), self.j
        try:
            chunks, valids, starts = self.chunk_plan(seq)
            n = self.setup.chunk
            embed_w, lm_w = m.embed_tokens["weight"][...], m.lm_head["weight"][...]
            gd_h, st_h = nnx.split(m.hc_head)
            gd_n, st_n = nnx.split(m.norm)
            compile_s = 0.0
            e_embed, c = self.exe("embed", j["embed"], (embed_w, chunks[0], self.cfg.hc_mult), "small", ("embed", n))
            compile_s += c
            streams_abs = jax.ShapeDtypeStruct((1, n, self.cfg.hc_mult, self.cfg.hidden_size), BF16)
            cache_abs = jax.eval_shape(lambda: m.init_cache(1, seq))
            layer_exes, splits = [], []
            for i, layer in enumerate(m.layers):
                gd, st = nnx.split(layer)
                args = (gd, st, streams_abs, starts[0], valids[0], chunks[0], cache_abs.layers[i])
                e, c = self.exe("layer_chunk", j["layer_chunk"], args, "full", ("layer_chunk", gd, seq, n))
                compile_s += c
                layer_exes.append(e)
                splits.append(st)
            e_head, c = self.exe("chunk_head", j["chunk_head"], (gd_h, st_h, gd_n, st_n, streams_abs, valids[0], lm_w),
                                 "small", ("chunk_head", n))  # fmt: skip
            compile_s += c
            track = MemTrack()

            def warm():  # one chunk through every layer, on scratch states
                states = list(m.init_cache(1, seq).layers)
                t0 = time.perf_counter()
                streams = e_embed(embed_w, chunks[0])
                for i, (e, st) in enumerate(zip(layer_exes, splits)):
                    streams, states[i] = e(st, streams, starts[0], valids[0], chunks[0], states[i])
                jax.block_until_ready(e_head(st_h, st_n, streams, valids[0], lm_w))
                return (time.perf_counter() - t0) * len(chunks)

            def one_pass():
                states = list(m.init_cache(1, seq).layers)
                jax.block_until_ready(states)
                lay = [0.0] * len(layer_exes)
                other = 0.0
                for ids, valid, start in zip(chunks, valids, starts):
                    t0 = time.perf_counter()
                    track.before(e_embed)
                    streams = e_embed(embed_w, ids)
                    jax.block_until_ready(streams)
                    other += time.perf_counter() - t0
                    for i, (e, st) in enumerate(zip(layer_exes, splits)):
                        track.before(e)
                        t1 = time.perf_counter()
                        streams, states[i] = e(st, streams, start, valid, ids, states[i])
                        jax.block_until_ready((streams, states[i]))
                        lay[i] += time.perf_counter() - t1
                    track.before(e_head)
                    t1 = time.perf_counter()
                    logits = e_head(st_h, st_n, streams, valid, lm_w)
                    jax.block_until_ready(logits)
                    other += time.perf_counter() - t1
                return other + sum(lay), lay, dict(embed_head_s=other)

            r = self._passes(one_pass, warm)
            r.update(compile_s=compile_s, est_peak=track.est_peak, ratio_vs_whole=r["ttft_s"] / ref["ttft_s"])
            ref["layer_s"] = r["layer_s"]
            ref["layer_s_from"] = "layer-split pass"
            self.out.setdefault("chunk_split", {})[str(seq)] = r
            self.rec.log(f"{where}: {r['ttft_s'] * 1e3:.1f} ms (split / whole = {r['ratio_vs_whole']:.3f}); layers ["
                         + ", ".join(f"{SHORT[t]} {x * 1e3:.1f}" for t, x in zip(self.types, r["layer_s"]))
                         + f"] ms; compile {compile_s:.1f} s")  # fmt: skip
            self.rec.write_json()
        except Exception as exc:
            self.rec.error(where, exc)
        finally:
            free()

    # ----- breakdown -----
    def piece_work(self, name: str, seq: int) -> float:
        """FLOPs-like work of a breakdown piece (time-scaling proxy; XLA's dense indexer and HCA core counted dense)."""
        cfg = self.cfg
        f = {t: layer_flops(cfg, t, seq) for t in (SLIDING, CSA, HCA)}
        parts = {"qkv": ("attn-qkv",), "out-proj": ("attn-out-a", "attn-out-b"), "mhc": ("mhc",),
                 "idx-keys": ("indexer-keys",)}
        if name in parts or name.startswith("moe-"):
            return sum(f[CSA][p] for p in parts.get(name, ("router", "moe-routed", "moe-shared")))
        if name == "compressor-csa":
            return f[CSA]["compressor"]
        if name == "compressor-hca":
            return f[HCA]["compressor"]
        if name.startswith("idx-topk"):
            dense = 2.0 if name.endswith("jnp") else 1.0
            return f[CSA]["indexer-q"] + f[CSA]["indexer-weights"] + dense * f[CSA]["indexer-scores"]
        if name.startswith("core-"):
            _, t, impl = name.split("-")
            ff = f[LONG[t]]
            dense = 2.0 if impl == "jnp" else 1.0
            return dense * (ff["window-core"] + ff.get("csa-core", 0.0) + ff.get("hca-core", 0.0))
        return 1e9

    def predict_piece(self, name: str, seq: int) -> float:
        rows = [(s, r[name]) for s, r in self.breakdown.items()
                if name in r and r[name].get("status") == "ok" and s < seq]  # fmt: skip
        if rows:
            s, r = max(rows, key=lambda x: x[0])
            return r["ms"] * 1e-3 * self.piece_work(name, seq) / max(self.piece_work(name, s), 1.0)
        return self.piece_work(name, seq) / (1e10 if self.smoke else 30e12) + 1e-3

    def piece(self, seq: int, name: str, jitted, args: tuple, dyn: tuple, keep: bool = False):
        """Compile + time one breakdown piece. args: all args (statics included) for tracing; dyn: call args.
        → the warm-up output if keep, else None."""
        where = f"{self.name} S={fmt_len(seq)} breakdown {name}"
        t_pred = self.predict_piece(name, seq)
        if t_pred > self.args.max_pass_s:
            self.rec.skip(where, f"predicted {t_pred:.0f} s per call")
            return None
        if not self.budget.fits(where, self.budget.compile_est("small") + 3 * t_pred):
            return None
        out_keep = None
        try:
            e, c = self.exe(name, jitted, args, "small")
            track = MemTrack()
            track.before(e)
            t0 = time.perf_counter()
            out = e(*dyn)
            jax.block_until_ready(out)
            warm = time.perf_counter() - t0
            if keep:
                out_keep = out
            del out
            reps = 1 if self.smoke else (1 if warm > 4.0 else int(min(10, max(3, 1.0 / max(warm, 1e-6)))))
            reps = max(0, min(reps, int((self.budget.left() - 5.0) / max(warm, 1e-6))))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                out = e(*dyn)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                del out
            ms = 1e3 * (statistics.median(times) if times else warm)
            row = dict(status="ok", ms=ms, reps=len(times), warm_ms=warm * 1e3, compile_s=c, est_peak=track.est_peak)
            self.rec.log(f"{where}: {ms:10.2f} ms  [{len(times)} runs, compile {c:.1f} s, "
                         f"est peak {gib(track.est_peak)} GiB]")  # fmt: skip
        except Exception as exc:
            kind = self.rec.error(where, exc)
            row = dict(status="oom" if kind == "OOM" else "error", note=f"{type(exc).__name__}")
        self.breakdown.setdefault(seq, {})[name] = row
        self.out.setdefault("breakdown", {}).setdefault(str(seq), {})[name] = row
        self.rec.write_json()
        free()
        return out_keep

    def run_breakdown(self, seq: int):
        self.rec.log(f"--- {self.name} S={fmt_len(seq)}: breakdown ---")
        m, bj, cfg = self.use_impls("jnp", "jnp"), BREAKDOWN_JITS, self.cfg
        ids, positions = self.inputs(seq)
        key = jax.random.key(self.args.seed * 31 + seq)
        x = _randn(jax.random.fold_in(key, 1), shape=(1, seq, cfg.hidden_size), dtype=BF16)
        by_type = {}
        for layer in m.layers:
            by_type.setdefault(layer.self_attn.layer_type, layer)
        any_layer = m.layers[0]
        attn_q = (by_type.get(CSA) or any_layer).self_attn
        gd_q, st_q = nnx.split(attn_q)
        qkv = self.piece(seq, "qkv", bj["qkv"], (gd_q, st_q, x, positions), (st_q, x, positions), keep=True)
        q = kv = q_res = None
        if qkv is not None:
            q, kv, q_res = qkv
        del qkv  # (the tuple would keep q alive after `del q`)
        entries, topk = {}, None
        for t in (CSA, HCA):
            if t in by_type:
                gd, st = nnx.split(by_type[t].self_attn)
                entries[t] = self.piece(seq, f"compressor-{SHORT[t]}", bj["compressor"], (gd, st, x), (st, x),
                                        keep=True)  # fmt: skip
        if CSA in by_type and q_res is not None:
            gd, st = nnx.split(by_type[CSA].self_attn)
            keys = self.piece(seq, "idx-keys", bj["idx_keys"], (gd, st, x), (st, x), keep=True)
            if keys is not None and keys.shape[1] > 0:
                args = (gd, st, x, q_res, positions, keys)
                topk = self.piece(seq, "idx-topk-jnp", bj["idx_topk"], (*args, "jnp", self.interpret), args[1:],
                                  keep=True)  # fmt: skip
                topk_p = self.piece(seq, "idx-topk-pallas", bj["idx_topk"], (*args, "pallas", self.interpret), args[1:],
                                    keep=True)  # fmt: skip
                if topk is not None and topk_p is not None:
                    self.compare_topk(seq, topk, topk_p)
                del topk_p
            del keys
        del q_res
        if q is not None:
            for t in (SLIDING, HCA, CSA):
                if t not in by_type:
                    continue
                attn = by_type[t].self_attn
                gd, st = nnx.split(attn)
                ent = entries.get(t) if t != SLIDING else None
                if t != SLIDING and (ent is None or ent.shape[1] == 0):
                    ent = None
                tk = topk if t == CSA else None
                if t == CSA and tk is None:
                    ent = None  # no indexer picks: the core would be HCA-like; skip the compressed part
                rate = attn.compressor.rate if t != SLIDING else 0
                for impl in ("jnp", "pallas"):
                    args = (gd, st, q, kv, positions, ent, tk, impl, rate)
                    self.piece(seq, f"core-{SHORT[t]}-{impl}", bj["core"], args, (st, q, kv, positions, ent, tk))
        del q, kv, entries, topk
        free()
        # The output projection on a random core output (its cost does not depend on the values); q is gone by now,
        # which keeps the peak at 512K (q and o are 32 GiB each) under the card's memory.
        o = _randn(jax.random.fold_in(key, 3), shape=(1, seq, cfg.num_attention_heads, cfg.head_dim), dtype=BF16)
        gd_o, st_o = nnx.split(attn_q)
        self.piece(seq, "out-proj", bj["out_proj"], (gd_o, st_o, o, positions), (st_o, o, positions))
        del o
        free()
        mlp = any_layer.mlp
        layer_idx = 0
        for impl in ("pallas", "xla_cap", "jnp"):
            ran = [self.results.get(seq, {}).get(k, {}).get("status") for k in ("xla", "pallas-attn")]
            if impl == "jnp" and "ok" not in ran:  # lax.ragged_dot can ask for ~96 GiB at 8K tokens
                self.rec.skip(f"{self.name} S={fmt_len(seq)} breakdown moe-jnp",
                              "no XLA-MoE variant ran at this length (did not fit, or not run)")  # fmt: skip
                continue
            gd, st = nnx.split(self.use_impls("jnp", impl).layers[layer_idx].mlp)
            self.piece(seq, f"moe-{impl}", bj["moe"], (gd, st, x, ids), (st, x, ids))
        try:
            gd, st = nnx.split(mlp)
            mx, total = jax.device_get(bj["route_load"](gd, st, x, ids))
            mean = float(total) / cfg.n_routed_experts
            cap = expert_capacity(int(total), cfg.n_routed_experts, self.args.capacity_factor)
            self.out.setdefault("routing", {})[str(seq)] = dict(max_load=int(mx), mean_load=mean, capacity=cap)
            drops = "no drops" if mx <= cap else "DROPS in the capacity MoE"
            self.rec.log(f"routing on random hidden states: max expert load {int(mx)} = {mx / mean:.2f} × mean; "
                         f"capacity {cap} ({drops})")  # fmt: skip
        except Exception as exc:
            self.rec.error(f"{self.name} S={fmt_len(seq)} routing check", exc)
        del x
        streams = _randn(jax.random.fold_in(key, 2), shape=(1, seq, cfg.hc_mult, cfg.hidden_size), dtype=BF16)
        gd, st = nnx.split(any_layer)
        self.piece(seq, "mhc", bj["mhc"], (gd, st, streams), (st, streams))
        del streams
        free()

    def compare_topk(self, seq, a, b):
        """Fraction of the XLA indexer's picks the Pallas kernel also picked (same set expected up to score ties)."""
        try:
            rows = np.unique(np.linspace(0, seq - 1, min(seq, 256)).astype(int))
            aa, bb = np.asarray(a[0, rows]), np.asarray(b[0, rows])
            agree = [len(set(x[x >= 0]) & set(y[y >= 0])) / max(1, len(set(x[x >= 0]))) for x, y in zip(aa, bb)]
            frac = float(np.mean(agree))
            self.out.setdefault("topk_agreement", {})[str(seq)] = frac
            self.rec.log(f"indexer top-k: Pallas kernel picks {100 * frac:.2f}% of the XLA path's entries (256 rows)")
        except Exception as exc:
            self.rec.error("compare_topk", exc)

    # ----- driver -----
    def run(self):
        try:
            self.init()
        except Exception as exc:
            self.rec.error(f"{self.name}: init", exc)
            self.model = self.state = None  # a later format builds its own model: leave it the memory
            free()
            return
        self.out["config"] = dict(layer_types=[SHORT[t] for t in self.types], lengths=self.setup.lengths,
                                  chunk=self.setup.chunk, variants=self.args.variants,
                                  flops_per_token=self.flops_table())  # fmt: skip
        if self.first:
            self.print_flops()
        # Order of work: every length's variants first (the headline numbers), then the chunked layer-split passes
        # (per-layer-type times of (4)), then the breakdowns (largest length first), then the whole-model check.
        for seq in self.setup.lengths:
            self.rec.log(f"--- {self.name} S={fmt_len(seq)}: variants ---")
            only = self.args.weight_variants.get(self.weights)
            for vkey in self.setup.variants or self.args.variants:
                if only is not None and vkey not in only:
                    continue
                try:
                    self.run_variant(vkey, seq)
                except Exception as exc:  # the bookkeeping around a variant failed; the next one still runs
                    self.rec.error(f"{self.name} S={fmt_len(seq)} {vkey}", exc)
                free()
        if self.setup.chunk_split and not self.args.no_chunk_split and self.first:
            for seq in self.setup.lengths:
                self.measure_chunk_split(seq)
        if self.setup.breakdown and not self.args.no_breakdown and self.first:
            for seq in sorted(self.setup.lengths, reverse=True):
                try:
                    self.run_breakdown(seq)
                except Exception as exc:
                    self.rec.error(f"{self.name} S={fmt_len(seq)} breakdown", exc)
                free()
        if self.setup.whole_check and not self.args.no_whole_check and self.first:
            self.measure_whole(self.setup.lengths[0])
        self.model = self.state = None
        self.exe_cache.clear()
        free()

    def flops_table(self) -> dict:
        out = {}
        for seq in sorted(set(self.setup.lengths) | {524288}):
            out[str(seq)] = {SHORT[t]: {k: v / seq for k, v in layer_flops(self.cfg, t, seq).items()}
                             for t in (SLIDING, CSA, HCA)}  # fmt: skip
        return out

    def print_flops(self):
        log = self.rec.log
        log(f"FLOPs per token per layer (useful; from the config; M = 1e6) — {self.name}:")
        for seq in sorted(set(self.setup.lengths) | {524288}):
            parts = []
            for t in (SLIDING, CSA, HCA):
                f = layer_flops(self.cfg, t, seq)
                parts.append(f"{SHORT[t]} {sum(f.values()) / seq / 1e6:,.4g}M (" +
                             ", ".join(f"{k} {v / seq / 1e6:,.4g}" for k, v in f.items()) + ")")  # fmt: skip
            log(f"  S={fmt_len(seq)}: " + "; ".join(parts))
        ref = Config.preset("v4-flash")
        per_tok = model_flops(self.cfg, ref.layer_types, 524288) / 524288
        log(f"  43-layer V4-Flash mix {self.n43}: {per_tok:.3g} FLOPs/token at 512K = {per_tok * 524288:.3g} FLOPs "
            f"(expected: ~5.6e10 / 2.9e16 at V4-Flash widths)")  # fmt: skip

    # ----- tables -----
    def type_times(self, row) -> dict[str, float] | None:
        if not row.get("layer_s") or any(x is None for x in row["layer_s"]):
            return None
        out = {}
        for t in (SLIDING, CSA, HCA):
            xs = [x for x, tt in zip(row["layer_s"], self.types) if tt == t]
            if xs:
                out[t] = sum(xs) / len(xs)
        return out

    def project(self, seq, vkey, row) -> dict | None:
        """PROJECTION to the 43-layer mix: measured + (n43 - n_measured) · t_type; chunked without a layer-split pass
        scales by variant (3)'s 43/3 ratio at the same length."""
        tt = self.type_times(row)
        if tt is not None and all(t in tt for t, n in self.n43.items() if n):
            t43 = row["ttft_s"] + sum((self.n43[t] - self.n_meas[t]) * tt[t] for t in self.n43 if self.n43[t])
            return dict(t43_1gpu=t43, t43_8gpu=t43 / 8, how="per-layer-type times")
        ref = self.results.get(seq, {}).get("pallas")
        if vkey == "chunked" and ref and ref.get("status") == "ok":
            p = self.project(seq, "pallas", ref)
            if p:
                t43 = row["ttft_s"] * p["t43_1gpu"] / ref["ttft_s"]
                return dict(t43_1gpu=t43, t43_8gpu=t43 / 8, how="scaled by (3)'s 43-layer/measured ratio")
        return None

    def table(self):
        log = self.rec.log
        name = self.name
        ref43 = Config.preset("v4-flash").layer_types
        log("=" * 132)
        mix = ",".join(SHORT[t] for t in self.types)
        log(f"TTFT — {name}: {len(self.types)} measured layers ({mix}), {self.weights} weights, bf16 activations, "
            f"B=1; ceilings (this run, TFLOP/s): {rates_text(self.rates)}")  # fmt: skip
        log(f"{'S':>5} {'variant':<38} {'TTFT ms':>10} {'vs(1)':>6} {'vs(1c)':>6} {'TF/s':>6} {'MFU':>4} {'MFUx':>4} "
            f"{'estpk':>6} {'prcpk':>6}  {'per layer ms: sliding / csa / hca':<34} "
            f"{'43L 1GPU s':>10} {'8GPU s':>7}")  # fmt: skip
        log(f"{'':>5} {'':<38} {'':>10} {'':>6} {'':>6} {'':>6} {'':>4} {'':>4} {'GiB':>6} {'GiB':>6}  {'':<34} "
            f"{'PROJECTION':>10} {'PROJ.':>7}")  # fmt: skip
        proj_out = {}
        for seq in sorted(self.results):
            rows = self.results[seq]
            base = rows.get("xla") if rows.get("xla", {}).get("status") == "ok" else None
            base_c = rows.get("xla-cap") if rows.get("xla-cap", {}).get("status") == "ok" else None
            for vkey in TABLE_ORDER:
                if vkey not in rows:
                    continue
                r, v = rows[vkey], VARIANTS[vkey]
                label = f"{v.tag} {v.label}"[:38]
                if r.get("status") != "ok":
                    what = {"oom": "does not fit (OOM)", "error": "ERROR", "skip": "skipped"}.get(r.get("status"), "?")
                    log(f"{fmt_len(seq):>5} {label:<38} {what:>10}  {r.get('note', '')[:150]}")
                    continue
                ms = r["ttft_s"] * 1e3
                s1 = f"{base['ttft_s'] / r['ttft_s']:.2f}x" if base else "-"
                s1c = f"{base_c['ttft_s'] / r['ttft_s']:.2f}x" if base_c else "-"
                mfu = f"{100 * r['mfu']:.0f}%" if r.get("mfu") else "-"
                mfux = f"{100 * r['mfu_mixed']:.0f}%" if r.get("mfu_mixed") else "-"
                tt = self.type_times(r)
                per = " / ".join(f"{tt[t] * 1e3:.1f}" if t in tt else "-" for t in (SLIDING, CSA, HCA)) if tt else "-"
                p = self.project(seq, vkey, r)
                if p:
                    proj_out.setdefault(str(seq), {})[vkey] = p
                flag = "*" if r.get("warm_only") else ""
                t1, t8 = (p["t43_1gpu"], p["t43_8gpu"]) if p else (float("nan"), float("nan"))
                log(f"{fmt_len(seq):>5} {label:<38} {ms:>9.1f}{flag:1} {s1:>6} {s1c:>6} {r['tflops']:>6.3g} {mfu:>4} "
                    f"{mfux:>4} {gib(r.get('est_peak')):>6} {gib(r.get('proc_peak')):>6}  {per:<34} "
                    f"{t1:>10.2f} {t8:>7.2f}")  # fmt: skip
        self.out["projection"] = proj_out
        log("vs(1)/vs(1c): speed-up over the XLA baseline (ragged_dot MoE) / over the XLA baseline with the capacity "
            "MoE, "
            "same length; TF/s, MFU: useful FLOPs of the measured layers + head over TTFT, MFU against the bf16 matmul "
            "ceiling; MFUx: the mixed-precision floor (each part at the rate of the precision the row runs it in) over "
            "TTFT; estpk: bytes in use + XLA buffer assignment, max over the variant's calls; prcpk: process-wide "
            "peak so far; 43L: PROJECTION to 2 sliding + 21 CSA + 20 HCA layers from per-layer-type times "
            "(8 GPU = ideal /8); * = warm-up pass only")  # fmt: skip
        for seq in sorted(self.results):
            f43 = model_flops(self.cfg, ref43, seq)
            if self.mm_bf16:
                floor = f43 / (self.mm_bf16 * 1e12)
                pallas = Kernels.all("pallas")
                mixed = [(idx, mixed_floor(self.cfg, ref43, seq, dataclasses.replace(pallas, indexer=idx),
                                           released(self.weights), self.rates))
                         for idx in ("pallas", "pallas-fp8")]  # fmt: skip
                mixed = ", ".join(f"indexer {'fp8' if i == 'pallas-fp8' else 'bf16'} {m['floor_s']:.2f} s "
                                  f"({m['floor_s'] / 8:.2f} on 8)" for i, m in mixed if m)  # fmt: skip
                log(f"S={fmt_len(seq)}: 43-layer FLOPs {f43:.3g}; at the bf16 matmul ceiling: {floor:.2f} s on 1 GPU, "
                    f"{floor / 8:.2f} s on 8; mixed-precision floor, Pallas kernels, {self.weights} weights: "
                    f"{mixed or '-'} (floors, not measurements)")  # fmt: skip
        for seq, r in sorted(self.out.get("whole_check", {}).items(), key=lambda x: int(x[0])):
            log(f"check S={fmt_len(int(seq))}: (3) as one whole-model jit {r['ttft_s'] * 1e3:.1f} ms = "
                f"{r['ratio_vs_split']:.3f} × the layer-split TTFT")  # fmt: skip
        for seq, r in sorted(self.out.get("chunk_split", {}).items(), key=lambda x: int(x[0])):
            log(f"check S={fmt_len(int(seq))}: (4) layer-split pass {r['ttft_s'] * 1e3:.1f} ms = "
                f"{r['ratio_vs_whole']:.3f} × forward_chunk (per-layer times of (4) come from this pass)")  # fmt: skip
        self.breakdown_table()

    def breakdown_table(self):
        log = self.rec.log
        if not self.breakdown:
            return
        log("-" * 132)
        log(f"Breakdown — {self.name} (ms; each piece its own jitted call on random inputs of the same shapes; "
            "per-layer rows: the variant's layer time split into its pieces)")  # fmt: skip

        def ms(seq, name):
            r = self.breakdown.get(seq, {}).get(name)
            if not r:
                return None
            return r["ms"] if r.get("status") == "ok" else r.get("status", "?").upper()

        def f(x):
            return "-" if x is None else (x if isinstance(x, str) else f"{x:.4g}")

        for seq in sorted(self.breakdown):
            g = lambda n: f(ms(seq, n))  # noqa: E731
            log(f"S={fmt_len(seq)} pieces: qkv {g('qkv')} | out-proj {g('out-proj')} | compressor csa "
                f"{g('compressor-csa')}, hca {g('compressor-hca')} | idx-keys {g('idx-keys')} | idx-topk xla "
                f"{g('idx-topk-jnp')}, pallas {g('idx-topk-pallas')} | "
                f"mhc {g('mhc')}")  # fmt: skip
            pad = " " * (len(fmt_len(seq)) + 2)
            log(f"{pad} core xla/pallas: sliding {g('core-sliding-jnp')}/{g('core-sliding-pallas')}, "
                f"csa {g('core-csa-jnp')}/{g('core-csa-pallas')}, hca {g('core-hca-jnp')}/{g('core-hca-pallas')} | "
                f"moe pallas {g('moe-pallas')}, xla_cap {g('moe-xla_cap')}, jnp {g('moe-jnp')}")  # fmt: skip
            shown = 0
            for vkey in ("xla", "xla-cap", "pallas", "chunked", "pallas-attn-cap", "pallas-attn"):
                r = self.results.get(seq, {}).get(vkey)
                tt = self.type_times(r) if r and r.get("status") == "ok" else None
                xla_ok = self.results[seq].get("xla", {}).get("status") == "ok"
                if not tt or shown >= 3 or (vkey == "xla-cap" and xla_ok):
                    continue
                shown += 1
                v = VARIANTS[vkey]
                moe, mhc = ms(seq, f"moe-{v.moe}"), ms(seq, "mhc")
                for t in (SLIDING, CSA, HCA):
                    if t not in tt:
                        continue
                    parts = ["qkv", "out-proj", f"core-{SHORT[t]}-{v.attention}"]
                    parts += [f"compressor-{SHORT[t]}"] if t != SLIDING else []
                    parts += ["idx-keys", f"idx-topk-{v.attention}"] if t == CSA else []
                    vals = [ms(seq, n) for n in parts]
                    attn = sum(vals) if all(isinstance(x, float) for x in vals) else None
                    total = tt[t] * 1e3
                    nums = (attn, moe, mhc)
                    rest = total - sum(nums) if all(isinstance(x, float) for x in nums) else None
                    pct = lambda x: f" {100 * x / total:.0f}%" if isinstance(x, float) and total else ""  # noqa: E731
                    core = ms(seq, parts[2])
                    idx = ms(seq, f"idx-topk-{v.attention}") if t == CSA else None
                    log(f"  {v.tag:<4} {SHORT[t]:<7} layer {total:9.1f} = attention {f(attn)}{pct(attn)} "
                        f"(core {f(core)}" + (f", indexer top-k {f(idx)}" if t == CSA else "")
                        + f") + moe {f(moe)}{pct(moe)} + mhc {f(mhc)}{pct(mhc)} "
                        f"+ other {f(rest)}{pct(rest)}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Ceilings and header.
# ---------------------------------------------------------------------------------------------
# The matmul ceilings, timed in the same interleaved rounds: (key, precision, build). "xla": XLA's defaults (on a GPU it
# may autotune Triton GEMMs against cuBLAS); "cublas": Triton GEMMs off, so the dot can only become a cuBLAS(Lt) call.
CEILINGS = (("bf16", "bf16", "xla"), ("bf16-cublas", "bf16", "cublas"), ("fp8", "fp8", "xla"),
            ("fp8-cublaslt", "fp8", "cublas"), ("f32", "f32", "xla"))  # fmt: skip
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}
CUBLASLT_FP8 = "__cublas$lt$matmul$f8"


def gemm_kernels(hlo: str) -> list[str]:
    """The GEMM implementations a compiled HLO text calls: custom-call targets (`__cublas$lt$matmul$f8`,
    `__cublas$gemm`, ...) and the kinds of custom fusions (`__triton_gemm`, ...)."""
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    fusions = re.findall(r'"kind":"(__[^"]+)"', hlo)
    return sorted(set(calls) | set(fusions))


def rates_text(rates: dict) -> str:
    return ", ".join(f"{p} {r:.4g}" if r else f"{p} -" for p, r in rates.items())


CEILING_CALL_S = 0.025
"""Seconds of back-to-back matmul calls a ceiling round times (one call of a 16384³ matmul, ~6 ms on an H200, is
timed four at a time; an 8192³ one ~20 at a time)."""


def measure_ceilings(rec: Recorder, budget: Budget, sizes, smoke: bool, seed: int) -> dict[str, float | None]:
    """Every build of `CEILINGS` at each n of `sizes` (n³, random normal operands) compiled and warmed up first, then
    rounds that time each build in turn (so clock and power drift hit them alike), as back-to-back calls filling about
    `CEILING_CALL_S` (a ~1 ms matmul timed alone carries the launch and the host's synchronization); a build's figure
    is the median of its rounds. → TFLOP/s by precision: its fastest build at its best size (None where none ran)."""
    rec.log("--- ceilings: matmuls in interleaved rounds (same run) ---")
    items = []
    for n in sizes:
        k1, k2 = jax.random.split(jax.random.key(seed + n))
        a, b = _randn(k1, shape=(n, n), dtype=BF16), _randn(k2, shape=(n, n), dtype=BF16)
        operands = {"bf16": (a, b), "fp8": (a.astype(FP8), b.astype(FP8)), "f32": (a.astype(F32), b.astype(F32))}
        for key, precision, build in CEILINGS:
            where = f"ceiling {key} {n}^3"
            if not budget.fits(where, budget.compile_est("small") + 12 * 2.0 * n**3 / 50e12):
                continue
            try:
                if precision == "fp8":
                    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32))
                else:
                    fn = jax.jit(lambda a, b: a @ b)
                args = operands[precision]
                e = Exe(fn, args, smoke=smoke, options=CUBLAS_ONLY if build == "cublas" else None)
                budget.saw_compile("ceiling", e.compile_s)  # kept apart: XLA's FP8 autotuning can take minutes
                jax.block_until_ready(e(*args))
                t0 = time.perf_counter()
                jax.block_until_ready(e(*args))
                calls = max(1, min(50, int(CEILING_CALL_S / max(time.perf_counter() - t0, 1e-6))))
                kernels = gemm_kernels(e.exe.as_text())
                items.append(dict(key=key, precision=precision, build=build, n=n, exe=e, args=args, kernels=kernels,
                                  compile_s=e.compile_s, calls=calls, times=[]))  # fmt: skip
                rec.log(f"{where}: compiled in {e.compile_s:.1f} s; GEMM kernels {kernels or '(none named)'}")
            except Exception as exc:
                rec.error(where, exc)
        del a, b, operands  # the items hold what they use
    rounds = 3 if smoke else 10
    for _ in range(rounds):
        for it in items:
            t0 = time.perf_counter()
            for _ in range(it["calls"]):
                out = it["exe"](*it["args"])
            jax.block_until_ready(out)
            it["times"].append((time.perf_counter() - t0) / it["calls"])
    table, rates, source = {}, {precision: None for _, precision, _ in CEILINGS}, {}
    for it in items:
        t = statistics.median(it["times"])
        tf = 2.0 * it["n"] ** 3 / t / 1e12
        row = dict(precision=it["precision"], build=it["build"], n=it["n"], ms=t * 1e3, tflops=tf,
                   times_ms=[x * 1e3 for x in it["times"]], spread=(max(it["times"]) - min(it["times"])) / t,
                   calls_per_round=it["calls"], compile_s=it["compile_s"], kernels=it["kernels"])  # fmt: skip
        table.setdefault(it["key"], {})[str(it["n"])] = row
        if rates[it["precision"]] is None or tf > rates[it["precision"]]:
            rates[it["precision"]], source[it["precision"]] = tf, f"{it['key']} {it['n']}^3"
        rec.log(f"ceiling {it['key']} {it['n']}^3: {t * 1e3:.3f} ms = {tf:.1f} TFLOP/s (median of {len(it['times'])} "
                f"rounds of {it['calls']} calls, spread {100 * row['spread']:.1f}%)")  # fmt: skip
    items.clear()
    free()
    verified = None  # off a GPU there is no cuBLAS to check for
    if jax.default_backend() == "gpu":
        builds = list(table.get("fp8-cublaslt", {}).values())
        verified = bool(builds) and all(CUBLASLT_FP8 in r["kernels"] and "__triton_gemm" not in r["kernels"]
                                        for r in builds)  # fmt: skip
        if not verified:
            rec.log(f"WARNING: the cuBLAS-only FP8 build is not a {CUBLASLT_FP8} call: "
                    f"{[r['kernels'] for r in builds]}")  # fmt: skip
    h = rec.data["header"]
    h.update(ceilings=table, rates_tflops=rates, rate_from=source, fp8_cublaslt_verified=verified,
             matmul_bf16=[dict(n=r["n"], ms=r["ms"], tflops=r["tflops"]) for r in table.get("bf16", {}).values()],
             matmul_bf16_best_tflops=rates["bf16"])  # fmt: skip
    sources = ", ".join(f"{p}: {w}" for p, w in source.items())
    rec.log(f"rates for the floors (TFLOP/s, the faster build at its best size): {rates_text(rates)} (from {sources}); "
            f"cuBLASLt FP8 call verified: {verified}")  # fmt: skip
    return rates


def weights_table(rec: Recorder, group: list[Bench]):
    """One setup's weights formats side by side: per length and variant, each format's TTFT, the mixed-precision floor
    of the precisions that row runs in, MFU against it (MFUx) and against the bf16 rate alone (MFU), and the speed-up
    over the same length's XLA baseline (bf16 weights: `BASELINES`), where one ran."""
    log, first = rec.log, group[0]
    cell = " | {:>10} {:>9} {:>5} {:>5} {:>6}"
    log("=" * 150)
    log(f"Weights formats side by side — {first.setup.name} ({len(first.types)} layers), B=1; ceilings (this run, "
        f"TFLOP/s): {rates_text(first.rates)}")  # fmt: skip
    log(f"{'S':>5} {'variant':<38}" + "".join(f" | {b.weights + ' weights':^40}" for b in group))
    log(f"{'':>5} {'':<38}" + "".join(cell.format("TTFT ms", "floor ms", "MFUx", "MFU", "× base") for _ in group))
    pct = lambda x: f"{100 * x:.0f}%" if x else "-"  # noqa: E731
    out, fp8_legend = [], {}
    for seq in sorted(set().union(*(b.results for b in group))):
        # the plain XLA baseline at this length: the full-sequence one if it ran, else the capacity MoE's
        base = next((dict(variant=v, ttft_s=r["ttft_s"]) for v in BASELINES for b in group
                     if (r := b.results.get(seq, {}).get(v)) and r.get("status") == "ok"), None)  # fmt: skip
        for vkey in TABLE_ORDER:
            rows = [b.results.get(seq, {}).get(vkey) for b in group]
            if not any(rows):
                continue
            cells, entry = [], dict(seq=seq, variant=vkey)
            for b, r in zip(group, rows):
                if not r or r.get("status") != "ok":
                    cells.append(cell.format((r or {}).get("status", "-").upper() if r else "-", "", "", "", ""))
                    continue
                floor = r.get("floor_s")
                cells.append(cell.format(f"{r['ttft_s'] * 1e3:.1f}" + ("*" if r.get("warm_only") else ""),
                                         f"{floor * 1e3:.1f}" if floor else "-", pct(r.get("mfu_mixed")),
                                         pct(r.get("mfu")),
                                         f"{base['ttft_s'] / r['ttft_s']:.2f}×" if base else "-"))  # fmt: skip
                entry[b.weights] = {k: r.get(k) for k in ("ttft_s", "floor_s", "mfu_mixed", "mfu", "fp8_parts",
                                                          "flops_by_precision", "kernels")}  # fmt: skip
                if base:
                    entry[b.weights]["speedup"] = base["ttft_s"] / r["ttft_s"]
                    entry["baseline"] = base
                fp8_legend[(b.weights, VARIANTS[vkey].tag)] = r.get("fp8_parts") or []
            log(f"{fmt_len(seq):>5} {(VARIANTS[vkey].tag + ' ' + VARIANTS[vkey].label)[:38]:<38}" + "".join(cells))
            out.append(entry)
    legend = "; ".join(f"{w} {tag} {'+'.join(p) or 'none'}" for (w, tag), p in fp8_legend.items())
    log("floor: the row's useful FLOPs, each part at the rate of the precision it runs in (dsv4.flops); MFUx = floor "
        "/ TTFT; MFU = useful FLOPs at the bf16 rate / TTFT; × base = the XLA baseline's TTFT (bf16 weights, this "
        "run) / TTFT; * = warm-up pass only. Parts in FP8 (the rest bf16, the mHC mixes float32): "
        f"{legend}")  # fmt: skip
    rec.data.setdefault("weights_table", {})[first.setup.name] = out


def header(args, rec: Recorder):
    dev = jax.devices()[0]
    h = dict(device_kind=dev.device_kind, platform=dev.platform, device_count=jax.device_count(), jax=jax.__version__,
             python=platform.python_version(), date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
             argv=" ".join(sys.argv), host=platform.node(),
             mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), xla_flags=os.environ.get("XLA_FLAGS"),
             budget_s=args.budget, variants=args.variants, weights=args.weights)  # fmt: skip
    s = mem_stats()
    if s:
        h["bytes_limit_gib"] = round(s.get("bytes_limit", 0) / GiB, 1)
    if dev.platform == "gpu":
        try:
            q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu"
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=15)  # fmt: skip
            h["nvidia_smi"] = r.stdout.strip()
        except Exception as exc:
            h["nvidia_smi"] = f"unavailable: {exc}"
    rec.data["header"].update(h)
    rec.log("=" * 100)
    rec.log(f"bench_ttft: {h['device_kind']} ({h['platform']}, {h['device_count']} device(s)); jax {h['jax']}, "
            f"python {h['python']}; {h['date']}")  # fmt: skip
    rec.log(f"command: {h['argv']}")
    rec.log(f"mem_fraction {h['mem_fraction']}  bytes_limit {h.get('bytes_limit_gib')} GiB  budget {args.budget:.0f} s")
    if "nvidia_smi" in h:
        rec.log(f"nvidia-smi: {h['nvidia_smi']}")
    for s in args.setups:
        c = s.config
        rec.log(f"setup {s.name}: hidden {c.hidden_size}, {c.num_attention_heads} heads × {c.head_dim}, q_lora "
                f"{c.q_lora_rank}, {c.n_routed_experts} experts top-{c.num_experts_per_tok} × "
                f"{c.moe_intermediate_size}, "
                f"index {c.index_n_heads}×{c.index_head_dim} top-{c.index_topk}, window {c.sliding_window}, rates "
                f"{dict(c.compress_rates)}; layers {','.join(SHORT[t] for t in c.layer_types)}; lengths "
                f"{[fmt_len(x) for x in s.lengths]}; chunk {s.chunk}")  # fmt: skip
    rec.log(f"variants (in order): {', '.join(VARIANTS[v].tag + ' ' + v for v in args.variants)}; weights (in "
            f"order): {', '.join(args.weights)}")  # fmt: skip
    rec.log("=" * 100)


def main():
    args = parse_args()
    CAPACITY["factor"] = args.capacity_factor
    rec = Recorder(args.out)
    if not args.smoke and jax.default_backend() != "gpu":
        rec.log(f"ERROR: jax's default backend is {jax.default_backend()!r}, not 'gpu'; run with --smoke on a CPU")
        sys.exit(2)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    budget = Budget(args.budget, rec, args.smoke)
    header(args, rec)
    rates = measure_ceilings(rec, budget, args.ceiling_sizes, args.smoke, args.seed)
    groups = []  # per setup, one Bench per weights format, in --weights order (one model on the device at a time)
    for setup in args.setups:
        group = []
        for i, weights in enumerate(args.weights):
            b = Bench(args, setup, rec, budget, rates, weights, first=i == 0)
            try:
                b.run()
            except Exception as exc:
                rec.error(f"{b.name}", exc)
            finally:
                b.model = b.state = None
                free()
            group.append(b)
            rec.write_json()
        groups.append(group)
    for group in groups:
        for b in group:
            try:
                b.table()
            except Exception as exc:
                rec.error(f"table {b.name}", exc)
        if len(group) > 1:
            try:
                weights_table(rec, group)
            except Exception as exc:
                rec.error(f"weights table {group[0].setup.name}", exc)
    errs, skips = rec.data["errors"], rec.data["skips"]
    rec.log(f"{len(errs)} error/OOM line(s), {len(skips)} skip(s); elapsed {time.monotonic() - T_START:.0f} s"
            + (f"; full numbers in {rec.out_dir / 'bench_ttft.json'}" if rec.out_dir else ""))  # fmt: skip
    for e in errs[:8]:
        rec.log(f"  {e['kind'].lower()}: {e['where']}: {e['type']}: {(e['message'].splitlines() or [''])[0][:100]}")
    for s in skips[:8]:
        rec.log(f"  skip: {s['where']}: {s['why']}"[:130])
    if len(errs) > 8 or len(skips) > 8:
        rec.log("  (all of them in the log and the JSON)")
    rec.log("=" * 132)
    rec.write_json()


if __name__ == "__main__":
    main()
