"""The shard_map'd sequence-parallel attention core (dsv4/attention/sequence_parallel.py) against
`core_attention_jnp`, float32, on 8 CPU host devices in a subprocess (as in tests/test_sharding.py).

Tiny shapes (H=4, D=32, W=16, B=2); lengths that are not divisible by the shard count, whose windows
straddle shard boundaries, shards shorter than the window (multi-hop halo), prompts shorter than one window;
HCA (rate 4) and CSA (rate 4, random top-8 with -1s, picks spread over every earlier shard); random sinks;
contiguous and zigzag layouts; CSA "gather" and "ring" modes; query chunks of 16 so every shard has several.
Then the tiny_long fixture model (sliding, CSA and HCA layers) on the "sp" core (`Kernels.attention`) on 4 shards
against its reference logits.
"""

import os
import subprocess
import sys
import textwrap
import zlib

import jax
import numpy as np
import pytest
from host_devices import host_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
    import functools, sys, numpy as np, jax, jax.numpy as jnp
    from dsv4.attention import CompressedKeys, core_attention_jnp
    from dsv4.sharding import make_mesh, use_mesh
    from dsv4.attention.sequence_parallel import core_attention_sp

    def inputs(s, kind, seed, H=4, D=32, rate=4, K=8):
        rng = np.random.default_rng(seed)
        q = jnp.asarray(rng.normal(size=(2, s, H, D)), jnp.float32)
        kv = jnp.asarray(rng.normal(size=(2, s, D)), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (2, s))
        sinks = jnp.asarray(2 * rng.normal(size=(H,)), jnp.float32)
        comp = None
        if kind != "sliding":
            c = s // rate
            entries = jnp.asarray(rng.normal(size=(2, c, D)), jnp.float32)
            topk = None
            if kind == "csa":
                visible = (np.arange(s) + 1) // rate
                t = rng.integers(0, c, size=(2, s, K))
                t = np.where(t < visible[None, :, None], t, -1)  # only causally complete entries
                t[rng.random(t.shape) < 0.2] = -1
                topk = jnp.asarray(t, jnp.int32)
            comp = CompressedKeys(entries, rate, topk)
        return (q, kv, pos, pos, sinks), dict(sliding_window=16, scale=D ** -0.5, compressed=comp, kv_aligned=True)

    for i, case in enumerate(sys.argv[1:]):
        sp, s, kind, *opts = case.split(":")
        sp, s = int(sp), int(s)
        extra = dict(query_chunk=16)
        for o in opts:
            k, v = o.split("=")
            extra[k] = int(v) if v.isdigit() else v
        args, kw = inputs(s, kind, seed=i)
        want = jax.jit(functools.partial(core_attention_jnp, **kw))(*args)
        with use_mesh(make_mesh(sp)):
            fn = jax.jit(functools.partial(core_attention_sp, **kw, **extra))
            got = fn(*args)
            uses_ppermute = "ppermute" in str(jax.make_jaxpr(fn)(*args))
        err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
        print(case, err, uses_ppermute, flush=True)

    # No mesh, or a cached (kv_aligned=False) call: exactly core_attention_jnp.
    args, kw = inputs(40, "hca", seed=99)
    same = bool(jnp.array_equal(core_attention_sp(*args, **kw), core_attention_jnp(*args, **kw)))
    print("fallback", 0.0 if same else 1.0, True)

    # A cached chunk split over 4 shards (`chunk_core_per_shard`) with q's factors (`Kernels.q_norm` "fold"): each
    # shard's factors travel with its queries, as the jnp core on queries q · q_scale without a mesh.
    from dsv4.attention.sequence_parallel import chunk_core_per_shard
    (q, kv, pos, _, sinks), kw = inputs(48, "csa", seed=7)
    kw.pop("kv_aligned")
    q_scale = jnp.asarray(np.random.default_rng(8).uniform(0.4, 2.5, q.shape[:3]), jnp.float32)
    keys = jnp.concatenate([jnp.zeros_like(kv[:, :16]), kv], axis=1)  # the 16 ring rows, empty: a first chunk
    key_pos = jnp.concatenate([jnp.full_like(pos[:, :16], -1), pos], axis=1)
    want = core_attention_jnp(q * q_scale[..., None], keys, pos, key_pos, sinks, **kw)
    with use_mesh(make_mesh(4)):
        fn = jax.jit(lambda *a: chunk_core_per_shard(core_attention_jnp, *a, q_scale=q_scale, **kw))
        got = fn(q, keys, pos, key_pos, sinks)
        split = "shard_map" in str(jax.make_jaxpr(fn)(q, keys, pos, key_pos, sinks))
    print("chunk:q_scale", float(jnp.abs(got - want).max() / jnp.abs(want).max()), split)

    # The whole model on the "sp" core (all three layer types) against its reference logits.
    import dsv4
    from flax import nnx
    from dsv4.model import _jitted_logits
    from dsv4.sharding import shard_model
    from dsv4.sharding.rules import active
    model = dsv4.load("tests/fixtures/tiny_long", dtype=jnp.float32, kernels="attention=sp")
    ref = np.load("tests/fixtures/tiny_long/reference.npz")
    mesh = make_mesh(4)
    shard_model(model, mesh)
    with use_mesh(mesh):
        logits = np.asarray(model.logits(ref["input_ids"]))
        g, s = nnx.split(model)
        text = _jitted_logits.lower(g, s, jnp.asarray(ref["input_ids"], jnp.int32), active()).as_text()
    err = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    print("model:tiny_long:sp=4", err, "collective_permute" in text)
