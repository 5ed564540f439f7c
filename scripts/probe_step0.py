"""Layer by layer: the attention core's inputs and output at one decode step of `check_decode_gpu.py`'s FP8-cache
run on the Mosaic route, and each kernel on those inputs, against a float32 jnp reference.

`check_decode_gpu.py --kv-format fp8-channel --one-token mosaic` missed its old tolerance at the first decode step
only (7.1e-2 against 5e-2), and with `--one-token triton` it did not (2.2e-2). This probe found why: the kernels are
right there, and the random model's logits at that step move as much under rounding-sized noise (docs/BENCHMARKS.md,
"One-token chunks on the Mosaic kernel"). The jnp path drives the model (prefill and cache); at each step named by
`--steps-to-probe` the model also runs twice on
the same inputs with `core_attention_pallas` (one-token chunks on the Mosaic kernel) behind a recording attention
impl that hands each layer's core inputs and output to the host. It prints the model's logits against the jnp
path's for both runs, and per layer, on the first run's inputs:
- `in-model`: what the core returned inside the model;
- `ref32`: `core_attention_jnp` in float32 (the measure for the others);
- `jnp`: the same in the model's dtype;
- `triton`: `dsv4.pallas.attention.v4_attention` (interpreted off-GPU);
- `mosaic`: `v4_attention_mgpu` called as `core_attention_pallas` calls it for a cached chunk (window and HCA
  layers, on a GPU), with `whole`, the run-time test that picks it.
It prints relative L2 errors against ref32, per batch row, and the worst (row, head) for the Mosaic kernel, and
saves the inputs (`--save DIR`, one npz per layer and step). `--noise REL` also runs each probed step with jnp's core
plus Gaussian noise of REL × its RMS on every layer (check_decode_gpu's noise floor), `--noise-seeds` times.

    PYTHONPATH=. python3 scripts/probe_step0.py --save $OUT/step0             # one H200 (check_decode_gpu's sizes)
    PYTHONPATH=. python3 scripts/probe_step0.py --noise 2e-3 --noise-seeds 12 # the noise floor at those steps
    PYTHONPATH=. python3 scripts/probe_step0.py --small --prompt 600 --chunk 256   # CPU smoke (no Mosaic kernel)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4  # noqa: E402
import dsv4.attention  # noqa: E402
from dsv4.attention import (  # noqa: E402
    CompressedKeys,
    core_attention_jnp,
    core_attention_pallas,
    prefix_is_whole,
    register_attention_impl,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_decode_gpu import NOISE, _step, config, noisy_core  # noqa: E402
from check_decode_gpu import rel_err as rel  # noqa: E402

RECORDS: list[dict] = []


def recording_core(q, kv, q_pos, kv_pos, sinks, *, sliding_window, scale, compressed=None, kv_aligned=False,
                   query_chunk=512, kv_prefix=0):  # fmt: skip
    """core_attention_pallas (one-token chunks on the Mosaic kernel), handing every input and its output to the
    host (RECORDS, in call order)."""
    # forward_chunk passes kv_prefix to the "auto" and "pallas" impls only; its layout (the ring's W rows, then the
    # chunk's) is what a cached chunk always has
    cached = not kv_aligned and kv.shape[1] == q.shape[1] + sliding_window
    kv_prefix = sliding_window if cached else kv_prefix
    dsv4.attention.MOSAIC_ONE_TOKEN = True
    out = core_attention_pallas(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale,
                                compressed=compressed, kv_aligned=kv_aligned, kv_prefix=kv_prefix)  # fmt: skip
    static = dict(sliding_window=sliding_window, scale=scale, kv_prefix=kv_prefix,
                  rate=None if compressed is None else compressed.rate)  # fmt: skip
    arrays = dict(q=q, kv=kv, q_pos=q_pos, kv_pos=kv_pos, sinks=sinks, model_out=out)
    if compressed is not None:
        arrays["entries"] = compressed.entries
        if compressed.topk_indices is not None:
            arrays["topk"] = compressed.topk_indices
    jax.debug.callback(lambda **a: RECORDS.append(dict(static, **{k: np.asarray(v) for k, v in a.items()})),
                       **arrays)  # fmt: skip
    return out


def run_cores(r: dict, mosaic_ok: bool, interpret: bool) -> dict:
    from dsv4.pallas.attention import v4_attention
    from dsv4.pallas.attention_mgpu import v4_attention_mgpu

    arr = {k: jnp.asarray(v) for k, v in r.items() if isinstance(v, np.ndarray) and k != "model_out"}
    sw, scale, rate = r["sliding_window"], r["scale"], r["rate"]
    comp = None
    if rate is not None:
        comp = CompressedKeys(arr["entries"], rate, arr.get("topk"))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    args = (arr["q"], arr["kv"], arr["q_pos"], arr["kv_pos"], arr["sinks"])
    out = {}
    comp32 = None if comp is None else comp._replace(entries=f32(comp.entries))
    out["ref32"] = core_attention_jnp(f32(args[0]), f32(args[1]), *args[2:], sliding_window=sw, scale=scale,
                                      compressed=comp32)  # fmt: skip
    out["jnp"] = core_attention_jnp(*args, sliding_window=sw, scale=scale, compressed=comp)
    entries = {} if comp is None else dict(compressed=comp.entries, compress_rate=rate)
    if comp is not None and comp.topk_indices is not None:
        entries["topk_indices"] = comp.topk_indices
    out["triton"] = v4_attention(*args, sliding_window=sw, scale=scale, interpret=interpret, **entries)
    csa = "topk_indices" in entries
    if r["kv_prefix"] > 0:
        out["whole"] = bool(prefix_is_whole(arr["q_pos"], arr["kv_pos"], r["kv_prefix"]))
    if mosaic_ok and not csa and r["kv_prefix"] > 0 and arr["q"].shape[2] % 64 == 0:
        out["mosaic"] = v4_attention_mgpu(arr["q"], arr["kv"], arr["q_pos"], arr["sinks"].astype(jnp.float32),
                                          sliding_window=sw, scale=scale, kv_offset=r["kv_prefix"],
                                          check_positions=False, **entries)  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--steps-to-probe", default="0,2", help="decode steps to record (step 1 has slot 1 idle)")
    p.add_argument("--kv-format", default="fp8-channel")
    p.add_argument("--small", action="store_true", help="4 heads x 64 (CPU smoke)")
    p.add_argument("--save", default=None, help="directory for one npz of inputs per layer and probed step")
    p.add_argument("--noise", type=float, default=0.0, help="also run each probed step with jnp's core plus this "
                   "much relative Gaussian noise (--noise-seeds seeds): how far rounding-sized changes in the core "
                   "move this model's logits")
    p.add_argument("--noise-seeds", type=int, default=8)
    args = p.parse_args()
    probe = {int(s) for s in args.steps_to_probe.split(",")}
    on_gpu = jax.default_backend() == "gpu"
    register_attention_impl("record", recording_core)
    register_attention_impl("noisy", noisy_core)
    NOISE["rel"] = args.noise
    cfg = config(args.small)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, cache {args.kv_format}", flush=True)
    models = {impl: dsv4.init_random(cfg, seed=0, dtype=jnp.bfloat16, attention_impl=impl)
              for impl in ("jnp", "record", "noisy")}  # fmt: skip
    lens = np.array([args.prompt, args.prompt - 333])
    page_tokens, max_len = 256, args.prompt + max(probe) + 1 + 256
    cols = -(-max_len // page_tokens)
    cache = models["jnp"].init_cache(2, max_len=max_len, kv_format=args.kv_format, page_tokens=page_tokens,
                                     num_pages=2 * cols + 1)  # fmt: skip
    pages = np.random.default_rng(1).permutation(np.arange(1, 2 * cols + 1)).reshape(2, cols)
    cache["block_table"] = jnp.asarray(pages, jnp.int32)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, cfg.vocab_size, (2, args.prompt)).astype(np.int32)
    g_jnp, state = nnx.split(models["jnp"])
    g_rec, _ = nnx.split(models["record"])
    g_noisy, _ = nnx.split(models["noisy"])
    for start in range(0, args.prompt, args.chunk):
        n = min(args.chunk, args.prompt - start)
        valid = np.clip(lens - start, 0, n).astype(np.int32)
        tokens = np.zeros((2, args.chunk), np.int32)
        tokens[:, :n] = prompt[:, start : start + n]
        logits, cache = _step(g_jnp, state, cache, jnp.asarray(tokens), jnp.asarray(valid))
    tok = np.asarray(logits).argmax(-1).astype(np.int32)
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    for step in range(max(probe) + 1):
        valid = jnp.asarray([1, 0 if step == 1 else 1], jnp.int32)
        args_ = (state, cache, jnp.asarray(tok[:, None]), valid)
        logits, new_cache = _step(g_jnp, *args_)
        if step in probe:
            # the model on the Mosaic route, twice on the same inputs (the executable is the same at every step)
            runs, records = [], []
            for _ in range(2):
                RECORDS.clear()
                runs.append(np.asarray(_step(g_rec, *args_)[0]))
                jax.effects_barrier()
                records.append(list(RECORDS))
            active = np.asarray(valid) > 0
            ref = np.asarray(logits)[active]
            errs = [rel(r[active], ref) for r in runs]
            print(f"step {step}: model logits on the Mosaic route against jnp's: {errs[0]:.2e} (first run), "
                  f"{errs[1]:.2e} (second); the two runs differ by {rel(runs[0], runs[1]):.2e}")  # fmt: skip
            if args.noise > 0:
                noisy = []
                for seed in range(args.noise_seeds):
                    NOISE["seed"] = seed
                    noisy.append(rel(np.asarray(_step(g_noisy, *args_)[0])[active], ref))
                print(f"step {step}: model logits with jnp's core + {args.noise:g} relative noise, against jnp's: "
                      f"{', '.join(f'{e:.2e}' for e in noisy)} (seeds 0..{args.noise_seeds - 1}; median "
                      f"{np.median(noisy):.2e})")  # fmt: skip
        cache = new_cache
        tok = np.asarray(logits).argmax(-1).astype(np.int32)
        if step not in probe:
            continue
        print(f"step {step}: {len(records[0])} core calls; q_pos {records[0][0]['q_pos'].ravel().tolist()}; "
              f"each layer's output, second run against first: "
              f"{', '.join(f'{rel(b["model_out"], a["model_out"]):.1e}' for a, b in zip(*records))}")  # fmt: skip
        for layer, r in enumerate(records[0]):
            kind = "sliding" if r["rate"] is None else ("csa" if "topk" in r else "hca")
            if args.save:
                np.savez(Path(args.save) / f"step{step}_layer{layer}_{kind}.npz",
                         **{k: (v if isinstance(v, np.ndarray) else np.asarray(-1 if v is None else v))
                            for k, v in r.items()})  # fmt: skip
            out = run_cores(r, on_gpu, not on_gpu)
            ref = np.asarray(out["ref32"], np.float64)
            shapes = f"kv {tuple(r['kv'].shape)}" + (f" entries {tuple(r['entries'].shape)}" if "entries" in r else "")
            line = [f"  layer {layer} {kind:7s} {shapes}"]
            out["in-model"] = r["model_out"]
            for name in ("in-model", "jnp", "triton", "mosaic"):
                if name in out:
                    o = np.asarray(out[name], np.float64)
                    rows = [rel(o[b], ref[b]) for b in range(o.shape[0])]
                    line.append(f"{name} {rel(o, ref):.2e} (rows {', '.join(f'{e:.1e}' for e in rows)})")
            if "mosaic" in out:
                o = np.asarray(out["mosaic"], np.float64)
                err = np.linalg.norm(o - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)  # [B,S,H]
                b, s_, h = np.unravel_index(np.argmax(err), err.shape)
                line.append(f"worst mosaic (row {b}, head {h}) {err.max():.2e}")
            if "whole" in out:
                line.append(f"whole {out['whole']}")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
