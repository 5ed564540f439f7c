"""Random weights made on the devices, in the formats DeepSeek releases, laid out on a mesh: for benchmarks of models
too big for any one host or device.

`random_model(config, seed, weights=..., mesh=...)` builds the model's abstract tree (`nnx.eval_shape`) and fills it
leaf by leaf, each leaf one jitted call whose output already has the leaf's sharding, so no host and no device ever
holds the whole model:

- every weight is normal with std 0.02 in the model's dtype (norm weights and scales 1; biases, sinks and position
  biases 0; hash-routing tables a random choice of distinct experts per token), as `dsv4.init_random` declares them;
- `weights="fp8"` keeps every matrix a release stores in FP8 (`dsv4.weights.RELEASED_FP8`: attention q / kv /
  output-b, the indexer's q, shared and routed experts) as e4m3 with one power-of-two (ue8m0) float32 scale per
  128 × 128 block; `"fp8-fp4-experts"` the routed experts as e2m1 instead, two a byte, one scale per row and 32
  columns. Both as `dsv4.quantization.BlockQuantized` values, bit for bit what `dsv4.quantization.quantize_fp8` /
  `quantize_fp4` (ue8m0) make of the same bf16 draw, and what `dsv4.load(keep_quantized=True)` holds for a release
  of it (the fused gate_up is quantized as one matrix: a release's separate w1 and w3 have the same blocks when the
  expert width is a multiple of 128, as V4's is);
- a leaf split over its first axis (the routed experts, the router's rows) is drawn one row at a time from a key of
  its own (the leaf's key folded with the row's global index), each device drawing and quantizing only its own rows
  (`shard_map`); other leaves are drawn whole on every device that holds them.

The values depend on the config, the seed and the leaf's name only: every mesh (and no mesh) gets the same model. They
differ from `dsv4.init_random`'s host draw (same distribution).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4.config import Config
from dsv4.kernels import Kernels
from dsv4.model import DeepseekV4
from dsv4.quantization import FP4_GROUP, FP4_MAX, FP8_MAX, BlockQuantized
from dsv4.sharding import SEQUENCE_PARALLEL, ShardingRules, param_sharding
from dsv4.weights import RELEASED_EXPERT, RELEASED_FP8, deepseek_tensors, fit_sharding, module_name

WEIGHT_FORMATS = ("bf16", "fp8", "fp8-fp4-experts")
"""bf16: every weight unquantized in the model's dtype; fp8 / fp8-fp4-experts: as released, kept quantized."""
FP8_BLOCK = (128, 128)  # DeepSeek's `weight_block_size`
STD = 0.02
_ZEROS = {"base", "hc_base", "position_bias", "sinks", "e_score_correction_bias"}
_ONES = {"scale", "hc_scale"}
# e2m1 magnitudes by code 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours, and whether a value
# exactly on one rounds up (to the even code: round to nearest, ties to even, as ml_dtypes casts).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_UP = (False, True, False, True, False, True, False)


def leaf_init(name: str) -> str:
    """How `dsv4.layers.param` and the model's buffers initialize the leaf called `name` (a module path such as
    "layers.0.input_layernorm.weight"): "zeros", "ones", "hash" (the hash-routing table) or "normal"."""
    parts = name.split(".")
    last = parts[-1]
    if last in _ZEROS:
        return "zeros"
    if last in _ONES or (last == "weight" and len(parts) > 1 and parts[-2].endswith("norm")):
        return "ones"
    if last == "tid2eid":
        return "hash"
    return "normal"