"""

CASES = [
    "2:83:hca:balance=zigzag",  # S odd (padded to 84); zigzag: 4 blocks of 21 rows
    "2:83:csa:csa_mode=ring:balance=zigzag",
    "4:37:sliding",  # 10 rows per shard < W - 1 = 15: two-hop halo
    "4:83:hca:entry_block=4",  # several causal sub-blocks per ring step
    "4:160:hca:balance=zigzag",  # 8 blocks of 20 rows
    "8:5:csa",  # shorter than one window and than the shard count
    "8:83:hca",  # 11 rows per shard: two-hop halo, 8-step ring
    "8:256:csa:balance=zigzag",  # 16 blocks of 16 rows
    # local_core=pallas: the Triton kernel per shard (interpreted), entries all-gathered
    "2:83:hca:local_core=pallas",  # S odd (padded), the halo from one shard back
    "4:37:sliding:local_core=pallas",  # 10 rows per shard: two-hop halo
    "4:83:csa:local_core=pallas",
]


def test_sequence_parallel_core_matches_jnp_and_model_reference():
    env = host_devices_env(8)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), *CASES], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.strip().splitlines()]
    assert [r[0] for r in rows] == [*CASES, "fallback", "chunk:q_scale", "model:tiny_long:sp=4"]
    for case, err, uses_ppermute in rows:
        assert float(err) < 1e-5, (case, err)
        assert uses_ppermute == "True", f"{case}: the sequence-parallel path did not run"


KERNELS_SCRIPT = """
    import numpy as np, jax, jax.numpy as jnp
    import dsv4
    from flax import nnx
    from dsv4.model import _jitted_logits
    from dsv4.sharding import make_mesh, shard_model, use_mesh
    from dsv4.sharding.rules import active

    from jax.extend.core import jaxprs_in_params

    def primitives(jaxpr, names):  # every primitive name in jaxpr, nested jaxprs included
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jaxprs_in_params(eqn.params):
                primitives(sub, names)
        return names

    def inner_primitives(jaxpr, found):  # per shard_map: the primitives of its body
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "shard_map":
                found.append(primitives(eqn.params["jaxpr"], set()))
            else:
                for sub in jaxprs_in_params(eqn.params):
                    inner_primitives(sub, found)
        return found

    ref = np.load("tests/fixtures/tiny_long/reference.npz")
    model = dsv4.load("tests/fixtures/tiny_long", dtype=jnp.float32, kernels="attention=sp,indexer=pallas,moe=pallas")
    mesh = make_mesh(4)
    shard_model(model, mesh)
    ids = jnp.asarray(ref["input_ids"], jnp.int32)
    with use_mesh(mesh):
        logits = np.asarray(model.logits(ref["input_ids"]))
        g, s = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda st: _jitted_logits(g, st, ids, active()))(s)
    err = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    bodies = inner_primitives(jaxpr.jaxpr, [])
    print("err", err)
    print("shard_maps_with_pallas", sum("pallas_call" in b for b in bodies))

    # per_sequence_shard itself: S = 10 over 4 shards (padded to 12, 3 rows each), a replicated operand, the
    # padding cut off; each shard sees only its own rows.
    from dsv4.sharding.sequence import per_sequence_shard
    x = jnp.arange(2 * 10 * 3, dtype=jnp.float32).reshape(2, 10, 3)
    r = jnp.asarray([1.0, 2.0, 3.0])
    def fn(x_, r_):
        return x_ * r_ + x_.shape[1] * 1000 + jax.lax.axis_index("sp") * 100
    with use_mesh(mesh):
        got = np.asarray(jax.jit(lambda a, b: per_sequence_shard(fn, (a,), (b,), fill=(0.0,)))(x, r))
    want = np.asarray(x * r) + 3000 + (np.arange(10) // 3)[None, :, None] * 100
    print("pad_ok", bool(got.shape == (2, 10, 3) and np.array_equal(got, want)))

    # W8A8 dense layers (Kernels.dense="pallas", the default on Hopper) through it: each token is quantized on its
    # own, so 10 tokens over 4 shards give the unsharded result bit for bit.
    from dsv4.layers import project
    from dsv4.quantization import BlockQuantized
    from dsv4.random_weights import quantize_fp8
    q8, s8 = quantize_fp8(jax.random.normal(jax.random.key(5), (256, 256), jnp.float32) * 0.05)
    w8 = nnx.Param(BlockQuantized(q8, s8, "fp8", (128, 128), (256, 256), "bfloat16"))
    xb = jax.random.normal(jax.random.key(6), (1, 10, 256), jnp.bfloat16)
    alone = np.asarray(project(xb, w8, "pallas"), np.float32)
    with use_mesh(mesh):
        sharded = np.asarray(jax.jit(lambda a: project(a, w8, "pallas"))(xb), np.float32)
    print("w8a8_ok", bool(sharded.shape == alone.shape and np.array_equal(sharded, alone) and np.isfinite(alone).all()))
    # ... and two weights of one x stacked into one GEMM per shard (`project_shared`; STACK_MIN_ROWS lowered to 10)
    import dsv4.layers as layers
    from dsv4.layers import project_shared
    q8b, s8b = quantize_fp8(jax.random.normal(jax.random.key(7), (256, 256), jnp.float32) * 0.05)
    w8b = nnx.Param(BlockQuantized(q8b, s8b, "fp8", (128, 128), (256, 256), "bfloat16"))
    layers.STACK_MIN_ROWS = 10
    with use_mesh(mesh):
        pair = [np.asarray(y, np.float32) for y in jax.jit(lambda a: project_shared(a, (w8, w8b), "pallas"))(xb)]
    each = [alone, np.asarray(project(xb, w8b, "pallas"), np.float32)]
    print("stacked_ok", all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(pair, each)))

    # The mHC Sinkhorn kernel as `dsv4.layers.sinkhorn_normalize` runs it on a GPU under a sequence mesh (interpreted
    # here): S = 10 over 4 shards, the padding filled with ones, against the reference.
    from dsv4.pallas.sinkhorn import sinkhorn, sinkhorn_reference
    comb = jax.nn.softmax(jax.random.normal(jax.random.key(5), (2, 10, 4, 4)) * 3, axis=-1) + 1e-6
    with use_mesh(mesh):
        got = jax.jit(lambda c: per_sequence_shard(lambda c_: sinkhorn(c_, 3, 1e-6, interpret=True), (c,),
                                                   fill=(1.0,)))(comb)
    print("sinkhorn_err", float(jnp.max(jnp.abs(got - sinkhorn_reference(comb, 3, 1e-6)))))
