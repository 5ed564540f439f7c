"""The public entry points: `load`, `init_random`, `convert`."""

from __future__ import annotations

import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import Config
from dsv4.kernels import Kernels
from dsv4.model import DeepseekV4
from dsv4.orbax_checkpoint import is_orbax_checkpoint, load_orbax_into, save_orbax
from dsv4.random_weights import random_model
from dsv4.sharding import SEQUENCE_PARALLEL, param_sharding
from dsv4.weights import CheckpointError, load_into

log = logging.getLogger("dsv4")


def _kernels(kernels: Kernels | str | None) -> Kernels:
    if kernels is None:
        return Kernels()
    return Kernels.parse(kernels) if isinstance(kernels, str) else kernels


def init_random(config: Config | str, seed: int = 0, *, dtype=jnp.float32, kernels: Kernels | str | None = None,
                weights: str = "bf16", mesh=None) -> DeepseekV4:  # fmt: skip
    """A model with random weights (normal, std 0.02; norms 1; biases 0) — for tests and benchmarks.

    `config` is a Config or a preset name ("tiny", "v4-flash", "v4-pro"). `kernels` picks the implementation of
    each part (a `Kernels`, or a spec such as "pallas" or "attention=pallas,moe=jnp"); default: the fastest
    measured on this device.

    weights "fp8" / "fp8-fp4-experts" (`dsv4.random_weights.WEIGHT_FORMATS`) keep the weights a release quantizes
    in that format on the devices; a `mesh` lays each weight out on it as the engine does. Either way the weights are
    made on the devices, leaf by leaf, each device making only its own slice (`dsv4.random_weights.random_model`:
    other values than the default host draw, the same on every mesh), so no host or device ever holds the whole
    model.
    """
    if weights != "bf16" or mesh is not None:
        return random_model(config, seed, dtype=dtype, kernels=_kernels(kernels), weights=weights, mesh=mesh)
    if isinstance(config, str):
        config = Config.preset(config)
    rng = np.random.default_rng(seed)
    model = DeepseekV4(config, rngs=rng, dtype=dtype, kernels=_kernels(kernels))
    for layer in model.layers:  # hash routing needs a real table: distinct experts per token
        if layer.mlp.is_hash:
            table = np.argsort(rng.random((config.vocab_size, config.n_routed_experts)), axis=1)
            layer.mlp.gate["tid2eid"].set_value(jnp.asarray(table[:, : config.num_experts_per_tok], jnp.int32))
    return model


CHECK_FINITE_MAX_BYTES = 2 << 30
"""`load` checks every weight for NaN / inf by default below this many bytes of parameters."""


