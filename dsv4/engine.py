"""The serving engine: `LLM` turns prompts into tokens with the host scheduler and the device runner.

    llm = dsv4.LLM("tiny", max_slots=8, max_model_len=8192)
    outputs = llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)          # blocking, in prompt order
    for event in llm.stream(prompts):  # TokenEvent(request_id, token_id, finish_reason, output, ...)
        ...
    rid = llm.add_request(prompt_ids, max_new_tokens=16); llm.step(); llm.cancel(rid)   # online

One engine step is: `Scheduler.schedule()` (host, pure Python: who runs, how many tokens, which pages),
`ModelRunner.execute(plan)` (device: the chunks, padded into a few fixed shapes, and each token drawn from the last
position's logits of each chunk that needs them, `dsv4.generate.sample_on_device`, keyed by the request's seed and
the token's position, with the logprobs asked for), `Scheduler.update(plan, sampled)`. The
engine adds what neither side knows about: prompts as text, sampling state, per-request metrics, and the
mapping of errors to the request that caused them.

Decode bursts (`LLM(decode_steps=k)`, k > 1). A step that would be decodes only (every running request decoding,
none waiting) runs up to k decode steps of every request in one device call instead (`ModelRunner.execute_burst`),
sampling on the device, so the host dispatches once for k tokens: the fix for a decode step whose host time exceeds
its device time. Any other step is the ordinary one, so an arrival waits at most one burst. A burst's greedy tokens
are the single steps' (the same argmax of the same logits); tokens past a stop token or max_new_tokens are dropped,
and the request finishes as it would have. Events come out in step order, one per token, but the tokens of one
burst reach the host together: they share one time in `RequestMetrics.token_times`, so inter-token latency inside a
burst is ~0 and the gap between bursts is k steps; what improves is TPOT.

Faults. A step is a transaction over the requests it planned: if anything fails after `schedule()` (the runner
before or after its device calls, the host bookkeeping, `update`), every request in the plan is finished with
finish_reason "error" (the exception in `RequestOutput.error`), its pages and slot released (`Scheduler.abort`,
`ModelRunner.release`); the other requests are untouched: the plan changed nothing of theirs but preemptions,
which are already a consistent state (they recompute from scratch). The device cache is donated to every jitted
call, so a failed call may have consumed it: then the runner rebuilds an empty cache (`ModelRunner.rebuild_cache`)
and every other request that had state in it is preempted, i.e. recomputes its prompt and outputs from position 0
(the scheduler's preemption), so its tokens are the same as if nothing had happened. Either way the next step runs.
A step whose chunks return no logits (a long prompt's chunks before its last) is left running on the device while
the host plans and dispatches the next (`ModelRunner.execute`), so a device fault in it surfaces in the next step,
which fails as above.
A failure that belongs to one request fails only that request: its logits are not finite, its sampling raises, or
decoding its text raises. Requests are validated at the door (`add_request`, `SamplingParams`): a bad one raises
ValueError naming the field and the value and never reaches a step.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dsv4.api import init_random, load
from dsv4.cache import BlockPool, KVCacheManager, PageSpec
from dsv4.config import SLIDING, Config
from dsv4.generate import (
    SamplingParams,
    is_int,
    is_real,
    sample,
)
from dsv4.kernels import Kernels
from dsv4.memory_plan import GIB, KV_FORMATS, MemoryPlan, default_chunk_size, default_max_model_len, plan_memory
from dsv4.model import DeepseekV4, check_token_ids
from dsv4.quantization import fp4_reblock_extra_bytes, reblock_fp4_experts
from dsv4.runner import BurstTokens, ModelRunner, power_of_two_buckets
from dsv4.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from dsv4.sharding.mesh import check_mesh, on_mesh, shard_model
from dsv4.tokenizer import TextTokenizer, load_tokenizer

Prompt = str | Sequence[int]

log = logging.getLogger("dsv4")

DEFAULT_PAGE_TOKENS = 256
"""Default tokens per KV page, rounded up to a multiple of every compress rate."""

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    """Wall-clock times (`time.perf_counter()` seconds) of one request's life."""

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each generated token reached the host, in order."""
    finished_time: float | None = None
    num_preemptions: int = 0
    compile_s: float = 0.0
    """Seconds of one-time compilation in the steps of this request's life (every running request waits for it).
    Not counted in `ttft_s`; `LLM(warmup=True)` (the default) compiles up front so this stays 0."""
    compile_before_first_token_s: float = 0.0
    """The part of `compile_s` before the first token, which `ttft_s` leaves out."""

    @property
    def ttft_s(self) -> float | None:
        """Arrival → first token: queueing, the whole (chunked) prefill, and the first sample; one-time
        compilation (`compile_s`) left out."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time - self.compile_before_first_token_s

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gap before each token after the first."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (n - 1); None below two tokens."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated tokens (a stop token that ended the request is included)."""
    metrics: RequestMetrics
    finish_reason: str | None = None
    """None while running; then "stop" (a stop token), "length" (max_new_tokens), "cancelled" or "error"."""
    error: str | None = None
    """Why the request failed (finish_reason "error"): refused (too long for the model or the KV memory, bad ids),
    its step failed, its logits were not finite, or decoding its text failed."""
    text: str | None = None
    """The generated tokens decoded, when the engine has a tokenizer."""
    logprobs: list[float] | None = None
    """With `SamplingParams.logprobs` set: each generated token's log-probability (log_softmax of the float32
    logits, before temperature / top-k / top-p)."""
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    """With `SamplingParams.logprobs` = k: for each generated token, the k most likely (token id, log-probability)
    pairs, most likely first."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class TokenEvent(NamedTuple):
    """One generated token of one request, as `stream` and `step` hand them out."""

    request_id: str
    token_id: int | None
    """None only on a failed request's last event (finish_reason "error": refused, or its step failed)."""
    finish_reason: str | None = None
    """Set on the request's last event."""
    output: RequestOutput | None = None
    """The finished request's output (tokens, metrics), on its last event only."""
    logprob: float | None = None
    """The token's log-probability, when the request asked for logprobs."""
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    """The k most likely (token id, log-probability) pairs, when the request asked for logprobs = k."""


