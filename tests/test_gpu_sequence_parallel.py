"""The model's multi-device variants, layer by layer, against the 1-device jnp model at V4-Flash widths (GPU only).

Model: V4-Flash's widths with 3 layers (sliding, CSA, HCA), bf16, random weights drawn on device 0; a 16K-token
prompt. Reference: one device, attention on the jnp core, indexer and MoE on Pallas. Each layer of each variant
gets the reference's input streams for that layer (teacher forcing, so errors do not compound), and its update
(output − input; the residual stream would dilute a wrong update) must match the reference's in relative L2, over
all tokens and over the first and the last shard's tokens. A bf16 model's variants differ by rounding (1-5%); a
wrong halo, compressed entry or expert shows as O(1) on one shard, hence the 0.1 bound. Variants:

    1dev-auto          one device, the library's default kernels (Pallas / Mosaic attention)   (1 GPU)
    sp-split           N devices, jnp sequence-parallel core, experts split over the devices  (2+ GPUs)
    sp-pallas-split    N devices, the Pallas kernel per shard, experts split                   (2+ GPUs)
    sp-pallas-repl     N devices, the Pallas kernel per shard, experts replicated              (2+ GPUs)
    sp-pallas-zigzag   N devices, the Pallas kernel per shard, experts split, zigzag order     (2+ GPUs)

    python3 -m pytest -m gpu -v tests/test_gpu_sequence_parallel.py      # 2 H200s
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

SEQ = 16384  # 2N blocks of whole compressor windows for the zigzag order
TOL = 0.1

_N_GPUS = len(jax.devices("gpu")) if jax.default_backend() == "gpu" else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_N_GPUS < 1, reason="needs a GPU")]
needs_2_gpus = pytest.mark.skipif(_N_GPUS < 2, reason="needs 2 GPUs of one host")


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float32), b.astype(np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _init_kind(names: list[str]) -> str:
    """The init `dsv4.layers.param` gives a leaf, from its path."""
    name = names[-1]
    if name in {"base", "hc_base", "position_bias", "sinks", "e_score_correction_bias"}:
        return "zeros"
    if name in {"scale", "hc_scale"} or (name == "weight" and len(names) > 1 and names[-2].endswith("norm")):
        return "ones"
    return "hash" if name == "tid2eid" else "normal"


def _normal(key, shape, dtype):
    """0.02 · N(0, 1) in `dtype`, drawn on the device in leading-axis chunks of <= 2^28 elements."""
    import jax.numpy as jnp

    lead, rest = (shape[0], shape[1:]) if shape else (1, ())
    chunks = 1
    while shape and lead % (chunks * 2) == 0 and (lead // chunks) * math.prod(rest) > (1 << 28):
        chunks *= 2
    if chunks == 1:
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    draw = jax.jit(lambda k: (0.02 * jax.random.normal(k, (lead // chunks, *rest), jnp.float32)).astype(dtype))
    return jnp.concatenate([draw(k) for k in jax.random.split(key, chunks)])


def _random_state(cfg, dtype, seed=0):
    """The model's nnx State with random weights drawn on the default device."""
    import jax.numpy as jnp
    from flax import nnx

    from dsv4.model import DeepseekV4

    _, abstract = nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype)))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    key, values = jax.random.key(seed), []
    for i, (path, leaf) in enumerate(leaves):
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        kind = _init_kind([n for n in names if n != "value"])
        shape, ldtype, k = tuple(leaf.shape), leaf.dtype, jax.random.fold_in(key, i)
        if kind == "zeros":
            values.append(jnp.zeros(shape, ldtype))
        elif kind == "ones":
            values.append(jnp.ones(shape, ldtype))
        elif kind == "hash":  # distinct experts per token
            table = jnp.argsort(jax.random.uniform(k, (shape[0], cfg.n_routed_experts)), axis=1)
            values.append(table[:, : shape[1]].astype(jnp.int32))
        else:
            values.append(_normal(k, shape, ldtype))
    return jax.tree_util.tree_unflatten(treedef, values)


def _graphdef(cfg, dtype, kernels):
    from flax import nnx

    from dsv4.model import DeepseekV4

    return nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels)))[0]


def _put(state, sharding_of):
    """Moves every parameter to `sharding_of(var)`, in place, one tensor at a time (never two copies of one)."""
    from flax import nnx

    for _, var in nnx.to_flat_state(state):
        var.set_value(jax.device_put(var[...], sharding_of(var)))


