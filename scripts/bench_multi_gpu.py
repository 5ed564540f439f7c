#!/usr/bin/env python3
"""The multi-GPU run: DeepSeek-V4-Flash at full depth through the engine on a mesh of every GPU, how it scales, where
its time goes, the same run in two processes, and its memory ledger; one JSON, with predictions beside measurements.

    python3 scripts/bench_multi_gpu.py --steps 1,5 --out $OUT       # 8 GPUs: the full model, the ledger
    XLA_FLAGS=--xla_gpu_enable_command_buffer= \
        python3 scripts/bench_multi_gpu.py --steps 3 --out $OUT     # the profile (every kernel with its HLO op)
    python3 scripts/bench_multi_gpu.py --steps 2 --out $OUT         # scaling over 1, 2, 4, 8 GPUs
    python3 scripts/bench_multi_gpu.py --steps 4 --out $OUT         # 2 processes × 4 GPUs
    python3 scripts/bench_multi_gpu.py --smoke --out /tmp/mgpu      # CPU: every step at tiny shapes, 8 host devices

Every invocation adds its steps to $OUT/bench_multi_gpu.json (and its log to bench_multi_gpu.log), so a run split
over several commands still ends in one JSON. A step that does not run says why (the memory plan, too few devices,
an error), in the JSON and the log.

Steps (``--steps``; always run in the order 4, 1, 3, 2, 5: the two processes of step 4 need the GPUs before this
process takes them, and step 1's memory peaks must not include step 2's):
  1  The full model: V4-Flash's 43 layers with its own layer types (2 sliding, then CSA and HCA alternating) and MoE
     types (3 hash-routed, then learned routing); random weights made on the devices in ``--weights`` (default fp8:
     as released, kept quantized; fp8-fp4-experts: FP4 routed experts), each device making only its slice
     (`dsv4.random_weights`); through `dsv4.LLM` on a mesh of every device: each ``--lengths`` prompt's TTFT, then
     ``--new-tokens`` (32) generated tokens' TPOT. `dsv4.memory_plan` decides, before anything is loaded, which
     lengths fit (a prompt of the length; "1m": 2^20 tokens of context, the model's limit, prompt and generated
     tokens together); the run then checks each device's measured peak against the plan.
  2  Scaling: TTFT at ``--scaling-lengths`` on meshes of ``--meshes`` devices, with the first L layers of V4-Flash's
     sequence, L the most that the plan fits on the smallest mesh (the same layers on every mesh); chunks of
     ``--chunk-per-device`` tokens per device. Scaling efficiency T_1 / (N · T_N), per-GPU MFU against the run's
     mixed-precision floor (`dsv4.flops`: each part's FLOPs at the rate of the precision it runs in, the rates
     measured first), and the first token of every mesh (the same on all).
  3  Where the time goes: a profiler trace of one chunk on every device (the prompt's last chunk, through the step-1
     engine, at ``--profile-length``; built here when step 1 does not run in the same invocation), analysed by
     scripts/trace_overlap.py per GPU and per layer type: compute, exposed communication (the K=V / entry
     all-gathers and the MoE's expert exchange apart) and idle time. Layers run in named scopes ("dsv4_sliding",
     "dsv4_csa", "dsv4_hca") and XLA's optimized HLO is dumped, so each kernel is traced back to its layer type (set
     XLA_FLAGS=--xla_gpu_enable_command_buffer= for this step: kernels replayed from a command buffer carry no HLO
     op; the JSON says which way it ran).
  4  Processes: the step-1 run at ``--process-length`` as 2 processes × N/2 devices under jax.distributed on this
     host (this script with --worker, each process on its own devices); requests enter at process 0 and are
     broadcast. Its tokens must equal the one-process run's (step 1's at that length, from this run or an earlier one
     in the same JSON, else run here).
  5  The memory ledger: `dsv4 plan` for V4-Flash at 128K / 512K / 1M in each weights format on N devices of this
     machine, an H200 and an H20 (the seed article's 96 GB card), and the measured peaks of step 1 against it.

Predictions (printed beside each measurement, labelled "pred"): compute = the mixed-precision floor of the N-device
share of the work / ``--prior-efficiency`` (0.5: a 512K prefill on one H200 ran at about half its floor, 3 layers,
both through the engine and chunked); communication from measurements on 2 H200s of one host (NVLink): a collective
costs about 0.35 ms plus its bytes at 241 GB/s (all-gather, bus) or 305 GB/s (permute); per layer and chunk, the
chunk's K=V rows and compressed entries are all-gathered, and the expert-parallel exchange (the model's schedule:
"direct" sends each device's tokens to every other device, "sparse" and "alltoall" the `sparse_capacity` share of
them to each) sends tokens (1.03 bytes a value with W8A8 experts: e4m3 and a float32 scale per 128; 2 in bf16) and
gets float32 partial results back (4 bytes a value), one collective latency per peer each way ("alltoall": one in
all each way); about 15% of it ran beside the expert GEMMs at N = 2 (3.4 of 19-27 ms), the rest is taken as
exposed, the gathers as exposed too. TPOT: the replicated
weights read once a step (three times when FP8 ones are dequantized where read) at 4.3 TB/s, plus the exchange's
latencies per layer (2 (N - 1), or 2 for "alltoall").

--smoke runs every step on 8 CPU host devices at tiny widths (one layer of each type, lengths 64 / 128 / 256,
chunks of 32, 2 tokens generated, meshes of 1 and 8 devices), kernels "auto" (XLA on a CPU), no HLO dump; its
ceilings and times mean nothing, its structure everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

T_START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
SMOKE_DEVICES = 8
# NOTE: before jax is imported. Smoke: 8 host devices (a --worker gets its own from jax.distributed).
if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "--worker" not in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={SMOKE_DEVICES}").strip()  # fmt: skip
else:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import trace_overlap  # noqa: E402

from dsv4.config import CSA, HCA, SLIDING, Config  # noqa: E402
from dsv4.engine import LLM  # noqa: E402
from dsv4.flops import by_precision, floor_seconds, prefill_flops  # noqa: E402
from dsv4.kernels import Kernels  # noqa: E402
from dsv4.memory_plan import (  # noqa: E402
    CHUNK_TOKENS_PER_DEVICE,
    GIB,
    SCHEDULES,
    device_gib,
    format_plan,
    plan_memory,
    resolve_schedule,
    sparse_capacity,
)
from dsv4.quantization import BlockQuantized  # noqa: E402
from dsv4.random_weights import WEIGHT_FORMATS, random_model  # noqa: E402
from dsv4.sharding import make_mesh  # noqa: E402
from dsv4.sharding.expert_parallel import DEFAULT_CHUNK_TOKENS  # noqa: E402

SHORT = {SLIDING: "sliding", CSA: "csa", HCA: "hca"}
PLAN_WEIGHTS = {"bf16": "bf16", "fp8": "fp8", "fp8-fp4-experts": "fp4-experts"}  # `dsv4 plan`'s names
STEP_ORDER = (4, 1, 3, 2, 5)
SCOPE = r"dsv4_(sliding|csa|hca)\b"

# Communication on 2 H200s of one host (NVLink), measured through shard_map: latency, and bandwidth of 1 GiB shards.
LINK_LATENCY_S = 0.35e-3
ALL_GATHER_BUS_BPS = 241e9
PERMUTE_BPS = 305e9
COPY_BPS = 4.3e12  # device-to-device copy, reads + writes
EXCHANGE_HIDDEN = 3.4 / 23.0  # of the expert exchange's NCCL time, the part beside compute at N = 2
PRIOR_EFFICIENCY = 0.5  # one H200, 512K, 3 layers: TTFT about twice the mixed-precision floor


# ---------------------------------------------------------------------------------------------
# Configs, prompts, models.
# ---------------------------------------------------------------------------------------------
def flash_config(layers: int | None, smoke: bool) -> Config:
    """V4-Flash with the first `layers` of its own layer and MoE types (None: all 43). Smoke: the tiny preset's widths
    and one layer of each type (sliding with hash routing, CSA, HCA), or the first `layers` of those."""
    flash = Config.preset("v4-flash")
    if smoke:
        base, types, mlp = Config.preset("tiny"), (SLIDING, CSA, HCA), ("hash_moe", "moe", "moe")
    else:
        base, types, mlp = flash, flash.layer_types, flash.mlp_layer_types
    n = layers or len(types)
    if not 1 <= n <= len(types):
        raise ValueError(f"layers={n}: the model has {len(types)}")
    return base.replace(num_hidden_layers=n, layer_types=types[:n], mlp_layer_types=mlp[:n])


def prompt_ids(config: Config, length: int, seed: int) -> list[int]:
    return np.random.default_rng([seed, length]).integers(0, config.vocab_size, length).tolist()


def build_model(args, config: Config, mesh):
    """Random weights in `args.weights`, made on `mesh`'s devices (each layer runs in its named scope,
    `dsv4.model.LAYER_SCOPES`). → (model, seconds, bytes)."""
    t0 = time.perf_counter()
    model = random_model(config, args.seed, dtype=jnp.bfloat16, kernels=args.kernels, weights=args.weights, mesh=mesh)
    for layer in model.layers:
        layer.mlp.ep_schedule = args.ep_schedule
    leaves = jax.tree.leaves(model)
    jax.block_until_ready(leaves)
    return model, time.perf_counter() - t0, sum(int(x.size) * x.dtype.itemsize for x in leaves)


def count_quantized(model) -> int:
    """Weights held as `BlockQuantized` (q + scales) in a model."""
    return sum(isinstance(v.get_value(), BlockQuantized) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def new_engine(args, model, mesh, max_model_len: int, chunk: int) -> LLM:
    """One request at a time; two compiled call shapes: the chunk (every prompt chunk, the remainder padded to it)
    and the one-token decode step."""
    return LLM(model, mesh=mesh, max_slots=1, max_model_len=max_model_len, chunk_size=chunk, width_buckets=(1, chunk),
               max_packed_width=1, kv_format=args.kv_format, warmup=False)  # fmt: skip


def free():
    gc.collect()


# ---------------------------------------------------------------------------------------------
# Memory.
# ---------------------------------------------------------------------------------------------
def device_peaks() -> list[int] | None:
    """Each local device's peak bytes in use so far (None where a backend keeps no statistics, e.g. CPU)."""
    peaks = []
    for d in jax.local_devices():
        try:
            s = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 -- a backend without statistics
            s = {}
        if "peak_bytes_in_use" not in s:
            return None
        peaks.append(int(s["peak_bytes_in_use"]))
    return peaks