def released_format(name: str, weights: str) -> str | None:
    """The format a release stores the leaf `name` in under `weights` ("fp8", "fp4"), or None (kept as it is)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}; choose one of {list(WEIGHT_FORMATS)}")
    if weights == "bf16":
        return None
    # The checkpoint writer's names decide, so this and `dsv4.weights.save(quantization=...)` agree; an expert
    # tensor maps to one name per expert, of which the first says it.
    dummy = np.zeros((1, 2, 1), np.float32) if name.endswith(("gate_up_proj", "down_proj")) else np.zeros((1, 1))
    released = deepseek_tensors(name, dummy)[0][0]
    if not RELEASED_FP8.search(released):
        return None
    return "fp4" if weights == "fp8-fp4-experts" and RELEASED_EXPERT.search(released) else "fp8"


# ---------------------------------------------------------------------------------------------
# Quantizers on the device: the host quantizers of `dsv4.quantization` (ue8m0 scales), bit for bit.
# ---------------------------------------------------------------------------------------------
def ue8m0_scale(amax: jax.Array, top: float) -> jax.Array:
    """The smallest power of two at least amax / top (1 where amax is 0), float32.

    NOTE: exact through frexp rather than exp2(ceil(log2(.))): XLA's log2 may land a hair off an exact power of
    two, and ceil would then double the scale."""
    ratio = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa · 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.float32(1.0), exponent - (mantissa == 0.5).astype(exponent.dtype))


def quantize_fp8(w: jax.Array, block: tuple[int, int] = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] → (q float8_e4m3fn [..., out, in], scale float32 [..., ceil(out/b0), ceil(in/b1)]): one
    ue8m0 scale per block (edge blocks partial), values rounded to nearest."""
    *lead, rows, cols = w.shape
    b0, b1 = block
    pr, pc = -rows % b0, -cols % b1  # zeros do not change a partial block's amax
    padded = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    tiles = padded.reshape(*lead, (rows + pr) // b0, b0, (cols + pc) // b1, b1)
    scale = ue8m0_scale(jnp.max(jnp.abs(tiles), axis=(-3, -1)), FP8_MAX)
    q = jnp.clip(tiles / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).reshape(padded.shape)
    return q[..., :rows, :cols].astype(jnp.float8_e4m3fn), scale


def e2m1_codes(x: jax.Array) -> jax.Array:
    """float32 values in [-6, 6] → e2m1 codes uint8 (bit 3 the sign), rounded to nearest, ties to even."""
    a = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for mid, up in zip(_FP4_MIDPOINTS, _FP4_TIE_UP, strict=True):
        code = code + ((a >= mid) if up else (a > mid)).astype(jnp.uint8)
    return code | (jnp.signbit(x).astype(jnp.uint8) << 3)


def quantize_fp4(w: jax.Array, group: int = FP4_GROUP) -> tuple[jax.Array, jax.Array]:
    """w [..., out, in] (in even) → (packed uint8 [..., out, in/2], even column in the low nibble; scale float32
    [..., out, ceil(in/group)]): one ue8m0 scale per row and `group` columns."""
    *lead, rows, cols = w.shape
    if cols % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim ({cols}) must be even")
    pc = -cols % group
    groups = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (len(lead) + 1) + [(0, pc)])
    groups = groups.reshape(*lead, rows, (cols + pc) // group, group)
    scale = ue8m0_scale(jnp.max(jnp.abs(groups), axis=-1), FP4_MAX)
    scaled = jnp.clip(groups / scale[..., None], -FP4_MAX, FP4_MAX).reshape(*lead, rows, cols + pc)[..., :cols]
    codes = e2m1_codes(scaled)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def _quantized(w: jax.Array, fmt: str | None):
    """w → (q, scale) in `fmt`, or w itself (fmt None)."""
    if fmt is None:
        return w
    return quantize_fp8(w) if fmt == "fp8" else quantize_fp4(w)


# ---------------------------------------------------------------------------------------------
# One leaf, made where it lives.
# ---------------------------------------------------------------------------------------------
def _draw(key, shape, dtype, init, fmt, experts: int):
    """One leaf (or one row of a row-wise leaf) → its value, quantized in `fmt`. Traced inside the leaf's jit."""
    if init == "hash":  # distinct experts per token: the first k of a random permutation
        rows, k = shape
        return jnp.argsort(jax.random.uniform(key, (rows, experts)), axis=1)[:, :k].astype(dtype)
    return _quantized((STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype), fmt)


def _over_rows(fn, count: int, mesh: Mesh | None, axis: str | None):
    """`fn(row index) → pytree` over rows 0..count-1, stacked: one row at a time (bounded temporaries), each device
    doing only its own rows when `axis` of `mesh` splits them. → a function of no arguments, to trace."""
    if axis is None:
        return lambda: jax.lax.map(fn, jnp.arange(count, dtype=jnp.int32))
    local = count // mesh.shape[axis]

    def body():
        return jax.lax.map(fn, jax.lax.axis_index(axis) * local + jnp.arange(local, dtype=jnp.int32))

    return jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(axis), check_vma=False)


