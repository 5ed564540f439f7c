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


def _build(config: Config, *, dtype, attention_impl: str, moe_impl: str, rngs) -> DeepseekV4:
    return DeepseekV4(config, rngs=rngs, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl)


def init_random(config: Config | str, seed: int = 0, *, dtype=jnp.float32, attention_impl: str = "jnp",
                moe_impl: str = "jnp") -> DeepseekV4:  # fmt: skip
    """A model with random weights (normal, std 0.02; norms 1; biases 0) — for tests and benchmarks.

    `config` is a Config or a preset name ("tiny", "v4-flash", "v4-pro"). `attention_impl` / `moe_impl`
    pick the kernels: "jnp" (XLA) or "pallas".
    """
    if isinstance(config, str):
        config = Config.preset(config)
    rng = np.random.default_rng(seed)
    model = _build(config, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl, rngs=rng)
    for layer in model.layers:  # hash routing needs a real table: distinct experts per token
        if layer.mlp.is_hash:
            table = np.argsort(rng.random((config.vocab_size, config.n_routed_experts)), axis=1)
            layer.mlp.gate["tid2eid"].set_value(jnp.asarray(table[:, : config.num_experts_per_tok], jnp.int32))
    return model


def load(model_dir: str | os.PathLike, *, dtype=jnp.bfloat16, attention_impl: str = "jnp",
         moe_impl: str = "jnp") -> DeepseekV4:  # fmt: skip
    """Loads a checkpoint directory (config.json + safetensors in transformers' layout).

    Raises ValueError (CheckpointError) naming the config field or tensor on bad input; nothing is
    placed on a device until the whole checkpoint has been checked.
    """
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = Config.from_hf(model_dir)
    abstract = nnx.eval_shape(
        lambda: _build(config, dtype=dtype, attention_impl=attention_impl, moe_impl=moe_impl, rngs=nnx.Rngs(0))
    )
    model = load_into(abstract, model_dir)
    for i, layer in enumerate(model.layers):
        if layer.mlp.is_hash:
            table = np.asarray(layer.mlp.gate["tid2eid"][...])
            if table.size and (table.min() < 0 or table.max() >= config.n_routed_experts):
                raise CheckpointError(
                    f"tensor model.layers.{i}.mlp.gate.tid2eid has expert ids outside [0, {config.n_routed_experts})"
                )
    log.info("loaded %s (safetensors, %d layers, %s)", model_dir, config.num_hidden_layers, jnp.dtype(dtype).name)
    return model


def num_params(model: DeepseekV4) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
