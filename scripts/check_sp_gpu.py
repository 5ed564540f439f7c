#!/usr/bin/env python3
"""Layer-by-layer agreement of the multi-device model variants with the 1-device model, on the real V4-Flash widths.

    python3 scripts/check_sp_gpu.py --length 16k          # 2 H200s (kind nvidia-h200-x2)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python3 scripts/check_sp_gpu.py --smoke

`bench_ttft_sp.py` compares only the last token's logits of its runs; this script finds WHERE two variants part.
Model: bench_ttft's (3 layers sliding / CSA / HCA, bf16, random weights drawn on device 0). Reference: one device,
attention_impl="jnp", indexer and MoE Pallas. Each layer of each variant gets the reference's input streams for
that layer (teacher forcing, so errors do not compound) and its update (output − input) is compared with the
reference's: relative L2 over all tokens, and over the first / last shard's tokens. Variants:
    1dev-auto             one device, the Pallas / Mosaic attention kernels (bench_ttft's (3))
    Ndev-sp-split         N devices, jnp SP core, experts split (expert parallelism)
    Ndev-sp-pallas-split  N devices, the Triton kernel per shard, experts split
    Ndev-sp-pallas-repl   N devices, the Triton kernel per shard, experts replicated
A bf16 model's variants differ by rounding (~1e-2 relative); a bug shows as O(1). Each variant also runs the
free-running chain (its own outputs feed the next layer) and its last-token logits are compared with every variant
run before it, the 1-device jnp reference included: that is the number `bench_ttft_sp.py` prints, and it shows how
far rounding alone moves one token's logits through 3 layers of discrete choices (top-k, routing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_SMOKE = "--smoke" in sys.argv
if not _SMOKE:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_ttft import build_model_on_device, default_mix, with_layers  # noqa: E402
from bench_ttft_sp import _nothing, parse_len, place  # noqa: E402

from dsv4.config import Config  # noqa: E402
from dsv4.model import DeepseekV4  # noqa: E402
from dsv4.sharding import SEQUENCE_ONLY, SEQUENCE_PARALLEL, SEQUENCE_PARALLEL_ZIGZAG, make_mesh, use_mesh  # noqa: E402
from dsv4.sharding.context_parallel import zigzag_permute  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float32), b.astype(np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", default="16k")
    p.add_argument("--variants", default="1dev-auto,sp-split,sp-pallas-split,sp-pallas-repl,sp-pallas-zigzag",
                   help="which of the variants to run (the N-device ones without the 'Ndev-' prefix; -split: experts "
                        "split, -repl: replicated, -zigzag: experts split, the sequence in zigzag order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    s = 128 if args.smoke else parse_len(args.length)  # zigzag: 2N blocks of whole compressor windows
    dtype = F32 if args.smoke else BF16
    cfg = with_layers(Config.preset("tiny" if args.smoke else "v4-flash"), default_mix(3))
    n_dev = len(jax.devices())
    print(f"jax {jax.__version__}, {n_dev} × {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"S={s}", flush=True)  # fmt: skip
    model, _ = build_model_on_device(cfg, args.seed, dtype)
    _, state = nnx.split(model)
    del model

    def graphdef(attention, indexer="pallas", moe="pallas"):
        abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype, attention_impl=attention,
                                                     indexer_impl=indexer, moe_impl=moe))  # fmt: skip
        return nnx.split(abstract)[0]

    ids = jax.random.randint(jax.random.key(args.seed + 1), (1, s), 0, cfg.vocab_size, jnp.int32)
    positions = jnp.arange(s, dtype=jnp.int32)[None]

    def last_logits(model, streams):
        h = model.norm(model.hc_head(streams[:, -1:]))[:, 0]
        return jnp.einsum("bd,vd->bv", h, model.lm_head["weight"][...], preferred_element_type=F32)

    def layer_outputs(gd, st, mesh, rules, inputs):
        """Each layer's output given `inputs[l]` (host arrays) as its input. → list of host arrays. Under a zigzag
        layout the inputs, positions and ids are permuted into zigzag order and the outputs back."""
        model = nnx.merge(gd, st)
        outs = []
        seq = None if mesh is None else NamedSharding(mesh, P(None, "sp"))
        n_zig = mesh.shape["sp"] if mesh is not None and rules.seq_order == "zigzag" else 0
        to_zig = (lambda a: np.asarray(zigzag_permute(jnp.asarray(a), n_zig))) if n_zig else (lambda a: a)  # noqa: E731
        from_zig = (lambda a: np.asarray(zigzag_permute(jnp.asarray(a), n_zig, inverse=True))) if n_zig else (lambda a: a)  # noqa: E731,E501
        put = (lambda a: jnp.asarray(a)) if seq is None else (lambda a: jax.device_put(to_zig(np.asarray(a)), seq))  # noqa: E731
        with use_mesh(mesh, rules) if mesh is not None else _nothing():
            pos, tok = put(positions), put(ids)
            for layer, x in zip(model.layers, inputs):
                g, lst = nnx.split(layer)
                out = jax.jit(lambda st_, x_, p_, t_, g=g: nnx.merge(g, st_)(x_, p_, t_))(lst, put(x), pos, tok)
                outs.append(from_zig(np.asarray(jax.device_get(out))))
                del out
            # The free-running chain (each layer on the variant's own previous output) and its last-token logits.
            x = put(inputs[0])
            for layer in model.layers:
                g, lst = nnx.split(layer)
                x = jax.jit(lambda st_, x_, p_, t_, g=g: nnx.merge(g, st_)(x_, p_, t_))(lst, x, pos, tok)
            last = from_zig(np.asarray(jax.device_get(x)))[:, -1:]
            logits = np.asarray(jax.device_get(jax.jit(last_logits)(model, last)))
        return outs, logits

    # The reference chain: one device, jnp attention core.
    ref_model = nnx.merge(graphdef("jnp"), state)
    x = jnp.broadcast_to(ref_model.embed_tokens["weight"][...][ids][:, :, None, :],
                         (1, s, cfg.hc_mult, cfg.hidden_size))  # fmt: skip
    inputs, ref_out = [], []
    for layer in ref_model.layers:
        inputs.append(np.asarray(jax.device_get(x)))
        g, lst = nnx.split(layer)
        x = jax.jit(lambda st_, x_, g=g: nnx.merge(g, st_)(x_, positions, ids))(lst, x)
        ref_out.append(np.asarray(jax.device_get(x)))
    ref_logits = np.asarray(jax.device_get(jax.jit(last_logits)(ref_model, x)))
    del ref_model, x
    half = s // max(n_dev, 1)
    chains = {"1dev-jnp": ref_logits}

    def report(name, result):
        outs, logits = result
        chains[name] = logits
        pairs = ", ".join(f"vs {k} {rel(logits, v):.2e}" for k, v in chains.items() if k != name)
        print(f"  {name:22s} free-running chain, last-token logits rel L2: {pairs}", flush=True)
        # rel L2 of each layer's update (output − input): the residual stream would dilute a wrong update
        for li, (o, r, x) in enumerate(zip(outs, ref_out, inputs)):
            do, dr = o.astype(np.float32) - x.astype(np.float32), r.astype(np.float32) - x.astype(np.float32)
            print(f"  {name:22s} layer {li} ({cfg.layer_types[li][:7]}): update rel L2 {rel(do, dr):.2e}  first "
                  f"shard {rel(do[:, :half], dr[:, :half]):.2e}  last shard {rel(do[:, -half:], dr[:, -half:]):.2e}",
                  flush=True)  # fmt: skip

    wanted = args.variants.split(",")
    if "1dev-auto" in wanted:
        report("1dev-auto", layer_outputs(graphdef("auto"), state, None, None, inputs))
    if n_dev < 2:
        return
    mesh = make_mesh(n_dev)
    for rules, tag in ((SEQUENCE_PARALLEL, "split"), (SEQUENCE_ONLY, "repl"), (SEQUENCE_PARALLEL_ZIGZAG, "zigzag")):
        todo = [a for a in ("sp", "sp-pallas") if f"{a}-{tag}" in wanted]
        if not todo:
            continue
        placed = place(state, mesh, rules)  # in place: the 1-device variant has run already
        for attention in todo:
            try:
                report(f"{n_dev}dev-{attention}-{tag}", layer_outputs(graphdef(attention), placed, mesh, rules, inputs))
            except Exception as exc:  # noqa: BLE001
                print(f"  {n_dev}dev-{attention}-{tag}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del placed


if __name__ == "__main__":
    main()
