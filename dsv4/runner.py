"""Device side of the engine: runs one scheduler plan (`SchedulerOutput`) on the model's cache.

The device cache is paged by default: `model.init_cache(max_slots, max_model_len, page_tokens=, num_pages=)`.
Every layer's compressed entries and indexer keys live in one pool of `num_pages` pages shared by all slots,
each page holding `page_tokens` tokens' worth of entries, so the memory is the pool, not `max_slots ×
max_model_len`. The host `KVCacheManager` (`PageSpec.tokens(page_tokens)`: one group, the request's token
pages) hands out the page ids; each `ScheduledChunk.block_tables[0]` is the request's table. The runner keeps
a host mirror of every slot's row (`np.int32 [max_slots, max_pages]`, zero-padded: page 0 is the null page)
and passes it to each jitted call, which puts it into `cache.block_table`. The sliding-window ring and the
compressors' open windows stay per slot (fixed size, independent of the length).

A slot is still what a running request owns on the device (its ring, open windows, token count, table row);
page ids come only from the host pool, so two slots never share a page.

With `page_tokens=None` the cache is dense instead (`init_cache(max_slots, max_model_len)`, each slot sized
for `max_model_len` tokens); the host pages are then accounting only (admission, preemption).

Each step is at most two kinds of jitted call, in a few fixed shapes so compilations stay bounded:

- one *packed* call `[max_slots, w]` over the whole cache for the short chunks (decodes, small prefill
  pieces): idle slots ride along with `valid = 0`, which `forward_chunk` leaves untouched;
- one *slot* call `[1, w]` per long chunk (a prefill piece wider than `max_packed_width`), on that slot's
  cache alone, sliced out and written back inside the jitted function.

NOTE: padding a long prefill chunk into `[max_slots, w]` would run `max_slots` times its work: on CPU an
8192-token chunk of the tiny model takes ~7 s as `[1, 8192]` and ~80-120 s as `[8, 8192]`. Hence the
second kind.

A step that is a decode burst (`ScheduledChunk.num_steps` > 1: every chunk a decode) is one *burst* call instead
(`execute_burst`): a loop of up to k `[max_slots, 1]` decode steps on the device, each sampling its tokens there
(`dsv4.generate.sample_on_device`) and feeding them to the next step, so the host dispatches once for k tokens of
every request and fetches only the tokens. Each slot runs its own number of steps; after them it rides along with
valid = 0, untouched, so its cache holds exactly what that many single decode steps would have written.

`w` comes from `width_buckets` (the smallest bucket ≥ the chunk). Only a chunk with `needs_logits` brings
logits back to the host, one row per request.

On a mesh (`mesh=`, the model's weights placed on it by `dsv4.sharding.shard_model` or a sharded load) every call
is traced under `use_mesh(mesh, rules)`: a chunk's tokens are split over the sequence axis, the routed experts run
expert-parallel, and the cache is replicated on every device (each device attends over every compressed entry, so
a replicated cache needs only each chunk's new rows gathered; docs/kernels/parallelism.md). The host side is the
same for any mesh: one page pool, one block table per slot.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4.cache.layout import FORMAT_NAMES
from dsv4.cache.store import per_slot_mask
from dsv4.generate import (
    MAX_LOGPROBS,
    DevicePick,
    SamplingParams,
    device_sampling_arrays,
    logprobs_on_device,
    non_finite_counts,
    pick_rows,
    sample_on_device,
    sampling_mode,
)
from dsv4.model import DeepseekV4
from dsv4.scheduler import ScheduledChunk, SchedulerOutput
from dsv4.sharding.rules import SEQUENCE_PARALLEL, ShardingRules, use_mesh


def power_of_two_buckets(chunk_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `chunk_size` (added if it is not a power of two)."""
    buckets = [1 << i for i in range(chunk_size.bit_length()) if 1 << i <= chunk_size]
    if buckets[-1] != chunk_size:
        buckets.append(chunk_size)
    return tuple(buckets)