def device_capacity_gib(args) -> tuple[float, str]:
    """Memory one device may use: --device-memory-gib, else the allocator's limit, else the --device preset."""
    if args.device_memory_gib:
        return args.device_memory_gib, "--device-memory-gib"
    try:
        limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001
        limit = None
    if limit:
        return limit / GIB, "allocator limit (memory_stats bytes_limit)"
    return device_gib(args.device), f"--device {args.device} (no allocator statistics here)"


def plan(args, config: Config, context: int, devices: int, chunk: int, *, weights: str | None = None,
         capacity_gib: float | None = None, device: str | None = None):  # fmt: skip
    kw = dict(device=device) if device else dict(device_memory_gib=capacity_gib)
    return plan_memory(config, context=context, devices=devices, kv_format=args.kv_format,
                       weights=PLAN_WEIGHTS[weights or args.weights], chunk_size=min(chunk, context),
                       headroom=args.headroom, **kw)  # fmt: skip


def plan_row(p) -> dict:
    return dict(total_gib=p.total_bytes / GIB, required_gib=p.required_bytes / GIB, capacity_gib=p.capacity_bytes / GIB,
                fits=p.fits, headroom=p.headroom)  # fmt: skip


def peak_check(p, peaks: list[int] | None) -> dict:
    """The plan against the measured peaks: within the plan's total, within its headroom, or over."""
    if not peaks:
        return dict(measured="unavailable: this backend keeps no memory statistics")
    peak = max(peaks)
    if peak <= p.total_bytes:
        verdict = "within the plan"
    elif peak <= p.required_bytes:
        verdict = f"within the {p.headroom}x headroom"
    else:
        verdict = "OVER the plan with headroom"
    return dict(peak_gib=peak / GIB, peaks_gib=[x / GIB for x in peaks], plan_total_gib=p.total_bytes / GIB,
                ratio=peak / p.total_bytes, verdict=verdict)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Ceilings, FLOPs and predictions.
# ---------------------------------------------------------------------------------------------
def measure_ceilings(smoke: bool) -> dict[str, float]:
    """Matmul rates (FLOP/s) on device 0 per precision: bf16, e4m3 with float32 accumulation, float32."""
    n = 256 if smoke else 8192
    k1, k2 = jax.random.split(jax.random.key(0))
    base = (jax.random.normal(k1, (n, n), jnp.float32), jax.random.normal(k2, (n, n), jnp.float32))
    rates = {}
    for precision, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn), ("f32", jnp.float32)):
        a, b = (x.astype(dtype) for x in base)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        jax.block_until_ready(f(a, b))
        times = []
        for _ in range(3 if smoke else 10):
            t0 = time.perf_counter()
            jax.block_until_ready(f(a, b))
            times.append(time.perf_counter() - t0)
        rates[precision] = 2.0 * n**3 / statistics.median(times)
    return rates


def floor_s(config: Config, seq: int, devices: int, kernels: Kernels, weights: str, rates) -> tuple[float, float]:
    """(useful FLOPs of a seq-token prefill, its mixed-precision floor on `devices` devices in seconds)."""
    parts = prefill_flops(config, seq)
    return sum(parts.values()), floor_seconds(
        {k: v / devices for k, v in by_precision(parts, kernels, PLAN_WEIGHTS[weights], config=config).items()},
        rates)  # fmt: skip


