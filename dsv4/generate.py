"""Generation without a KV cache: every step re-runs the whole (padded) sequence.

NOTE: this is the foundation's correctness path, not the serving path. Because every part of V4 is
causal (window attention, compressor entries only once their window is complete, per-token MoE and
hyper-connections), logits at position p do not depend on tokens after p. So the prompt is padded
once to prompt + max_new_tokens and each step reads one position of the same-shaped forward — one
compilation for the whole request. The paged-cache engine replaces this for decode.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4.model import DeepseekV4, check_token_ids

MAX_LOGPROBS = 20
"""The most alternatives `SamplingParams.logprobs` may ask for (OpenAI-compatible servers allow 20)."""


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or numpy integer or float, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0; top_k == 0 and top_p == 1 disable those filters.

    Validated here, so sampling only ever sees good values: temperature a finite number >= 0, top_k an int
    >= 0, top_p a finite number in (0, 1], seed an int >= 0, logprobs None or an int in [0, 20]. A bad value
    raises ValueError naming the field and the value.

    logprobs: None (none reported), or k: each generated token's log-probability plus the k most likely
    alternatives (`TokenEvent.logprob` / `.top_logprobs`, `RequestOutput.logprobs` / `.top_logprobs`). They are
    the log_softmax of the model's float32 logits, before temperature, top-k and top-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0")
        if not is_real(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} must be a finite number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0: no top-k filter)")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an int >= 0")
        k = self.logprobs
        if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={k!r} must be None or an int in [0, {MAX_LOGPROBS}]")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "seed", int(self.seed))
        if k is not None:
            object.__setattr__(self, "logprobs", int(k))


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


def check_logits(logits: np.ndarray) -> None:
    """Raises ValueError if the logits hold NaN or +inf (-inf, a masked token, is fine)."""
    bad = np.isnan(logits) | (logits == np.inf)
    if bad.any():
        first = int(np.argmax(bad))
        raise ValueError(f"the model's logits are not finite ({int(bad.sum())} of {logits.size} NaN or +inf, the "
                         f"first at token {first}: {logits[first]})")  # fmt: skip


def sample(logits: np.ndarray | DevicePick, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from float32 logits [vocab] on the host, or the token a `DevicePick` holds (drawn on the device by
    the same params). Raises ValueError on NaN / +inf logits."""
    if isinstance(logits, DevicePick):
        if logits.non_finite:
            raise ValueError(f"the model's logits are not finite ({logits.non_finite} of {logits.vocab} NaN or +inf)")
        return logits.token
    check_logits(logits)
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


def logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log-probability of `token`, the k most likely tokens with theirs, most likely first), from the
    log_softmax of float32 logits [vocab] (before temperature and filters)."""
    z = logits.astype(np.float64)
    z = z - z.max()
    lse = np.log(np.exp(z).sum())
    chosen = float(z[token] - lse)
    if k <= 0:
        return chosen, ()
    top = np.argpartition(-z, min(k, z.size) - 1)[:k]
    top = top[np.lexsort((top, -z[top]))]  # most likely first, ties by token id
    return chosen, tuple((int(t), float(z[t] - lse)) for t in top)


# ----- sampling on the device (the engine's steps and decode bursts) ------------------------------------------


def sampling_key_data(seed: int) -> tuple[int, int]:
    """A request's seed (its low 64 bits) as threefry2x32 key data, the (high, low) 32-bit words `jax.random.key(seed)`
    makes of it: the key that `sample_on_device` folds each token's position into."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


SAMPLING_MODES = ("greedy", "sample", "restrict")


def sampling_mode(temperature, top_k, top_p) -> str:
    """Which of `sample_on_device`'s paths the host arrays of `device_sampling_arrays` take, decided on the host:
    "greedy" (no row samples), "restrict" (a row limits top_k or top_p), else "sample"."""
    if not np.any(np.asarray(temperature) > 0):
        return "greedy"
    return "restrict" if np.any((np.asarray(top_k) > 0) | (np.asarray(top_p) < 1)) else "sample"