def _with_table(cache, block_table):
    """The cache with the host's block tables [max_slots, max_pages] in place (None: a dense cache, as is)."""
    return cache if block_table is None else cache.replace(block_table=block_table)


def _slot_of_cache(cache, slot):
    """One slot's view of the cache: per-slot leaves sliced to [1, ...], shared leaves (FP8 scale states, page
    pools) whole."""
    return jax.tree.map(lambda x, own: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0) if own else x,
                        cache, per_slot_mask(cache))  # fmt: skip


BURST_FORMS = ("loop", "fixed", "unrolled")
"""How a decode burst's steps run: "loop", XLA's while loop of max(steps) iterations (a slot past its steps rides
along idle); "fixed", the loop with its trip count fixed at k, every burst k iterations (XLA knows the count, so
on a GPU the host need not read the loop's predicate back each iteration; idle iterations where every request has
fewer than k tokens left); "unrolled", the k steps as straight-line code (no loop; k times the program)."""


class BurstTokens(NamedTuple):
    """One request's share of a decode burst, on the host: one row per step it ran."""

    tokens: np.ndarray
    """int32 [num_steps]: the token each step sampled (the same as the host's `sample` for greedy requests)."""
    non_finite: np.ndarray
    """int32 [num_steps]: NaN / +inf entries in each step's logits (nonzero: that step's sampling fails)."""
    logprobs: np.ndarray | None = None
    """float32 [num_steps]: each token's log-probability, when some request of the burst asked for logprobs."""
    top_ids: np.ndarray | None = None
    """int32 [num_steps, MAX_LOGPROBS]: the most likely ids of each step, most likely first (with `logprobs`)."""
    top_logprobs: np.ndarray | None = None
    """float32 [num_steps, MAX_LOGPROBS]: their log-probabilities."""

    def logprobs_at(self, step: int, k: int | None) -> tuple[float | None, tuple[tuple[int, float], ...] | None]:
        """(the token's log-probability, its step's k most likely (id, log-probability)) at `step`, as a single
        step's `logprobs` gives them; (None, None) without k."""
        if k is None:
            return None, None
        return float(self.logprobs[step]), top_pairs(self.top_ids[step], self.top_logprobs[step], k)


