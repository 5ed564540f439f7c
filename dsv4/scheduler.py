"""Host-side scheduler: which requests run in the next device step, and how many tokens each.

NOTE: there is no "prefill phase" and no "decode phase". A request has `num_computed_tokens` (tokens whose
KV is in the cache) toward `num_tokens` (prompt + generated so far). Each step hands out a budget of
`max_num_batched_tokens` tokens; a request granted k tokens processes positions
[num_computed_tokens, num_computed_tokens + k). A prompt longer than `long_prefill_chunk` is prefilled over
several steps as partial grants (chunked prefill); a decode is simply a grant of the one token left; a
request resumed after preemption recomputes prompt + outputs the same way (vLLM v1 `sched/scheduler.py`).
What differs between the policies is only the order in which grants are handed out.

Decode bursts (`SchedulerConfig.decode_steps` = k > 1): when every running request is decoding and none is waiting,
each decode is granted up to k steps at once (`ScheduledChunk.num_steps`), capped by the tokens it may still
generate, with the pages for all of them allocated now; the device runs the steps in one call, feeding each sampled
token to the next step, and `update` takes the tokens in order until one finishes the request. Any other step (a
prefill chunk, a request waiting) is the ordinary one, so an arrival waits at most one burst.

The scheduler imports no JAX: it talks to the device side only through `SchedulerOutput` (plain
dataclasses of ints) and gets back the sampled tokens as a dict. Its one dependency is the host-side
`KVCacheManager`, whose `allocate_slots` returns None when pages run out; the scheduler turns that into
waiting (for a new request) or preemption (for a running one), never into an exception mid-step. Should granting
a request raise all the same, that request alone leaves the scheduler (`SchedulerOutput.failed`).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from dsv4.cache.manager import KVCacheManager


class SchedulingPolicy(enum.StrEnum):
    PREFILL_PRIORITY = "prefill_priority"
    """Running decodes (1 token each), then running prefills in arrival order, then new requests in arrival
    order. A long prefill already running is not pushed back by short requests arriving after it: it gets
    its full chunk before any of them is admitted (the seed article's TTFT-for-long-context setting)."""

    DECODE_PRIORITY = "decode_priority"
    """Running decodes first, then every prefill (running or new) shortest-remaining first. Short prompts
    arriving behind a long prefill overtake it; the long one gets what budget they leave. Lowest mean
    TTFT; a steady stream of short prompts that fills the budget can stall a long prefill."""

    FCFS = "fcfs"
    """Every grant in strict arrival order, decodes included: an older prefill can take the whole budget
    and hold back younger requests' decodes for a step."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    """Back in the waiting queue after losing its pages; keeps its outputs and its arrival order."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_CANCELLED = "finished_cancelled"
    FINISHED_ERROR = "finished_error"
    """Failed: its step failed, or sampling it did (`Scheduler.abort`)."""

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_CANCELLED, RequestStatus.FINISHED_ERROR)  # fmt: skip


@dataclass(eq=False)
class Request:
    """One generation request. The caller fills the first four fields; the rest is the scheduler's state.

    `eq=False`: requests compare by identity, so list membership tests cannot confuse two requests.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    """Sampling one of these finishes the request (FINISHED_STOPPED); the stop token is kept in the output."""

    num_computed_tokens: int = field(default=0, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    arrival_seq: int = field(default=-1, init=False)
    """Set by `Scheduler.add_request`: 0, 1, 2, ... in the order requests were added."""
    num_preemptions: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens={self.max_new_tokens!r} must be an int >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far: what the cache must hold before the next token can be sampled."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens not yet in the cache; 1 for a request that is decoding."""
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens [start, stop) of prompt + outputs, without building the whole (possibly 512K) list."""
        prompt_len = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:stop] if start < prompt_len else []
        tail = self.output_token_ids[max(start - prompt_len, 0) : max(stop - prompt_len, 0)]
        return tuple(head) + tuple(tail)


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: process tokens [start, start + num_tokens) of prompt + outputs."""

    request_id: str
    start: int
    """Position of the first token; equals the request's num_computed_tokens when it was scheduled."""
    num_tokens: int
    token_ids: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    """The request's page ids per page group (`PageSpec.groups` order), already covering start + num_tokens."""
    needs_logits: bool
    """True when the chunk ends at the request's last known token, so the next token is sampled from its
    last position: the last chunk of a prefill (or of a recompute), and every decode. Earlier prefill chunks
    need no logits at all."""
    num_steps: int = 1
    """Decode steps of this chunk: 1, or a decode burst of up to `SchedulerConfig.decode_steps`. A burst's chunk
    holds the one known token (num_tokens 1); each later step feeds the token the step before sampled, so the
    request's pages (`block_tables`) cover start + num_steps tokens, and `update` takes up to num_steps tokens."""

    @property
    def block_table(self) -> tuple[int, ...]:
        """The first page group's table: the only one with the default `PageSpec.tokens`."""
        return self.block_tables[0]