@pytest.fixture(scope="module")
def reference():
    """(config, state, ids, each layer's input, each layer's output) of the 1-device jnp model."""
    import jax.numpy as jnp
    from flax import nnx

    import dsv4
    from dsv4.config import CSA, HCA, SLIDING, Config

    types = (SLIDING, CSA, HCA)
    cfg = Config.preset("v4-flash").replace(num_hidden_layers=3, layer_types=types, mlp_layer_types=("moe",) * 3)
    state = _random_state(cfg, jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(1), (1, SEQ), 0, cfg.vocab_size, jnp.int32)
    positions = jnp.arange(SEQ, dtype=jnp.int32)[None]
    model = nnx.merge(_graphdef(cfg, jnp.bfloat16, dsv4.Kernels(attention="jnp", indexer="pallas", moe="pallas")),
                      state)  # fmt: skip
    x = jnp.broadcast_to(model.embed_tokens["weight"][...][ids][:, :, None, :], (1, SEQ, cfg.hc_mult, cfg.hidden_size))
    inputs, outputs = [], []
    for layer in model.layers:
        inputs.append(np.asarray(jax.device_get(x)))
        g, lst = nnx.split(layer)
        x = jax.jit(lambda st, x_, g=g: nnx.merge(g, st)(x_, positions, ids))(lst, x)
        outputs.append(np.asarray(jax.device_get(x)))
    del model, x
    return cfg, state, ids, inputs, outputs


def _layer_outputs(gd, state, ids, inputs, mesh=None, rules=None):
    """Each layer's output given `inputs[l]` (host arrays) as its input, as host arrays. Under a zigzag layout the
    inputs, positions and ids go in permuted into zigzag order and the outputs come back in sequence order."""
    import contextlib

    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dsv4.sharding import use_mesh
    from dsv4.sharding.sequence import zigzag_permute

    model = nnx.merge(gd, state)
    n_zig = mesh.shape["sp"] if mesh is not None and rules.seq_order == "zigzag" else 0

    def to_zig(a):
        return np.asarray(zigzag_permute(jnp.asarray(a), n_zig)) if n_zig else a

    def from_zig(a):
        return np.asarray(zigzag_permute(jnp.asarray(a), n_zig, inverse=True)) if n_zig else a

    def put(a):
        if mesh is None:
            return jnp.asarray(a)
        return jax.device_put(to_zig(np.asarray(a)), NamedSharding(mesh, P(None, "sp")))

    outs = []
    with use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
        pos, tok = put(np.arange(SEQ, dtype=np.int32)[None]), put(ids)
        for layer, x in zip(model.layers, inputs):
            g, lst = nnx.split(layer)
            out = jax.jit(lambda st, x_, p_, t_, g=g: nnx.merge(g, st)(x_, p_, t_))(lst, put(x), pos, tok)
            outs.append(from_zig(np.asarray(jax.device_get(out))))
            del out
    return outs


def _check_updates(name, cfg, outs, reference_out, inputs, shards):
    """Each layer's update against the reference's: all tokens, the first shard's and the last shard's."""
    part = SEQ // shards
    errors = {}
    for li, (o, r, x) in enumerate(zip(outs, reference_out, inputs)):
        do, dr = o.astype(np.float32) - x.astype(np.float32), r.astype(np.float32) - x.astype(np.float32)
        errors[f"layer {li} ({cfg.layer_types[li]})"] = (_rel(do, dr), _rel(do[:, :part], dr[:, :part]),
                                                         _rel(do[:, -part:], dr[:, -part:]))  # fmt: skip
    bad = {k: v for k, v in errors.items() if max(v) >= TOL}
    assert not bad, f"{name}: update rel L2 (all, first shard, last shard) >= {TOL}: {bad}; all: {errors}"


def test_gpu_one_device_default_kernels_match_jnp(reference):
    import jax.numpy as jnp

    import dsv4

    cfg, state, ids, inputs, ref_out = reference
    device = jax.devices()[0]
    _put(state, lambda var: jax.sharding.SingleDeviceSharding(device))
    gd = _graphdef(cfg, jnp.bfloat16, dsv4.Kernels(indexer="pallas", moe="pallas"))
    _check_updates("1dev-auto", cfg, _layer_outputs(gd, state, ids, inputs), ref_out, inputs, max(_N_GPUS, 1))


@needs_2_gpus
@pytest.mark.parametrize("variant", ["sp-split", "sp-pallas-split", "sp-pallas-repl", "sp-pallas-zigzag"])
def test_gpu_sequence_parallel_matches_one_device_jnp(reference, variant):
    import jax.numpy as jnp

    import dsv4
    from dsv4.sharding import SEQUENCE_ONLY, SEQUENCE_PARALLEL, SEQUENCE_PARALLEL_ZIGZAG, make_mesh
    from dsv4.sharding.rules import named_sharding

    cfg, state, ids, inputs, ref_out = reference
    attention, layout = variant.rsplit("-", 1)
    rules = {"split": SEQUENCE_PARALLEL, "repl": SEQUENCE_ONLY, "zigzag": SEQUENCE_PARALLEL_ZIGZAG}[layout]
    mesh = make_mesh(_N_GPUS)

    def sharding_of(var):
        return named_sharding(mesh, rules, var.get_metadata().get("axes", (None,) * var.ndim), var.shape)

    _put(state, sharding_of)
    gd = _graphdef(cfg, jnp.bfloat16, dsv4.Kernels(attention=attention, indexer="pallas", moe="pallas"))
    outs = _layer_outputs(gd, state, ids, inputs, mesh, rules)
    _check_updates(f"{_N_GPUS}dev-{variant}", cfg, outs, ref_out, inputs, _N_GPUS)