def top_pairs(ids: np.ndarray, values: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely (token id, log-probability) of `logprobs_on_device`'s ids and values, most likely first."""
    return tuple((int(t), float(v)) for t, v in zip(ids[:k], values[:k]))


def _to_host(x: jax.Array) -> np.ndarray:
    # replicated on the mesh: this process's copy is the whole array, whatever the process count
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _put_slot(cache, sub, slot, *, shared_too: bool):
    """Writes a slot's view back: per-slot leaves into row `slot`; shared leaves replaced if `shared_too`."""
    return jax.tree.map(lambda x, y, own: jax.lax.dynamic_update_slice_in_dim(x, y, slot, axis=0) if own
                        else (y if shared_too else x), cache, sub, per_slot_mask(cache))  # fmt: skip


class _Programs:
    """The runner's jitted calls for one model graph. They close over its nnx GraphDef and the treedef of its
    state, so a call passes only arrays (the weights as a flat list): a static GraphDef would be hashed, and the
    nnx State flattened, on every call, host time that every step waits for (`scripts/bench_runner_host.py`)."""

    def __init__(self, graphdef, state_def, layout: tuple[Mesh, ShardingRules] | None):
        def model(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves))

        def on_mesh(fn):  # traced under the layout, results replicated on it (the cache keeps one placement)
            if layout is None:
                return fn

            def traced(*args):
                with use_mesh(*layout):
                    return fn(*args)

            return functools.wraps(fn)(traced)

        def packed_step(leaves, cache, token_ids, valid, block_table):
            """token_ids: [max_slots, w]; valid: [max_slots]; block_table: [max_slots, max_pages] or None (dense)
            → (logits [max_slots, vocab], cache)."""
            return model(leaves).forward_chunk(_with_table(cache, block_table), token_ids, valid)

        def slot_step(leaves, cache, slot, token_ids, valid, block_table):
            """One slot's chunk: token_ids [1, w], valid [1], slot a scalar, block_table as in `packed_step` (all
            slots' rows; the slot's is sliced out with the rest of its view) → (logits [1, vocab], cache)."""
            cache = _with_table(cache, block_table)
            logits, sub = model(leaves).forward_chunk(_slot_of_cache(cache, slot), token_ids, valid)
            return logits, _put_slot(cache, sub, slot, shared_too=True)

        def reset_slot(leaves, cache, slot, max_len, dtype, kv_format, page_tokens):
            """Puts one slot back to exactly `init_cache`'s state (num_tokens 0, empty window ring with positions
            -1, CSA overlap gates -inf, zero entries or an all-null block table row), so a new or
            preempted-and-resumed request starts clean. Shared leaves (page pools, FP8 scale states) are left as
            they are: a request's pages need no clearing, since reads only look below its entry count."""
            # NOTE: a paged `fresh` must have the cache's tree structure (paged stores), but its pools are dropped
            # by `_put_slot`: the smallest pool (2 pages) will do.
            paging = {} if page_tokens is None else dict(page_tokens=page_tokens, num_pages=2)
            fresh = model(leaves).init_cache(1, max_len, dtype, kv_format=kv_format, **paging)
            return _put_slot(cache, fresh, slot, shared_too=False)

        def decode_burst(leaves, cache, token_ids, steps, block_table, temperature, top_k, top_p, key_data,
                         max_steps, num_logprobs, form):  # fmt: skip
            """Up to `max_steps` decode steps of every slot in one call, each step's sampled tokens fed to the next.
            token_ids [max_slots]: each slot's next token; steps [max_slots]: how many steps it runs (0: an idle
            slot, left untouched, as is a slot after its steps); temperature ... key_data: one request's sampling
            per slot (`dsv4.generate.sample_on_device`); block_table as in `packed_step`, covering every step.
            → (out, cache); out["tokens"], out["non_finite"]: [max_steps, max_slots] int32; with num_logprobs > 0
            also out["logprobs"] [max_steps, max_slots] and out["top_ids"], out["top_logprobs"] [max_steps,
            max_slots, num_logprobs]. form: how the steps run (`BURST_FORMS`)."""
            m = model(leaves)
            cache = _with_table(cache, block_table)
            first = cache.num_tokens + 1  # [max_slots]: where each slot's first sampled token sits
            shape = (max_steps, token_ids.shape[0])
            out = dict(tokens=jnp.zeros(shape, jnp.int32), non_finite=jnp.zeros(shape, jnp.int32))
            if num_logprobs:
                top = min(num_logprobs, m.config.vocab_size)
                out.update(logprobs=jnp.zeros(shape, jnp.float32), top_ids=jnp.zeros((*shape, top), jnp.int32),
                           top_logprobs=jnp.zeros((*shape, top), jnp.float32))  # fmt: skip

            def step(i, carry):
                cache, tokens, out = carry
                valid = (i < steps).astype(jnp.int32)
                logits, cache = m.forward_chunk(cache, jnp.where(valid > 0, tokens, 0)[:, None], valid)
                sampled = sample_on_device(logits, temperature, top_k, top_p, key_data, first + i)
                new = dict(tokens=sampled, non_finite=non_finite_counts(logits))
                if num_logprobs:
                    new["logprobs"], new["top_ids"], new["top_logprobs"] = logprobs_on_device(logits, sampled, top)
                return cache, sampled, {name: out[name].at[i].set(new[name]) for name in out}

            carry = (cache, token_ids, out)
            if form == "unrolled":
                for i in range(max_steps):
                    carry = step(i, carry)
            else:
                carry = jax.lax.fori_loop(0, jnp.max(steps) if form == "loop" else max_steps, step, carry)
            cache, _, out = carry
            return out, cache

        def init_cache(leaves, batch, max_len, dtype, kv_format, page_tokens, num_pages):
            paging = {} if page_tokens is None else dict(page_tokens=page_tokens, num_pages=num_pages)
            return model(leaves).init_cache(batch, max_len, dtype, kv_format=kv_format, **paging)

        out = {} if layout is None else dict(out_shardings=NamedSharding(layout[0], P()))
        self.init_cache = jax.jit(on_mesh(init_cache), static_argnums=(1, 2, 3, 4, 5, 6), **out)
        self.packed_step = jax.jit(on_mesh(packed_step), donate_argnums=1, **out)
        self.slot_step = jax.jit(on_mesh(slot_step), donate_argnums=1, **out)
        self.reset_slot = jax.jit(on_mesh(reset_slot), static_argnums=(3, 4, 5, 6), donate_argnums=1, **out)
        self.decode_burst = jax.jit(on_mesh(decode_burst), static_argnums=(9, 10, 11), donate_argnums=1, **out)


