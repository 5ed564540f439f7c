"""The public entry points: `load`, `init_random`."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.config import Config
from dsv4.model import DeepseekV4
from dsv4.weights import CheckpointError, load_into

log = logging.getLogger("dsv4")


def _build(config: Config, *, dtype, attention_impl: str, moe_impl: str, rngs,
           indexer_impl: str = "auto") -> DeepseekV4:  # fmt: skip
    return DeepseekV4(config, rngs=rngs, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl,
                      indexer_impl=indexer_impl)


def init_random(config: Config | str, seed: int = 0, *, dtype=jnp.float32, attention_impl: str = "auto",
                moe_impl: str = "jnp", indexer_impl: str = "auto") -> DeepseekV4:  # fmt: skip
    """A model with random weights (normal, std 0.02; norms 1; biases 0) — for tests and benchmarks.

    `config` is a Config or a preset name ("tiny", "v4-flash", "v4-pro"). `attention_impl` / `moe_impl` /
    `indexer_impl` pick the kernels: "jnp" (XLA), "pallas", or "auto" (Pallas for 16-bit prefill on a GPU).
    """
    if isinstance(config, str):
        config = Config.preset(config)
    rng = np.random.default_rng(seed)
    model = _build(config, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl, rngs=rng,
                   indexer_impl=indexer_impl)
    for layer in model.layers:  # hash routing needs a real table: distinct experts per token
        if layer.mlp.is_hash:
            table = np.argsort(rng.random((config.vocab_size, config.n_routed_experts)), axis=1)
            layer.mlp.gate["tid2eid"].set_value(jnp.asarray(table[:, : config.num_experts_per_tok], jnp.int32))
    return model


def load(model_dir: str | os.PathLike, *, dtype=jnp.bfloat16, attention_impl: str = "auto", moe_impl: str = "jnp",
         indexer_impl: str = "auto", mesh=None, shardings=None, keep_quantized: bool = False,
         progress: bool | None = None) -> DeepseekV4:  # fmt: skip
    """Loads a checkpoint directory: config.json + safetensors (either tensor layout, plain or FP8/FP4
    block-quantized), or an orbax checkpoint written by `dsv4.convert.convert`; the log says which it found.

    mesh / shardings: where each parameter goes. `shardings` is a `dsv4.sharding.ShardingRules` (with
    `mesh`), or a callable `sharding_for(path, var) -> jax.sharding.Sharding`; a `mesh` alone uses the default
    rules (`dsv4.sharding.SEQUENCE_PARALLEL`). Each tensor is streamed from disk to its devices, each device
    receiving only its slice, so host RAM holds about one tensor at a time. Default: the default device.
    keep_quantized: keep FP8/FP4 weights quantized on the devices (`dsv4.quantization.BlockQuantized`
    parameter values: q + float32 scales, dequantized where the model reads them) instead of dequantizing
    them to `dtype` on load. progress: a stderr progress line (default: for checkpoints of 1 GB or more).

    Raises ValueError (CheckpointError) naming the config field or tensor and file on bad input; nothing is
    placed on a device until the whole checkpoint has been checked.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = Config.from_hf(model_dir)
    abstract = nnx.eval_shape(
        lambda: _build(config, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl, rngs=nnx.Rngs(0),
                       indexer_impl=indexer_impl)
    )
    sharding_for = _sharding_for(mesh, shardings)

    def check_integer(name: str, table: np.ndarray, where: str) -> None:
        n = config.n_routed_experts
        if name.endswith("mlp.gate.tid2eid") and table.size and (table.min() < 0 or table.max() >= n):
            raise CheckpointError(f"tensor model.{name} in {where} has expert ids outside [0, {n})")

    from dsv4.convert import is_orbax_checkpoint, load_orbax_into

    if is_orbax_checkpoint(model_dir):
        fmt = "orbax"
        model = load_orbax_into(abstract, model_dir, sharding_for=sharding_for, keep_quantized=keep_quantized,
                                check_integer=check_integer)  # fmt: skip
    else:
        fmt = "safetensors"
        model = load_into(abstract, model_dir, sharding_for=sharding_for, keep_quantized=keep_quantized,
                          progress=progress, check_integer=check_integer)  # fmt: skip
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
    from dsv4.sharding import SEQUENCE_PARALLEL, param_sharding

    return param_sharding(mesh, shardings if shardings is not None else SEQUENCE_PARALLEL)


def num_params(model: DeepseekV4) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
