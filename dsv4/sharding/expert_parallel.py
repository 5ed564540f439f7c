"""Expert parallelism for the routed experts: experts split over the sequence-parallel devices, tokens sent to them
by collective-permutes or all-to-alls, dropless.

Layout (the `SEQUENCE_PARALLEL` rules): the tokens are split over the mesh axis "sp" (shard i holds the tokens of
sequence block i) and so are the routed experts (shard i holds experts [i · E/N, (i + 1) · E/N)). A token's K experts
can live anywhere, so its hidden state has to reach every shard that owns one of them and the weighted expert
outputs have to come back.

Dispatch and combine (`routed_experts_ep`), per chunk of at most `chunk_tokens` of each shard's tokens:

    schedule "direct" ("auto" on 2 devices), on shard i:
        send my chunk (x [, x_scales], ids, weights) to i + 1, …, i + N − 1     (all at once, before any compute)
        y = my_experts(my chunk)                                               (float32)
        for t = 1 … N − 1:  part = my_experts(chunk received from i − t)       (its pairs on my experts)
                            send part (combine_dtype) back to i − t;  y += part received from i + t
    schedule "ring": the chunk travels i → i + 1 → … → i − 1 with one accumulator of its routed output; at step t
        shard i adds its experts' part for chunk (i − t) mod N and passes both on; after N steps it is home.
    schedule "sparse" ("direct", owner-only): as "direct", but shard i + t gets only the chunk's tokens with at
        least one expert on it, packed into a static `capacity` rows (fill rows route nowhere), and its parts come
        back to those rows. If any shard's count for any peer exceeds the capacity (agreed by one pmax of a scalar,
        so every shard takes the same branch), the chunk goes "direct" instead: dropless either way.
    schedule "alltoall" ("auto" on more than 2 devices): the packs of "sparse", stacked by destination, their pieces
        (x [, x_scales], ids, weights) as the bytes of one buffer, sent in one all-to-all; all arrivals computed in
        one call of the local experts; their parts back in one all-to-all; the same fallback. Two collectives a
        step where "direct" and "sparse" issue 2 (N − 1), at the price of overlap: every part waits for every pack.

Either way every token's sum is complete and exact (no token dropped, no capacity: a pair on another shard's
expert is sent to the kernel's empty group and costs no FLOPs), and every transfer is independent of the expert
GEMMs it can overlap with. "direct" moves fewer bytes: each remote part goes home in one transfer (N − 1 of them)
instead of riding an accumulator round all N hops, and each token copy leaves from its owner, so nothing waits for
a forward. Chunks run one after another, which bounds the per-step memory (sorted rows, SwiGLU activations,
float32 outputs) by `chunk_tokens` instead of the shard's tokens: unrolled into one program when there are few
(so a chunk's last transfer can overlap the next chunk's compute), else a `lax.scan`.

Bytes each device sends per layer, N_l tokens of D values, in units of N_l · D bytes (tokens bf16 = 2, or fp8 with
one float32 scale per 128 = 1.03; partial results bf16 = 2 or float32 = 4):
    direct:        (N − 1) · (token + part)     N = 2: 6 (bf16 tokens, f32 parts), 5.03 (fp8 tokens), 4 (bf16 parts)
    ring:          (N − 1) · token + N · part   N = 2: 10 (f32 accumulator), 6 (bf16)
    all-to-all:    2 · K · (N − 1) / N · 2 (K = 6 copies out, as many back, no deduplication)   N = 2: 12
    sparse, alltoall: (N − 1) · c · (token + part), c = the capacity over the chunk: under uniform top-K routing a
                   peer needs 1 − C(E − E/N, K) / C(E, K) of the tokens (N = 8, K = 6 of 256: 0.555), and the
                   capacity is that × SPARSE_MARGIN (0.69)
At N = 8 "direct" sends 42 (28 with bf16 parts) against the per-pair all-to-all's 21 and "sparse"'s 29: a token only
goes where one of its experts is, as a ragged all-to-all (`jax.lax.ragged_all_to_all`, whose split is data
dependent) would send it, but in static shapes that run on every backend (XLA:CPU has no ragged all-to-all, so the
CPU tests could not check that one). At N = 2 a peer needs 98% of a chunk: "auto" stays "direct", the schedule
measured there (docs/kernels/parallelism.md); past 2 it takes "alltoall", predicted from the 0.35 ms a collective
cost on 2 H200s, not yet measured.
Tokens in FP8: with FP8 expert weights run W8A8, the activations are quantized per token and 128-group before the
first GEMM anyway, so quantizing where the token lives and sending the fp8 values with their scales gives bit for bit
the same GEMM inputs for half the dispatch bytes.
Imbalance: each shard computes the pairs routed to its own experts, whatever shard the tokens came from, so the
load per shard is the routing's load per expert group, as with any dropless EP.

`comm="local"` replaces every transfer by a local copy of the same array, rolled by one (`local_stand_in`: wrong
values, the same compute), for measuring how much communication is exposed (scripts/bench_moe_ep.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv4.memory_plan import SCHEDULES, resolve_schedule, sparse_capacity
from dsv4.sharding.rules import active
from dsv4.sharding.sequence import local_stand_in

F32 = jnp.float32
# Tokens per step: ≈ 5 TFLOP of expert GEMMs per shard at V4-Flash widths and N = 2, ~6 GiB of temporaries.
DEFAULT_CHUNK_TOKENS = 32768
MAX_UNROLLED_CHUNKS = 16


def ep_layout(num_experts: int, mesh: Mesh | None = None, axis: str | None = None) -> tuple[Mesh, str, int] | None:
    """(mesh, axis, N) when the routed experts are split over the same mesh axis as the sequence, else None.

    With the active `use_mesh` rules: "experts" and "seq" must map to one mesh axis of more than one device that
    divides `num_experts` (otherwise `named_sharding` keeps the experts replicated, and so does the MoE).
    """
    if mesh is None:
        current = active()
        if current is None:
            return None
        mesh, rules = current
        seq_axis, expert_axis = rules.mesh_axis("seq"), rules.mesh_axis("experts")
        if expert_axis is None or expert_axis != seq_axis:
            return None
        axis = axis or expert_axis
    axis = axis or "sp"
    if axis not in mesh.shape or mesh.shape[axis] < 2 or num_experts % mesh.shape[axis]:
        return None
    return mesh, axis, mesh.shape[axis]


# local_experts(x [n, D], expert_ids [n, K] (ids outside [0, E_l) contribute nothing), weights [n, K],
#               gate_up [E_l, 2I, D], down [E_l, D, I], **fp8) → float32 [n, D]; fp8 holds x_scales [n, D // 128]
#               when the tokens come quantized, and gate_up_scales / down_scales when the weights are FP8.
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def routed_experts_ep(
    local_experts: LocalExperts,
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    x_scales: jax.Array | None = None,
    gate_up_scales: jax.Array | None = None,
    down_scales: jax.Array | None = None,
    out_dtype=None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    schedule: str = "direct",
    capacity: float | None = None,
    comm: str = "ppermute",
    unroll: bool | None = None,
    combine_dtype=F32,
    mesh: Mesh | None = None,
    axis: str | None = None,
) -> jax.Array:
    """Dropless expert-parallel routed experts (module docstring). → [B, S, D] in out_dtype (default x's).

    x: [B, S, D] and expert_ids [B, S, K] int32 (global expert ids), weights [B, S, K] f32, all split over the
    sequence axis; gate_up [E, 2I, D], down [E, D, I] split over the expert axis (the same mesh axis).
    S need not divide by N: padded tokens route nowhere (id -1) and are cut from the result.
    FP8: gate_up_scales / down_scales (split like the weights) go to local_experts with them; x may come quantized
    (float8_e4m3fn with x_scales [B, S, D // 128] f32, W8A8's own quantization): the tokens then travel as 1-byte
    values, the dispatch's bytes halved at no cost in accuracy. out_dtype is then required.
    chunk_tokens: tokens per step per device. schedule: "direct" (each step's partial result goes straight home),
    "ring" (one accumulator passed round the ring), "sparse" (as "direct", each peer sent only the tokens it has
    experts for, in `capacity` × chunk rows; default capacity `sparse_capacity`), "alltoall" (those packs in one
    all-to-all each way) or "auto" (`resolve_schedule`: "direct" on 2 devices, "alltoall" on more).
    unroll: one straight-line program over the chunks (default when there are at most MAX_UNROLLED_CHUNKS) or a
    `lax.scan` over them. combine_dtype: the dtype partial results
    travel in: float32 (the default) keeps each token's sum as one device computes it; bfloat16 halves those bytes
    and rounds each remote part once before the float32 sum at home (a V4-Flash MoE output moves by 2e-3 rel. L2,
    a 3-layer model's last-token logits moved by 3e-2: docs/kernels/parallelism.md);
    None: the output's dtype.
    """
    if comm not in ("ppermute", "local"):
        raise ValueError(f"comm={comm!r}; expected 'ppermute' or 'local'")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")
    if capacity is not None and not 0 < capacity <= 1:
        raise ValueError(f"capacity={capacity}: a share of the chunk's tokens, in (0, 1]")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if (x_scales is not None) != (x.dtype == jnp.float8_e4m3fn):
        raise ValueError(f"routed_experts_ep: x is {x.dtype} and x_scales {'given' if x_scales is not None else 'none'}"
                         "; quantized tokens (float8_e4m3fn) need their scales, and only they")  # fmt: skip
    if x_scales is not None and out_dtype is None:
        raise ValueError("routed_experts_ep: quantized x needs out_dtype")
    if (gate_up_scales is None) != (down_scales is None):
        raise ValueError("routed_experts_ep: give both gate_up_scales and down_scales, or neither")
    e = gate_up.shape[0]
    layout = ep_layout(e, mesh, axis)
    if layout is None:
        raise ValueError(f"routed_experts_ep: no mesh axis splits both the sequence and the {e} experts")
    mesh, axis, n = layout
    b, s, d = x.shape
    k = expert_ids.shape[-1]
    schedule = resolve_schedule(schedule, e, n, k)
    if schedule in ("sparse", "alltoall") and capacity is None:
        capacity = sparse_capacity(e, n, k)
    tokens = (x,) if x_scales is None else (x, x_scales)
    experts = (gate_up, down) if gate_up_scales is None else (gate_up, down, gate_up_scales, down_scales)
    pad = -s % n
    if pad:
        tokens = tuple(jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in tokens)
        expert_ids = jnp.pad(expert_ids, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, 0), (0, pad), (0, 0)))
    combine = jnp.dtype(combine_dtype or out_dtype or x.dtype)  # None: the output's dtype
    program = _ep_program(local_experts, mesh, axis, n, len(tokens), len(experts), chunk_tokens, schedule,
                          capacity if schedule in ("sparse", "alltoall") else None, comm, unroll, combine)  # fmt: skip
    out = program(*tokens, expert_ids, weights.astype(F32), *experts)
    out = out[:, :s] if pad else out
    return out.astype(out_dtype or x.dtype)


@functools.lru_cache(maxsize=64)
def _ep_program(local_experts, mesh, axis, n, n_tokens, n_experts, chunk_tokens, schedule, capacity, comm, unroll,
                combine_dtype):  # fmt: skip
    """The jitted shard_map, cached: inside an outer jit it is inlined; called eagerly (the model's
    `prefill_chunk` / `decode` outside jit) it is compiled once instead of dispatched op by op, which took minutes
    per call. Pass the same `local_experts` object for the same math (dsv4.moe does) to hit the cache."""
    body = functools.partial(_ep_body, local_experts, axis=axis, n=n, n_tokens=n_tokens, chunk_tokens=chunk_tokens,
                             schedule=schedule, capacity=capacity, comm=comm, unroll=unroll,
                             combine_dtype=combine_dtype)  # fmt: skip
    seq = P(None, axis)
    specs = (seq,) * (n_tokens + 2) + (P(axis),) * n_experts
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=False))


def as_bytes(a: jax.Array) -> jax.Array:
    """[n, rows, ...] of any dtype → uint8 [n, rows, bytes a row] (its bits, for one buffer of several arrays)."""
    b = jax.lax.bitcast_convert_type(a.reshape(*a.shape[:2], -1), jnp.uint8)
    return b.reshape(*a.shape[:2], -1)


def from_bytes(b: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of `as_bytes`: uint8 [n, rows, bytes] → an array shaped and typed as `like`."""
    size = jnp.dtype(like.dtype).itemsize
    b = b.reshape(*b.shape[:2], -1, size) if size > 1 else b
    return jax.lax.bitcast_convert_type(b, like.dtype).reshape(like.shape)


def _ep_body(local_experts, *arrays, axis, n, n_tokens, chunk_tokens, schedule, capacity, comm, unroll,
             combine_dtype):  # fmt: skip
    """One shard: arrays = token pieces (x [, x_scales]), expert_ids, weights, expert pieces (gate_up, down [,
    their scales]), all local slices. → float32 [B, S_l, D], this shard's tokens' routed output."""
    tok, (expert_ids, weights), experts = arrays[:n_tokens], arrays[n_tokens : n_tokens + 2], arrays[n_tokens + 2 :]
    b, s_l, d = tok[0].shape
    e_l = experts[0].shape[0]
    first = jax.lax.axis_index(axis) * e_l  # this shard's experts are [first, first + e_l)
    tokens = b * s_l
    size = min(tokens, chunk_tokens)
    chunks = -(-tokens // size)
    extra = chunks * size - tokens
    names = ("gate_up_scales", "down_scales")
    fp8 = dict(zip(names, experts[2:]))  # the weights' block scales, if FP8

    def flat(a, fill):
        a = a.reshape(tokens, *a.shape[2:])
        if extra:
            a = jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(chunks, size, *a.shape[1:])

    pieces = tuple(flat(a, 0) for a in tok) + (flat(expert_ids, -1), flat(weights, 0))

    def shift(a, by):
        """to shard i + by (mod N) from every shard i."""
        if comm == "local":  # same shape and bytes, no transfer: for measuring exposed communication only
            return local_stand_in(a)
        return jax.lax.ppermute(a, axis, [(j, (j + by) % n) for j in range(n)])

    def mine(chunk):
        x_c, ids_c, w_c = chunk[0], chunk[n_tokens], chunk[n_tokens + 1]
        local = ids_c - first
        local = jnp.where((local >= 0) & (local < e_l), local, -1)  # another shard's expert (or padding): skipped
        scales = {"x_scales": chunk[1]} if n_tokens == 2 else {}
        return local_experts(x_c, local, w_c, experts[0], experts[1], **scales, **fp8)

    def direct(chunk):
        # Every copy of the chunk leaves first (independent of any compute): shard i + t gets it at step t.
        arrived = [None] + [tuple(shift(a, t) for a in chunk) for t in range(1, n)]
        y = mine(chunk).astype(F32)  # own tokens, own experts
        for t in range(1, n):  # the chunk of shard i − t: its pairs on my experts, sent straight back
            part = mine(arrived[t]).astype(combine_dtype)
            y = y + shift(part, -t).astype(F32)
        return y

    def ring(chunk):
        in_hand = chunk  # the chunk at this step: own at t = 0
        y = None
        for t in range(n):
            if t < n - 1:
                nxt = tuple(shift(a, 1) for a in in_hand)  # issued before the compute it overlaps with
            part = mine(in_hand)
            y = part if y is None else y.astype(F32) + part
            # to i + 1, who adds to it after its own next step; at t = N − 1 this is the way home
            y = shift(y.astype(combine_dtype), 1)
            if t < n - 1:
                in_hand = nxt
        return y.astype(F32)

    fills = [0] * n_tokens + [-1, 0]  # a pack's fill rows: no token, no expert, no weight

    def owner_only(chunk, rows, exchange):
        """As direct(chunk), each peer sent only the chunk's tokens that have an expert on it, packed into `rows`,
        through `exchange` (below); the chunk goes direct() when any shard has more for any peer (all shards agree
        through one pmax)."""
        owner = jnp.where(chunk[n_tokens] >= 0, chunk[n_tokens] // e_l, -1)  # [size, K]: the shard of each expert
        me = jax.lax.axis_index(axis)
        # needs[t]: [size], peer i + t needs the token (t ≥ 1; lists below are indexed by t, [0] unused)
        needs = [None] + [(owner == (me + t) % n).any(-1) for t in range(1, n)]

        def packed(chunk):
            # row j of peer i + t's pack is my token slots[t][j]; `size` (out of range) fills the rest
            slots = [None] + [jnp.nonzero(needs[t], size=rows, fill_value=size)[0] for t in range(1, n)]
            packs = [None] + [tuple(jnp.take(a, slots[t], axis=0, mode="fill", fill_value=f) for a, f in
                                    zip(chunk, fills, strict=True)) for t in range(1, n)]  # fmt: skip
            y = mine(chunk).astype(F32)
            for t, back in exchange(packs, me):  # from shard i + t: the parts of my pack for it, row for row
                y = y.at[slots[t]].add(back.astype(F32), mode="drop")
            return y

        if rows >= size:  # every token fits: no fallback needed
            return packed(chunk)
        most = jnp.max(jnp.stack([m.sum() for m in needs[1:]]))
        fits = (most if comm == "local" else jax.lax.pmax(most, axis)) <= rows
        return jax.lax.cond(fits, packed, direct, chunk)

    def by_permutes(packs, me):
        """ "sparse": pack t to shard i + t, each by its own permute, its parts back the same way."""
        arrived = [None] + [tuple(shift(a, t) for a in packs[t]) for t in range(1, n)]
        return [(t, shift(mine(arrived[t]).astype(combine_dtype), -t)) for t in range(1, n)]

    def by_all_to_all(packs, me):
        """ "alltoall": every pack's pieces as the bytes of one buffer in one all-to-all, every part back in another.
        Packs are listed by offset t (pack t is for shard i + t), the all-to-all by shard, hence the rolls by i; my
        own slot goes out empty."""
        empty = tuple(jnp.full_like(a, f) for a, f in zip(packs[1], fills, strict=True))
        stacked = [jnp.stack([empty[j]] + [packs[t][j] for t in range(1, n)]) for j in range(len(empty))]

        def swap(a):  # a[s] goes to shard s; returns what shard s sent me, at s
            if comm == "local":
                return local_stand_in(a)
            return jax.lax.all_to_all(a, axis, 0, 0)

        pieces = [as_bytes(a) for a in stacked]  # x [, x_scales], ids, weights: one latency instead of four
        widths = [b.shape[-1] for b in pieces]
        arrived = jnp.split(swap(jnp.roll(jnp.concatenate(pieces, -1), me, axis=0)), np.cumsum(widths)[:-1], -1)
        arrived = [from_bytes(b, a) for b, a in zip(arrived, stacked, strict=True)]  # [s]: shard s's pack for me
        parts = mine(tuple(a.reshape(n * rows, *a.shape[2:]) for a in arrived)).astype(combine_dtype)
        back = jnp.roll(swap(parts.reshape(n, rows, d)), -me, axis=0)  # back[t]: shard i + t's parts of my pack
        return [(t, back[t]) for t in range(1, n)]

    if schedule in ("sparse", "alltoall"):
        rows = max(1, min(size, math.ceil(capacity * size)))
        if schedule == "sparse" and rows == size:  # nothing to leave out: the permutes of "direct" as they are
            step = direct
        else:  # "alltoall" keeps its two collectives a step even with every token in each pack
            exchange = by_permutes if schedule == "sparse" else by_all_to_all
            step = lambda c: owner_only(c, rows, exchange)  # noqa: E731
    else:
        step = direct if schedule == "direct" else ring
    if unroll is None:
        unroll = chunks <= MAX_UNROLLED_CHUNKS
    if unroll:  # one program: a chunk's last transfer home can overlap the next chunk's compute
        ys = jnp.stack([step(tuple(p[j] for p in pieces)) for j in range(chunks)])
    else:  # bounded program size; each chunk's last transfer is exposed
        _, ys = jax.lax.scan(lambda _, c: (None, step(c)), None, pieces)
    ys = ys.reshape(chunks * size, d)[:tokens]
    return ys.reshape(b, s_l, d)