def sample_on_device(logits, temperature, top_k, top_p, key_data, positions, mode: str | None = None):
    """One token per row of float32 logits [B, vocab], each row by its own request's parameters, inside a jitted
    program: temperature [B] float32 (0: greedy), top_k [B] int32 (0: off), top_p [B] float32 (1: off), key_data
    [B, 2] uint32 (`sampling_key_data` of the seed), positions [B] int32 (where the sampled token will sit). → int32
    [B].

    Greedy rows take the argmax, the lowest id among ties, as `sample` does on the host: the same token from the same
    logits. Other rows draw from softmax(logits / temperature) restricted as `sample` restricts it (the top_k largest,
    ties at the k-th kept; then the smallest most-likely set whose mass reaches top_p, every token tied with its least
    likely member kept) by the Gumbel-max trick, with noise from the seed's key folded with the position: a
    request's draws depend on its seed and positions only, not on the batch or on how its steps were grouped. They are
    not numpy's draws: a seeded request's tokens differ from `sample`'s.

    mode: None decides the paths on the device (`lax.cond`); or `sampling_mode` of the same arrays, decided on the
    host. A GPU copies a conditional's predicate to the host before it runs the branch, a sync in the middle of
    the call; a mode that the arrays do not match gives wrong tokens."""
    if mode is not None and mode not in SAMPLING_MODES:
        raise ValueError(f"mode={mode!r}: None or one of {SAMPLING_MODES}")
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]

    def draw():
        z = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]

        def restrict():
            ordered = -jnp.sort(-z, axis=-1)  # [B, vocab], largest first
            k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
            kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)  # [B, 1]
            ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
            probs = jax.nn.softmax(ordered, axis=-1)
            kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p[:, None], axis=-1)  # >= 1: the first has 0
            least = jnp.take_along_axis(ordered, jnp.maximum(kept - 1, 0)[:, None], axis=-1)
            # NOTE: top_p = 1 keeps everything top-k kept: float32 mass summed over a large vocabulary can reach 1
            # before its tail, which would drop tokens the host keeps.
            floor = jnp.where(top_p[:, None] < 1, jnp.maximum(least, kth), kth)
            return jnp.where(z >= floor, z, -jnp.inf)

        if mode is None:
            filtered = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1)), restrict, lambda: z)
        else:
            filtered = restrict() if mode == "restrict" else z
        keys = jax.vmap(lambda d, p: jax.random.fold_in(jax.random.wrap_key_data(d, impl="threefry2x32"), p))(
            key_data, positions
        )
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)  # [B, vocab]
        drawn = jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    if mode is None:
        return jax.lax.cond(jnp.any(temperature > 0), draw, lambda: greedy)
    return greedy if mode == "greedy" else draw()


def logprobs_on_device(logits, tokens, num_top: int):
    """`logprobs` for rows of float32 logits [B, vocab] inside a jitted program, in float32 (the host's are float64:
    they agree to ~1e-6): → (log-probability of tokens [B], the num_top most likely ids [B, num_top] int32, most
    likely first, ties by id, and their log-probabilities [B, num_top])."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    values, ids = jax.lax.top_k(lp, min(num_top, logits.shape[-1]))
    return chosen, ids.astype(jnp.int32), values


def non_finite_counts(logits):
    """NaN or +inf entries per row of logits [B, vocab] (what `check_logits` refuses) → int32 [B]."""
    return jnp.sum(jnp.isnan(logits) | (logits == jnp.inf), axis=-1, dtype=jnp.int32)


def device_sampling_arrays(params: list[SamplingParams | None]) -> tuple[np.ndarray, ...]:
    """One row per slot (None: an idle slot, greedy) → (temperature [B] float32, top_k [B] int32, top_p [B] float32,
    key_data [B, 2] uint32), the arguments of `sample_on_device`."""
    temperature = np.zeros(len(params), np.float32)
    top_k = np.zeros(len(params), np.int32)
    top_p = np.ones(len(params), np.float32)
    key_data = np.zeros((len(params), 2), np.uint32)
    for row, p in enumerate(params):
        if p is not None:
            temperature[row], top_k[row], top_p[row] = p.temperature, min(p.top_k, 2**31 - 1), p.top_p
            key_data[row] = sampling_key_data(p.seed)
    return temperature, top_k, top_p, key_data


class DevicePick(NamedTuple):
    """A row's token drawn on the device by its request's sampling (`pick_rows`), in place of its logits on the
    host, with its logprobs when the request asked for them."""

    token: int
    non_finite: int
    """NaN / +inf entries in the row (nonzero: sampling fails, as `check_logits` makes it)."""
    vocab: int
    logprob: float | None = None
    """The token's log-probability (`logprobs_on_device`), when the request asked for logprobs."""
    top: tuple[tuple[int, float], ...] | None = None
    """The k most likely (token id, log-probability), most likely first, for the request's logprobs = k."""


@functools.partial(jax.jit, static_argnums=(6, 7))
def pick_rows(logits, temperature, top_k, top_p, key_data, positions, num_top: int = 0, mode: str | None = None):
    """What a single engine step fetches instead of logits [B, vocab]: each row's token (`sample_on_device`, its
    `mode`: the engine passes `sampling_mode` of the arrays) and its NaN / +inf count, int32 [B] each; with num_top
    > 0 also `logprobs_on_device`'s (log-probability [B], top ids [B, num_top], their log-probabilities [B,
    num_top])."""
    tokens = sample_on_device(logits, temperature, top_k, top_p, key_data, positions, mode)
    picks = (tokens, non_finite_counts(logits))
    return picks + logprobs_on_device(logits, tokens, num_top) if num_top else picks


def generate(model: DeepseekV4, prompt_ids, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: tuple[int, ...] = (), on_token=None) -> GenerationResult:  # fmt: skip
    """Generates up to `max_new_tokens` after `prompt_ids` ([S] ints); stops early on a stop token."""
    prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt is empty: give at least one token")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
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
