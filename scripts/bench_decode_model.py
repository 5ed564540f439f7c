"""The model's decode step at long context, by cache format and decode route, from one prefilled cache.

    PYTHONPATH=. python3 scripts/bench_decode_model.py --contexts 128k,512k --out $OUT/dm     # one H200
    PYTHONPATH=. python3 scripts/bench_decode_model.py --small --contexts 600 --steps 3       # CPU smoke (interpreted)
    PYTHONPATH=. python3 scripts/bench_decode_model.py --contexts 128k --batch 32 --formats fp8-channel --routes jnp \
        --decode-steps 1,4,8 --vocab 129280 --steps 16 --rounds 9 --out $OUT/bursts                   # one H200
    PYTHONPATH=. python3 scripts/bench_decode_model.py --small --contexts 600 --routes jnp --decode-steps 1,4 \
        --steps 4 --rounds 1 --burst-forms loop,fixed,unrolled                                     # CPU smoke

Routes (one jitted `forward_chunk` each, the same weights, each from its own copy of the same prefilled cache; each
a model built with its own `dsv4.Kernels` value, `ROUTE_KERNELS`; the MoE on XLA's (moe="jnp") except in auto):
    kernel  Kernels(attention="pallas", decode="pallas", kv_write="pallas"): a one-token step runs
            `dsv4.pallas.decode.paged_decode_attention` on the cache itself (bf16 rows; or FP8 ones as stored, e4m3
            nope channels beside bf16 RoPE channels);
    dense   as kernel with decode="jnp": every stored row of the ring and the compressed pool is dequantized into
            a dense copy, then the jnp core runs a one-token chunk over it (writes still by the kv_write kernel);
    jnp     Kernels(attention="jnp", decode="jnp", kv_write="jnp") (the dense copy, then XLA attention);
    auto    Kernels(), the library's default (`Kernels.resolve` says which of the above a step takes on this
            device);
    jnp-loop  jnp with sinkhorn="jnp": the mHC Sinkhorn as XLA's while loop;
    jnp-dense-index  jnp with paged_indexer="jnp": the CSA indexer's keys read out densely (every listed page
            dequantized into a copy), then scored;
    jnp-triton-index  jnp with paged_indexer="pallas-triton": the CSA indexer's keys scored where the cache stores
            them by the Triton kernel, on every page format;
    jnp-triton-sinkhorn  jnp with sinkhorn="pallas-triton": the mHC Sinkhorn on its Triton kernel (the default
            on Hopper is the Mosaic GPU one).
Every other route's CSA indexer takes `Kernels.paged_indexer`'s default: on a GPU it scores its keys where the
cache stores them (`dsv4.pallas.indexer_paged`; bf16 pages on Hopper by `indexer_paged_mgpu`'s Mosaic kernel).

Model: tests/test_gpu_decode.py's (V4-Flash attention shapes: 64 heads x 512, window 128, CSA 4:1 with a
64 x 128 indexer keeping 512, HCA 128:1; narrow residual stream, few experts; layers sliding, CSA, HCA), bf16,
random weights. `--batch` requests of `ctx`, ctx - 333, ... tokens, prefilled in 8K chunks on the kernel route, in
256-token pages of a permuted block table. Each route first runs step 0 (it compiles) from its own copy of the
prefilled cache; the logits' relative L2 distance from the kernel route's there is the table's last column. Then
`--rounds` rounds, each timing every route in turn over `--steps` steps dispatched back to back (fixed random tokens,
the same for every route; no host round trip between steps), the route's own cache carried on: ms / step is the
median over rounds, and "host ms / step" the median time the host took to hand the steps to the runtime (where it
is close to ms / step, the step waits on its dispatch, not on the GPU). Each step is called as `dsv4.runner`
calls it, the GraphDef closed over and the weights a flat list; `--calling static` adds each route called with the
GraphDef a static argument (hashed every call) and the nnx State a pytree (flattened every call) as ROUTE:static, and
`--calling opts` each route closed over and compiled with `--compiler-options` as ROUTE:opts, `--calling donate`
each route closed over with the last step's logits donated to the next (so the output's address stays put) as
ROUTE:donate; `--same-tokens` feeds one token array to every step (so the input's address stays put too). Each
step donates its cache, as the engine's does (`dsv4.runner`), so a step's time holds no copy
of the cache. `--trace DIR` profiles each route's steps once more and prints, per step, the GPU's busy time against
the wall time and the kernels that take the most of it (`trace_overlap.kernel_table`).

`--decode-steps 1,4,8` adds the engine's decode loop per token, k steps a call, on `--burst-route`'s model (default
auto, the engine's), each k from its own copy of the prefilled cache, through the runner's own jitted calls
(`dsv4.runner._Programs`): k = 1 is `LLM`'s single step (the packed `[batch, 1]` call, the logits fetched, each row
sampled on the host by `dsv4.generate.sample`, the tokens fed back, as the engine did; row "1 (device)": its single
step as it is, each token drawn on the device, `dsv4.generate.pick_rows` with its sampling mode decided on the host,
only each row's token and NaN / +inf count fetched; row "1 (device-cond)": the same with the mode decided on the
device by conditionals), k > 1 its decode burst (one call of k steps sampling on the device,
`ModelRunner.execute_burst`; only the tokens come back). Per token, medians over rounds:
ms / token (the wall time: TPOT at this batch), dispatch ms / token (the host handing the calls to the runtime) and
host sampling ms / token (fetching the ready logits and sampling them: k = 1 only). `--burst-forms
loop,fixed,unrolled` times each way a burst's steps can run (`dsv4.runner.BURST_FORMS`: XLA's while loop of max(steps)
iterations, the loop with its trip count fixed at k, or the k steps unrolled), one row each. `--vocab 129280` gives the
model V4's vocabulary, so k = 1 fetches and samples logits of the real size. The greedy tokens of every k are compared
with the smallest k's (the same cache, the same first tokens): "tokens = smallest k's" is the fraction equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4  # noqa: E402
from dsv4.config import Config  # noqa: E402
from dsv4.kernels import Kernels  # noqa: E402
from dsv4.model import DeepseekV4  # noqa: E402
from dsv4.runner import BURST_FORMS  # noqa: E402

_KERNEL = Kernels(attention="pallas", decode="pallas", kv_write="pallas", moe="jnp")
_JNP = Kernels(attention="jnp", decode="jnp", kv_write="jnp", moe="jnp")
ROUTE_KERNELS = {
    "kernel": _KERNEL,
    "dense": dataclasses.replace(_KERNEL, decode="jnp"),
    "jnp": _JNP,
    "auto": Kernels(),
    "jnp-loop": dataclasses.replace(_JNP, sinkhorn="jnp"),
    "jnp-dense-index": dataclasses.replace(_JNP, paged_indexer="jnp"),
    "jnp-triton-index": dataclasses.replace(_JNP, paged_indexer="pallas-triton"),
    "jnp-triton-sinkhorn": dataclasses.replace(_JNP, sinkhorn="pallas-triton"),
}
ROUTES = tuple(ROUTE_KERNELS)


def config(small: bool, repeats: int = 1, vocab: int = 1024) -> Config:
    """The benchmark's model (tests/test_gpu_decode.py's); repeats: the (sliding, CSA, HCA) pattern that many times
    (3 · repeats layers)."""
    heads, head_dim, idx_heads, idx_dim, topk = (4, 64, 4, 32, 16) if small else (64, 512, 64, 128, 512)
    return Config.from_hf({
        "vocab_size": vocab, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 3 * repeats,
        "num_attention_heads": heads, "head_dim": head_dim, "q_lora_rank": 256, "qk_rope_head_dim": 16 if small else 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 128,
        "index_n_heads": idx_heads, "index_head_dim": idx_dim, "index_topk": topk, "sliding_window": 128,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * repeats,
        "mlp_layer_types": ["moe"] * 3 * repeats, "max_position_embeddings": 1 << 20,
    })  # fmt: skip


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def parse_length(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def make_step(graph=None, state_def=None, compiler_options=None, donate_logits=False):
    """A fresh jitted step (its own trace cache) that donates its cache, as `dsv4.runner`'s does. Which kernels it
    runs is the route's GraphDef's (its model's `Kernels`).

    graph None: step(graphdef, state, cache, tokens, valid), the GraphDef a static argument and the nnx State a
    pytree, so every call hashes the one and flattens the other. Otherwise step(leaves, cache, tokens, valid) closes
    over `graph` and `state_def` (the treedef of the state) and takes the weights as a flat list, as
    `dsv4.runner._Programs` does; compiler_options: XLA options for that jit (`jax.jit(compiler_options=...)`);
    donate_logits: step(leaves, cache, tokens, valid, logits_in) donates the last step's logits too, so that the new
    logits take their buffer (a stable output address)."""
    if graph is None:

        def step(graphdef, state, cache, tokens, valid):
            return nnx.merge(graphdef, state).forward_chunk(cache, tokens, valid)

        jitted = jax.jit(step, donate_argnums=2)
    else:

        def step(leaves, cache, tokens, valid, *logits_in):  # logits_in: only to be donated, never read
            return nnx.merge(graph, jax.tree.unflatten(state_def, leaves)).forward_chunk(cache, tokens, valid)

        donate = (1, 4) if donate_logits else 1
        jitted = jax.jit(step, donate_argnums=donate, compiler_options=compiler_options)
    return jitted


def trace_steps(route, call, cache, feed, trace_dir, top=14):
    """The route's steps once more (back to back, as timed) under `jax.profiler.trace`; prints the GPU's busy time
    (the union of its kernels), the kernels' first-to-last span and the wall time, each per step, the kernels
    that take the most GPU time, and the host's events that take the most host time (`trace_overlap.host_table`).
    → dict of those (and "cache": the route's cache after the steps)."""
    from trace_overlap import host_table, kernel_table

    jax.block_until_ready(cache)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t = time.perf_counter()
        for tok in feed:
            out, cache = call(cache, tok)
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t) / len(feed)
    n = len(feed)
    try:
        table, host = kernel_table(trace_dir), host_table(trace_dir)
    except FileNotFoundError as exc:
        print(f"  {route} trace: {exc}", flush=True)
        return dict(cache=cache)
    host = sorted(((k, v) for k, v in host.items() if not k.startswith("$")),  # "$...": Python frames
                  key=lambda kv: -kv[1][0])  # fmt: skip
    result = dict(cache=cache, wall_us=wall * 1e6, host=[(name, total / n, count / n)
                                                          for name, (total, count, _) in host[:60]])  # fmt: skip
    if not table:
        print(f"  {route} trace: no GPU kernels (CPU run?)", flush=True)
    else:
        gpu = table[sorted(table)[0]]
        kernels = sorted(gpu["kernels"].items(), key=lambda kv: -kv[1][0])
        busy, span = gpu["busy_us"] / n, gpu["span_us"] / n
        print(f"  {route} trace: per step GPU busy {busy:.1f} us, kernel span {span:.1f} us, wall {wall * 1e6:.1f} us "
              f"(under the profiler); {sum(c for _, c in gpu['kernels'].values()) / n:.0f} kernels a step",
              flush=True)  # fmt: skip
        for name, (total, count) in kernels[:top]:
            print(f"      {total / n:9.1f} us {count / n:5.1f}x  {name[:100]}", flush=True)
        result.update(busy_us=busy, span_us=span,
                      kernels=[(name, total / n, count / n) for name, (total, count) in kernels[:40]])  # fmt: skip
    print(f"    {route} host events per step (nested events each counted):", flush=True)
    for name, (total, count, threads) in host[: top + 6]:
        print(f"      {total / n:9.1f} us {count / n:6.1f}x  {name[:90]}  [{len(threads)} thread(s)]", flush=True)
    return result


def bench_bursts(ctx, batch, kv_format, args, cache, first, state_def, state_leaves, graph):
    """The engine's decode loop, k steps a call, for each k of args.decode_steps (see the module docstring), from
    copies of the prefilled `cache` and the first tokens `first` [batch, 1]. → table rows."""
    from dsv4.generate import DevicePick, SamplingParams, device_sampling_arrays, pick_rows, sample, sampling_mode
    from dsv4.runner import _programs

    programs = _programs(graph, state_def, None)
    table = np.asarray(cache.block_table)  # passed every call, as the runner passes its host mirror
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    arrays = device_sampling_arrays([params] * batch)
    mode = sampling_mode(*arrays[:3])
    unit = math.lcm(*args.decode_steps)
    n_tokens = -(-args.steps // unit) * unit  # every k makes the same tokens
    valid, first = np.ones((batch,), np.int32), np.asarray(first)[:, 0].astype(np.int32)
    rows, greedy = [], {}
    for k in args.decode_steps:
        for form in ["loop", "device", "device-cond"] if k == 1 else args.burst_forms:
            c = jax.tree.map(jnp.copy, cache)
            rngs = [np.random.default_rng(i) for i in range(batch)]
            steps = np.full((batch,), k, np.int32)

            def run(c, tokens, k=k, form=form, steps=steps, rngs=rngs):
                """n_tokens tokens per request, k a call → (cache, tokens made, dispatch s, host sampling s)."""
                made, dispatch, sampling = [], 0.0, 0.0
                for _ in range(n_tokens // k):
                    t = time.perf_counter()
                    if k == 1:
                        logits, c = programs.packed_step(state_leaves, c, tokens[:, None], valid, table)
                        t1 = time.perf_counter()
                        jax.block_until_ready(logits)
                        t2 = time.perf_counter()
                        if form != "loop":  # the engine's step: tokens drawn on the device come back
                            at = np.full((batch,), ctx + len(made), np.int32)  # the tokens' positions
                            how = mode if form == "device" else None
                            picks, bad = (np.asarray(x) for x in pick_rows(logits, *arrays, at, 0, how))
                            tokens = np.array([sample(DevicePick(int(t), int(b), logits.shape[-1]), params, rng)
                                               for t, b, rng in zip(picks, bad, rngs)], np.int32)  # fmt: skip
                        else:
                            host = np.asarray(logits)  # the engine's fetch, then its per-request sampling
                            tokens = np.array([sample(row, params, rng) for row, rng in zip(host, rngs)], np.int32)
                        sampling += time.perf_counter() - t2
                        made.append(tokens[None])
                    else:
                        out, c = programs.decode_burst(state_leaves, c, tokens, steps, table, *arrays, k, 0,
                                                       form)  # fmt: skip
                        t1 = time.perf_counter()
                        burst = np.asarray(out["tokens"])  # [k, batch]: all that comes back
                        tokens = burst[-1]
                        made.append(burst)
                    dispatch += t1 - t
                return c, np.concatenate(made), dispatch, sampling

            t = time.perf_counter()
            c, made, _, _ = run(c, first)  # compiles
            compile_s = time.perf_counter() - t
            name = f"{k}" if form == "loop" else f"{k}:{form}"
            # the smallest k runs first; greedy, every k makes its tokens from the same cache and first tokens
            reference = greedy.setdefault("smallest", made)
            same = float(np.mean(made == reference)) if args.temperature == 0 else None
            times, dispatch, sampling = [], [], []
            last = made[-1]
            for _ in range(args.rounds):
                jax.block_until_ready(c)
                t = time.perf_counter()
                c, made, d, h = run(c, last)
                times.append((time.perf_counter() - t) / n_tokens)
                dispatch.append(d / n_tokens)
                sampling.append(h / n_tokens)
                last = made[-1]
            del c
            row = dict(ctx=ctx, batch=batch, cache=kv_format, route=args.burst_route, decode_steps=k, form=form,
                       ms_per_token=statistics.median(times) * 1e3, dispatch_ms_per_token=statistics.median(dispatch)
                       * 1e3, sampling_ms_per_token=statistics.median(sampling) * 1e3, compile_s=compile_s,
                       tokens_equal_smallest_k=same, rounds_ms_per_token=[x * 1e3 for x in times])  # fmt: skip
            rows.append(row)
            print(f"  decode steps {name:11s} {row['ms_per_token']:8.3f} ms / token, dispatch "
                  f"{row['dispatch_ms_per_token']:.3f}, host sampling {row['sampling_ms_per_token']:.3f} ms / token "
                  f"(first call with its compile {compile_s:.1f} s)", flush=True)  # fmt: skip
    return rows


def bench_one(cfg, ctx, batch, kv_format, args, model, graphs):
    """model: the weights (the kernel route's model); graphs: route → GraphDef of the route's model."""
    lens = np.array([ctx - 333 * i for i in range(batch)])
    burst_tokens = -(-args.steps // math.lcm(*args.decode_steps)) * math.lcm(*args.decode_steps)
    page_tokens, max_len = 256, ctx + 1 + (args.rounds + 1) * max(args.steps, burst_tokens) + 256
    cols = -(-max_len // page_tokens)
    cache = model.init_cache(batch, max_len=max_len, kv_format=kv_format, page_tokens=page_tokens,
                             num_pages=batch * cols + 1)  # fmt: skip
    pages = np.random.default_rng(1).permutation(np.arange(1, batch * cols + 1)).reshape(batch, cols)
    cache = cache.replace(block_table=jnp.asarray(pages, jnp.int32))
    cache = jax.device_put(cache, jax.devices()[0])
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (batch, ctx)).astype(np.int32)
    state = nnx.split(model)[1]
    prefill = make_step()
    t0 = time.perf_counter()
    for start in range(0, ctx, args.chunk):
        n = min(args.chunk, ctx - start)
        tokens = np.zeros((batch, args.chunk), np.int32)
        tokens[:, :n] = prompt[:, start : start + n]
        valid = np.clip(lens - start, 0, n).astype(np.int32)
        logits, cache = prefill(graphs["kernel"], state, cache, jnp.asarray(tokens), jnp.asarray(valid))
    jax.block_until_ready(logits)
    print(f"  prefill {ctx} x {batch} ({kv_format}): {time.perf_counter() - t0:.1f} s", flush=True)
    first = jnp.asarray(np.asarray(logits).argmax(-1).astype(np.int32)[:, None])
    ones = jnp.ones((batch,), jnp.int32)
    # Steps 1.. feed fixed random tokens, the same for every route (the time does not depend on which).
    feed = [jnp.asarray(t) for t in np.random.default_rng(3).integers(0, cfg.vocab_size, (args.steps, batch, 1),
                                                                      dtype=np.int32)]  # fmt: skip
    if args.same_tokens:  # one array for every step: its device address does not change between steps
        feed = [feed[0]] * len(feed)
    state_leaves, state_def = jax.tree.flatten(state)
    rows = []
    if args.decode_steps:  # each k from its own copy of the cache, released before the routes' copies are made
        rows += bench_bursts(ctx, batch, kv_format, args, cache, first, state_def, state_leaves,
                             graphs[args.burst_route])  # fmt: skip
    variants = [route if calling == "closed" else f"{route}:{calling}" for route in args.routes
                for calling in args.calling]  # fmt: skip
    calls, caches, step0, compile_s = {}, {}, {}, {}
    for name in variants:  # step 0 (compiles) from the same cache: the logits compared across routes
        route, _, calling = name.partition(":")
        if calling == "static":
            step = make_step()
            calls[name] = lambda c, tok, step=step, graph=graphs[route]: step(graph, state, c, tok, ones)
        else:
            options = args.compiler_options if calling == "opts" else None
            step = make_step(graph=graphs[route], state_def=state_def, compiler_options=options,
                             donate_logits=calling == "donate")  # fmt: skip
            if calling == "donate":
                held = {"out": jnp.zeros(logits.shape, logits.dtype)}  # the last step's logits, donated to the next

                def donating(c, tok, step=step, held=held):
                    out, c = step(state_leaves, c, tok, ones, held.pop("out"))
                    held["out"] = out
                    return out, c

                calls[name] = donating
            else:
                calls[name] = lambda c, tok, step=step: step(state_leaves, c, tok, ones)
        t = time.perf_counter()
        out, caches[name] = calls[name](jax.tree.map(jnp.copy, cache), first)
        step0[name], compile_s[name] = np.asarray(out, np.float32), time.perf_counter() - t
    del cache
    times = {name: [] for name in variants}
    host = {name: [] for name in variants}
    last = {}  # each variant's logits after its last round: every variant ran the same tokens from the same cache
    for _ in range(args.rounds):  # routes interleaved, so drift (clocks, other work) reaches them all alike
        for name in variants:
            call, c = calls[name], caches[name]
            jax.block_until_ready(c)
            t = time.perf_counter()
            for tok in feed:  # dispatched back to back, as a serving loop that keeps tokens on the device would
                out, c = call(c, tok)
            dispatched = time.perf_counter()  # the host's part: every step handed to the runtime
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / args.steps)
            host[name].append((dispatched - t) / args.steps)
            caches[name], last[name] = c, out
    traces = {}
    if args.trace:  # where a step's time goes: each route's --steps steps once more, under the profiler
        for name in variants:
            traces[name] = trace_steps(name, calls[name], caches[name], feed,
                                       f"{args.trace}/{ctx}_{batch}_{kv_format}_{name.replace(':', '_')}")  # fmt: skip
            caches[name] = traces[name].pop("cache")
    base = "kernel" if "kernel" in variants else variants[0]
    for name in variants:
        ms, host_ms = statistics.median(times[name]) * 1e3, statistics.median(host[name]) * 1e3
        err = rel_err(step0[name], step0[base])
        spread = (max(times[name]) - min(times[name])) * 1e3
        route = name.partition(":")[0]  # a ROUTE:calling variant's last logits against the closed call's
        same = rel_err(np.asarray(last[name], np.float32), np.asarray(last[route], np.float32)) if (
            route != name and route in last) else None  # fmt: skip
        rows.append(dict(ctx=ctx, batch=batch, cache=kv_format, route=name, ms=ms, host_ms=host_ms,
                         rounds_ms=[x * 1e3 for x in times[name]], rounds_host_ms=[x * 1e3 for x in host[name]],
                         compile_s=compile_s[name], step0_rel_err=err, last_vs_closed=same,
                         trace=traces.get(name)))  # fmt: skip
        print(f"  {name:15s} {ms:8.2f} ms / step, host {host_ms:.2f} ms / step (rounds spread {spread:.2f} ms; step 0 "
              f"with its compile {compile_s[name]:.1f} s), step 0 logits vs {base} {err:.2e}"
              + ("" if same is None else f"; last logits vs {route} {same:.2e}"), flush=True)  # fmt: skip
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="128k,512k")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--formats", default="fp8-channel,bf16", help="cache formats (dsv4.cache.layout.FORMAT_NAMES)")
    p.add_argument("--routes", default=",".join(ROUTES), help=f"subset of {ROUTES}")
    p.add_argument("--steps", type=int, default=10, help="timed steps a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each times every route, in turn)")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--calling", default="closed", help="how each step is called, comma-separated: closed (the "
                   "runner's: the GraphDef closed over, the weights a flat list), static (the GraphDef a static "
                   "argument, hashed every call; the State flattened every call), opts (closed, compiled with "
                   "--compiler-options), donate (closed, the last logits donated to the next step); rows other "
                   "than closed are named ROUTE:CALLING")  # fmt: skip
    p.add_argument("--compiler-options", default="", help="KEY=VALUE;... XLA options (as in XLA_FLAGS, without "
                   "the dashes) for the steps of --calling opts")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1, help="the model's (sliding, CSA, HCA) layers this many times: "
                   "3 layers leave the step host-bound (docs/BENCHMARKS.md), more put the GPU's work above the "
                   "host's")  # fmt: skip
    p.add_argument("--same-tokens", action="store_true", help="feed every step the same token array")
    p.add_argument("--small", action="store_true", help="4 heads x 64 (CPU smoke)")
    p.add_argument("--out", default=None, help="write the rows as JSON to OUT.json")
    p.add_argument("--trace", default=None, help="profile each route's steps once more (jax.profiler) into this "
                   "directory; print where a step's GPU time goes")  # fmt: skip
    p.add_argument("--decode-steps", default="", help="also time the engine's decode loop with k decode steps a "
                   "call for each k, e.g. 1,4,8 (k = 1: LLM's single step, with host sampling and as it is, "
                   "drawing on the device; k > 1: its decode burst); greedy tokens compared with the smallest "
                   "k's")  # fmt: skip
    p.add_argument("--burst-route", default="auto", help=f"the route of --decode-steps, one of {ROUTES} (default "
                   "auto: the engine's)")  # fmt: skip
    p.add_argument("--burst-forms", default="loop", help="how each burst's steps run, comma-separated, of "
                   f"{BURST_FORMS} (dsv4.runner.BURST_FORMS; default loop, the engine's)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="sampling of --decode-steps (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling of --decode-steps (default 1: off)")
    p.add_argument("--vocab", type=int, default=1024, help="the model's vocabulary (129280: V4's, so the single "
                   "step fetches and samples logits of the real size; default 1024)")  # fmt: skip
    args = p.parse_args()
    args.decode_steps = sorted({int(k) for k in args.decode_steps.split(",") if k.strip()})
    if any(k < 1 for k in args.decode_steps):
        p.error(f"--decode-steps must be positive, got {args.decode_steps}")
    if args.burst_route not in ROUTES:
        p.error(f"--burst-route must be one of {ROUTES}, got {args.burst_route!r}")
    args.burst_forms = [f.strip() for f in args.burst_forms.split(",") if f.strip()]
    if not args.burst_forms or any(f not in BURST_FORMS for f in args.burst_forms):
        p.error(f"--burst-forms must name some of {BURST_FORMS}; got {args.burst_forms}")
    args.routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    if any(r not in ROUTES for r in args.routes):
        p.error(f"--routes must name some of {ROUTES}, got {args.routes}")
    args.calling = [c.strip() for c in args.calling.split(",") if c.strip()]
    if not args.calling or any(c not in ("closed", "static", "opts", "donate") for c in args.calling):
        p.error(f"--calling must name some of closed, static, opts, donate; got {args.calling}")
    args.compiler_options = dict(kv.split("=", 1) for kv in args.compiler_options.split(";") if kv.strip())
    if "opts" in args.calling and not args.compiler_options:
        p.error("--calling opts needs --compiler-options")
    cfg = config(args.small, args.repeats, args.vocab)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, batch {args.batch}, steps {args.steps}, "
          f"{cfg.num_hidden_layers} layers", flush=True)  # fmt: skip
    model = dsv4.init_random(cfg, seed=0, dtype=jnp.bfloat16, kernels=ROUTE_KERNELS["kernel"])
    # every route's GraphDef over the same weights (the Kernels value changes no parameter)
    graphs = {route: nnx.split(nnx.eval_shape(lambda k=k: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                                     kernels=k)))[0]
              for route, k in ROUTE_KERNELS.items() if route in {"kernel", args.burst_route, *args.routes}}  # fmt: skip
    for route in args.routes:
        print(f"  {route}: {ROUTE_KERNELS[route].resolve(jnp.bfloat16)}", flush=True)
    rows = []
    for ctx in map(parse_length, args.contexts.split(",")):
        for kv_format in args.formats.split(","):
            rows += bench_one(cfg, ctx, args.batch, kv_format.strip(), args, model, graphs)
    bursts = [r for r in rows if "decode_steps" in r]
    if bursts:
        print("\n| ctx | B | cache | route | decode steps a call | ms / token | dispatch ms / token | host sampling "
              "ms / token | vs 1 step a call | tokens = smallest k's |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in bursts:
            one = next((b["ms_per_token"] for b in bursts if b["decode_steps"] == 1 and b["ctx"] == r["ctx"]
                        and b["cache"] == r["cache"]), None)  # fmt: skip
            steps = f"{r['decode_steps']}" + ("" if r["form"] == "loop" else f" ({r['form']})")
            same = "-" if r["tokens_equal_smallest_k"] is None else f"{r['tokens_equal_smallest_k']:.0%}"
            speedup = "-" if one is None else f"{one / r['ms_per_token']:.2f}x"
            head = f"| {r['ctx']} | {r['batch']} | {r['cache']} | {r['route']} | {steps}"
            times = f"{r['ms_per_token']:.3f} | {r['dispatch_ms_per_token']:.3f} | {r['sampling_ms_per_token']:.3f}"
            print(f"{head} | {times} | {speedup} | {same} |")
    routes = [r for r in rows if "decode_steps" not in r]
    print("\n| ctx | B | cache | route | ms / step | host ms / step | vs kernel | step 0 logits rel L2 vs kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in routes:
        kernel = next((k["ms"] for k in routes if k["route"] == "kernel" and k["ctx"] == r["ctx"]
                       and k["cache"] == r["cache"]), None)  # fmt: skip
        ratio = f"{r['ms'] / kernel:.2f}x" if kernel else "-"
        print(f"| {r['ctx']} | {r['batch']} | {r['cache']} | {r['route']} | {r['ms']:.2f} | {r['host_ms']:.2f} | "
              f"{ratio} | {r['step0_rel_err']:.2e} |")  # fmt: skip
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                                                            rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
