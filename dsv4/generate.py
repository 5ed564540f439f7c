"""Generation without a KV cache: every step re-runs the whole (padded) sequence.

NOTE: this is the foundation's correctness path, not the serving path. Because every part of V4 is
causal (window attention, compressor entries only once their window is complete, per-token MoE and
hyper-connections), logits at position p do not depend on tokens after p. So the prompt is padded
once to prompt + max_new_tokens and each step reads one position of the same-shaped forward — one
compilation for the whole request. The paged-cache engine replaces this for decode.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.model import DeepseekV4, check_token_ids


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0. top_k <= 0 and top_p >= 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only
    ttft_s: float  # prompt in → first token out (the prefill), excluding one-time compilation
    compile_s: float
    step_s: list[float] = field(default_factory=list)  # time of each later token

    @property
    def tpot_s(self) -> float:
        return float(np.median(self.step_s)) if self.step_s else float("nan")


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, ids, position):
    """ids: [1, L]; position: scalar → logits [vocab] float32 at that position."""
    model = nnx.merge(graphdef, state)
    hidden = model.hidden_states(ids)  # [1, L, D]
    h = jax.lax.dynamic_index_in_dim(hidden[0], position, axis=0, keepdims=False)
    return model.lm_logits(h)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from float32 logits [vocab] on the host."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    if params.top_k > 0:
        kth = np.sort(z)[-min(params.top_k, z.size)]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs)
        keep = np.cumsum(probs[order]) - probs[order] < params.top_p  # smallest set reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def generate(model: DeepseekV4, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: tuple[int, ...] = (), on_token=None) -> GenerationResult:  # fmt: skip
    """Generates up to `max_new_tokens` after `prompt_ids` ([S] ints); stops early on a stop token."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    check_token_ids(prompt, model.config.vocab_size)
    total = prompt.size + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(f"prompt of {prompt.size} + {max_new_tokens} new tokens exceeds max_position_embeddings="
                         f"{model.config.max_position_embeddings}")  # fmt: skip
    ids = np.zeros((1, total), np.int32)
    ids[0, : prompt.size] = prompt
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(sampling.seed)

    start = time.perf_counter()
    compiled = _logits_at.lower(graphdef, state, jnp.asarray(ids), prompt.size - 1).compile()
    compile_s = time.perf_counter() - start

    out, step_s, ttft = [], [], 0.0
    for i in range(max_new_tokens):
        t0 = time.perf_counter()
        logits = np.asarray(compiled(state, jnp.asarray(ids), prompt.size - 1 + i))
        token = sample(logits, sampling, rng)
        elapsed = time.perf_counter() - t0
        if i == 0:
            ttft = elapsed
        else:
            step_s.append(elapsed)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop_token_ids:
            break
        if i + 1 < max_new_tokens:
            ids[0, prompt.size + i] = token
    return GenerationResult(out, ttft, compile_s, step_s)
