"""Host time of a decode step's call into the model, by how the weights reach the jitted function (CPU is enough).

    PYTHONPATH=. python3 scripts/bench_runner_host.py                  # 3 and 43 layers, tiny widths (~2 min)
    PYTHONPATH=. python3 scripts/bench_runner_host.py --layers 3 --steps 10

`dsv4.runner.ModelRunner.execute` waits for the device every step, so the host's time to dispatch a step adds to
every step's latency. Two ways to pass the model, timed side by side on the same model, cache and tokens (one
decode token for each of 2 slots, dense float32 cache, V4 layer mix at tiny widths, so that the device work is small
and the host's part shows):

    static    jit(step, static_argnums=0)(graphdef, state, cache, ...): the nnx GraphDef is a static argument (hashed
              on every call) and the nnx State a pytree (flattened on every call);
    closure   as the runner calls it (`dsv4.runner._Programs`): the GraphDef and the state's treedef closed over,
              the weights passed as a flat list of arrays.

Also: `hash(graphdef)` and `jax.tree.flatten(state)` alone, and a whole `execute` of a one-token plan. Medians of
--steps calls, each waited for.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4  # noqa: E402
from dsv4.config import Config  # noqa: E402
from dsv4.runner import ModelRunner  # noqa: E402
from dsv4.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402


def tiny_config(layers: int) -> Config:
    """V4-Flash's layer mix (2 sliding, then CSA / HCA alternating) at tiny widths."""
    types = (["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * layers)
    return Config.from_hf({
        "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": layers,
        "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 32, "qk_rope_head_dim": 16,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16, "sliding_window": 16,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "layer_types": types[:layers], "mlp_layer_types": ["moe"] * layers, "max_position_embeddings": 1 << 16,
    })  # fmt: skip


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _static_step(graphdef, state, cache, token_ids, valid):
    return nnx.merge(graphdef, state).forward_chunk(cache, token_ids, valid)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="3,43")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; medians of {args.steps} calls", flush=True)
    rows = []
    for n in (int(x) for x in args.layers.split(",")):
        model = dsv4.init_random(tiny_config(n), seed=0, dtype=jnp.float32, kernels=dsv4.Kernels.all("jnp"))
        runner = ModelRunner(model, max_slots=2, max_model_len=256, kv_format=jnp.float32, width_buckets=(1, 8),
                             max_packed_width=8)  # fmt: skip
        runner.execute(SchedulerOutput([ScheduledChunk("a", 0, 8, tuple(range(8)), (), True)]))
        graphdef, state = runner.graphdef, runner.state
        tokens, valid = jnp.full((2, 1), 5, jnp.int32), jnp.array([1, 0], jnp.int32)
        box = {"cache": runner.cache}

        def static():
            logits, box["cache"] = _static_step(graphdef, state, box["cache"], tokens, valid)
            return logits

        def closure():
            logits, box["cache"] = runner._programs.packed_step(runner._weights, box["cache"], tokens, valid, None)
            return logits

        for fn in (static, closure):  # compile
            jax.block_until_ready(fn())
        row = dict(layers=n, leaves=len(runner._weights))
        for _ in range(2):  # interleaved twice; the second pair is kept
            row["static_ms"] = median_ms(static, args.steps)
            row["closure_ms"] = median_ms(closure, args.steps)
        row["hash_ms"] = median_ms(lambda: hash(graphdef), args.steps)
        row["flatten_ms"] = median_ms(lambda: jax.tree.flatten(state)[0][0], args.steps)
        runner.cache = box["cache"]
        pos = [8]

        def execute():
            out = runner.execute(SchedulerOutput([ScheduledChunk("a", pos[0], 1, (5,), (), True)]))
            pos[0] += 1
            return out["a"]

        row["execute_ms"] = median_ms(execute, args.steps)
        rows.append(row)
        print(f"  {n} layers done", flush=True)
    print("\n| layers | weight arrays | static GraphDef call, ms | closure call, ms | static / closure | "
          "hash(GraphDef), ms | flatten(State), ms | execute (closure), ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layers']} | {r['leaves']} | {r['static_ms']:.2f} | {r['closure_ms']:.2f} | "
              f"{r['static_ms'] / r['closure_ms']:.2f}x | {r['hash_ms']:.2f} | {r['flatten_ms']:.2f} | "
              f"{r['execute_ms']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