@dataclass
class SchedulerOutput:
    """The plan for one device step, and what the device side should drop."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    """In grant order (the policy's order); at most one chunk per request."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Lost their pages in this `schedule` call; they will recompute from position 0 when resumed."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Finished (stopped, length, cancelled) since the previous `schedule` call."""
    failed: dict[str, str] = field(default_factory=dict)
    """Request id → message: granting it raised (a fault in the page pool, say), so this call took it out of the
    scheduler (FINISHED_ERROR) with whatever pages it held freed; the other requests were scheduled as usual."""
    draws: dict[str, tuple] = field(default_factory=dict)
    """Request id → (its `dsv4.generate.SamplingParams`, the position its token will take), set by the engine: how
    the runner draws the token (and the logprobs asked for) on the device; a request not here draws greedily."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    """Token budget of one step, summed over all chunks."""
    max_num_seqs: int = 256
    """At most this many requests running (holding pages) at once."""
    long_prefill_chunk: int = 8192
    """At most this many tokens for one request in one step (8K: the seed article's measured sweet spot)."""
    policy: SchedulingPolicy = SchedulingPolicy.PREFILL_PRIORITY
    mixed_prefill_chunk: int | None = None
    """In a step that also carries decodes, prefills get at most this many tokens in all (None: no limit beyond
    the others). A decode's inter-token latency is its whole step, so while requests stream tokens a long prefill
    advances in pieces of this size; a step without decodes keeps the full chunk, so a prompt alone keeps prefill
    priority's TTFT. (Sarathi-Serve's stall-free batching bounds a step the same way.)"""
    max_model_len: int | None = None
    """Prompt + max_new_tokens may not exceed this. None: only the KV pool's size limits a request."""
    decode_steps: int = 1
    """Up to this many decode steps per request in one step when the step would be decodes only (every running
    request decoding, none waiting): a decode burst (see the module docstring). 1: never."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))  # accept the plain string too
        for name in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_chunk", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name}={getattr(self, name)} must be >= 1")
        if self.mixed_prefill_chunk is not None and self.mixed_prefill_chunk < 1:
            raise ValueError(f"SchedulerConfig.mixed_prefill_chunk={self.mixed_prefill_chunk} must be >= 1 or None")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise a full batch of decodes could not all get their token in one step.
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"SchedulerConfig.max_model_len={self.max_model_len} must be >= 2 or None")


def _by_arrival(request: Request) -> int:
    return request.arrival_seq


def _tokens(sample: int | Sequence[int] | None) -> tuple[int, ...]:
    """A chunk's sample as a tuple of tokens: a token, a list or tuple of them, or None (no sample)."""
    if sample is None:
        return ()
    return tuple(sample) if isinstance(sample, (list, tuple)) else (sample,)


class Scheduler:
    """Turns requests into per-step plans (`schedule`) and applies the device's results (`update`).

    The engine loop is synchronous: `schedule()`, run the plan on the device, `update(plan, sampled)`, and
    `add_request` / `cancel` only between an `update` and the next `schedule`.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._requests: dict[str, Request] = {}  # live (unfinished) requests only
        # Both kept sorted by arrival_seq: preemption takes the newest running request, and a preempted
        # request goes back to its arrival position among the waiting (ahead of later arrivals).
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._next_arrival_seq = 0
        self._finished_since_schedule: list[str] = []

    # ----- queries -------------------------------------------------------------------------------------

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting and preempted requests, oldest first."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """Requests holding pages, oldest first."""
        return tuple(self._running)

    def get_request(self, request_id: str) -> Request | None:
        """A live request; None once it has finished or been cancelled."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ----- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request, or raises ValueError naming it if it could never run.

        It could never run if prompt + max_new_tokens exceeds `max_model_len`, or if the KV it would need at
        its longest does not fit in the whole pool even with every other request preempted. The longest is
        prompt + max_new_tokens - 1 tokens: the last sampled token is never fed back, so it needs no KV.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        if request.status is not RequestStatus.WAITING or request.arrival_seq != -1:
            raise ValueError(f"request {request.request_id!r} has already been through a scheduler")
        total_len = request.num_prompt_tokens + request.max_new_tokens
        max_model_len = self.config.max_model_len
        if max_model_len is not None and total_len > max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) = {total_len} tokens exceeds max_model_len={max_model_len}"
            )
        max_kv_tokens = total_len - 1
        pages_needed = self.kv_cache.page_spec.num_pages(max_kv_tokens)
        pool_pages = self.kv_cache.pool.num_usable_blocks
        if pages_needed > pool_pages:
            pool_tokens = self.kv_cache.page_spec.max_tokens(pool_pages)
            raise ValueError(
                f"request {request.request_id!r}: prompt ({request.num_prompt_tokens} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) needs KV for {max_kv_tokens} tokens = {pages_needed} pages, but the "
                f"whole KV pool holds {pool_pages} pages = {pool_tokens} tokens"
            )
        request.arrival_seq = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)  # newest arrival: appending keeps the queue sorted

    def cancel(self, request_id: str) -> Request | None:
        """Finishes a live request as cancelled and frees its pages now. None if it is not live (it may have
        finished in the last `update`: cancelling then is a race the engine need not avoid)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        (self._running if request.status is RequestStatus.RUNNING else self._waiting).remove(request)
        self._finish(request, RequestStatus.FINISHED_CANCELLED)
        return request

    def abort(self, request_id: str) -> Request | None:
        """Finishes a live request as failed (FINISHED_ERROR) and frees its pages now; None if it is not live.
        The engine calls it for the requests of a step that failed, and for one whose sampling failed."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        (self._running if request.status is RequestStatus.RUNNING else self._waiting).remove(request)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return request

    def preempt(self, request_id: str) -> bool:
        """Preempts a running request now (frees its pages; it recomputes from position 0 when resumed, keeping its
        outputs). False if it is not running. The engine calls it when the device cache had to be rebuilt."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self._preempt(request)
        return True

    # ----- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Hands out this step's token budget in the policy's order; see `SchedulingPolicy`.

        A running request that cannot get pages for its grant preempts the most recently arrived running
        request (possibly itself) and retries. So an older request is never preempted for a younger one, and
        the oldest running request always gets its pages (its longest length fits the pool, checked at
        `add_request`): every request finishes eventually. A victim scheduled earlier in this step loses its
        chunk and the budget it took is handed out again.

        A waiting request that cannot get pages (or a seat under `max_num_seqs`) stays waiting, and no
        request after it in the order is admitted this step: a large request at the head of the queue is
        not starved by smaller ones slipping past it. Running requests later in the order still get grants.

        With `decode_steps` > 1 and every running request decoding, none waiting, the plan is a decode burst: each
        request gets min(decode_steps, max_new_tokens - its outputs) steps (`ScheduledChunk.num_steps`) and the
        pages for them, under the same preemption rule.
        """
        budget = self.config.max_num_batched_tokens
        burst = (self.config.decode_steps > 1 and not self._waiting and bool(self._running)
                 and all(r.num_remaining_tokens == 1 for r in self._running))  # fmt: skip
        decoding = any(r.num_remaining_tokens == 1 for r in self._running)
        prefill_budget = self.config.mixed_prefill_chunk if decoding else None  # None: no separate prefill cap
        planned: dict[str, ScheduledChunk] = {}  # insertion order = grant order
        preempted: list[str] = []  # in preemption order, for the plan
        preempted_now: set[str] = set()
        failed: dict[str, str] = {}
        admitting = True
        # Once admission has stopped and every running request has had its turn, only waiting requests are
        # left in the order: stop there rather than walk a long waiting queue every step.
        running_unvisited = set(self._running)  # Request hashes by identity (eq=False)
        for request in self._grant_order():
            if budget == 0 or (not admitting and not running_unvisited):
                break
            running_unvisited.discard(request)
            try:
                num_steps = 1
                if request.status is RequestStatus.RUNNING:
                    num_new = self._grant_size(request, budget, prefill_budget)
                    if num_new == 0:
                        continue  # a prefill, and this step's prefill share is spent
                    if burst:  # the last sampled token is never fed back: no steps (nor pages) past max_new_tokens
                        num_steps = min(self.config.decode_steps,
                                        request.max_new_tokens - len(request.output_token_ids))  # fmt: skip
                    while self.kv_cache.allocate_slots(request.request_id, num_new + num_steps - 1) is None:
                        victim = self._running[-1]
                        self._preempt(victim)
                        preempted.append(victim.request_id)
                        preempted_now.add(victim.request_id)
                        refunded = planned.pop(victim.request_id, None)
                        if refunded is not None:
                            budget += refunded.num_tokens
                        if victim is request:
                            break
                    if request.status is not RequestStatus.RUNNING:
                        continue
                elif request.request_id in preempted_now:
                    continue  # lost its pages in this very step; trying again now would only thrash
                else:
                    if not admitting:
                        continue
                    num_new = self._grant_size(request, budget, prefill_budget)
                    if (
                        num_new == 0
                        or len(self._running) >= self.config.max_num_seqs
                        or (self.kv_cache.allocate_slots(request.request_id, num_new) is None)
                    ):
                        admitting = False
                        continue
                    self._waiting.remove(request)
                    bisect.insort(self._running, request, key=_by_arrival)
                    request.status = RequestStatus.RUNNING
                start = request.num_computed_tokens
                planned[request.request_id] = ScheduledChunk(
                    request_id=request.request_id,
                    start=start,
                    num_tokens=num_new,
                    token_ids=request.token_ids(start, start + num_new),
                    block_tables=self.kv_cache.block_tables(request.request_id),
                    needs_logits=start + num_new == request.num_tokens,
                    num_steps=num_steps,
                )
                budget -= num_new
                if prefill_budget is not None and request.num_remaining_tokens > 1:
                    prefill_budget -= num_new
            except Exception as e:  # noqa: BLE001 -- a fault while granting this request: it fails alone
                planned.pop(request.request_id, None)
                failed[request.request_id] = f"scheduling failed: {type(e).__name__}: {e}"
                self._drop_failed(request)
        finished, self._finished_since_schedule = self._finished_since_schedule, []
        return SchedulerOutput(list(planned.values()), preempted, finished, failed)

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]) -> list[Request]:
        """Applies a step's results: advances `num_computed_tokens` by each chunk, appends the sampled token
        of every chunk with `needs_logits`, and finishes requests on a stop token or `max_new_tokens`
        (freeing their pages). Returns the requests that finished here.

        A chunk's sample is a token, or a sequence of tokens in order: one for an ordinary chunk, 1 to num_steps for
        a decode burst's, each fed back by the step after it (so each later one advances the request by one more
        computed token), taken until one finishes the request; the rest are dropped. Fewer than num_steps tokens for
        a request they do not finish leave its cache (written for every step) ahead of `num_computed_tokens`: only
        for a request the caller then aborts (its sampling failed mid-burst).

        Chunks of requests that are no longer running (cancelled since `schedule`) are skipped; tokens
        sampled for chunks without `needs_logits` are ignored. A missing sample, or a chunk that does not
        start where its request stands (an output applied twice), raises ValueError naming the request, and
        then nothing has been applied.
        """
        live_chunks = []
        for chunk in output.chunks:  # check everything first, so a bad call changes nothing
            request = self._requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if chunk.start != request.num_computed_tokens:
                raise ValueError(
                    f"update: chunk of request {chunk.request_id!r} starts at {chunk.start} but the request has "
                    f"{request.num_computed_tokens} computed tokens (stale or repeated SchedulerOutput?)"
                )
            if chunk.needs_logits and chunk.request_id not in sampled:
                raise ValueError(f"update: no sampled token for request {chunk.request_id!r}, whose chunk needs one")
            tokens = _tokens(sampled.get(chunk.request_id))
            if chunk.needs_logits and not 1 <= len(tokens) <= chunk.num_steps:
                raise ValueError(f"update: request {chunk.request_id!r} ran {chunk.num_steps} decode step(s); it "
                                 f"takes 1 to {chunk.num_steps} sampled tokens, got {len(tokens)}")  # fmt: skip
            live_chunks.append((chunk, request, tokens))
        finished = []
        for chunk, request, tokens in live_chunks:
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.needs_logits:
                continue
            for i, token in enumerate(tokens):
                if i:
                    request.num_computed_tokens += 1  # a burst's later step fed the token sampled before it
                request.output_token_ids.append(token)
                if token in request.stop_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif len(request.output_token_ids) >= request.max_new_tokens:
                    status = RequestStatus.FINISHED_LENGTH
                else:
                    continue
                self._running.remove(request)
                self._finish(request, status)
                finished.append(request)
                break
        return finished

    # ----- internals -----------------------------------------------------------------------------------

    def _grant_order(self) -> Iterator[Request]:
        """Every live request once, in the order the policy hands out grants.

        Lazy over the waiting queue where the policy allows, since `schedule` usually stops early. The
        queues are snapshotted first: `schedule` moves requests between them while it walks this order.
        """
        policy = self.config.policy
        running, waiting = list(self._running), list(self._waiting)
        if policy is SchedulingPolicy.FCFS:
            return heapq.merge(running, waiting, key=_by_arrival)
        decodes = [r for r in running if r.num_remaining_tokens == 1]
        prefills = [r for r in running if r.num_remaining_tokens > 1]
        if policy is SchedulingPolicy.PREFILL_PRIORITY:
            return itertools.chain(decodes, prefills, waiting)
        # DECODE_PRIORITY: shortest remaining first, ties by arrival. NOTE: this sorts the whole waiting
        # queue every step, O(W log W); fine for hundreds of waiting requests, a heap if it ever is not.
        return iter(decodes + sorted(prefills + waiting, key=lambda r: (r.num_remaining_tokens, r.arrival_seq)))

    def _grant_size(self, request: Request, budget: int, prefill_budget: int | None) -> int:
        size = min(request.num_remaining_tokens, self.config.long_prefill_chunk, budget)
        if prefill_budget is not None and request.num_remaining_tokens > 1:  # a prefill in a step with decodes
            size = min(size, prefill_budget)
        return size

    def _preempt(self, request: Request) -> None:
        # Recompute on resume: its pages are freed now, and its outputs are kept so it resumes as one long
        # prefill of prompt + outputs. (Swapping KV to host memory is the alternative; recompute needs no
        # second pool and, with chunked prefill, costs what a prefill of that length costs.)
        self.kv_cache.free(request.request_id)
        self._running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        bisect.insort(self._waiting, request, key=_by_arrival)

    def _drop_failed(self, request: Request) -> None:
        """Takes a request whose grant raised out of the scheduler, from whatever state the fault left it in."""
        for queue in (self._running, self._waiting):
            if request in queue:
                queue.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        del self._requests[request.request_id]
        self._finished_since_schedule.append(request.request_id)
        self.kv_cache.free(request.request_id)  # last: should the pool itself be broken, no request is left half-out

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """`request` must already be out of the running / waiting queue."""
        self.kv_cache.free(request.request_id)
        request.status = status
        del self._requests[request.request_id]
        self._finished_since_schedule.append(request.request_id)


__all__ = [
    "Request",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
]