@functools.lru_cache(maxsize=256)
def _leaf_program(shape, dtype_name, init, fmt, experts, row_wise, out_shardings, mesh, axis):
    """The jitted maker of one kind of leaf: fn(seed, leaf_id) → its value (or (q, scale)), laid out as
    `out_shardings`. Row-wise leaves: row r from fold_in(leaf key, r). Cached per kind, so the layers' equal leaves
    share one compilation."""
    dtype = jnp.dtype(dtype_name)

    def fn(seed, leaf_id):
        key = jax.random.fold_in(jax.random.key(seed), leaf_id)
        if not row_wise:
            return _draw(key, shape, dtype, init, fmt, experts)
        row = lambda r: _draw(jax.random.fold_in(key, r), shape[1:], dtype, init, fmt, experts)  # noqa: E731
        return _over_rows(row, shape[0], mesh, axis)()

    return jax.jit(fn, out_shardings=out_shardings)


def _row_split(sharding, ndim: int) -> str | None:
    """The mesh axis that splits an array's first dim and nothing else, or None."""
    if not isinstance(sharding, NamedSharding) or not ndim:
        return None
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    return spec[0] if isinstance(spec[0], str) and all(s is None for s in spec[1:]) else None


def _scale_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    *lead, rows, cols = shape
    if fmt == "fp8":
        return (*lead, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
    return (*lead, rows, -(-cols // FP4_GROUP))


def _layout(sharding, shape: tuple[int, ...], fmt: str | None):
    """→ (out_shardings: one sharding, or (q's, scale's) as the loader lays them out; the mesh axis splitting the
    first dim of every output, or None; that axis's mesh)."""
    if fmt is None:
        outs = (sharding,)
        shapes = (shape,)
    else:
        q_shape = (*shape[:-1], shape[-1] // 2) if fmt == "fp4" else shape
        shapes = (q_shape, _scale_shape(shape, fmt))
        outs = tuple(fit_sharding(sharding, s) for s in shapes)
    axes = {_row_split(o, len(s)) for o, s in zip(outs, shapes)}
    axis = axes.pop() if len(axes) == 1 else None  # q and scale split alike, or every row on every device
    return (outs[0] if fmt is None else outs), axis, (outs[0].mesh if axis is not None else None)


def make_leaf(name: str, shape: tuple[int, ...], dtype, axes, *, seed: int, weights: str, experts: int,
              sharding=None):  # fmt: skip
    """The value of the leaf `name` (declared `shape`, `dtype`, logical `axes`): an array, or a `BlockQuantized`
    where `weights` quantizes it, on `sharding` (None: the default device)."""
    init = leaf_init(name)
    fmt = released_format(name, weights) if init == "normal" and len(shape) >= 2 else None
    row_wise = bool(axes) and axes[0] == "experts" and len(shape) >= 2
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if init in ("zeros", "ones"):  # constants: each device's slice from the host, no program to compile
        fill = np.dtype(dtype).type(init == "ones")
        return jax.make_array_from_callback(shape, sharding, lambda index: np.full(shape, fill)[index])
    out, axis, mesh = _layout(sharding, shape, fmt)
    program = _leaf_program(tuple(shape), jnp.dtype(dtype).name, init, fmt, experts, row_wise, out,
                            mesh if row_wise else None, axis if row_wise else None)  # fmt: skip
    value = program(np.uint32(seed), np.uint32(zlib.crc32(name.encode()) & 0x7FFFFFFF))
    if fmt is None:
        return value
    q, scale = value
    return BlockQuantized(q, scale, fmt, FP8_BLOCK if fmt == "fp8" else (1, FP4_GROUP), tuple(shape),
                          jnp.dtype(dtype).name)  # fmt: skip


def random_model(config: Config | str, seed: int = 0, *, dtype=jnp.bfloat16, kernels: Kernels | str | None = None,
                 weights: str = "bf16", mesh: Mesh | None = None,
                 rules: ShardingRules = SEQUENCE_PARALLEL) -> DeepseekV4:  # fmt: skip
    """A model with random weights made on the devices (module docstring), in `weights` (`WEIGHT_FORMATS`), each
    leaf placed on `mesh` as `rules` lay it out (default: the engine's layout; no mesh: the default device).

    `config`: a Config or a preset name; `kernels`: as `dsv4.init_random`. Raises ValueError naming a bad argument.
    """
    if isinstance(config, str):
        config = Config.preset(config)
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}; choose one of {list(WEIGHT_FORMATS)}")
    if isinstance(kernels, str):
        kernels = Kernels.parse(kernels)
    kernels = (kernels or Kernels()).resolve(jnp.dtype(dtype))
    abstract = nnx.eval_shape(lambda: DeepseekV4(config, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels))
    graphdef, state = nnx.split(abstract)
    sharding_for = None if mesh is None else param_sharding(mesh, rules)
    flat = nnx.to_flat_state(state)
    values = {}
    for path, var in flat:
        axes = var.get_metadata().get("axes") or (None,) * len(var.shape)
        values[path] = make_leaf(module_name(path), tuple(var.shape), var.dtype, tuple(axes), seed=seed,
                                 weights=weights, experts=config.n_routed_experts,
                                 sharding=None if sharding_for is None else sharding_for(path, var))  # fmt: skip
    for path, var in flat:
        var.set_value(values[path])
    return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=64)
def _quantizer(fmt: str, row_wise: bool, out_shardings, mesh, axis):
    """A jitted quantizer of whole weights [..., out, in]; row-wise (3-D expert weights) one expert at a time, each
    device its own experts when `axis` splits them, to bound the float32 temporaries."""
    one = quantize_fp8 if fmt == "fp8" else quantize_fp4
    if not row_wise:
        return jax.jit(one, out_shardings=out_shardings)
    if axis is None:
        return jax.jit(lambda w: jax.lax.map(one, w), out_shardings=out_shardings)
    body = lambda w: jax.lax.map(one, w)  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False),
                   out_shardings=out_shardings)  # fmt: skip