def predict_comm(config: Config, devices: int, seq: int, chunk: int, weights: str,
                 schedule: str = "auto") -> dict[str, float]:  # fmt: skip
    """Seconds of all-gathers and of the expert exchange in one device's share of a `seq`-token prefill in chunks
    of `chunk` tokens (the model in the module docstring), and the exposed part predicted."""
    if devices == 1:
        return dict(gather_s=0.0, exchange_s=0.0, exposed_s=0.0)
    d, hd, ihd = config.hidden_size, config.head_dim, config.index_head_dim
    row_bytes = 2  # K=V rows and entries gathered in bf16
    fp8_tokens = weights in ("fp8", "fp8-fp4-experts")  # W8A8 experts (FP4 ones re-blocked): e4m3 + a float32 / 128
    token_bytes = d + d // 128 * 4 if fp8_tokens else 2 * d
    e, k = config.n_routed_experts, config.num_experts_per_tok
    schedule = resolve_schedule(schedule, e, devices, k)
    sent = sparse_capacity(e, devices, k) if schedule in ("sparse", "alltoall") else 1.0  # "ring" counted as direct
    gather = exchange = 0.0
    for start in range(0, seq, chunk):
        t = -(-min(chunk, seq - start) // devices)  # this device's tokens of the chunk
        for layer_type in config.layer_types:
            sizes = [t * hd * row_bytes]  # the chunk's K=V rows
            if layer_type == CSA:  # closed windows' entries and indexer keys
                rate = config.compress_rate(CSA)
                sizes += [t // rate * hd * row_bytes, t // rate * ihd * row_bytes]
            elif layer_type == HCA:
                sizes += [t // config.compress_rate(HCA) * hd * row_bytes]
            gather += sum(LINK_LATENCY_S + (devices - 1) * s / ALL_GATHER_BUS_BPS for s in sizes if s)
            for s0 in range(0, t, DEFAULT_CHUNK_TOKENS):
                step = min(DEFAULT_CHUNK_TOKENS, t - s0)
                rows = math.ceil(sent * step)  # each peer's packed rows under "sparse" / "alltoall"
                transfers = (devices - 1) * rows * (token_bytes + 4 * d) / PERMUTE_BPS
                # a collective's latency per peer each way, or for "alltoall" once each way
                exchange += 2 * LINK_LATENCY_S * (1 if schedule == "alltoall" else devices - 1) + transfers
    return dict(gather_s=gather, exchange_s=exchange, exposed_s=gather + (1 - EXCHANGE_HIDDEN) * exchange)


def predict_ttft(args, config: Config, devices: int, seq: int, chunk: int, kernels: Kernels, rates,
                 efficiency: float | None = None) -> dict:  # fmt: skip
    flops, floor = floor_s(config, seq, devices, kernels, args.weights, rates)
    comm = predict_comm(config, devices, seq, chunk, args.weights, args.ep_schedule)
    compute = floor / (efficiency or args.prior_efficiency)
    return dict(flops=flops, floor_s=floor, compute_s=compute, **comm, ttft_s=compute + comm["exposed_s"])


def predict_tpot(args, config: Config, devices: int, p) -> float:
    """Seconds per generated token (module docstring): replicated weights streamed, exchange latencies."""
    replicated = sum(line.bytes_per_device for line in p.lines if "(replicated)" in line.name)
    reads = 3 if args.weights != "bf16" else 1  # FP8 dense weights are dequantized where read: read, write, read
    schedule = resolve_schedule(args.ep_schedule, config.n_routed_experts, devices, config.num_experts_per_tok)
    collectives = 1 if schedule == "alltoall" else devices - 1  # each way, a layer
    return replicated * reads / COPY_BPS + config.num_hidden_layers * 2 * collectives * LINK_LATENCY_S


# ---------------------------------------------------------------------------------------------
# Log and JSON.
# ---------------------------------------------------------------------------------------------
class Recorder:
    """Log lines to stdout and OUT/bench_multi_gpu.log; results into OUT/bench_multi_gpu.json, merged with what
    earlier invocations left there (each step's entry replaced by the latest run of it)."""

    def __init__(self, out_dir: Path | None):
        self.out_dir = out_dir
        self.data: dict = {"runs": [], "steps": {}}
        self._log = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / "bench_multi_gpu.json"
            if path.exists():
                try:
                    self.data = json.loads(path.read_text())
                except json.JSONDecodeError:
                    path.rename(path.with_suffix(".json.unreadable"))
            self._log = open(out_dir / "bench_multi_gpu.log", "a", buffering=1)

    def log(self, msg: str = ""):
        line = f"[{time.monotonic() - T_START:6.1f}s] {msg}" if msg else ""
        print(line, flush=True)
        if self._log:
            self._log.write(line + "\n")

    def step(self, key: int) -> dict:
        """A fresh record for step `key` of this run."""
        entry = {"run": len(self.data["runs"]) - 1, "status": "running", "errors": [], "skips": []}
        self.data["steps"][str(key)] = entry
        return entry

    def skip(self, entry: dict, where: str, why: str):
        self.log(f"SKIP {where}: {why}")
        entry["skips"].append(dict(where=where, why=why))

    def error(self, entry: dict, where: str, exc: BaseException):
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        self.log(f"ERROR {where}: {type(exc).__name__}: {first}")
        entry["errors"].append(dict(where=where, type=type(exc).__name__, message=str(exc)[:4000],
                                    traceback=traceback.format_exc()[-6000:]))  # fmt: skip

    def write(self):
        if self.out_dir is None:
            return
        tmp = self.out_dir / "bench_multi_gpu.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        tmp.replace(self.out_dir / "bench_multi_gpu.json")


def _json_default(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


def fmt_len(s: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if s >= size and s % size == 0:
            return f"{s // size}{unit}"
    return str(s)


def length_label(prompt_len: int, context: int) -> str:
    """A prompt by its length ("512K"), or by its context where the model's limit cut the prompt ("1M ctx")."""
    return fmt_len(prompt_len) if fmt_len(prompt_len) != str(prompt_len) else f"{fmt_len(context)} ctx"


def ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


# ---------------------------------------------------------------------------------------------
# The benchmark.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    rec: Recorder
    rates: dict[str, float]
    capacity_gib: float
    capacity_how: str
    n_devices: int
    engine: tuple | None = None  # step 1's (llm, model, mesh, config, max length, chunk), kept for step 3
    tokens: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # step 1's tokens by prompt length
    peaks: dict[int, dict] = dataclasses.field(default_factory=dict)

    def chunk(self, devices: int) -> int:
        return self.args.chunk or self.args.chunk_per_device * devices

    def this_run(self, step: str, needs: str | None = None) -> dict | None:
        """The step's JSON entry if this invocation wrote it (and it holds `needs`), for the step's table."""
        entry = self.rec.data["steps"].get(step)
        if not entry or entry.get("run") != len(self.rec.data["runs"]) - 1 or (needs and not entry.get(needs)):
            return None
        return entry

    def kernels(self, model) -> Kernels:
        return model.kernels


def run_prompt(llm: LLM, prompt: list[int], new_tokens: int):
    """One request through the engine → its output; raises if the engine failed it."""
    out = llm.generate([prompt], max_new_tokens=new_tokens)[0]
    if out.finish_reason == "error":
        raise RuntimeError(f"the engine failed the request: {out.error}")
    return out


def full_engine(ctx: Context, entry: dict, where: str, lengths: list[int]):
    """The full-depth model and its engine on a mesh of every device, for the prompt `lengths` the memory plan fits
    (each length's plan recorded in entry["lengths"], the others skipped with the plan's numbers).
    → (llm, model, mesh, config, fitting prompt lengths, chunk, the engine's plan), or None (recorded why)."""
    args, rec = ctx.args, ctx.rec
    n = ctx.n_devices
    config = flash_config(None, args.smoke)
    chunk = ctx.chunk(n)
    entry.update(devices=n, layers=config.num_hidden_layers, weights=args.weights, kv_format=args.kv_format,
                 chunk=chunk, new_tokens=args.new_tokens)  # fmt: skip
    entry.setdefault("lengths", {})
    if config.n_routed_experts % n:
        rec.skip(entry, where, f"{n} devices do not split {config.n_routed_experts} routed experts evenly")
        return None
    fitting = []
    for length in lengths:
        prompt_len = min(length, config.max_position_embeddings - args.new_tokens - 1)
        context = prompt_len + args.new_tokens + 1
        p = plan(args, config, context, n, chunk, capacity_gib=ctx.capacity_gib)
        row = entry["lengths"][str(prompt_len)] = dict(context=context, plan=plan_row(p))
        if not p.fits:
            row["status"] = "skipped"
            rec.skip(entry, f"{where} {length_label(prompt_len, context)}", f"the memory plan needs "
                     f"{p.required_bytes / GIB:.1f} GiB per device with {args.headroom}x headroom, "
                     f"{ctx.capacity_gib:.1f} GiB available ({ctx.capacity_how})")  # fmt: skip
            continue
        fitting.append(prompt_len)
    rec.write()
    if not fitting:
        return None
    mesh = make_mesh(n)
    max_len = max(fitting) + args.new_tokens + 1
    engine_plan = plan(args, config, max_len, n, chunk, capacity_gib=ctx.capacity_gib)
    try:
        model, init_s, nbytes = build_model(args, config, mesh)
        entry.update(init_s=init_s, param_bytes=nbytes, kernels=str(model.kernels))
        rec.log(f"{where}: weights made in {init_s:.1f} s ({nbytes / 1e9:.2f} GB over {n} devices); kernels "
                f"{model.kernels}")  # fmt: skip
        quantized = count_quantized(model)
        llm = new_engine(args, model, mesh, max_len, chunk)
        # the engine takes the model as made: already on the mesh, nothing moved, the weights still quantized
        entry["quantized_leaves"] = dict(made=quantized, in_engine=count_quantized(llm.model))
        entry["compile_s"] = llm.warmup(prompt_lens=[max(fitting)], widths=[1])
        rec.log(f"{where}: engine compiled in {entry['compile_s']:.1f} s")
    except Exception as exc:  # noqa: BLE001 -- recorded, the other steps go on
        rec.error(entry, f"{where}: model / engine", exc)
        free()
        return None
    entry["engine_plan"] = plan_row(engine_plan)
    return llm, model, mesh, config, fitting, chunk, engine_plan


def step_full(ctx: Context) -> None:
    """Step 1: the full-depth model through the engine on a mesh of every device."""
    args, rec = ctx.args, ctx.rec
    entry = rec.step(1)
    rec.log(f"=== step 1: the full model on {ctx.n_devices} devices, weights {args.weights} ===")
    built = full_engine(ctx, entry, "step 1", args.lengths)
    if built is None:
        entry["status"] = "error" if entry["errors"] else "skipped"
        return
    llm, model, mesh, config, fitting, chunk, engine_plan = built
    n = ctx.n_devices
    for prompt_len in fitting:
        row = entry["lengths"][str(prompt_len)]
        where = f"step 1 S={length_label(prompt_len, row['context'])}"
        try:
            out = run_prompt(llm, prompt_ids(config, prompt_len, args.seed), args.new_tokens + 1)
        except Exception as exc:  # noqa: BLE001
            rec.error(entry, where, exc)
            row["status"] = "error"
            continue
        m = out.metrics
        peaks = device_peaks()
        pred = predict_ttft(args, config, n, prompt_len, chunk, model.kernels, ctx.rates)
        row.update(status="ok", prompt_len=prompt_len, ttft_s=m.ttft_s, tpot_s=m.tpot_s, tokens=out.token_ids,
                   compile_in_request_s=m.compile_s, pred=pred,
                   pred_tpot_s=predict_tpot(args, config, n, engine_plan),
                   mfu_mixed=pred["floor_s"] / m.ttft_s, memory=peak_check(engine_plan, peaks))  # fmt: skip
        ctx.tokens[prompt_len] = out.token_ids
        ctx.peaks[prompt_len] = row["memory"]
        peak = row["memory"].get("peak_gib")
        rec.log(f"{where}: TTFT {m.ttft_s:.3f} s (pred {pred['ttft_s']:.3f}), TPOT {ms(m.tpot_s)} ms (pred "
                f"{ms(row['pred_tpot_s'])}); peak {'-' if peak is None else f'{peak:.2f}'} GiB, plan "
                f"{engine_plan.total_bytes / GIB:.3g} GiB")  # fmt: skip
        rec.write()
    entry["status"] = "ok"
    ctx.engine = (llm, model, mesh, config, max(fitting), chunk)


def table_full(ctx: Context) -> None:
    entry = ctx.this_run("1")
    if entry is None:
        return
    log = ctx.rec.log
    log("-" * 120)
    log(f"Step 1: V4-Flash, {entry.get('layers')} layers, {entry.get('devices')} devices, weights "
        f"{entry.get('weights')}, KV {entry.get('kv_format')}, chunk {entry.get('chunk')}; pred = floor / "
        f"{ctx.args.prior_efficiency} + exposed communication (module docstring)")  # fmt: skip
    log(f"{'prompt':>8} {'TTFT s':>8} {'pred':>8} {'floor':>7} {'MFUx':>5} {'TPOT ms':>8} {'pred':>7} "
        f"{'comm pred: gather / exchange s':>31} {'peak GiB':>9} {'plan GiB':>9}  memory")  # fmt: skip
    for prompt_len, row in entry.get("lengths", {}).items():
        ctx_len = length_label(int(prompt_len), row["context"])
        if row.get("status") != "ok":
            log(f"{ctx_len:>8} {row.get('status', '?'):>8}  plan {row['plan']['required_gib']:.1f} GiB with headroom "
                f"of {row['plan']['capacity_gib']:.1f}")  # fmt: skip
            continue
        p, mem = row["pred"], row["memory"]
        peak = f"{mem['peak_gib']:.1f}" if "peak_gib" in mem else "-"
        plan_total = f"{mem['plan_total_gib']:.1f}" if "plan_total_gib" in mem else "-"
        log(f"{ctx_len:>8} {row['ttft_s']:>8.3f} {p['ttft_s']:>8.3f} {p['floor_s']:>7.3f} "
            f"{100 * row['mfu_mixed']:>4.0f}% {ms(row['tpot_s']):>8} {ms(row['pred_tpot_s']):>7} "
            f"{p['gather_s']:>15.3f} / {p['exchange_s']:<13.3f} {peak:>9} {plan_total:>9}  "
            f"{mem.get('verdict', mem.get('measured'))}")  # fmt: skip


def step_profile(ctx: Context) -> None:
    """Step 3: one chunk under the profiler, and where its time goes per GPU and per layer type."""
    args, rec = ctx.args, ctx.rec
    entry = rec.step(3)
    rec.log("=== step 3: a profile of one chunk ===")
    if ctx.engine is None:  # step 3 alone: the step-1 model and engine, for the profiled length only
        built = full_engine(ctx, entry, "step 3", [args.profile_length])
        if built is None:
            entry["status"] = "error" if entry["errors"] else "skipped"
            return
        llm, model, mesh, config, fitting, chunk, _ = built
        ctx.engine = (llm, model, mesh, config, max(fitting), chunk)
    llm, model, mesh, config, longest, chunk = ctx.engine
    length = max([s for s in ctx.tokens if s <= args.profile_length] or [longest])
    trace_dir = (args.out or Path("/tmp/bench_multi_gpu")) / "trace"
    entry.update(prompt_len=length, chunk=chunk, devices=len(mesh.devices.flat), trace_dir=str(trace_dir),
                 command_buffers=trace_overlap.command_buffers())  # fmt: skip
    try:
        rid = llm.add_request(prompt_ids(config, length, args.seed), max_new_tokens=1)
        while True:
            done, total = llm.progress(rid)
            if total - done <= chunk:
                break
            llm.step()
        offset = llm.progress(rid)[0]
        jax.block_until_ready(llm.runner.cache)  # the runner leaves a step without logits running: let it finish
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            t0 = time.perf_counter()
            llm.step()
            entry["chunk_wall_s"] = time.perf_counter() - t0
        llm.pop_output(rid)
    except Exception as exc:  # noqa: BLE001
        rec.error(entry, "step 3: profiled chunk", exc)
        entry["status"] = "error"
        return
    entry["offset"] = offset
    op_names = trace_overlap.hlo_op_names(str(args.hlo_dump), "slot_step") if args.hlo_dump else {}
    scopes_in_hlo = {}
    for op_name in op_names.values():
        for t in ("sliding", "csa", "hca"):
            if f"dsv4_{t}" in op_name:
                scopes_in_hlo[t] = scopes_in_hlo.get(t, 0) + 1
    entry["hlo_ops"] = dict(total=len(op_names), by_layer_type=scopes_in_hlo)
    rows = trace_overlap.breakdown(str(trace_dir), trace_overlap.scope_finder(SCOPE, op_names))
    entry["per_gpu"] = rows
    share, devices = min(chunk, length - offset), len(mesh.devices.flat)
    after = prefill_flops(config, offset + share)  # the chunk's useful work: the prefix's after it less before it
    parts = {k: v - (prefill_flops(config, offset)[k] if offset else 0.0) for k, v in after.items()}
    floor = floor_seconds({k: v / devices for k, v in by_precision(parts, model.kernels, PLAN_WEIGHTS[args.weights],
                                                                     config=config).items()}, ctx.rates)  # fmt: skip
    entry["pred"] = dict(flops=sum(parts.values()), floor_s=floor, compute_s=floor / args.prior_efficiency,
                         **predict_comm(config, devices, share, chunk, args.weights, args.ep_schedule))  # fmt: skip
    if not rows:
        entry["status"] = "ok"
        entry["note"] = "no GPU kernels in the trace (a CPU run): the breakdown needs GPU device events" + (
            "" if args.hlo_dump else "; no HLO dump (--hlo-dump) to name the kernels' layer types")  # fmt: skip
        rec.log(f"step 3: chunk at offset {offset} of {length}: {entry['chunk_wall_s'] * 1e3:.1f} ms under the "
                f"profiler; {entry['note']}; HLO ops by layer type {scopes_in_hlo}")  # fmt: skip
        return
    keys = ("span_ms", "compute_ms", "exposed_ms", "idle_ms")
    entry["mean"] = {k: statistics.mean(r[k] for r in rows.values()) for k in keys}
    entry["mean"]["exposed_kind_ms"] = {k: statistics.mean(r["exposed_kind_ms"][k] for r in rows.values())
                                        for k in ("gather", "exchange", "other")}  # fmt: skip
    entry["mean"]["attributed"] = statistics.mean(r["attributed"] for r in rows.values())
    entry["status"] = "ok"


def table_profile(ctx: Context) -> None:
    entry = ctx.this_run("3", needs="per_gpu")
    if entry is None:
        return
    log = ctx.rec.log
    log("-" * 120)
    pred = entry["pred"]
    log(f"Step 3: one chunk of {entry['chunk']} tokens at offset {entry['offset']} of a {fmt_len(entry['prompt_len'])} "
        f"prompt, {entry['devices']} GPUs, command buffers {entry['command_buffers']} (ms; exposed = communication "
        f"with no compute kernel running; pred per device: compute {pred['compute_s'] * 1e3:.1f} (floor "
        f"{pred['floor_s'] * 1e3:.1f}), gathers {pred['gather_s'] * 1e3:.1f}, exchange "
        f"{pred['exchange_s'] * 1e3:.1f})")  # fmt: skip
    log(f"{'GPU / layer type':<22} {'span':>8} {'compute':>8} {'exp. gather':>11} {'exp. exchange':>13} "
        f"{'exp. other':>10} {'idle':>8} {'exposed %':>9}")  # fmt: skip
    for pname, r in entry["per_gpu"].items():
        e = r["exposed_kind_ms"]
        log(f"{pname[-20:]:<22} {r['span_ms']:>8.2f} {r['compute_ms']:>8.2f} {e['gather']:>11.2f} "
            f"{e['exchange']:>13.2f} {e['other']:>10.2f} {r['idle_ms']:>8.2f} "
            f"{100 * r['exposed_ms'] / max(r['span_ms'], 1e-9):>8.1f}%")  # fmt: skip
    first = next(iter(entry["per_gpu"].values()))
    for scope, r in first["scopes"].items():
        e = r["exposed_kind_ms"]
        log(f"  {scope:<20} {'':>8} {r['compute_ms']:>8.2f} {e['gather']:>11.2f} {e['exchange']:>13.2f} "
            f"{e['other']:>10.2f} {r['idle_ms']:>8.2f}")  # fmt: skip
    log(f"(per layer type: the first GPU; {100 * first['attributed']:.0f}% of its kernel time carried a layer-type "
        "scope)")  # fmt: skip


def step_scaling(ctx: Context) -> None:
    """Step 2: TTFT on meshes of 1, 2, 4, 8 devices with as many layers as the smallest mesh fits."""
    args, rec = ctx.args, ctx.rec
    previous = rec.data["steps"].get("2")  # an earlier invocation's meshes, if it ran the same layers and settings
    entry = rec.step(2)
    rec.log("=== step 2: scaling ===")
    flash = flash_config(None, args.smoke)
    meshes = []
    for m in args.meshes:
        if m > ctx.n_devices:
            rec.skip(entry, f"step 2 mesh {m}", f"needs {m} devices, {ctx.n_devices} present")
        elif flash.n_routed_experts % m:
            rec.skip(entry, f"step 2 mesh {m}", f"{m} devices do not split {flash.n_routed_experts} experts evenly")
        else:
            meshes.append(m)
    if not meshes:
        entry["status"] = "skipped"
        return
    smallest, longest = min(meshes), max(args.scaling_lengths)
    layers = args.scaling_layers
    if layers is None:  # the most of V4-Flash's layers that the smallest mesh fits at the longest length
        layers = 0
        for n in range(1, flash.num_hidden_layers + 1):
            if not plan(args, flash_config(n, args.smoke), longest + 1, smallest, ctx.chunk(smallest),
                        capacity_gib=ctx.capacity_gib).fits:  # fmt: skip
                break
            layers = n
    if not layers:
        rec.skip(entry, "step 2", f"not one layer fits {smallest} device(s) at {fmt_len(longest)} by the plan")
        entry["status"] = "skipped"
        return
    config = flash_config(layers, args.smoke)
    types = ",".join(SHORT[t] for t in config.layer_types)
    entry.update(layers=layers, layer_types=types, meshes={}, lengths=list(args.scaling_lengths),
                 weights=args.weights, kernels_spec=args.kernels, kv_format=args.kv_format,
                 chunk_per_device=None if args.chunk else args.chunk_per_device)  # fmt: skip
    rec.log(f"step 2: {layers} layers ({types}), lengths {[fmt_len(s) for s in args.scaling_lengths]}")
    reuse = None  # step 1's engine serves its own mesh when it runs these very layers (smoke); else it goes first
    if ctx.engine is not None:
        llm, model, mesh, config1, longest1, chunk1 = ctx.engine
        m1 = len(mesh.devices.flat)
        if config1 == config and m1 in meshes and chunk1 == ctx.chunk(m1) and longest1 >= longest:
            reuse = m1
        else:
            ctx.engine = llm = model = None
            free()
    for m in sorted(meshes, key=lambda m: m != reuse):
        chunk = ctx.chunk(m)
        mrow = entry["meshes"][str(m)] = dict(chunk=chunk, lengths={})
        mesh = make_mesh(m)
        try:
            if m == reuse:
                llm, model = ctx.engine[:2]
                mrow["reused"] = "step 1's model and engine"
            else:
                model, init_s, _ = build_model(args, config, mesh)
                llm = new_engine(args, model, mesh, longest + 1, chunk)
                mrow.update(init_s=init_s, compile_s=llm.warmup(prompt_lens=[longest], widths=[1]))
            mrow["kernels"] = str(model.kernels)
        except Exception as exc:  # noqa: BLE001
            rec.error(entry, f"step 2 mesh {m}: model / engine", exc)
            mrow["status"] = "error"
            free()
            continue
        for length in args.scaling_lengths:
            p = plan(args, config, length + 1, m, chunk, capacity_gib=ctx.capacity_gib)
            where = f"step 2 mesh {m} S={fmt_len(length)}"
            if not p.fits:
                rec.skip(entry, where, f"the plan needs {p.required_bytes / GIB:.1f} GiB of {ctx.capacity_gib:.1f}")
                continue
            try:
                out = run_prompt(llm, prompt_ids(config, length, args.seed), 1)
            except Exception as exc:  # noqa: BLE001
                rec.error(entry, where, exc)
                continue
            flops, floor = floor_s(config, length, m, model.kernels, args.weights, ctx.rates)
            comm_pred = predict_comm(config, m, length, chunk, args.weights, args.ep_schedule)
            mrow["lengths"][str(length)] = dict(ttft_s=out.metrics.ttft_s, first_token=out.token_ids[0], flops=flops,
                                                floor_s=floor, mfu_mixed=floor / out.metrics.ttft_s,
                                                comm_pred=comm_pred, memory=peak_check(p, device_peaks()))  # fmt: skip
            rec.log(f"{where}: TTFT {out.metrics.ttft_s:.3f} s, per-GPU MFU vs mixed floor "
                    f"{100 * floor / out.metrics.ttft_s:.0f}%")  # fmt: skip
            rec.write()
        mrow["status"] = "ok"
        ctx.engine = llm = model = None
        free()
    keys = ("layers", "lengths", "weights", "kernels_spec", "kv_format", "chunk_per_device")
    if previous and all(previous.get(k) == entry[k] for k in keys):
        for m, mrow in previous.get("meshes", {}).items():
            if m not in entry["meshes"] and mrow.get("lengths"):
                entry["meshes"][m] = {**mrow, "from_run": previous.get("from_run", previous.get("run"))}
    base_m = min(int(k) for k, v in entry["meshes"].items() if v.get("lengths")) if any(
        v.get("lengths") for v in entry["meshes"].values()) else None  # fmt: skip
    for length in args.scaling_lengths:
        base = entry["meshes"].get(str(base_m), {}).get("lengths", {}).get(str(length)) if base_m else None
        for m, mrow in entry["meshes"].items():
            row = mrow.get("lengths", {}).get(str(length))
            if not row or not base:
                continue
            row["efficiency"] = base["ttft_s"] * base_m / (int(m) * row["ttft_s"])
            row["pred_ttft_s"] = base["ttft_s"] * base_m / int(m) + row["comm_pred"]["exposed_s"]
            row["pred_efficiency"] = base["ttft_s"] * base_m / (int(m) * row["pred_ttft_s"])
    firsts = {row["first_token"] for mrow in entry["meshes"].values() for row in mrow.get("lengths", {}).values()
              if row}  # fmt: skip
    by_length = {s: {mrow["lengths"][str(s)]["first_token"] for mrow in entry["meshes"].values()
                     if str(s) in mrow.get("lengths", {})} for s in args.scaling_lengths}  # fmt: skip
    entry["same_first_token"] = all(len(v) <= 1 for v in by_length.values()) and bool(firsts)
    entry["base_mesh"] = base_m
    entry["status"] = "ok"


def table_scaling(ctx: Context) -> None:
    entry = ctx.this_run("2", needs="meshes")
    if entry is None:
        return
    log = ctx.rec.log
    log("-" * 120)
    log(f"Step 2: scaling, {entry['layers']} layers ({entry['layer_types']}); efficiency = T_{entry['base_mesh']} · "
        f"{entry['base_mesh']} / (N · T_N); MFUx = mixed-precision floor of the N-GPU share / TTFT; pred = T_"
        f"{entry['base_mesh']} · {entry['base_mesh']} / N + predicted exposed communication")  # fmt: skip
    log(f"{'length':>7} {'N':>3} {'chunk':>7} {'TTFT s':>8} {'pred':>8} {'eff':>6} {'pred':>6} {'MFUx':>5} "
        f"{'first token':>11}")  # fmt: skip
    for length in entry["lengths"]:
        for m, mrow in sorted(entry["meshes"].items(), key=lambda x: int(x[0])):
            row = mrow.get("lengths", {}).get(str(length))
            if not row:
                log(f"{fmt_len(length):>7} {m:>3}  {mrow.get('status', 'skipped')}")
                continue
            eff = f"{100 * row['efficiency']:.0f}%" if "efficiency" in row else "-"
            peff = f"{100 * row['pred_efficiency']:.0f}%" if "pred_efficiency" in row else "-"
            pred = f"{row['pred_ttft_s']:.3f}" if "pred_ttft_s" in row else "-"
            earlier = f" (from run {mrow['from_run']})" if "from_run" in mrow else ""
            log(f"{fmt_len(length):>7} {m:>3} {mrow['chunk']:>7} {row['ttft_s']:>8.3f} {pred:>8} {eff:>6} {peff:>6} "
                f"{100 * row['mfu_mixed']:>4.0f}% {row['first_token']:>11}{earlier}")  # fmt: skip
    log(f"the same first token on every mesh: {entry['same_first_token']}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> list[str]:
    """This host's GPU ids without initializing jax (which would take their memory from the worker processes)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x for x in env.split(",") if x.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def worker_argv(args, process_id: int, port: int, out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--process-id", str(process_id), "--worker-out", str(out),
            "--weights", args.weights, "--kv-format", args.kv_format, "--seed", str(args.seed),
            "--ep-schedule", args.ep_schedule,
            "--new-tokens", str(args.new_tokens), "--worker-length", str(args.worker_length),
            "--worker-chunk", str(args.worker_chunk)]  # fmt: skip
    if args.compile_cache:
        argv += ["--compile-cache", args.compile_cache]
    if args.kernels:
        argv += ["--kernels", args.kernels]
    return argv + (["--smoke"] if args.smoke else [])


def step_processes_spawn(args, rec: Recorder) -> None:
    """Step 4, first half (before this process touches a device): 2 worker processes under jax.distributed."""
    entry = rec.step(4)
    rec.log("=== step 4: 2 processes under jax.distributed ===")
    if args.smoke:
        devices, groups = SMOKE_DEVICES, [None, None]
    else:
        gpus = visible_gpus()
        devices = len(gpus)
        groups = [",".join(gpus[: devices // 2]), ",".join(gpus[devices // 2 :])]
    config = flash_config(None, args.smoke)
    prompt_len = min(args.process_length, config.max_position_embeddings - args.new_tokens - 1)
    context = prompt_len + args.new_tokens + 1
    entry.update(devices=devices, processes=2, prompt_len=prompt_len)
    if devices < 2 or devices % 2 or config.n_routed_experts % devices:
        rec.skip(entry, "step 4", f"needs an even number of devices (at least 2) that splits the experts; {devices}")
        entry["status"] = "skipped"
        return
    chunk = args.chunk or args.chunk_per_device * devices
    capacity = args.device_memory_gib or device_gib(args.device)  # no device statistics before jax starts
    p = plan(args, config, context, devices, chunk, capacity_gib=capacity)
    entry["plan"] = plan_row(p)
    if not p.fits:
        rec.skip(entry, "step 4", f"the plan needs {p.required_bytes / GIB:.1f} GiB per device of {capacity:.1f}")
        entry["status"] = "skipped"
        return
    args.worker_length, args.worker_chunk = prompt_len, chunk
    out = (args.out or Path("/tmp/bench_multi_gpu")) / "processes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    port = free_port()
    procs = []
    for i, group in enumerate(groups):
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(("--xla_force_host_platform",
                                                                                   "--xla_dump"))]  # fmt: skip
        env["XLA_FLAGS"] = " ".join(flags)
        if group is not None:
            env["CUDA_VISIBLE_DEVICES"] = group
        log_path = out.parent / f"process_{i}.log"
        procs.append((subprocess.Popen(worker_argv(args, i, port, out), env=env, stdout=open(log_path, "w"),
                                       stderr=subprocess.STDOUT, cwd=str(ROOT)), log_path))  # fmt: skip
    t0 = time.perf_counter()
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.worker_timeout - (time.perf_counter() - t0))))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append("timeout")
    entry["wall_s"] = time.perf_counter() - t0
    entry["exit_codes"] = codes
    entry["logs"] = {str(path): path.read_text()[-3000:] for _, path in procs}
    if codes != [0, 0] or not out.exists():
        entry["status"] = "error"
        entry["errors"].append(dict(where="step 4 workers", type="WorkerFailed",
                                    message=f"exit codes {codes}; logs in {out.parent}"))  # fmt: skip
        rec.log(f"ERROR step 4: worker exit codes {codes}; see {out.parent}/process_*.log")
        return
    entry["result"] = json.loads(out.read_text())
    entry["status"] = "ran"
    r = entry["result"]
    rec.log(f"step 4: {r['processes']} processes × {r['local_devices']} devices: TTFT {r['ttft_s']:.3f} s, TPOT "
            f"{ms(r['tpot_s'])} ms (compile {r['compile_s']:.1f} s)")  # fmt: skip


def step_processes_compare(ctx: Context) -> None:
    """Step 4, second half: the two-process tokens against this process's run at the same length."""
    entry = ctx.rec.data["steps"].get("4")
    if not entry or entry.get("status") != "ran":
        return
    prompt_len = entry["prompt_len"]
    ref, where = ctx.tokens.get(prompt_len), "step 1 of this run"
    if ref is None:  # an earlier run's step 1 in the same JSON, same settings
        previous = ctx.rec.data.get("previous_step1", {})
        old = previous.get("lengths", {}).get(str(prompt_len), {})
        same = (previous.get("weights"), previous.get("chunk"), previous.get("kv_format")) == (
            ctx.args.weights, ctx.chunk(entry["devices"]), ctx.args.kv_format)  # fmt: skip
        if old.get("tokens") and same:
            ref, where = old["tokens"], "an earlier run's step 1"
    if ref is None:
        ctx.rec.log(f"step 4: no one-process tokens at {prompt_len}; running it here")
        saved = ctx.args.lengths
        ctx.args.lengths = [prompt_len]
        step1 = ctx.rec.data["steps"].get("1")
        step_full(ctx)
        ctx.args.lengths = saved
        entry["reference_run"] = ctx.rec.data["steps"].pop("1")
        if step1 is not None:
            ctx.rec.data["steps"]["1"] = step1
        ref, where = ctx.tokens.get(prompt_len), "a one-process run for this comparison"
    got = entry["result"]["tokens"]
    entry.update(reference=where, reference_tokens=ref, same_tokens=ref == got)
    entry["status"] = "ok" if ref is not None else "error"
    ctx.rec.log(f"step 4: tokens of 2 processes {'==' if ref == got else '!='} {where} "
                f"({len(got)} tokens)")  # fmt: skip


def worker(args) -> int:
    """A step-4 process: the step-1 engine on one mesh over both processes; process 0 writes the result."""
    from dsv4 import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           cpu_devices=SMOKE_DEVICES // 2 if args.smoke else None)  # fmt: skip
    config = flash_config(None, args.smoke)
    mesh = make_mesh()
    prompts = distributed.broadcast_prompts([prompt_ids(config, args.worker_length, args.seed)]
                                            if jax.process_index() == 0 else None)  # fmt: skip
    model, init_s, _ = build_model(args, config, mesh)
    llm = new_engine(args, model, mesh, args.worker_length + args.new_tokens + 1, args.worker_chunk)
    compile_s = llm.warmup(prompt_lens=[args.worker_length], widths=[1])
    out = run_prompt(llm, prompts[0], args.new_tokens + 1)
    if jax.process_index() == 0:
        result = dict(processes=jax.process_count(), devices=len(jax.devices()), local_devices=len(jax.local_devices()),
                      tokens=out.token_ids, ttft_s=out.metrics.ttft_s, tpot_s=out.metrics.tpot_s, compile_s=compile_s,
                      init_s=init_s, peaks=device_peaks(), kernels=str(model.kernels))  # fmt: skip
        Path(args.worker_out).write_text(json.dumps(result))
    print(f"process {jax.process_index()}: done", flush=True)
    return 0


def step_ledger(ctx: Context) -> None:
    """Step 5: `dsv4 plan` for V4-Flash on N devices of this machine, an H200 and an H20, against step 1's peaks."""
    args, rec = ctx.args, ctx.rec
    entry = rec.step(5)
    flash = Config.preset("v4-flash")
    n = 8 if args.smoke else max(ctx.n_devices, 1)
    chunk = args.chunk_per_device * n
    entry.update(devices=n, chunk=chunk, rows=[])
    targets = [("this device", dict(capacity_gib=ctx.capacity_gib)), ("h200", dict(device="h200")),
               ("h20", dict(device="h20"))]  # fmt: skip
    for label, where in targets:
        for weights in WEIGHT_FORMATS:
            for context in (128 << 10, 512 << 10, 1 << 20):
                p = plan(args, flash, context, n, chunk, weights=weights, **where)
                entry["rows"].append(dict(device=label, weights=weights, context=context, **plan_row(p),
                                          spare_gib=(p.capacity_bytes - p.required_bytes) / GIB,
                                          above_peak=p.capacity_bytes / p.total_bytes))  # fmt: skip
    h20 = plan(args, flash, 512 << 10, 8, args.chunk_per_device * 8, device="h20")
    entry["h20_512k"] = dict(weights=args.weights, fits=h20.fits, required_gib=h20.required_bytes / GIB,
                             capacity_gib=h20.capacity_bytes / GIB, total_gib=h20.total_bytes / GIB,
                             spare_gib=(h20.capacity_bytes - h20.required_bytes) / GIB,
                             capacity_over_peak=h20.capacity_bytes / h20.total_bytes,
                             ledger=format_plan(h20))  # fmt: skip
    step1 = rec.data["steps"].get("1", {})
    entry["measured"] = {k: v.get("memory") for k, v in step1.get("lengths", {}).items() if v.get("memory")}
    entry["status"] = "ok"


def table_ledger(ctx: Context) -> None:
    entry = ctx.this_run("5")
    if entry is None:
        return
    log = ctx.rec.log
    log("-" * 120)
    log(f"Step 5: memory ledger, V4-Flash (43 layers), {entry['devices']} devices, KV {ctx.args.kv_format}, chunk "
        f"{entry['chunk']}, {ctx.args.headroom}x headroom (GiB per device; `dsv4 plan`)")  # fmt: skip
    log(f"{'device':<12} {'weights':<16} {'context':>8} {'need':>7} {'w/ hdrm':>8} {'capacity':>9} {'fits':>5} "
        f"{'spare':>7} {'cap/need':>8}")  # fmt: skip
    for r in entry["rows"]:
        log(f"{r['device']:<12} {r['weights']:<16} {fmt_len(r['context']):>8} {r['total_gib']:>7.1f} "
            f"{r['required_gib']:>8.1f} {r['capacity_gib']:>9.1f} {'yes' if r['fits'] else 'NO':>5} "
            f"{r['spare_gib']:>7.1f} {r['above_peak']:>7.2f}x")  # fmt: skip
    h = entry["h20_512k"]
    log(f"8 H20, 512K, weights {h['weights']}: {'fits' if h['fits'] else 'DOES NOT FIT'}: needs {h['total_gib']:.1f} "
        f"GiB ({h['required_gib']:.1f} with headroom) of {h['capacity_gib']:.1f}; {h['spare_gib']:.1f} GiB spare, "
        f"capacity {h['capacity_over_peak']:.2f}x the planned peak")  # fmt: skip
    for length, m in entry.get("measured", {}).items():
        log(f"measured, step 1 prompt {length}: " + (f"peak {m['peak_gib']:.2f} GiB = {m['ratio']:.2f}x the plan's "
            f"{m['plan_total_gib']:.2f} ({m['verdict']})" if "peak_gib" in m else m["measured"]))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    text = text.strip().lower()
    for suffix, scale in (("k", 1 << 10), ("m", 1 << 20)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * scale)
    return int(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every step at tiny shapes on 8 CPU host devices")
    p.add_argument("--out", type=Path, help="write bench_multi_gpu.json (merged across runs) and .log here")
    p.add_argument("--steps", default="1,2,3,4,5", help="which steps (run in the order 4, 1, 3, 2, 5)")
    p.add_argument("--weights", default="fp8", choices=WEIGHT_FORMATS, help="weights format (default fp8)")
    p.add_argument("--kv-format", default="fp8-channel", help="KV cache storage (default fp8-channel)")
    p.add_argument("--ep-schedule", default="auto", choices=SCHEDULES,
                   help="the expert exchange's schedule (default auto: dsv4.sharding.expert_parallel)")  # fmt: skip
    p.add_argument("--kernels", default=None, help="dsv4.Kernels spec (GPU default indexer=pallas-fp8; smoke auto)")
    p.add_argument("--lengths", default=None, help="step 1 contexts (default 128k,512k,1m; smoke 64,128,256)")
    p.add_argument("--scaling-lengths", default=None, help="step 2 prompts (default 128k,512k; smoke 64,128)")
    p.add_argument("--meshes", default=None, help="step 2 device counts (default 1,2,4,8; smoke 1,8)")
    p.add_argument("--scaling-layers", type=int, default=None, help="step 2 depth (default: the plan's most on 1)")
    p.add_argument("--profile-length", default=None, help="step 3 prompt (default 512k; smoke 128)")
    p.add_argument("--process-length", default=None, help="step 4 context (default 512k; smoke 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens after the first (default 32)")
    p.add_argument("--chunk-per-device", type=int, default=CHUNK_TOKENS_PER_DEVICE,
                   help=f"prefill chunk per device (default {CHUNK_TOKENS_PER_DEVICE}, the engine's short default: "
                        "fixed over every step, so the meshes compare like with like)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=None, help="a fixed chunk for every mesh (smoke 32)")
    p.add_argument("--device", default="h200", help="memory preset where the allocator reports none (default h200)")
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory of one device (overrides)")
    p.add_argument("--headroom", type=float, default=1.2, help="plan for this multiple of the peak (default 1.2)")
    p.add_argument("--prior-efficiency", type=float, default=PRIOR_EFFICIENCY,
                   help="predicted TTFT = floor / this + exposed communication (default 0.5)")  # fmt: skip
    p.add_argument("--worker-timeout", type=float, default=None, help="step 4 seconds (default 900; smoke 240)")
    p.add_argument("--hlo-dump", type=Path, default=None,
                   help="XLA's HLO dump dir (default OUT/hlo with step 3, not in smoke)")  # fmt: skip
    p.add_argument("--compile-cache", default=None, help="jax's persistent compilation cache directory (off)")
    p.add_argument("--seed", type=int, default=0)
    # a step-4 worker process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--worker-length", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = args.smoke
    args.steps = sorted({int(s) for s in args.steps.split(",") if s.strip()}, key=STEP_ORDER.index)
    if args.kernels is None and not smoke:
        args.kernels = "indexer=pallas-fp8"
    counts = lambda text: sorted({parse_count(x) for x in text.split(",") if x.strip()})  # noqa: E731
    args.lengths = counts(args.lengths or ("64,128,256" if smoke else "128k,512k,1m"))
    args.scaling_lengths = counts(args.scaling_lengths or ("64,128" if smoke else "128k,512k"))
    args.meshes = counts(args.meshes or ("1,8" if smoke else "1,2,4,8"))
    args.profile_length = parse_count(args.profile_length or ("128" if smoke else "512k"))
    args.process_length = parse_count(args.process_length or ("128" if smoke else "512k"))
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (1 if smoke else 32)
    args.chunk = args.chunk or (32 if smoke else None)
    args.worker_timeout = args.worker_timeout or (240.0 if smoke else 900.0)
    if 3 in args.steps and args.hlo_dump is None and args.out is not None and not smoke:
        args.hlo_dump = args.out / "hlo"
    return args


def header(args, rec: Recorder) -> dict:
    dev = jax.devices()[0]
    h = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), argv=" ".join(sys.argv),
             host=platform.node(), device_kind=dev.device_kind, platform=dev.platform, devices=jax.device_count(),
             jax=jax.__version__, python=platform.python_version(), xla_flags=os.environ.get("XLA_FLAGS"),
             mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), steps=args.steps, weights=args.weights,
             kernels=args.kernels, kv_format=args.kv_format, smoke=args.smoke)  # fmt: skip
    if dev.platform == "gpu":
        try:
            q = "name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
            h["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                             capture_output=True, text=True, timeout=15).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            h["nvidia_smi"] = f"unavailable: {exc}"
    rec.log("=" * 120)
    rec.log(f"bench_multi_gpu: {h['devices']} x {h['device_kind']} ({h['platform']}); jax {h['jax']}; {h['date']}")
    rec.log(f"command: {h['argv']}")
    return h


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    if args.worker:
        return worker(args)
    if args.hlo_dump is not None:  # before the backend starts: XLA reads its flags once
        args.hlo_dump.mkdir(parents=True, exist_ok=True)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.hlo_dump} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=slot_step").strip()  # fmt: skip
    rec = Recorder(args.out)
    if "1" in rec.data["steps"]:  # an earlier run's tokens, for step 4's comparison
        rec.data["previous_step1"] = {k: v for k, v in rec.data["steps"]["1"].items()
                                      if k in ("weights", "chunk", "kv_format", "lengths")}  # fmt: skip
    rec.data["runs"].append(dict(started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                                 argv=" ".join(sys.argv)))  # fmt: skip
    if not args.smoke and 4 in args.steps:
        step_processes_spawn(args, rec)  # the GPUs are still free: nothing here has touched them
        rec.write()
    h = header(args, rec)
    rec.data["runs"][-1]["header"] = h
    if not args.smoke and jax.default_backend() != "gpu":
        rec.log(f"ERROR: jax's default backend is {jax.default_backend()!r}, not 'gpu'; run with --smoke on a CPU")
        return 2
    if args.smoke and 4 in args.steps:
        step_processes_spawn(args, rec)
    capacity, how = device_capacity_gib(args)
    rates = measure_ceilings(args.smoke)
    rec.data["runs"][-1].update(rates=rates, capacity_gib=capacity, capacity_how=how)
    rec.log("ceilings (matmul, device 0): " + ", ".join(f"{k} {v / 1e12:.4g} TFLOP/s" for k, v in rates.items())
            + f"; device memory {capacity:.1f} GiB ({how})")  # fmt: skip
    ctx = Context(args, rec, rates, capacity, how, jax.device_count())
    steps = {1: step_full, 3: step_profile, 2: step_scaling, 4: step_processes_compare, 5: step_ledger}
    for key in (1, 3, 2, 4, 5):
        if key not in args.steps:
            continue
        try:
            steps[key](ctx)
        except Exception as exc:  # noqa: BLE001 -- one step's failure is recorded; the others run
            entry = rec.data["steps"].setdefault(str(key), {"errors": [], "skips": []})
            entry["status"] = "error"
            rec.error(entry, f"step {key}", exc)
        rec.write()
    for table in (table_full, table_profile, table_scaling, table_ledger):
        table(ctx)
    for key in args.steps:
        entry = rec.data["steps"].get(str(key), {})
        if key == 4 and "same_tokens" in entry:
            rec.log(f"step 4: the 2-process tokens {'equal' if entry['same_tokens'] else 'DIFFER FROM'} "
                    f"{entry['reference']}")  # fmt: skip
    summary = {k: rec.data["steps"].get(str(k), {}).get("status") for k in args.steps}
    rec.data["runs"][-1]["summary"] = summary
    rec.data["runs"][-1]["elapsed_s"] = time.monotonic() - T_START
    rec.data.pop("previous_step1", None)
    rec.log(f"steps: {summary}; elapsed {time.monotonic() - T_START:.0f} s" +
            (f"; {args.out / 'bench_multi_gpu.json'}" if args.out else ""))  # fmt: skip
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