@functools.lru_cache(maxsize=8)
def _programs(graphdef, state_def, layout) -> _Programs:
    """One `_Programs` per model graph and layout, so runners over equal graphs share compiled code; the GraphDef
    is hashed here once per runner, not once per call."""
    return _Programs(graphdef, state_def, layout)


class ModelRunner:
    """Owns the model's weights and its cache (paged, or dense per slot); executes plans; maps requests to slots.

    A request gets a slot when its chunk starting at position 0 is executed (a new request, or one resumed
    after preemption, which recomputes from scratch) and gives it back on `release` (finished, cancelled,
    preempted). Slots are handed out lowest first.

    page_tokens, num_pages: page the cache (see the module docstring): a pool of `num_pages` pages (page 0,
    the null page, included: the host `BlockPool`'s `num_blocks`) of `page_tokens` tokens each. Both None:
    the dense cache.
    mesh / rules: run on this mesh (the model already placed on it), laid out by `rules`; None: one device.
    """

    def __init__(self, model: DeepseekV4, *, max_slots: int, max_model_len: int, kv_format,
                 width_buckets: Sequence[int], max_packed_width: int, page_tokens: int | None = None,
                 num_pages: int | None = None, mesh: Mesh | None = None,
                 rules: ShardingRules = SEQUENCE_PARALLEL) -> None:  # fmt: skip
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots} must be >= 1")
        if (page_tokens is None) != (num_pages is None):
            raise ValueError(f"a paged cache needs both page_tokens and num_pages; got page_tokens={page_tokens}, "
                             f"num_pages={num_pages}")  # fmt: skip
        buckets = sorted(set(int(w) for w in width_buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"width_buckets={list(width_buckets)} must be positive widths")
        self.model = model
        self.max_slots, self.max_model_len = max_slots, max_model_len
        # A storage format name ("bf16", "fp8-channel", ...) stores the rows in it (computing in the model's
        # dtype); a dtype keeps them unquantized in that dtype.
        if kv_format is None:
            kv_format = model.dtype
        if isinstance(kv_format, str) and kv_format in FORMAT_NAMES:
            self.kv_format, self.cache_dtype = kv_format, model.dtype
        else:
            self.kv_format, self.cache_dtype = None, jnp.dtype(kv_format)
        self.width_buckets = tuple(buckets)
        self.max_packed_width = max_packed_width
        self.graphdef, self.state = nnx.split(model)
        self._weights, state_def = jax.tree.flatten(self.state)  # passed as a flat list: see `_Programs`
        self.mesh = mesh
        self._programs = _programs(self.graphdef, state_def, None if mesh is None else (mesh, rules))
        self.page_tokens, self.num_pages = page_tokens, num_pages
        self.cache = self._new_cache()
        # Host mirror of cache.block_table, passed to every call (None: dense). A row is its slot's request's
        # token pages, zero-padded; a free slot's row is all null pages.
        self._block_tables = (None if page_tokens is None else
                              np.zeros((max_slots, -(-max_model_len // page_tokens)), np.int32))  # fmt: skip
        self._slot_of: dict[str, int] = {}
        self._free_slots = list(range(max_slots))  # kept sorted: lowest slot first
        self._num_tokens = [0] * max_slots  # host mirror of cache.num_tokens: checked against each chunk
        self._seen_shapes: set[tuple] = set()
        self._queued: jax.Array | None = None  # an output of the step left running on the device (`execute`)
        self.burst_form = "loop"
        """How a decode burst's steps run (`BURST_FORMS`); "loop" until a GPU measurement picks the fastest."""
        self.compile_s = 0.0
        """Wall time of the first call of each shape (compilation plus one run), summed."""

    def _new_cache(self):
        """An empty cache, committed to the weights' device(s): the jitted steps return committed arrays, and jit
        keys its cache on commitment too, so an uncommitted first cache would compile each shape twice (once in
        `warmup`, again at the first real step)."""
        cache = self._programs.init_cache(self._weights, self.max_slots, self.max_model_len, self.cache_dtype,
                                          self.kv_format, self.page_tokens, self.num_pages)  # fmt: skip
        if self.mesh is None:
            cache = jax.device_put(cache, next(iter(self._weights[0].devices())))
        return cache

    # ----- slots -----------------------------------------------------------------------------------------

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def release(self, request_id: str) -> None:
        """Gives the request's slot back; a request without one (never ran, already released) is a no-op."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            bisect.insort(self._free_slots, slot)
            if self._block_tables is not None:
                self._block_tables[slot] = 0  # its pages may go to another request now

    def _assign(self, request_id: str) -> int:
        self.release(request_id)  # a resumed request's old slot, if it was never released
        if not self._free_slots:
            raise RuntimeError(
                f"no free cache slot for request {request_id!r}: more running requests than "
                f"max_slots={self.max_slots} (the scheduler's max_num_seqs must equal max_slots)"
            )
        slot = self._free_slots.pop(0)
        self._slot_of[request_id] = slot
        self.cache = self._timed(("reset", 0), self._programs.reset_slot, self._weights, self.cache, jnp.int32(slot),
                                 self.max_model_len, self.cache_dtype, self.kv_format,
                                 self.page_tokens)  # fmt: skip
        self._num_tokens[slot] = 0
        return slot

    # ----- recovery after a failed step ----------------------------------------------------------------------

    def cache_ok(self) -> bool:
        """Whether the device cache is still usable: a failed jitted call may have consumed it (the cache is
        donated to every call) or left it holding the failed computation's error."""
        try:
            leaves = jax.tree.leaves(self.cache)
            if any(x.is_deleted() for x in leaves):
                return False
            jax.block_until_ready(leaves)
            return True
        except Exception:  # noqa: BLE001 -- any error here means the cache is gone
            return False

    def rebuild_cache(self) -> list[str]:
        """Replaces the cache with an empty one (the init program, already compiled) and frees every slot.
        Returns the requests that held a slot: their cached state is gone (the engine preempts or fails them)."""
        lost = list(self._slot_of)
        self._queued = None
        self.cache = self._new_cache()
        self._slot_of.clear()
        self._free_slots = list(range(self.max_slots))
        self._num_tokens = [0] * self.max_slots
        if self._block_tables is not None:
            self._block_tables[:] = 0
        return lost

    # ----- shapes ----------------------------------------------------------------------------------------

    def bucket(self, num_tokens: int) -> int:
        i = bisect.bisect_left(self.width_buckets, num_tokens)
        if i == len(self.width_buckets):
            raise ValueError(
                f"a chunk of {num_tokens} tokens exceeds the largest width bucket {self.width_buckets[-1]}"
            )
        return self.width_buckets[i]

    def is_packed(self, num_tokens: int) -> bool:
        return self.bucket(num_tokens) <= self.max_packed_width

    def _timed(self, shape: tuple[str, int], fn, *args):
        if shape in self._seen_shapes:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        self.compile_s += time.perf_counter() - t0
        self._seen_shapes.add(shape)
        return out

    def warmup(self, widths: Iterable[int], decode_steps: Iterable[int] = ()) -> float:
        """Compiles the calls that chunks of these widths would use (and the slot reset), and decode bursts of each
        of `decode_steps` (> 1) steps without logprobs, without changing any slot's contents (every row runs with
        valid = 0, every burst with no steps). Returns the seconds spent."""
        t0 = time.perf_counter()
        if ("reset", 0) not in self._seen_shapes and self._free_slots:
            # Resetting a free slot changes nothing a request can see.
            self.cache = self._timed(
                ("reset", 0),
                self._programs.reset_slot,
                self._weights,
                self.cache,
                jnp.int32(self._free_slots[0]),
                self.max_model_len,
                self.cache_dtype,
                self.kv_format,
                self.page_tokens,
            )
        for max_steps in sorted({s for s in decode_steps if s > 1}):
            tokens, steps = np.zeros((self.max_slots,), np.int32), np.zeros((self.max_slots,), np.int32)
            params = device_sampling_arrays([None] * self.max_slots)
            _, self.cache = self._timed(("burst", max_steps, 0, self.burst_form), self._programs.decode_burst,
                                        self._weights, self.cache, tokens, steps, self._tables(), *params, max_steps,
                                        0, self.burst_form)  # fmt: skip
        for width in sorted({self.bucket(w) for w in widths}):
            if self.is_packed(width):
                tokens, valid = np.zeros((self.max_slots, width), np.int32), np.zeros((self.max_slots,), np.int32)
                logits, self.cache = self._timed(("packed", width), self._programs.packed_step, self._weights,
                                                 self.cache, tokens, valid, self._tables())  # fmt: skip
            else:
                tokens, valid = np.zeros((1, width), np.int32), np.zeros((1,), np.int32)
                logits, self.cache = self._timed(("slot", width), self._programs.slot_step, self._weights,
                                                 self.cache, jnp.int32(0), tokens, valid, self._tables())  # fmt: skip
            for draw in (None, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)):
                self._pick(logits, [] if draw is None else [(0, (draw, 0))])  # each `sampling_mode`
        return time.perf_counter() - t0

    # ----- one step --------------------------------------------------------------------------------------

    def _tables(self) -> np.ndarray | None:
        """The block tables for a call: a copy of the mirror, so a later edit cannot reach a call still in flight
        (on CPU a numpy argument may be used without a copy)."""
        return None if self._block_tables is None else self._block_tables.copy()

    def _set_block_table(self, slot: int, chunk: ScheduledChunk) -> None:
        """Copies the chunk's token pages (`block_tables[0]`) into the slot's mirror row, zero-padded."""
        table = chunk.block_tables[0]
        row = self._block_tables[slot]
        end = chunk.start + chunk.num_tokens + chunk.num_steps - 1  # a burst writes one token a step
        needed = -(-end // self.page_tokens)
        if len(table) < needed or len(table) > len(row):
            raise RuntimeError(f"request {chunk.request_id!r}: its block table has {len(table)} pages; tokens "
                               f"[{chunk.start}, {end}) need {needed} of {self.page_tokens} tokens, at most "
                               f"{len(row)}")  # fmt: skip
        row[: len(table)] = table
        row[len(table) :] = 0

    def execute(self, plan: SchedulerOutput) -> dict[str, DevicePick]:
        """Runs every chunk of the plan. → for each request whose chunk needs_logits, its token drawn on the device
        by its plan.draws entry (greedily without one), and the logprobs it asks for (`DevicePick`)."""
        for request_id in plan.preempted_request_ids:
            self.release(request_id)
        packed: list[tuple[ScheduledChunk, int]] = []
        single: list[tuple[ScheduledChunk, int]] = []
        for chunk in plan.chunks:
            if chunk.start == 0:
                slot = self._assign(chunk.request_id)
            else:
                slot = self._slot_of.get(chunk.request_id)
                if slot is None:
                    raise RuntimeError(f"request {chunk.request_id!r} continues at position {chunk.start} but holds "
                                       "no cache slot")  # fmt: skip
            if self._num_tokens[slot] != chunk.start:
                raise RuntimeError(f"request {chunk.request_id!r}: chunk starts at {chunk.start} but its slot {slot} "
                                   f"holds {self._num_tokens[slot]} tokens")  # fmt: skip
            if self._block_tables is not None:
                self._set_block_table(slot, chunk)
            (packed if self.is_packed(chunk.num_tokens) else single).append((chunk, slot))

        pending: list[tuple[jax.Array, int, str]] = []  # (logits on device, row, request id)
        last = None  # the last call's logits: done once the device has run every call of this step
        if packed:
            width = self.bucket(max(chunk.num_tokens for chunk, _ in packed))
            tokens = np.zeros((self.max_slots, width), np.int32)
            valid = np.zeros((self.max_slots,), np.int32)
            for chunk, slot in packed:
                tokens[slot, : chunk.num_tokens] = chunk.token_ids
                valid[slot] = chunk.num_tokens
            logits, self.cache = self._timed(("packed", width), self._programs.packed_step, self._weights, self.cache,
                                             tokens, valid, self._tables())  # fmt: skip
            pending += [(logits, slot, chunk.request_id) for chunk, slot in packed if chunk.needs_logits]
            last = logits
        for chunk, slot in single:
            width = self.bucket(chunk.num_tokens)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : chunk.num_tokens] = chunk.token_ids
            valid = np.array([chunk.num_tokens], np.int32)
            logits, self.cache = self._timed(("slot", width), self._programs.slot_step, self._weights, self.cache,
                                             jnp.int32(slot), tokens, valid, self._tables())  # fmt: skip
            if chunk.needs_logits:
                pending.append((logits, 0, chunk.request_id))
            last = logits
        for chunk, slot in packed + single:
            self._num_tokens[slot] += chunk.num_tokens
        # NOTE: a step that returns no logits (prefill chunks short of a prompt's last) stays queued on the device
        # while the host plans and dispatches the next: the call waits for the step before it instead. Waiting for
        # each step left the GPU idle through the host's work between chunks. One step ahead at most: an arrival
        # still joins within a chunk, and a step that returns logits (a prompt's last chunk, every decode) waits
        # for itself, so TTFT and ITL still measure the device.
        queued, self._queued = self._queued, None
        if queued is not None:
            jax.block_until_ready(queued)
        if not pending:
            self._queued = last
            return {}
        jax.block_until_ready(self.cache)
        # NOTE: tokens (and logprobs) are drawn on the device; a row comes back as a few numbers: with V4's
        # vocabulary a 32-request decode step's logits are 16.5 MB to fetch, and the host's sampler sorts each row
        # for top-p (about 4 ms a request on a 2-core CPU, docs/BENCHMARKS.md "Decode").
        draws = {}  # id(device array) → [(row, (params, position) or None)]: one pick call per array
        for logits, row, request_id in pending:
            draws.setdefault(id(logits), (logits, []))[1].append((row, plan.draws.get(request_id)))
        picks = {key: self._pick(logits, rows) for key, (logits, rows) in draws.items()}
        out = {}
        for logits, row, request_id in pending:
            draw = plan.draws.get(request_id)
            out[request_id] = self._device_pick(picks[id(logits)], row, None if draw is None else draw[0],
                                                logits.shape[-1])  # fmt: skip
        return out

    def _pick(self, logits: jax.Array, draws: list[tuple[int, tuple | None]]) -> tuple[np.ndarray, ...]:
        """Each row's token of logits [R, vocab] drawn on the device (`pick_rows`): draws = (row, (params,
        position)) for the rows that serve a request (None, or any row not listed: greedy). → `pick_rows`' arrays
        on the host, with logprobs if a row asks for them."""
        rows = logits.shape[0]
        params: list[SamplingParams | None] = [None] * rows
        positions = np.zeros((rows,), np.int32)
        for row, draw in draws:
            if draw is not None:
                params[row], positions[row] = draw
        num_top = min(MAX_LOGPROBS, logits.shape[-1]) if any(p is not None and p.logprobs is not None
                                                             for p in params) else 0  # fmt: skip
        arrays = device_sampling_arrays(params)
        mode = sampling_mode(*arrays[:3])  # on the host: no conditional (a device-to-host sync) inside the call
        picks = self._timed(("pick", rows, num_top, mode), pick_rows, logits, *arrays, positions, num_top, mode)
        return tuple(_to_host(x) for x in picks)

    @staticmethod
    def _device_pick(picks: tuple[np.ndarray, ...], row: int, sampling: SamplingParams | None,
                     vocab: int) -> DevicePick:  # fmt: skip
        """Row `row` of `_pick`'s arrays as the request's `DevicePick` (its k most likely, for logprobs = k)."""
        token, non_finite = int(picks[0][row]), int(picks[1][row])
        k = None if sampling is None else sampling.logprobs
        if k is None:
            return DevicePick(token, non_finite, vocab)
        return DevicePick(token, non_finite, vocab, float(picks[2][row]), top_pairs(picks[3][row], picks[4][row], k))

    def execute_burst(self, plan: SchedulerOutput, sampling: dict[str, SamplingParams], max_steps: int, *,
                      form: str | None = None) -> dict[str, BurstTokens]:  # fmt: skip
        """Runs a decode burst: every chunk of the plan a decode of a request holding a slot, of 1 to `max_steps`
        steps (`ScheduledChunk.num_steps`), all in one jitted call of `max_steps` steps (its shape: one compilation
        per value, and one more when a request asks for logprobs), sampled on the device by each request's
        `sampling`. → each request's tokens, one per step it ran (`BurstTokens`)."""
        form = form or self.burst_form
        if form not in BURST_FORMS:
            raise ValueError(f"burst form {form!r} is not one of {BURST_FORMS}")
        for request_id in plan.preempted_request_ids:
            self.release(request_id)
        tokens = np.zeros((self.max_slots,), np.int32)
        steps = np.zeros((self.max_slots,), np.int32)
        params: list[SamplingParams | None] = [None] * self.max_slots
        slots = []
        for chunk in plan.chunks:
            slot = self._slot_of.get(chunk.request_id)
            if chunk.num_tokens != 1 or not chunk.needs_logits or slot is None or not 1 <= chunk.num_steps <= max_steps:
                raise RuntimeError(f"request {chunk.request_id!r}: a decode burst runs decodes (1 token, then 1 to "
                                   f"{max_steps} steps) of requests holding a slot; got {chunk.num_tokens} token(s) "
                                   f"from {chunk.start}, {chunk.num_steps} steps, slot {slot}")  # fmt: skip
            if self._num_tokens[slot] != chunk.start:
                raise RuntimeError(f"request {chunk.request_id!r}: chunk starts at {chunk.start} but its slot {slot} "
                                   f"holds {self._num_tokens[slot]} tokens")  # fmt: skip
            if self._block_tables is not None:
                self._set_block_table(slot, chunk)
            tokens[slot], steps[slot], params[slot] = chunk.token_ids[0], chunk.num_steps, sampling[chunk.request_id]
            slots.append(slot)
        num_logprobs = MAX_LOGPROBS if any(p is not None and p.logprobs is not None for p in params) else 0
        out, self.cache = self._timed(("burst", max_steps, num_logprobs, form), self._programs.decode_burst,
                                      self._weights, self.cache, tokens, steps, self._tables(),
                                      *device_sampling_arrays(params), max_steps, num_logprobs, form)  # fmt: skip
        for chunk, slot in zip(plan.chunks, slots):
            self._num_tokens[slot] += chunk.num_steps
        out = {name: _to_host(x) for name, x in out.items()}  # waits for the whole burst
        result = {}
        for chunk, slot in zip(plan.chunks, slots):
            n = chunk.num_steps
            extra = {name: out[name][:n, slot] for name in ("logprobs", "top_ids", "top_logprobs") if name in out}
            result[chunk.request_id] = BurstTokens(out["tokens"][:n, slot], out["non_finite"][:n, slot], **extra)
        return result