def quantize_released(model: DeepseekV4, weights: str) -> dict:
    """Puts a model's weights, in place, into the format a release stores them in under `weights` (`WEIGHT_FORMATS`),
    kept quantized (`BlockQuantized`, laid out as the weight was); the rest stays as it is. Bit for bit
    `random_model(..., weights=weights)` when the model is `random_model(..., weights="bf16")` with the same seed.
    → {"weights", "quantized": {fmt: count}, "quantized_bytes"}."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r}; choose one of {list(WEIGHT_FORMATS)}")
    counts, nbytes = {}, 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        w = var.get_value()
        name = module_name(path)
        fmt = None if isinstance(w, BlockQuantized) or leaf_init(name) != "normal" else released_format(name, weights)
        if fmt is None or w.ndim < 2:
            continue
        out, axis, mesh = _layout(w.sharding, tuple(w.shape), fmt)
        q, scale = _quantizer(fmt, w.ndim > 2, out, mesh, axis)(w)
        value = BlockQuantized(q, scale, fmt, FP8_BLOCK if fmt == "fp8" else (1, FP4_GROUP), tuple(w.shape),
                               jnp.dtype(w.dtype).name)  # fmt: skip
        jax.block_until_ready(value)
        var.set_value(value)
        del w
        counts[fmt] = counts.get(fmt, 0) + 1
        nbytes += int(q.nbytes + scale.nbytes)
    return dict(weights=weights, quantized=counts, quantized_bytes=nbytes)


def init_kinds(config: Config) -> dict[str, str]:
    """{leaf name: `leaf_init` kind} for every leaf of `DeepseekV4(config)`."""
    abstract = nnx.eval_shape(lambda: DeepseekV4(config, rngs=nnx.Rngs(0)))
    return {module_name(path): leaf_init(module_name(path))
            for path, _ in nnx.to_flat_state(nnx.state(abstract, nnx.Variable))}  # fmt: skip
