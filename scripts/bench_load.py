"""Checkpoint loading benchmark: peak host RAM and time while loading a multi-GB synthetic checkpoint.

Writes (once) a DeepSeek-V4-Flash-width checkpoint with few layers, stored as DeepSeek releases it (DeepSeek
tensor names, FP8 e4m3 weights with 128×128 ue8m0 block scales, FP4 routed experts with per-32 scales, bf16
embeddings / head, float32 norms), then loads it in fresh processes, each reporting its own peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) against its RSS just before the load:

  bf16     dsv4.load(dtype=bfloat16): every FP8/FP4 weight dequantized on the host, streamed to the device
  kept     dsv4.load(keep_quantized=True): FP8/FP4 bytes + float32 scales streamed as they are
  convert  dsv4.convert (dsv4.api.convert) → orbax (bfloat16), then
  orbax    dsv4.load of that orbax checkpoint

On a GPU the model lands in device memory, so peak − baseline RSS is the loader's own host footprint; on CPU
the "device" is host RAM too, and the report subtracts the model's bytes to show the same overhead.

    python scripts/bench_load.py --dir /tmp/v4flash-2l                       # write if missing, then measure
    python scripts/bench_load.py --dir /tmp/v4flash-2l --experts 8 --modes bf16,kept   # a small CPU check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def bench_config(layers: int, experts: int):
    from dsv4.config import CSA, HCA, Config

    base = Config.preset("v4-flash")
    layer_types = tuple((CSA, HCA)[i % 2] for i in range(layers))
    mlp_types = tuple("hash_moe" if i == 0 else "moe" for i in range(layers))
    return base.replace(num_hidden_layers=layers, layer_types=layer_types, mlp_layer_types=mlp_types,
                        n_routed_experts=experts,
                        quantization_config_json=json.dumps(QUANTIZATION, sort_keys=True))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Writing: shapes from the model's own declarations, names as released, data generated tensor by tensor
# and streamed to disk (a safetensors header first, then each tensor's bytes), one shard per layer.
# ---------------------------------------------------------------------------------------------
def released_tensors(config) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(shard, name, shape, kind) for every tensor of the checkpoint; kind: fp8 | fp4 | e8m0 | bf16 | f32 | tid2eid."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv4.kernels import Kernels
    from dsv4.model import DeepseekV4
    from dsv4.quantization import fp4_scale_shape, fp8_scale_shape
    from dsv4.weights import _TO_DEEPSEEK, RELEASED_EXPERT, RELEASED_FP8, declared_tensors, module_name

    abstract = nnx.eval_shape(lambda: DeepseekV4(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                 kernels=Kernels.all("jnp")))  # fmt: skip
    block = tuple(QUANTIZATION["weight_block_size"])
    out = []
    for path, var in declared_tensors(abstract):
        name, shape = module_name(path), tuple(var.shape)
        shard = f"layer{path[1]}" if path[0] == "layers" else "other"
        m = re.match(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            e, rows, cols = shape
            ws = ("w2",) if m.group(2) == "down_proj" else ("w1", "w3")
            rows //= len(ws)
            for i in range(e):
                for w in ws:
                    stem = f"{m.group(1)}.ffn.experts.{i}.{w}"
                    out.append((shard, f"{stem}.weight", (rows, cols // 2), "fp4"))
                    out.append((shard, f"{stem}.scale", fp4_scale_shape((rows, cols)), "e8m0"))
            continue
        for pattern, repl in _TO_DEEPSEEK:
            name = re.sub(pattern, repl, name)
        if RELEASED_FP8.search(name) and not RELEASED_EXPERT.search(name):
            out.append((shard, name, shape, "fp8"))
            out.append((shard, name.removesuffix(".weight") + ".scale", fp8_scale_shape(shape, block), "e8m0"))
        elif name.endswith("tid2eid"):
            out.append((shard, name, shape, "tid2eid"))
        else:
            out.append((shard, name, shape, "f32" if np.dtype(var.dtype) == np.float32 else "bf16"))
    return out


_DTYPES = {"fp8": ("F8_E4M3", 1), "fp4": ("I8", 1), "e8m0": ("F8_E8M0", 1), "bf16": ("BF16", 2), "f32": ("F32", 4),
           "tid2eid": ("I32", 4)}  # fmt: skip


def _data(kind: str, shape: tuple[int, ...], rng: np.random.Generator, experts: int, rows=None) -> bytes:
    """Bytes of `kind` for rows [rows) of a tensor (all rows when None): valid values, cheap to make."""
    r0, r1 = rows if rows is not None else (0, shape[0] if shape else 1)
    count = (r1 - r0) * math.prod(shape[1:])
    if kind in ("fp8", "fp4"):
        raw = np.frombuffer(rng.bytes(count), np.uint8).copy()
        if kind == "fp8":
            raw[(raw & 0x7F) == 0x7F] ^= 1  # no NaN codes
        return raw.tobytes()
    if kind == "e8m0":
        return rng.integers(117, 121, count, dtype=np.uint8).tobytes()  # 2^-10 .. 2^-7
    if kind == "tid2eid":
        k = shape[1]
        tokens = np.arange(r0, r1, dtype=np.int64)[:, None]
        return ((tokens * 7 + np.arange(k)[None, :] * (experts // k)) % experts).astype(np.int32).tobytes()
    values = (0.02 * rng.standard_normal(count, np.float32)) if len(shape) > 1 else np.ones(count, np.float32)
    import ml_dtypes

    return (values.astype(ml_dtypes.bfloat16) if kind == "bf16" else values).tobytes()


def write_checkpoint(out_dir: str, config) -> int:
    os.makedirs(out_dir, exist_ok=True)
    tensors = released_tensors(config)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    shards = sorted({t[0] for t in tensors})
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        members = [t for t in tensors if t[0] == shard]
        header, offset = {}, 0
        for _, name, shape, kind in members:
            dtype, size = _DTYPES[kind]
            nbytes = math.prod(shape) * size
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(out_dir, file), "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for _, name, shape, kind in members:
                rows = shape[0] if shape else 1
                step = max(1, (64 << 20) // max(1, math.prod(shape[1:]) * _DTYPES[kind][1]))
                for r0 in range(0, rows, step):
                    f.write(_data(kind, shape, rng, config.n_routed_experts, (r0, min(rows, r0 + step))))
        total += offset
        print(f"  wrote {file}: {len(members)} tensors, {offset / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)  # fmt: skip
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    return total


# ---------------------------------------------------------------------------------------------
# Measuring, one fresh process per mode.
# ---------------------------------------------------------------------------------------------
def measure(mode: str, ckpt_dir: str, orbax_dir: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import dsv4
    from dsv4.api import convert

    device = jax.devices()[0]
    jnp.zeros(1).block_until_ready()  # backend up before the baseline
    baseline = rss_bytes()
    t0 = time.perf_counter()
    if mode == "convert":
        convert(ckpt_dir, orbax_dir, dtype=jnp.bfloat16, progress=True)
        model = None
    else:
        src = orbax_dir if mode == "orbax" else ckpt_dir
        model = dsv4.load(src, dtype=jnp.bfloat16, keep_quantized=mode == "kept", progress=True)
        jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - t0
    peak = peak_rss_bytes()
    leaves = jax.tree.leaves(nnx.state(model)) if model is not None else []
    model_bytes = sum(x.nbytes for x in leaves)
    largest = max((x.nbytes for x in leaves), default=0)
    on_host = device.platform == "cpu"
    return {
        "mode": mode, "platform": device.platform, "device": device.device_kind, "seconds": round(seconds, 1),
        "baseline_rss_gb": round(baseline / 1e9, 3), "peak_rss_gb": round(peak / 1e9, 3),
        "peak_minus_baseline_gb": round((peak - baseline) / 1e9, 3),
        "loader_overhead_gb": round((peak - baseline - (model_bytes if on_host else 0)) / 1e9, 3),
        "model_gb": round(model_bytes / 1e9, 3), "largest_tensor_gb": round(largest / 1e9, 3),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="synthetic checkpoint directory (written when missing)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=256, help="routed experts per layer (V4-Flash: 256)")
    parser.add_argument("--modes", default="bf16,kept,convert,orbax")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one mode, this process
    args = parser.parse_args()
    orbax_dir = args.dir.rstrip("/") + "-orbax"
    if args.measure:
        print("RESULT " + json.dumps(measure(args.measure, args.dir, orbax_dir)))
        return 0
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        config = bench_config(args.layers, args.experts)
        print(f"writing a {args.layers}-layer, {args.experts}-expert V4-Flash-width checkpoint to {args.dir}",
              file=sys.stderr)  # fmt: skip
        write_checkpoint(args.dir, config)
    ckpt_bytes = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    from dsv4.weights import checkpoint_index

    largest_stored = max(e.nbytes for e in checkpoint_index(args.dir).values())
    results = {"checkpoint_dir": args.dir, "checkpoint_gb": round(ckpt_bytes / 1e9, 3),
               "largest_stored_tensor_gb": round(largest_stored / 1e9, 3), "runs": []}  # fmt: skip
    for mode in args.modes.split(","):
        if mode == "convert" and os.path.exists(orbax_dir):
            import shutil

            shutil.rmtree(orbax_dir)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--measure", mode],
                              capture_output=True, text=True)  # fmt: skip
        sys.stderr.write(proc.stderr[-4000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{mode}: failed (exit {proc.returncode})", file=sys.stderr)
            results["runs"].append({"mode": mode, "error": proc.stderr[-2000:]})
            continue
        run = json.loads(lines[-1][len("RESULT "):])
        results["runs"].append(run)
        print(f"{mode:8s} {run['seconds']:7.1f} s   peak RSS {run['peak_rss_gb']:6.2f} GB (baseline "
              f"{run['baseline_rss_gb']:.2f}, +{run['peak_minus_baseline_gb']:.2f}; loader overhead "
              f"{run['loader_overhead_gb']:.2f})   model {run['model_gb']:.2f} GB on {run['platform']}, largest tensor "
              f"{run['largest_tensor_gb']:.2f} GB", flush=True)  # fmt: skip
        if args.out:  # after every mode, so a run cut short still leaves its numbers
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
