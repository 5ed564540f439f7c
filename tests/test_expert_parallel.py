"""Expert parallelism (dsv4/sharding/expert_parallel.py) on 2, 4 and 8 CPU devices, against the dense reference.

The test process has one CPU device, so the runs happen in a subprocess with 8 host devices.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest
from host_devices import host_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, devices: int = 8, timeout: int = 900) -> str:
    env = host_devices_env(devices)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


EP_SCRIPT = """
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv4.moe import routed_experts_jnp, routed_experts_pallas
    from dsv4.pallas.moe import routed_experts_reference
    from dsv4.sharding import make_mesh, use_mesh
    from dsv4.sharding.expert_parallel import routed_experts_ep

    D, I, E, K, LIMIT = 64, 32, 8, 3, 7.0
    IMPLS = {"jnp": routed_experts_jnp, "pallas": routed_experts_pallas}

    def inputs(seed, s, routing):
        k = jax.random.split(jax.random.key(seed), 5)
        x = jax.random.normal(k[0], (1, s, D), jnp.float32)
        if routing == "skewed":  # expert 5 in every token, experts 0, 1, 2 never: empty groups on some shards
            rest = jax.random.choice(k[1], jnp.array([3, 4, 6, 7]), (1, s, 4 * (K - 1)))[..., : K - 1]
            ids = jnp.concatenate([jnp.full((1, s, 1), 5), rest], -1)
        else:
            ids = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:K])(jax.random.split(k[1], s))[None]
        w = jax.random.uniform(k[2], (1, s, K), jnp.float32)
        gu = jax.random.normal(k[3], (E, 2 * I, D), jnp.float32) * 0.2
        dn = jax.random.normal(k[4], (E, D, I), jnp.float32) * 0.2
        return x, ids.astype(jnp.int32), w, gu, dn

    # (devices, local kernels, tokens, chunk, routing, unroll the chunks?, schedule)
    for n, impl, s, chunk, routing, unroll, schedule in [
        (2, "jnp", 37, 5, "uniform", False, "direct"), (4, "jnp", 50, 1000, "skewed", None, "ring"),
        (4, "jnp", 50, 7, "skewed", None, "direct"), (8, "jnp", 3, 4, "uniform", True, "direct"),
        (2, "pallas", 29, 8, "skewed", True, "direct"), (8, "pallas", 41, 3, "uniform", False, "ring"),
    ]:
        x, ids, w, gu, dn = inputs(n * 100 + s, s, routing)
        want = routed_experts_reference(x[0], ids[0], w[0], gu, dn, LIMIT)
        mesh = make_mesh(n)
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        local = lambda *a, f=IMPLS[impl]: f(*a, LIMIT, out_dtype=jnp.float32)
        with use_mesh(mesh):
            args = (x, ids, w, put(gu, P("sp")), put(dn, P("sp")))
            for comm in ("ppermute", "local"):
                fn = jax.jit(lambda *a, comm=comm: routed_experts_ep(local, *a, chunk_tokens=chunk, comm=comm,
                                                                     unroll=unroll, schedule=schedule))
                got = fn(*args)[0]
                if comm == "ppermute":
                    hlo = fn.lower(*args).compile().as_text()
                err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
                print("case", n, impl, s, chunk, routing, schedule, comm, err)
        gathered = [l for l in hlo.splitlines() if "all-gather(" in l and f"[{E}," in l.split("all-gather(")[0]]
        print("hlo", n, impl, schedule, hlo.count("collective-permute("), len(gathered))
    with use_mesh(make_mesh(4)):  # partial results travelling in bfloat16: rounded (each hop of the ring's sum)
        x, ids, w, gu, dn = inputs(7, 45, "uniform")
        want = routed_experts_reference(x[0], ids[0], w[0], gu, dn, LIMIT)
        for schedule in ("direct", "ring"):
            got = routed_experts_ep(lambda *a: routed_experts_jnp(*a, LIMIT, out_dtype=jnp.float32), x, ids, w, gu, dn,
                                    chunk_tokens=16, combine_dtype=jnp.bfloat16, schedule=schedule)[0]
            print("bf16-combine", schedule, float(jnp.abs(got - want).max() / jnp.abs(want).max()))

    # "sparse" and "alltoall" on 8 devices (E = 8: one expert a shard). Token j of 64 (8-token chunks, one a shard)
    # routes to expert j % 8: each peer needs 1 token of each chunk, which fits capacity 1/8 (1 row); to expert
    # (j // 2) % 8, 2: the chunk goes "direct". Which branch ran shows under comm="local", whose stand-in transfers
    # give other (wrong) values for packs than for whole chunks.
    mesh = make_mesh(8)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    local = lambda *a: routed_experts_jnp(*a, LIMIT, out_dtype=jnp.float32)
    x, _, w, gu, dn = inputs(11, 64, "uniform")
    j = jnp.arange(64, dtype=jnp.int32)
    routes = {"fits": (j % 8)[None, :, None], "over": ((j // 2) % 8)[None, :, None]}
    with use_mesh(mesh):
        for schedule in ("sparse", "alltoall"):
            for name, ids in routes.items():
                w1 = w[..., :1]
                want = routed_experts_reference(x[0], ids[0], w1[0], gu, dn, LIMIT)
                args = (x, ids, w1, put(gu, P("sp")), put(dn, P("sp")))
                run = lambda sched, comm: jax.jit(lambda *a: routed_experts_ep(
                    local, *a, chunk_tokens=8, schedule=sched, capacity=1 / 8, comm=comm))(*args)[0]
                err = float(jnp.abs(run(schedule, "ppermute") - want).max() / jnp.abs(want).max())
                packed = bool(jnp.abs(run(schedule, "local") - run("direct", "local")).max() > 0)
                print("owner-only", schedule, name, err, packed)
        x, ids, w, gu, dn = inputs(12, 90, "uniform")  # K = 3 of 8: a peer needs 3/8 of the tokens, capacity 0.47
        want = routed_experts_reference(x[0], ids[0], w[0], gu, dn, LIMIT)
        args = (x, ids, w, put(gu, P("sp")), put(dn, P("sp")))
        for schedule in ("sparse", "auto"):  # auto: "alltoall" on 8
            fn = jax.jit(lambda *a: routed_experts_ep(local, *a, chunk_tokens=6, schedule=schedule))
            err = float(jnp.abs(fn(*args)[0] - want).max() / jnp.abs(want).max())
            hlo = fn.lower(*args).compile().as_text().splitlines()
            permuted = any("f32[3,64]" in l.split("collective-permute(")[0] for l in hlo if "collective-permute(" in l)
            # XLA:CPU splits an all-to-all into one [1, ...] operand a device
            swapped = any(s in l for l in hlo if "all-to-all(" in l for s in ("f32[8,3,64]", "f32[1,3,64]"))
            print("owner-only-ops", schedule, err, permuted, swapped)
"""


def test_expert_parallel_ring_matches_dense_reference():
    """Dropless: every token's K experts (uniform and skewed loads, empty experts, S not divisible by N, S < N,
    chunk sizes that do not divide the shard) sum exactly to the reference, in every schedule (the owner-only ones
    packed and over capacity); no expert weight is gathered."""
    rows = [line.split() for line in _run(EP_SCRIPT).strip().splitlines()]
    cases = [r for r in rows if r[0] == "case"]
    assert len(cases) == 12
    for _, n, impl, s, chunk, routing, schedule, comm, err in cases:
        if comm == "ppermute":
            assert float(err) < 1e-5, (n, impl, s, chunk, routing, schedule, err)
        else:  # transfers replaced by rolled local copies: the sums must come out wrong (the link matters)
            assert float(err) > 1e-2, (n, impl, s, chunk, routing, schedule, err)
    for _, n, impl, schedule, permutes, gathered in (r for r in rows if r[0] == "hlo"):
        # per chunk: N - 1 transfers of (x, ids, weights); the ring's accumulator makes N hops, "direct" sends
        # N - 1 parts home
        n = int(n)
        assert int(permutes) >= 3 * (n - 1) + (n if schedule == "ring" else n - 1), (n, impl, schedule, permutes)
        assert int(gathered) == 0, f"an expert weight was all-gathered (n={n}, {impl})"
    bf16 = {r[1]: float(r[2]) for r in rows if r[0] == "bf16-combine"}
    assert all(1e-5 < v < 1e-2 for v in bf16.values()), bf16  # rounded (so not exact), only by bfloat16's precision
    owner = {(r[1], r[2]): (float(r[3]), r[4]) for r in rows if r[0] == "owner-only"}
    assert len(owner) == 4, owner
    for schedule in ("sparse", "alltoall"):
        err, packed = owner[schedule, "fits"]
        assert err < 1e-5 and packed == "True", (schedule, owner)  # packed, exact
        err, packed = owner[schedule, "over"]
        assert err < 1e-5 and packed == "False", (schedule, owner)  # over capacity: direct, exact
    ops = {r[1]: (float(r[2]), r[3], r[4]) for r in rows if r[0] == "owner-only-ops"}
    # 12 tokens a shard in chunks of 6: ceil(0.47 · 6) = 3 rows for each peer; "sparse" permutes them one peer at a
    # time, "alltoall" (auto on 8) swaps all 8 packs at once
    assert ops["sparse"][0] < 1e-5 and ops["sparse"][1:] == ("True", "False"), ops
    assert ops["auto"][0] < 1e-5 and ops["auto"][1:] == ("False", "True"), ops


def test_sparse_capacity_and_auto_schedule_by_hand():
    from dsv4.memory_plan import peer_share, resolve_schedule, sparse_capacity

    # V4-Flash, 6 of 256 experts over 8 shards: a peer has none of a token's with probability
    # 224·223·222·221·220·219 / (256·255·254·253·252·251) = 0.4450 (near (7/8)^6 = 0.4488)
    assert abs(peer_share(256, 8, 6) - 0.5550) < 1e-4
    assert abs(sparse_capacity(256, 8, 6) - 1.25 * 0.5550) < 1e-3
    assert peer_share(8, 8, 1) == 1 / 8 and peer_share(8, 2, 5) == 1.0  # 5 of 8 can't all miss 4
    assert sparse_capacity(256, 2, 6) == 1.0  # 98.5% × 1.25, capped
    # auto: "direct" on 2 devices (measured there), "alltoall" on more
    assert [resolve_schedule("auto", 256, n, 6) for n in (2, 4, 8)] == ["direct", "alltoall", "alltoall"]
    assert resolve_schedule("ring", 256, 8, 6) == "ring"
    with pytest.raises(ValueError, match="schedule='all'"):
        resolve_schedule("all", 256, 8, 6)


MODEL_SCRIPT = """
    import jax, jax.numpy as jnp, dsv4
    from flax import nnx
    from dsv4.model import _jitted_logits
    from dsv4.sharding import make_mesh, shard_model, use_mesh
    from dsv4.sharding.rules import active
    model = dsv4.init_random("tiny", 0)
    cfg = model.config
    mesh = make_mesh(4)
    shard_model(model, mesh)
    with use_mesh(mesh):
        g, s = nnx.split(model)
        hlo = _jitted_logits.lower(g, s, jnp.zeros((1, 64), jnp.int32), active()).compile().as_text()
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    full = [f"[{e},{2 * i},{d}]", f"[{e},{d},{i}]"]
    print(sum(l.count(f) for l in hlo.splitlines() if "all-gather" in l for f in full), hlo.count("collective-permute"))

    # The cached path (a prompt chunk, then a decode step) on the mesh (experts split, so the MoE runs the ring)
    # against the same model's run without a mesh.
    import numpy as np
    ids = jax.random.randint(jax.random.key(3), (1, 21), 0, cfg.vocab_size)
    def cached(model):
        g, st = nnx.split(model)
        @jax.jit
        def steps(st):
            m = nnx.merge(g, st)
            cache = m.init_cache(batch=1, max_len=64)
            first, cache = m.prefill_chunk(cache, ids[:, :20])
            second, _ = m.decode(cache, ids[:, 20])
            return jnp.stack([first, second])
        return np.asarray(steps(st))
    with use_mesh(mesh):
        got = cached(model)
    want = cached(dsv4.init_random("tiny", 0))
    print(float(np.abs(got - want).max() / np.abs(want).max()))
"""


def test_model_under_a_mesh_runs_its_experts_expert_parallel():
    """The whole model on 4 devices: the routed experts' weights stay split (never all-gathered) and tokens move by
    collective-permute (the logits themselves are checked in test_sharding.py); a prompt chunk and a decode step on
    the mesh give the unsharded model's logits."""
    gathered, permutes, cached_err = _run(MODEL_SCRIPT).split()
    assert int(gathered) == 0 and int(permutes) > 0
    assert float(cached_err) < 1e-4, cached_err


@pytest.mark.gpu
@pytest.mark.skipif(len(jax.devices("gpu") if jax.default_backend() == "gpu" else []) < 2,
                    reason="needs 2 GPUs (the exchange between real devices)")  # fmt: skip
def test_gpu_ring_with_the_pallas_kernels_matches_one_device():
    """On 2+ GPUs with the compiled grouped-GEMM kernels, V4-Flash's widths and a skewed load: the expert-parallel
    result equals one device's `routed_experts` up to float32 summation order (bf16 output)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv4.moe import routed_experts_pallas
    from dsv4.sharding import make_mesh, use_mesh
    from dsv4.sharding.expert_parallel import routed_experts_ep

    n_tok, d, inter, e, k = 3000, 4096, 2048, 32, 6
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n_tok, d), jnp.bfloat16)
    popularity = -0.5 * jnp.log1p(jnp.arange(e, dtype=jnp.float32))  # Zipf: expert 0 is the busiest
    _, ids = jax.lax.top_k(popularity + jax.random.gumbel(keys[1], (n_tok, e)), k)
    w = jax.random.uniform(keys[2], (n_tok, k), jnp.float32)
    gu = jax.random.normal(keys[3], (e, 2 * inter, d), jnp.bfloat16) * 0.02
    dn = jax.random.normal(keys[4], (e, d, inter), jnp.bfloat16) * 0.02
    want = routed_experts_pallas(x, ids.astype(jnp.int32), w, gu, dn, 7.0).astype(jnp.float32)
    mesh = make_mesh(len(jax.devices()))
    split = NamedSharding(mesh, P("sp"))
    with use_mesh(mesh):
        got = routed_experts_ep(lambda *a: routed_experts_pallas(*a, 7.0, out_dtype=jnp.float32), x[None],
                                ids[None].astype(jnp.int32), w[None], jax.device_put(gu, split),
                                jax.device_put(dn, split), chunk_tokens=700)[0].astype(jnp.float32)  # fmt: skip
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert rel < 1e-2, rel


FP8_SCRIPT = """
    import numpy as np, jax, jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dsv4.config import Config
    from dsv4.layers import linear
    from dsv4.moe import MoE, routed_experts_pallas, swiglu
    from dsv4.pallas.moe import quantize_per_token_group, routed_experts_reference
    from dsv4.quantization import BlockQuantized, quantize_fp8
    from dsv4.sharding import make_mesh, use_mesh
    from dsv4.sharding.expert_parallel import routed_experts_ep

    D, I, E, K, LIMIT, S = 256, 128, 8, 3, 7.0, 23
    rng = np.random.default_rng(0)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (S, D), jnp.bfloat16)
    ids = jax.vmap(lambda kk: jax.random.permutation(kk, E)[:K])(jax.random.split(k[1], S)).astype(jnp.int32)
    w = jax.random.uniform(k[2], (S, K), jnp.float32)
    gq, gs = map(jnp.asarray, quantize_fp8(rng.normal(0, 0.1, (E, 2 * I, D)), (128, 128), None))
    dq, ds = map(jnp.asarray, quantize_fp8(rng.normal(0, 0.1, (E, D, I)), (128, 128), None))
    scales = dict(gate_up_scales=gs, down_scales=ds)
    one = routed_experts_pallas(x, ids, w, gq, dq, LIMIT, out_dtype=jnp.float32, **scales)
    ref = routed_experts_reference(x, ids, w, gq, dq, LIMIT, **scales).astype(jnp.float32)
    rel = lambda a, b: float(jnp.abs(a - b).max() / jnp.abs(b).max())
    print("one-vs-ref", rel(one, ref))

    # The function: tokens quantized where they live, fp8 on the wire, each shard's scales with its experts.
    xq, xs = quantize_per_token_group(x)
    local = lambda *a, **kw: routed_experts_pallas(*a, LIMIT, out_dtype=jnp.float32, **kw)
    for n in (2, 4):
        mesh = make_mesh(n)
        split = lambda a: jax.device_put(a, NamedSharding(mesh, P("sp")))
        with use_mesh(mesh):
            fn = jax.jit(lambda *a: routed_experts_ep(local, *a[:5], x_scales=a[5], gate_up_scales=a[6],
                                                      down_scales=a[7], out_dtype=jnp.float32, chunk_tokens=4))
            args = (xq[None], ids[None], w[None], split(gq), split(dq), xs[None], split(gs), split(ds))
            got = fn(*args)[0]
            # what the program sends (XLA:CPU then widens fp8 collectives to f16; XLA:GPU sends fp8 as it is)
            permutes = [l for l in fn.lower(*args).as_text().splitlines() if "collective_permute" in l]
        fp8_sent = sum(f"4x{D}xf8E4M3FN" in l for l in permutes)
        bf16_tokens = sum(f"4x{D}xbf16" in l for l in permutes)
        print("ep", n, rel(got, one), fp8_sent, bf16_tokens)
    with use_mesh(mesh):  # "alltoall" on 4: a pack row is D fp8 bytes + D / 128 float32 scales + K ids + K weights
        fn = jax.jit(lambda *a: routed_experts_ep(local, *a[:5], x_scales=a[5], gate_up_scales=a[6],
                                                  down_scales=a[7], out_dtype=jnp.float32, chunk_tokens=4,
                                                  schedule="alltoall"))
        got = fn(*args)[0]
        swaps = [l for l in fn.lower(*args).as_text().splitlines() if "all_to_all" in l]
    row = D + D // 128 * 4 + 4 * K + 4 * K
    print("a2a", rel(got, one), sum(f"x{row}xui8" in l for l in swaps), len(swaps))

    # The model's MoE with FP8 experts kept quantized: no mesh (one call), then expert-parallel on 2 devices.
    cfg = Config.preset("tiny").replace(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E,
                                        num_experts_per_tok=K, swiglu_limit=LIMIT)
    moe = MoE(cfg, "moe", rngs=nnx.Rngs(1), dtype=jnp.bfloat16, moe_impl="pallas")
    moe.experts["gate_up_proj"].set_value(BlockQuantized(gq, gs, "fp8", (128, 128), gq.shape, "bfloat16"))
    moe.experts["down_proj"].set_value(BlockQuantized(dq, ds, "fp8", (128, 128), dq.shape, "bfloat16"))
    xm = jax.random.normal(jax.random.key(5), (1, S, D), jnp.bfloat16)
    tok = jnp.arange(S, dtype=jnp.int32)[None]
    flat = xm[0]
    r_ids, r_w = moe.route(flat, tok[0])
    sh = moe.shared_experts
    shared = linear(swiglu(linear(flat, sh["gate_proj"]["weight"][...]), linear(flat, sh["up_proj"]["weight"][...]),
                           LIMIT), sh["down_proj"]["weight"][...])
    for acts in (True, False):
        moe.fp8_activations = acts
        want = routed_experts_reference(flat, r_ids, r_w, gq, dq, LIMIT, **scales, fp8_activations=acts) + shared
        got = moe(xm, tok)[0]
        print("moe", acts, "single", rel(got.astype(jnp.float32), want.astype(jnp.float32)))
        with use_mesh(make_mesh(2)):
            got_ep = moe(xm, tok)[0]
        print("moe", acts, "ep", rel(got_ep.astype(jnp.float32), want.astype(jnp.float32)))

    # The shared expert FP8 too, on W8A8 dense layers: its gate | up stacked on x quantized once with the experts'
    # (from any row count here), alone and expert-parallel, bit-equal to each quantizing x on its own.
    import dsv4.layers as layers
    moe.fp8_activations, moe.dense_impl = True, "pallas"
    for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
        wq, ws = map(jnp.asarray, quantize_fp8(rng.normal(0, 0.1, shape), (128, 128), None))
        sh[name]["weight"].set_value(BlockQuantized(wq, ws, "fp8", (128, 128), shape, "bfloat16"))
    outs = {}
    for rows in (1, 1 << 30):
        layers.STACK_MIN_ROWS = rows
        outs[rows, "single"] = np.asarray(moe(xm, tok), np.float32)
        with use_mesh(make_mesh(2)):
            outs[rows, "ep"] = np.asarray(moe(xm, tok), np.float32)
    print("stacked", *(bool(np.array_equal(outs[1, w], outs[1 << 30, w])) for w in ("single", "ep")))
"""


def test_fp8_experts_run_w8a8_and_send_fp8_tokens():
    """FP8 expert weights (DeepSeek's 128 × 128 blocks): under expert parallelism the tokens travel as fp8 values
    with their scales (no bf16 token is sent) and the result equals one device's W8A8 run; the model's MoE with
    experts kept quantized runs the FP8 kernels (W8A8, or W8A16 with fp8_activations False), alone and
    expert-parallel, against the jnp reference that quantizes the same way; with the shared expert FP8 as well, its
    gate and up stacked on the experts' quantized x, alone and expert-parallel, bit-equal to separate quantizations."""
    rows = [line.split() for line in _run(FP8_SCRIPT, devices=4).strip().splitlines()]
    (one_vs_ref,) = [float(r[1]) for r in rows if r[0] == "one-vs-ref"]
    assert one_vs_ref < 2**-6, one_vs_ref  # bf16 output of the reference vs float32: rounding only
    eps = [r for r in rows if r[0] == "ep"]
    assert len(eps) == 2
    for _, n, err, fp8_sent, bf16_tokens in eps:
        assert float(err) < 1e-5, (n, err)  # same quantized inputs, same kernels; f32 summation order only
        assert int(fp8_sent) >= int(n) - 1 and int(bf16_tokens) == 0, (n, fp8_sent, bf16_tokens)
    ((_, err, byte_swaps, swaps),) = [r for r in rows if r[0] == "a2a"]
    # 6 tokens a shard in chunks of 4: two steps, each one all-to-all of packed fp8 rows out and one of parts back
    assert float(err) < 1e-5 and int(byte_swaps) == 2 and int(swaps) == 4, (err, byte_swaps, swaps)
    moes = {(r[1], r[2]): float(r[3]) for r in rows if r[0] == "moe"}
    assert len(moes) == 4
    for key, err in moes.items():
        # bf16 outputs (and, expert-parallel, bf16 remote parts) against the reference's own bf16 rounding
        assert err < 2**-6, (key, err)
    assert [r for r in rows if r[0] == "stacked"] == [["stacked", "True", "True"]]


@pytest.mark.gpu
@pytest.mark.skipif(len(jax.devices("gpu") if jax.default_backend() == "gpu" else []) < 2,
                    reason="needs 2 GPUs (the exchange between real devices)")  # fmt: skip
def test_gpu_w8a8_with_fp8_tokens_matches_one_device():
    """On 2+ GPUs at V4-Flash's widths: FP8 expert weights (128 × 128 blocks), tokens quantized where they live and
    sent as e4m3 + scales; the result equals one device's W8A8 `routed_experts` up to float32 summation order."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv4.moe import routed_experts_pallas
    from dsv4.pallas.moe import quantize_per_token_group
    from dsv4.sharding import make_mesh, use_mesh
    from dsv4.sharding.expert_parallel import routed_experts_ep

    n_tok, d, inter, e, k = 3000, 4096, 2048, 16, 6
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (n_tok, d), jnp.bfloat16)
    popularity = -0.5 * jnp.log1p(jnp.arange(e, dtype=jnp.float32))
    _, ids = jax.lax.top_k(popularity + jax.random.gumbel(keys[1], (n_tok, e)), k)
    ids = ids.astype(jnp.int32)
    w = jax.random.uniform(keys[2], (n_tok, k), jnp.float32)

    def fp8_blocks(key, shape):  # DeepSeek's format: e4m3 values, one float32 scale per 128 × 128 block
        v = jax.random.normal(key, shape, jnp.float32) * 0.02
        blocks = v.reshape(shape[0], shape[1] // 128, 128, shape[2] // 128, 128)
        scale = jnp.abs(blocks).max(axis=(2, 4)) / 448.0
        return (blocks / scale[:, :, None, :, None]).astype(jnp.float8_e4m3fn).reshape(shape), scale

    (gq, gs), (dq, ds) = fp8_blocks(keys[3], (e, 2 * inter, d)), fp8_blocks(keys[4], (e, d, inter))
    want = routed_experts_pallas(x, ids, w, gq, dq, 7.0, out_dtype=jnp.float32, gate_up_scales=gs, down_scales=ds)
    xq, xs = quantize_per_token_group(x)
    mesh = make_mesh(len(jax.devices()))
    split = lambda a: jax.device_put(a, NamedSharding(mesh, P("sp")))  # noqa: E731
    with use_mesh(mesh):
        got = routed_experts_ep(lambda *a, **kw: routed_experts_pallas(*a, 7.0, out_dtype=jnp.float32, **kw), xq[None],
                                ids[None], w[None], split(gq), split(dq), x_scales=xs[None], gate_up_scales=split(gs),
                                down_scales=split(ds), out_dtype=jnp.float32, chunk_tokens=700)[0]  # fmt: skip
    rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert rel < 1e-4, rel