"""


def test_pallas_indexer_and_moe_run_per_sequence_shard():
    """Under a sequence mesh the Pallas indexer and MoE (custom calls XLA cannot partition) run inside shard_map on
    each shard's own tokens, and the model still matches its reference logits (tiny_long: 2 CSA layers → 2
    indexers, 4 MoE layers; Pallas interpreted on 4 CPU devices). Then `per_sequence_shard` alone: padding a length
    that does not divide over the shards, a replicated operand, and each shard seeing only its own rows; a W8A8 dense
    layer (one weight, and two stacked) and the mHC Sinkhorn kernel through it, as a GPU runs them under a sequence
    mesh."""
    env = host_devices_env(8)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(KERNELS_SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    wanted = ("err", "shard_maps_with_pallas", "pad_ok", "w8a8_ok", "stacked_ok", "sinkhorn_err")
    values = dict(line.split() for line in out.stdout.strip().splitlines() if line.split()[0] in wanted)
    assert float(values["err"]) < 1e-4, values
    from dsv4.config import Config

    cfg = Config.from_hf(os.path.join(ROOT, "tests/fixtures/tiny_long/config.json"))
    expected = cfg.layer_types.count("compressed_sparse_attention") + cfg.num_hidden_layers
    assert int(values["shard_maps_with_pallas"]) == expected, (values, expected)
    assert values["pad_ok"] == "True", values
    assert values["w8a8_ok"] == "True", values
    assert values["stacked_ok"] == "True", values
    assert float(values["sinkhorn_err"]) < 1e-6, values


@pytest.mark.gpu
@pytest.mark.skipif(len(jax.devices("gpu") if jax.default_backend() == "gpu" else []) < 2,
                    reason="needs 2 GPUs (halo and entries between real devices)")  # fmt: skip
@pytest.mark.parametrize("kind", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
def test_gpu_pallas_core_per_shard_matches_reference(kind, balance):
    """On 2+ H200s at V4 widths (64 heads, D = 512, W = 128), bf16: local_core="pallas" (the Mosaic kernel per block
    with the halo as its kv_offset for window and HCA layers, the Triton one for CSA), contiguous and zigzag (inputs
    already permuted, as the model keeps them), against the jnp reference; the output poisoned first."""
    import jax.numpy as jnp

    from dsv4.attention import CompressedKeys
    from dsv4.attention.sequence_parallel import core_attention_sp
    from dsv4.pallas.attention import v4_attention_reference
    from dsv4.sharding import make_mesh
    from dsv4.sharding.sequence import zigzag_permute

    n = len(jax.devices())
    s, h, d, w, rate = 2 * n * 384, 64, 512, 128, (4 if kind == "csa" else 16)
    keys = jax.random.split(jax.random.key(zlib.crc32(f"{kind}-{balance}".encode())), 5)  # fixed per case
    q = jax.random.normal(keys[0], (1, s, h, d), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (1, s, d), jnp.bfloat16)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    sinks = jax.random.normal(keys[2], (h,), jnp.float32)
    comp = None
    if kind != "sliding":
        entries = jax.random.normal(keys[3], (1, s // rate, d), jnp.bfloat16)
        topk = None
        if kind == "csa":
            visible = (pos[..., None] + 1) // rate
            picks = jax.lax.top_k(jax.random.uniform(keys[4], (1, s, s // rate)), 64)[1]  # distinct, as top-k's
            topk = jnp.where(picks < visible, picks, -1).astype(jnp.int32)
        comp = CompressedKeys(entries, rate, topk)
    kw = dict(sliding_window=w, scale=d**-0.5)
    want = v4_attention_reference(q, kv, pos, pos, sinks, **kw, compressed=None if comp is None else comp.entries,
                                  compress_rate=rate if comp else None,
                                  topk_indices=None if comp is None else comp.topk_indices)  # fmt: skip
    zig = balance == "zigzag"
    perm = (lambda x: zigzag_permute(x, n)) if zig else (lambda x: x)  # noqa: E731
    if comp is not None and comp.topk_indices is not None:
        comp = CompressedKeys(comp.entries, rate, perm(comp.topk_indices))
    fn = lambda *a: core_attention_sp(*a, **kw, compressed=comp, kv_aligned=True, mesh=make_mesh(n), axis="sp",  # noqa: E731
                                      balance=balance, inputs_permuted=zig, local_core="pallas")  # fmt: skip
    jax.block_until_ready(fn(jnp.full_like(perm(q), jnp.nan), perm(kv), perm(pos), perm(pos), sinks))  # poison
    got = fn(perm(q), perm(kv), perm(pos), perm(pos), sinks)
    got = zigzag_permute(got, n, inverse=True) if zig else got
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=0)