def check_finite(model: DeepseekV4, where: str = "") -> None:
    """Raises CheckpointError (a ValueError) naming the first parameter holding NaN or inf, and how many."""
    state = nnx.state(model, nnx.Param)
    for path, value in jax.tree_util.tree_leaves_with_path(state):
        if not jnp.issubdtype(value.dtype, jnp.floating):
            continue
        bad = int(_count_non_finite(value))
        if bad:
            parts = (str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
            name = ".".join(p for p in parts if p and p != "value")
            raise CheckpointError(f"tensor model.{name}{' in ' + where if where else ''} holds {bad} non-finite values "
                                  f"(NaN or inf) of {value.size}")  # fmt: skip


@jax.jit
def _count_non_finite(x):
    return jnp.sum(~jnp.isfinite(x.astype(jnp.float32)))


def load(model_dir: str | os.PathLike, *, dtype=jnp.bfloat16, kernels: Kernels | str | None = None, mesh=None,
         shardings=None, keep_quantized: bool = False, progress: bool | None = None,
         check_finite_weights: bool | None = None) -> DeepseekV4:  # fmt: skip
    """Loads a checkpoint directory: config.json + safetensors (either tensor layout, plain or FP8/FP4
    block-quantized), or an orbax checkpoint written by `dsv4.convert`; the log says which it found.

    kernels: as `init_random`.
    mesh / shardings: where each parameter goes. `shardings` is a `dsv4.sharding.ShardingRules` (with
    `mesh`), or a callable `sharding_for(path, var) -> jax.sharding.Sharding`; a `mesh` alone uses the default
    rules (`dsv4.sharding.SEQUENCE_PARALLEL`). Each tensor is streamed from disk to its devices, each device
    receiving only its slice, so host RAM holds about one tensor at a time. Default: the default device.
    keep_quantized: keep FP8/FP4 weights quantized on the devices (`dsv4.quantization.BlockQuantized`
    parameter values: q + float32 scales, dequantized where the model reads them) instead of dequantizing
    them to `dtype` on load. progress: a stderr progress line (default: for checkpoints of 1 GB or more).

    Raises ValueError (CheckpointError) naming the config field or tensor and file on bad input; nothing is
    placed on a device until the whole checkpoint has been checked. check_finite_weights: also check every weight
    for NaN / inf (a ValueError naming the tensor); default: for models under 2 GB of parameters.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = Config.from_hf(model_dir)
    kernels = _kernels(kernels).resolve(dtype)
    abstract = nnx.eval_shape(lambda: DeepseekV4(config, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels))
    sharding_for = _sharding_for(mesh, shardings)

    def check_integer(name: str, table: np.ndarray, where: str) -> None:
        n = config.n_routed_experts
        if name.endswith("mlp.gate.tid2eid") and table.size and (table.min() < 0 or table.max() >= n):
            raise CheckpointError(f"tensor model.{name} in {where} has expert ids outside [0, {n})")

    if is_orbax_checkpoint(model_dir):
        fmt = "orbax"
        model = load_orbax_into(abstract, model_dir, sharding_for=sharding_for, keep_quantized=keep_quantized,
                                check_integer=check_integer)  # fmt: skip
    else:
        fmt = "safetensors"
        model = load_into(abstract, model_dir, sharding_for=sharding_for, keep_quantized=keep_quantized,
                          progress=progress, check_integer=check_integer)  # fmt: skip
    if check_finite_weights is None:
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        check_finite_weights = nbytes < CHECK_FINITE_MAX_BYTES
    if check_finite_weights:
        check_finite(model, model_dir)
    log.info("loaded %s (%s checkpoint, %d layers, %s%s)", model_dir, fmt, config.num_hidden_layers,
             jnp.dtype(dtype).name, ", quantized weights kept" if keep_quantized else "")  # fmt: skip
    return model


def _sharding_for(mesh, shardings):
    """`load`'s mesh/shardings arguments → a `sharding_for(path, var)` callable, or None (default device)."""
    if callable(shardings):
        return shardings
    if mesh is None:
        if shardings is not None:
            raise ValueError("shardings=ShardingRules needs a mesh")
        return None
    return param_sharding(mesh, shardings if shardings is not None else SEQUENCE_PARALLEL)


def convert(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, *, dtype=None, keep_quantized: bool = False,
            mesh=None, shardings=None, progress: bool | None = None) -> None:  # fmt: skip
    """Converts a checkpoint (safetensors in either layout, plain or FP8/FP4; or orbax) to an orbax
    checkpoint plus config.json in `dst_dir`.

    The model passes through device memory once: spread it with `mesh`/`shardings` (as for `dsv4.load`)
    when it does not fit one device. dtype: of the stored weights (default bfloat16; float32 parameters
    such as norms stay float32). keep_quantized: store FP8/FP4 weights as they are (q + float32 scales).
    """
    src_dir, dst_dir = os.fspath(src_dir), os.fspath(dst_dir)
    if os.path.exists(os.path.join(dst_dir, "state")):
        raise FileExistsError(f"{os.path.join(dst_dir, 'state')} exists; convert into an empty directory")
    t0 = time.perf_counter()
    model = load(src_dir, dtype=dtype or jnp.bfloat16, mesh=mesh, shardings=shardings, keep_quantized=keep_quantized,
                 progress=progress)  # fmt: skip
    loaded_s = time.perf_counter() - t0
    show = progress if progress is not None else sys.stderr.isatty()
    if show:
        print(f"loaded {src_dir} in {loaded_s:.1f} s; writing orbax checkpoint {dst_dir} ...", file=sys.stderr)
    save_orbax(model, dst_dir)
    if show:
        print(f"converted {src_dir} → {dst_dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)




def num_params(model: DeepseekV4) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