@dataclass
class _Live:
    request: Request
    sampling: SamplingParams
    rng: np.random.Generator
    output: RequestOutput


FP4_EXPERTS = ("auto", "fp4", "fp8")


def fp8_experts_fit(plan: MemoryPlan, *, extra_bytes: int, in_use: int, limit: int, max_slots: int) -> bool:
    """Whether FP4 experts re-blocked as FP8 (`extra_bytes` more on the device) leave room for what `plan` (the
    engine's ledger, weights="fp8", at its max_model_len) counts beyond the weights: the KV cache of `max_slots`
    requests, one chunk's activations and exchanges, the transient buffers; all with the plan's headroom, on a device
    using `in_use` of its `limit` bytes with the weights already placed."""
    runtime = sum(line.bytes_per_device for line in plan.lines
                  if not line.name.startswith("weights:") or "transient" in line.name)  # fmt: skip
    runtime += plan.more_slots_bytes(max_slots)
    return in_use + (extra_bytes + runtime) * plan.headroom <= limit


def _resolve_model(model, *, dtype, seed: int, kernels: Kernels | str | None = None, keep_quantized: bool = False,
                   mesh: Mesh | None = None) -> tuple[DeepseekV4, str | None]:  # fmt: skip
    """A model instance, a checkpoint directory or a preset name → (model, directory or None), on `mesh` if given
    (a checkpoint streamed onto it, each device reading its slice)."""
    if isinstance(model, DeepseekV4):
        if mesh is not None:
            check_mesh(mesh, model.config.n_routed_experts)
            if not on_mesh(model, mesh):
                shard_model(model, mesh)
        return model, None
    name = os.fspath(model)
    if os.path.isdir(name):
        if mesh is not None:
            check_mesh(mesh, Config.from_hf(name).n_routed_experts)
        try:
            return load(name, dtype=jnp.dtype(dtype or "bfloat16"), kernels=kernels, keep_quantized=keep_quantized,
                        mesh=mesh), name  # fmt: skip
        except ValueError as e:
            pickles = sorted(f for f in os.listdir(name) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
            if "no .safetensors files" in str(e) and pickles:
                raise type(e)(f"{e}; {', '.join(pickles[:3])} {'is' if len(pickles) == 1 else 'are'} PyTorch pickle "
                              "file(s), refused, not read (unpickling can run arbitrary code): convert the checkpoint "
                              "to safetensors") from None  # fmt: skip
            raise
    if name not in ("tiny", "v4-flash", "v4-pro") and (os.sep in name or os.path.exists(name)):
        raise FileNotFoundError(f"model {name!r}: {'not a directory' if os.path.exists(name) else 'no such directory'}"
                                " (a checkpoint is a directory with config.json; presets: tiny, v4-flash, v4-pro)")
    if keep_quantized:
        raise ValueError(f"keep_quantized: {name!r} is a preset (random weights, nothing quantized); it applies to a "
                         "checkpoint directory with FP8 / FP4 weights")  # fmt: skip
    dtype = dtype or ("float32" if name == "tiny" else "bfloat16")
    if mesh is not None:
        check_mesh(mesh, Config.preset(name).n_routed_experts)
    model = init_random(name, seed, dtype=jnp.dtype(dtype), kernels=kernels)
    return (model if mesh is None else shard_model(model, mesh)), None


class LLM:
    """An inference engine over one model: continuous batching of up to `max_slots` requests.

    model: a `DeepseekV4`, a checkpoint directory, or a preset name ("tiny", "v4-flash", "v4-pro": random
        weights from `seed`, in `dtype`: default float32 for tiny, bfloat16 otherwise).
    max_slots: requests running at once; each owns one slot of the device cache (its sliding-window ring,
        compressor windows and block table row; its compressed entries live in the shared page pool).
    max_model_len: prompt + max_new_tokens limit of one request, and the longest block table (default:
        min(max_position_embeddings, 32768): `dsv4.memory_plan.default_max_model_len`).
    chunk_size: at most this many tokens of one request per step (chunked prefill). Default: 32768 a device of the
        mesh where the device reports the room for it (the memory plan's runtime lines at that chunk, the other
        slots' caches and FP4 experts' re-blocked copy under fp4_experts="auto", × 1.2 headroom), else 16384; at
        most max_model_len (`dsv4.memory_plan.default_chunk_size`; at 512K on one GPU 32K chunks measured 1.041×
        faster than 16K, and 16K 1.057× faster than 8K). A chunk is one step: set mixed_chunk_size to bound how
        long running requests wait for it.
    mixed_chunk_size: in a step that also runs decodes, prefills get at most this many tokens (default: no limit
        beyond chunk_size). Every running request waits for the whole step, so this bounds their inter-token
        latency while a long prompt prefills; a prompt alone still gets whole chunks.
    max_num_batched_tokens: token budget of one step (default chunk_size + max_slots, so a running long
        prefill keeps its whole chunk while every running decode also gets its token).
    policy: "prefill_priority" (default), "decode_priority" or "fcfs"; see `dsv4.scheduler.SchedulingPolicy`.
    kv_format: how cached rows are stored: "bfloat16" or "float32" (default: the model's dtype), or a
        storage format of `dsv4.cache.layout.FORMAT_NAMES` ("bf16", "fp8-channel", "fp8-tile", ...).
    width_buckets: the chunk widths calls are padded to (default powers of two up to chunk_size); each
        width used costs one compilation. max_packed_width: chunks up to this bucket share one
        [max_slots, w] call; wider ones run as [1, w] on their own slot (see `dsv4.runner`).
    page_size / num_kv_pages: the KV page pool. page_size is in *tokens* per page (a request of N tokens
        holds ceil(N / page_size) pages; each page holds page_size // rate compressed entries of every layer
        at compress rate `rate`), so it must be a multiple of every compress rate; default 256 rounded up to
        one. num_kv_pages: usable pages (the null page comes on top); default what max_slots requests of
        max_model_len need, so requests are never preempted. A smaller pool is less device memory: it admits
        fewer requests and preempts (recompute) when it runs out. The host `KVCacheManager`
        (`PageSpec.tokens(page_size)`) hands out the page ids, the device cache is a pool of that many pages.
    paged: False keeps the older dense device cache (every slot sized for max_model_len; the pages are then
        host accounting only), e.g. for comparisons; the default True pages it.
    tokenizer: a `TextTokenizer`; default: the checkpoint directory's tokenizer.json, if any (else token
        ids only). chat_template: wrap str prompts in the tokenizer's chat template when it has one.
    kernels: which implementation runs each part (`dsv4.Kernels`, or a spec string), for a preset or checkpoint;
        default: the fastest measured on this device. keep_quantized (a checkpoint directory only): keep
        FP8 / FP4 weights quantized on the device (`dsv4.load`); with `Kernels.moe="pallas"` (a GPU's default), FP8
        experts in 128 × 128 blocks run on the FP8 expert kernels (W8A8), and so do FP4 experts, re-blocked as FP8
        once, here (`fp4_experts="fp8"`: twice the experts' FP4 memory; a model instance passed in is converted in
        place), or in each step (`"fp4"`: as stored; a step then re-blocks every expert it reads, 17% of the 512K
        TTFT on an H200, and a decode step every expert of every layer). `"auto"` (the default) re-blocks once when
        the device, as it reports its memory with the weights placed, keeps room for the KV cache of `max_slots`
        requests of `max_model_len` tokens and a chunk's working memory as `dsv4.memory_plan` counts them
        (`fp8_experts_fit`); `self.fp4_experts` says which it chose.
    mesh: run on these devices (`dsv4.sharding.make_mesh()`: every device, over every process): each chunk's tokens
        split over them, the routed experts expert-parallel, the cache replicated; the same greedy tokens as one
        device. A model instance is placed on it, a checkpoint streamed onto it (each device reads its slice).
    warmup: compile the call shapes up front: the decode width, every packed width (chunks up to max_packed_width:
        short prompts and decode batches) and the full chunk's width, so a request waits for no compilation (a long
        prompt's last, partial chunk may still compile its width once); `compile_s` says how long it took. False
        compiles each shape on first use (faster to build, e.g. for tests that build many engines; `warmup()`
        compiles chosen shapes later). Compilation a request waits for is in its `metrics.compile_s`, never in its
        TTFT.
    decode_steps: k > 1 runs a step that would be decodes only as a decode burst of up to k steps in one device call
        (see the module docstring): one more compilation (k loop iterations over the `[max_slots, 1]` step; a burst
        holding a request that asks for logprobs compiles another, on first use). Tokens are drawn on the device
        in bursts as in single steps (`dsv4.generate.sample_on_device`): greedy tokens are the argmax; other
        requests draw with a key of their seed folded with the token's position, so a seeded request's tokens do
        not depend on how its steps were grouped, or on decode_steps. `SamplingParams.seed` defaults to 0, so every
        request has one: two requests left at the default draw alike (`dsv4 serve` gives a request without a seed a
        random one). Logprobs are computed on the device too, in float32 (`dsv4.generate.logprobs`, the host's
        float64 reference, is ~1e-6 away). `runner.burst_form` picks how a burst's steps run
        (`dsv4.runner.BURST_FORMS`). Default 1: every step is the ordinary one.
    """

    def __init__(
        self,
        model: DeepseekV4 | str | os.PathLike,
        *,
        max_slots: int = 8,
        max_model_len: int | None = None,
        chunk_size: int | None = None,
        mixed_chunk_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        policy: str = "prefill_priority",
        kv_format: str | None = None,
        seed: int = 0,
        dtype: str | None = None,
        width_buckets: Sequence[int] | None = None,
        max_packed_width: int = 16,
        page_size: int | None = None,
        num_kv_pages: int | None = None,
        paged: bool = True,
        tokenizer: TextTokenizer | None = None,
        chat_template: bool = True,
        kernels: Kernels | str | None = None,
        keep_quantized: bool = False,
        mesh: Mesh | None = None,
        warmup: bool = True,
        decode_steps: int = 1,
        fp4_experts: str = "auto",
    ) -> None:
        if fp4_experts not in FP4_EXPERTS:
            raise ValueError(f"fp4_experts={fp4_experts!r}; expected 'auto', 'fp4' (as stored) or 'fp8' (re-blocked "
                             "once)")  # fmt: skip
        self.model, model_dir = _resolve_model(model, dtype=dtype, seed=seed, kernels=kernels,
                                               keep_quantized=keep_quantized, mesh=mesh)  # fmt: skip
        self.mesh = mesh
        config = self.config = self.model.config
        if max_model_len is None:
            max_model_len = default_max_model_len(config)
        if not 2 <= max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, max_position_embeddings="
                             f"{config.max_position_embeddings}]")  # fmt: skip
        for name, value in (("max_slots", max_slots), ("max_model_len", max_model_len), ("chunk_size", chunk_size),
                            ("max_packed_width", max_packed_width), ("decode_steps", decode_steps)):  # fmt: skip
            if (value is not None or name != "chunk_size") and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        for name, value in (("max_num_batched_tokens", max_num_batched_tokens), ("mixed_chunk_size", mixed_chunk_size)):
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1 or None")
        self.max_model_len, self.decode_steps = max_model_len, int(decode_steps)
        # FP4 experts re-blocked as FP8 once, for the W8A8 kernels, unless asked not to: their extra bytes
        reblock = fp4_experts != "fp4" and self.model.kernels.moe == "pallas"
        count, extra = fp4_reblock_extra_bytes(self.model, self._local_device()) if reblock else (0, 0)
        # Whether a device has the room at a chunk size, the re-blocked copy included: asked once a size (an
        # allgather across processes), by the default chunk and by the re-blocking choice. The longer chunk only
        # where it leaves room for that copy: the copy saves more (1.17x at 512K) than the longer chunk (1.04x).
        room = functools.cache(lambda chunk: self._room_for(chunk, max_slots, kv_format, extra))
        if chunk_size is None:
            chunk_size = default_chunk_size(max_model_len, mesh.size if mesh is not None else 1, fits=room)
        self.chunk_size = chunk_size
        self.fp4_experts = self._hold_fp4_experts(fp4_experts, count, extra, room, max_slots)
        """How FP4 routed experts are held: "fp8" (re-blocked here, once) or "fp4" (as stored, or none to hold)."""
        buckets = sorted(set(width_buckets)) if width_buckets is not None else list(power_of_two_buckets(chunk_size))
        if buckets[-1] < chunk_size:
            buckets.append(chunk_size)  # a full chunk must fit some bucket

        rates = sorted({config.compress_rate(t) for t in config.layer_types if t != SLIDING})
        unit = math.lcm(*rates) if rates else 1  # a page holds whole entries of every rate
        if page_size is None:
            page_size = -(-DEFAULT_PAGE_TOKENS // unit) * unit
        if page_size < 1 or page_size % unit:
            raise ValueError(f"page_size={page_size} (tokens per page) must be a positive multiple of every "
                             f"compress rate {rates}")  # fmt: skip
        self.page_size = page_size
        self.page_spec = PageSpec.tokens(page_size)
        if num_kv_pages is None:
            num_kv_pages = max_slots * self.page_spec.num_pages(max_model_len)
        if num_kv_pages < 1:
            raise ValueError(f"num_kv_pages={num_kv_pages} must be >= 1")
        self.pool = BlockPool(num_kv_pages + 1, page_size)  # + the reserved null page
        self.kv_cache = KVCacheManager(self.pool, self.page_spec)
        paging = dict(page_tokens=page_size, num_pages=self.pool.num_blocks) if paged else {}
        self.runner = ModelRunner(self.model, max_slots=max_slots, max_model_len=max_model_len,
                                  kv_format=kv_format, width_buckets=buckets,
                                  max_packed_width=max_packed_width, mesh=mesh, **paging)  # fmt: skip
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens or chunk_size + max_slots, max_num_seqs=max_slots,
                long_prefill_chunk=chunk_size, mixed_prefill_chunk=mixed_chunk_size, policy=policy,
                max_model_len=max_model_len, decode_steps=self.decode_steps,
            ),
            self.kv_cache,
        )  # fmt: skip
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.chat_template = chat_template
        self._live: dict[str, _Live] = {}
        self._finished: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        # Up front: decode and every packed width (short prompts, decode batches) and the full chunk's width; a
        # long prompt's remainder width compiles on first use (a whole-model compile each: minutes for every bucket).
        widths = [w for w in self.runner.width_buckets if self.runner.is_packed(w)] + [chunk_size]
        self.compile_s = self.warmup(widths=widths) if warmup else 0.0
        """Seconds spent compiling up front (`warmup`)."""

    def _local_device(self):
        """A device of this engine whose memory this process can see."""
        devices = self.mesh.devices.flat if self.mesh is not None else jax.local_devices()
        return next(d for d in devices if d.process_index == jax.process_index())

    def _room_for(self, chunk_size: int, max_slots: int, kv_format, extra_bytes: int) -> bool:
        """Whether every process's device has the room (`fp8_experts_fit`: with the weights placed, `extra_bytes`
        more plus the plan's runtime lines at `chunk_size`, × the headroom). False where a device reports no limit."""
        device = self._local_device()
        stats = (device.memory_stats() if hasattr(device, "memory_stats") else None) or {}
        limit = stats.get("bytes_limit")
        fits = False
        if limit:
            kv = kv_format if isinstance(kv_format, str) and kv_format in KV_FORMATS else "bf16"
            plan = plan_memory(self.config, context=self.max_model_len, devices=self.mesh.size if self.mesh else 1,
                               kv_format=kv, weights="fp8", chunk_size=min(chunk_size, self.max_model_len),
                               device_memory_gib=limit / GIB)  # fmt: skip
            fits = fp8_experts_fit(plan, extra_bytes=extra_bytes, in_use=stats.get("bytes_in_use", 0), limit=limit,
                                   max_slots=max_slots)  # fmt: skip
        if jax.process_count() > 1:  # every process must decide alike
            from jax.experimental import multihost_utils

            fits = bool(np.all(multihost_utils.process_allgather(np.array(fits))))
        return fits

    def _hold_fp4_experts(self, choice: str, count: int, extra: int, room, max_slots: int) -> str:
        """Re-blocks the `count` FP4 routed experts (`extra` bytes more a device; none to re-block under the jnp MoE
        or `choice` "fp4") as FP8 once if `choice` is "fp8", or "auto" and `room(self.chunk_size)` (`_room_for`).
        → "fp8" if it did, else "fp4"."""
        if not count:  # as asked, none, or the jnp MoE (it dequantizes FP4 experts where it reads them); the same in
            return "fp4"  # every process (unlike `extra`)
        if choice == "auto" and not room(self.chunk_size):
            log.info("FP4 experts kept as stored (re-blocked in each step): as FP8 they would take %.1f GiB more a "
                     "device than its memory leaves beside %d slots of %d tokens and %d-token chunks (or it reports "
                     "no limit)", extra / GIB, max_slots, self.max_model_len, self.chunk_size)  # fmt: skip
            return "fp4"
        reblock_fp4_experts(self.model)
        log.info("FP4 experts re-blocked as FP8 once: %.1f GiB more a device, no pass in each step", extra / GIB)
        return "fp8"

    # ----- online API ------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids: a str through the checkpoint's tokenizer, or a flat sequence of ints (Python or
        numpy; a 1-D integer array). Raises ValueError naming the problem: a float or nested element, a 2-D
        array, a str without a tokenizer. (Empty prompts and ids out of range are `add_request`'s to refuse.)"""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this model has none (no tokenizer.json in "
                                 "its directory): pass token ids instead")  # fmt: skip
            return self.tokenizer.encode(prompt, chat_template=self.chat_template)
        if isinstance(prompt, (bytes, bytearray, dict, set, frozenset)) or not (
            isinstance(prompt, Sequence) or hasattr(prompt, "__array__")
        ):
            raise ValueError(f"prompt: expected a str or a flat sequence of int token ids; got {type(prompt).__name__}")
        if hasattr(prompt, "__array__") and not isinstance(prompt, Sequence):
            array = np.asarray(prompt)
            if array.ndim != 1:
                raise ValueError(f"prompt: token ids must be a flat sequence; got an array of shape {array.shape}")
            if not np.issubdtype(array.dtype, np.integer):
                raise ValueError(f"prompt: token ids must be integers; got an array of dtype {array.dtype}")
            return array.tolist()  # Python ints, whatever the integer dtype
        if type(prompt) is list and set(map(type, prompt)) == {int}:  # the common case, checked in C loops
            return list(prompt)  # (a 128K-token prompt: ~2 ms, where the loop below takes ~55 on a 2-core box)
        ids = []
        for position, token in enumerate(prompt):
            if not is_int(token):
                kind = type(token).__name__
                if isinstance(token, (Sequence, np.ndarray)):
                    kind += ", a nested sequence: prompts are flat"
                raise ValueError(f"prompt: the token id at position {position} is {token!r} ({kind}); token ids "
                                 "are ints")  # fmt: skip
            ids.append(int(token))
        return ids

    def add_request(self, prompt: Prompt, *, max_new_tokens: int = 16, sampling: SamplingParams | None = None,
                    stop_token_ids: Iterable[int] = (), request_id: str | None = None,
                    arrival_time: float | None = None) -> str:  # fmt: skip
        """Queues a request and returns its id. Raises ValueError naming the field and the value when it can never
        run: a prompt that is empty, not a str or flat sequence of ints, or has an id out of range; max_new_tokens
        not an int >= 1; sampling not a `SamplingParams` (whose own fields are checked when it is made); a stop
        token that is not an int; prompt + max_new_tokens over max_model_len, or more KV than the whole page pool.
        `arrival_time` (perf_counter seconds, default now) is where TTFT starts."""
        if arrival_time is not None and (not is_real(arrival_time) or not math.isfinite(arrival_time)):
            raise ValueError(f"arrival_time={arrival_time!r} must be a finite number (perf_counter seconds)")
        arrival = time.perf_counter() if arrival_time is None else float(arrival_time)
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id={request_id!r} must be a str")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already running")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens={max_new_tokens!r} must be an int >= 1")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling={sampling!r} must be a dsv4.SamplingParams")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise ValueError(f"request {request_id!r}: stop_token_ids={stop_token_ids!r} must be a collection of ints")
        stop = list(stop_token_ids)
        bad_stop = [t for t in stop if not is_int(t)]
        if bad_stop:
            raise ValueError(f"request {request_id!r}: stop_token_ids holds {bad_stop[0]!r}, not an int token id")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        check_token_ids(np.asarray(ids), self.config.vocab_size)
        request = Request(request_id, ids, int(max_new_tokens), frozenset(int(t) for t in stop))
        self.scheduler.add_request(request)  # may raise: too long for max_model_len or the pool
        sampling = sampling or SamplingParams()
        metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids))
        output = RequestOutput(request_id, request.prompt_token_ids, request.output_token_ids, metrics)
        if sampling.logprobs is not None:
            output.logprobs, output.top_logprobs = [], []
        self._live[request_id] = _Live(request, sampling, np.random.default_rng(sampling.seed), output)
        self._finished.pop(request_id, None)
        return request_id

    def step(self) -> list[TokenEvent]:
        """Runs one engine step; returns the tokens it produced (last event of a request: finish_reason set).

        Never raises for a fault inside the step: the requests it hits are finished with finish_reason "error"
        (their last event has token_id None unless a token was sampled), and the next step runs; see the module
        docstring, "Faults"."""
        if not self.scheduler.has_unfinished_requests():
            return []
        plan = self.scheduler.schedule()
        events = []  # requests whose grant raised (SchedulerOutput.failed): already out of the scheduler
        for request_id, message in plan.failed.items():
            events += self._fail(request_id, message, time.perf_counter())
        if not plan.chunks:
            return events
        if any(chunk.num_steps > 1 for chunk in plan.chunks):
            return events + self._step_burst(plan)
        return events + self._step_chunks(plan)

    def _step_chunks(self, plan) -> list[TokenEvent]:
        """`step` for an ordinary plan: the runner's one call, then a token for each chunk that needs logits."""

        def run():
            now = time.perf_counter()
            for chunk in plan.chunks:
                live = self._live[chunk.request_id]
                if live.output.metrics.first_scheduled_time is None:
                    live.output.metrics.first_scheduled_time = now
                plan.draws[chunk.request_id] = (live.sampling, live.request.num_tokens)  # how its token is drawn
            return self.runner.execute(plan)

        picks, failure = self._execute(plan, run)
        if failure is not None:
            return failure

        sampled: dict[str, int] = {}
        extra: dict[str, tuple[float, tuple[tuple[int, float], ...]] | None] = {}
        failed: dict[str, str] = {}
        for request_id, pick in picks.items():
            live = self._live.get(request_id)
            if live is None or live.request.status is not RequestStatus.RUNNING:
                continue  # cancelled while the step ran
            try:
                token = sample(pick, live.sampling, live.rng)
                extra[request_id] = None if live.sampling.logprobs is None else (pick.logprob, pick.top)
            except Exception as e:  # noqa: BLE001 -- this request's fault: it fails alone
                failed[request_id] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            sampled[request_id] = token
        events, finished = self._update(plan, sampled, failed)
        if finished is None:
            return events
        now = time.perf_counter()
        for request_id, token in sampled.items():
            live = self._live.get(request_id)
            if live is None:
                continue  # cancelled meanwhile: no more events
            try:
                logprob, top = extra[request_id] if extra[request_id] is not None else (None, None)
                events.append(self._emit(live, token, logprob, top, now, finished.get(request_id)))
            except Exception as e:  # noqa: BLE001
                log.warning("request %s failed after its step", request_id, exc_info=True)
                events += self._fail_emitted(request_id, live, f"{type(e).__name__}: {e}", now, token)
        return events

    def cancel(self, request_id: str) -> bool:
        """Stops a live request now and frees its pages and slot; False if it is not live (already finished)."""
        if self.scheduler.cancel(request_id) is None:
            return False
        self._finish(request_id, "cancelled", time.perf_counter())
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_output(self, request_id: str) -> RequestOutput | None:
        """A live request's output so far, or a finished one's until `pop_output` takes it."""
        live = self._live.get(request_id)
        return live.output if live is not None else self._finished.get(request_id)

    def pop_output(self, request_id: str) -> RequestOutput | None:
        """Takes a finished request's output (the engine keeps finished outputs until they are popped)."""
        return self._finished.pop(request_id, None)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens in the cache, prompt tokens) for a live request: the prefill's progress."""
        live = self._live.get(request_id)
        if live is None:
            return None
        request = live.request
        return min(request.num_computed_tokens, request.num_prompt_tokens), request.num_prompt_tokens

    def warmup(self, prompt_lens: Iterable[int] = (), widths: Iterable[int] = ()) -> float:
        """Compiles, ahead of time, the calls a lone request with each prompt length would make (chunks of
        chunk_size, the remainder, decode), plus any explicit `widths`. Returns the seconds spent."""
        wanted = {1, *widths}
        for length in prompt_lens:
            wanted.update(min(self.chunk_size, length - start) for start in range(0, length, self.chunk_size))
        return self.runner.warmup(wanted, decode_steps=(self.decode_steps,))

    # ----- batch API -------------------------------------------------------------------------------------

    def stream(self, prompts: Sequence[Prompt], max_new_tokens: int = 16, sampling: SamplingParams | None = None,
               stop_token_ids: Iterable[int] = ()) -> Iterator[TokenEvent]:  # fmt: skip
        """Runs the prompts concurrently, yielding each token as it is sampled.

        A refused prompt (too long, bad ids) yields one event with token_id None and finish_reason "error"
        (its output's `error` says why); the others run. Closing the iterator early cancels the rest.
        """
        for _, event in self._run(prompts, max_new_tokens, sampling, stop_token_ids):
            yield event

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int = 16, sampling: SamplingParams | None = None,
                 stop_token_ids: Iterable[int] = ()) -> list[RequestOutput]:  # fmt: skip
        """Runs the prompts concurrently to completion; one output per prompt, in order. A refused prompt's
        output has finish_reason "error" and `error` set; the other prompts still run."""
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for index, event in self._run(prompts, max_new_tokens, sampling, stop_token_ids):
            if event.output is not None:
                outputs[index] = event.output
        return outputs

    def _run(self, prompts, max_new_tokens, sampling, stop_token_ids) -> Iterator[tuple[int, TokenEvent]]:
        """(prompt index, event) for the prompts' requests until all have finished; see `stream`."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise ValueError("prompts must be a list of prompts (each a str or a list of token ids)")
        stop_token_ids = frozenset(stop_token_ids)
        pending: dict[str, int] = {}  # request id → prompt index
        try:
            for index, prompt in enumerate(prompts):
                request_id = f"req-{next(self._ids)}"
                try:
                    self.add_request(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                     stop_token_ids=stop_token_ids, request_id=request_id)  # fmt: skip
                except ValueError as e:
                    yield index, TokenEvent(request_id, None, "error", self._error_output(request_id, prompt, e))
                    continue
                pending[request_id] = index
            while pending:
                if not self.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(pending)} are pending but the scheduler has none")
                for event in self.step():
                    index = pending.get(event.request_id)
                    if index is None:
                        continue  # another caller's request (add_request); its output waits in pop_output
                    if event.finish_reason is not None:
                        del pending[event.request_id]
                        self._finished.pop(event.request_id, None)
                    yield index, event
        finally:
            for request_id in pending:  # closed early: do not leave orphans running
                self.cancel(request_id)
                self._finished.pop(request_id, None)

    # ----- internals -------------------------------------------------------------------------------------

    def _execute(self, plan, run) -> tuple[object, list[TokenEvent] | None]:
        """The runner's call for `plan` (`run()`), its compile time charged: → (its result, None), or (None, the
        events of the plan's requests failing) when it raised: any fault fails them, and the engine goes on.
        Requests cancelled while it ran are released (the call may have given one a slot again)."""
        compile_before = self.runner.compile_s
        try:
            result = run()
        except Exception as e:  # noqa: BLE001
            self._charge_compile(self.runner.compile_s - compile_before)
            return None, self._fail_step(plan, e)
        self._charge_compile(self.runner.compile_s - compile_before)
        for chunk in plan.chunks:
            if chunk.request_id not in self._live:
                self.runner.release(chunk.request_id)
        return result, None

    def _step_burst(self, plan) -> list[TokenEvent]:
        """`step` for a decode burst plan (`ScheduledChunk.num_steps`): the runner's one call, then each request's
        tokens in order until one finishes it (stop token, max_new_tokens; the rest dropped) or fails it (its logits
        not finite at that step: the tokens before it are kept). Faults as in `step`."""

        def run():
            sampling = {chunk.request_id: self._live[chunk.request_id].sampling for chunk in plan.chunks}
            return self.runner.execute_burst(plan, sampling, self.decode_steps)

        bursts: dict[str, BurstTokens]
        bursts, failure = self._execute(plan, run)
        if failure is not None:
            return failure

        sampled: dict[str, list[int]] = {}
        failed: dict[str, tuple[int, str]] = {}  # request id → (step that failed, message)
        before: dict[str, int] = {}  # request id → outputs before the burst
        for chunk in plan.chunks:
            request_id = chunk.request_id
            live = self._live.get(request_id)
            if live is None or live.request.status is not RequestStatus.RUNNING:
                continue
            burst = bursts[request_id]
            bad = np.flatnonzero(burst.non_finite)
            n = int(bad[0]) if bad.size else len(burst.tokens)
            if bad.size:
                count = int(burst.non_finite[n])
                failed[request_id] = (n, f"sampling failed: ValueError: the model's logits are not finite ({count} of "
                                         f"{self.config.vocab_size} NaN or +inf)")  # fmt: skip
            if n:
                sampled[request_id] = [int(t) for t in burst.tokens[:n]]
            before[request_id] = len(live.request.output_token_ids)
        # a request that failed at its first step has nothing to keep: it fails now, as a single step's would
        events, finished = self._update(plan, sampled, {rid: message for rid, (n, message) in failed.items() if n == 0})
        if finished is None:
            return events
        now = time.perf_counter()
        taken = {}  # request id → the tokens it took, in order
        for request_id in sampled:
            live = self._live.get(request_id)
            if live is not None:
                taken[request_id] = live.request.output_token_ids[before[request_id] :]
        for step in range(max((len(t) for t in taken.values()), default=0) + 1):  # step order, as single steps
            for request_id, tokens in taken.items():
                live = self._live.get(request_id)
                if live is None:
                    continue  # finished or failed at an earlier token
                if step == len(tokens):
                    if request_id in failed:  # its next step's logits were not finite
                        events += self._fail(request_id, failed[request_id][1], now)
                    continue
                if step > len(tokens):
                    continue
                token = tokens[step]
                last = step == len(tokens) - 1
                try:
                    logprob, top = bursts[request_id].logprobs_at(step, live.sampling.logprobs)
                    ends = finished.get(request_id) if last else None
                    events.append(self._emit(live, token, logprob, top, now, ends))
                except Exception as e:  # noqa: BLE001
                    log.warning("request %s failed after its step", request_id, exc_info=True)
                    events += self._fail_emitted(request_id, live, f"{type(e).__name__}: {e}", now, token)
        return events

    def _update(self, plan, sampled, failing: dict[str, str]) -> tuple[list[TokenEvent], dict[str, Request] | None]:
        """Fails the requests in `failing` (request id → message), then applies the step's tokens to the scheduler.
        → (the events so far, the requests the update finished by id), or (the events, None) when the update raised:
        then the whole plan has failed (`_fail_step`)."""
        now = time.perf_counter()
        events = [event for rid, message in failing.items() for event in self._fail(rid, message, now)]
        try:
            return events, {request.request_id: request for request in self.scheduler.update(plan, sampled)}
        except Exception as e:  # noqa: BLE001
            return events + self._fail_step(plan, e), None

    def _emit(self, live: _Live, token: int, logprob: float | None, top, now: float,
              finished: Request | None) -> TokenEvent:  # fmt: skip
        """One token's event: its time and logprobs (if asked for) recorded; the request finished with it if
        `finished`."""
        output, metrics, request_id = live.output, live.output.metrics, live.request.request_id
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.token_times.append(now)
        if logprob is not None:
            output.logprobs.append(logprob)
            output.top_logprobs.append(top)
        if finished is not None:
            output = self._finish(request_id, _FINISH_REASONS[finished.status], now)
            return TokenEvent(request_id, token, output.finish_reason, output, logprob, top)
        return TokenEvent(request_id, token, None, None, logprob, top)

    def _fail_emitted(self, request_id: str, live: _Live, message: str, now: float, token: int) -> list[TokenEvent]:
        """A request whose bookkeeping after its step raised fails with `message` (its last event carries `token`)."""
        if request_id in self._live:
            return self._fail(request_id, message, now, token)
        # failed inside `_finish`, after leaving the engine: finish its output here
        self.scheduler.abort(request_id)
        self.runner.release(request_id)
        live.output.finish_reason, live.output.error = "error", message
        self._finished[request_id] = live.output
        return [TokenEvent(request_id, token, "error", live.output)]

    def _finish(self, request_id: str, reason: str, now: float, error: str | None = None) -> RequestOutput:
        """Takes a request that the scheduler has finished out of the engine: releases its slot, completes its
        output (text included: if decoding it fails, the request fails, with the tokens kept)."""
        live = self._live.pop(request_id)
        self.runner.release(request_id)
        output = live.output
        output.finish_reason, output.error = reason, error
        output.metrics.finished_time = now
        output.metrics.num_preemptions = live.request.num_preemptions
        output.token_ids = list(live.request.output_token_ids)
        if self.tokenizer is not None:
            try:
                output.text = self.tokenizer.decode(output.token_ids)
            except Exception as e:  # noqa: BLE001 -- this request's fault alone
                output.finish_reason = "error"
                output.error = (error + "; " if error else "") + f"decoding the text failed: {type(e).__name__}: {e}"
        self._finished[request_id] = output
        return output

    def _fail(self, request_id: str, message: str, now: float, token: int | None = None) -> list[TokenEvent]:
        """Finishes a live request with finish_reason "error": its pages and slot released. → its last event
        (none if it is no longer live)."""
        if request_id not in self._live:
            return []
        self.scheduler.abort(request_id)  # None if the scheduler had already finished it
        output = self._finish(request_id, "error", now, message)
        output.finish_reason = "error"
        return [TokenEvent(request_id, token, "error", output)]

    def _fail_step(self, plan, error: Exception) -> list[TokenEvent]:
        """A step failed after `schedule()`: every request of its plan fails; if the device cache was lost, every
        other request with state in it is preempted (recomputes from scratch). See the module docstring."""
        log.warning("engine step failed; its requests are finished with an error", exc_info=error)
        message = f"the engine step failed: {type(error).__name__}: {error}"
        for request_id in plan.preempted_request_ids:
            self.runner.release(request_id)
        now = time.perf_counter()
        events = []
        for chunk in plan.chunks:
            events += self._fail(chunk.request_id, message, now)
        if not self.runner.cache_ok():
            for request_id in self.runner.rebuild_cache():
                self.scheduler.preempt(request_id)  # recomputes from position 0 when next scheduled
        return events

    def _charge_compile(self, seconds: float) -> None:
        """Compilation in a step delays every live request: it goes to their `compile_s`, and out of TTFT."""
        if seconds <= 0:
            return
        for live in self._live.values():
            metrics = live.output.metrics
            metrics.compile_s += seconds
            if metrics.first_token_time is None:
                metrics.compile_before_first_token_s += seconds

    def _error_output(self, request_id: str, prompt: Prompt, error: Exception) -> RequestOutput:
        try:
            ids = self.encode(prompt)
        except ValueError:
            ids = []
        now = time.perf_counter()
        metrics = RequestMetrics(arrival_time=now, num_prompt_tokens=len(ids), finished_time=now)
        return RequestOutput(request_id, ids, [], metrics, finish_reason="error", error=str(error))
