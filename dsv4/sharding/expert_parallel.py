"""Expert parallelism for the routed experts: experts split over the sequence-parallel devices, tokens passed round
a ring, dropless, with every transfer overlapped with expert compute.

Layout (the `SEQUENCE_PARALLEL` rules): the tokens are split over the mesh axis "sp" (shard i holds the tokens of
sequence block i) and so are the routed experts (shard i holds experts [i · E/N, (i + 1) · E/N)). A token's K experts
can live anywhere, so its hidden state has to reach every shard that owns one of them and the weighted expert
outputs have to come back.

Dispatch and combine as a ring (`routed_experts_ep`): shard i's tokens, in chunks of at most `chunk_tokens`, travel
i → i + 1 → … → i − 1 together with a float32 accumulator of their routed output. At ring step t, shard i holds
chunk c = (i − t) mod N with the sum of what shards c … i − 1 computed for it; it runs its own experts on the
pairs of that chunk routed to them (the rest are sent to the kernel's empty group and cost no FLOPs), adds the
result, and passes both on. After N steps every accumulator is back at its owner, complete:

    step t:  send (x, ids, weights) of the chunk in hand to i + 1   ─┐ independent of ─┐
             y_in_hand += my_experts(chunk in hand)                  ◀┘                  │
             send y_in_hand to i + 1     (needed there only after its own step-t+1 compute)  ◀┘

Each token's sum is therefore complete and exact (no token dropped, no capacity), and both transfers of a step are
independent of that step's expert GEMMs, so XLA's asynchronous collective-permutes can overlap them. (How much
they do is XLA's scheduler's choice: on 2 H200s at 512K tokens 8.3% of the layer time stayed exposed, and the
compiled schedule had hoisted the token sends to the start; docs/BENCHMARKS.md, "Expert parallelism".)
Chunks run one after another, which bounds the per-step memory
(sorted rows, SwiGLU activations, float32 outputs) by `chunk_tokens` instead of the shard's tokens: unrolled into
one program when there are few (so a chunk's last hop can overlap the next chunk's compute), else a `lax.scan`.

Why a ring and not a ragged all-to-all. Bytes each device sends per layer, N_l tokens of D values:
    ring:          (N − 1) · N_l · D · 2 B (tokens, bf16) + N · N_l · D · 4 B (float32 accumulators)
    all-to-all:    K · (N − 1)/N · N_l · D · 2 B out and the same back (K = 6 copies, no deduplication)
In bytes per N_l · D: at N = 2 the ring sends 10 (6 with bfloat16 accumulators) against the all-to-all's 12; at
N = 8, 46 against 21. So at 8 devices and past a node the all-to-all (`jax.lax.ragged_all_to_all`, whose exact
split is data dependent) is the better transport. The ring
needs no per-step sizes, has static shapes, runs on every backend (XLA:CPU has no ragged all-to-all, so the CPU
tests could not check that one), and its transfers are plain collective-permutes that overlap with compute.
Imbalance: each shard computes the pairs routed to its own experts, whatever shard the tokens came from, so the
load per shard is the routing's load per expert group, as with any dropless EP.

`comm="local"` replaces every transfer by a local copy of the same array, rolled by one (`local_stand_in`: wrong
values, the same compute), for measuring how much communication is exposed (scripts/bench_moe_ep.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv4.sharding.context_parallel import local_stand_in
from dsv4.sharding.rules import active

F32 = jnp.float32
# Tokens per ring step: ≈ 5 TFLOP of expert GEMMs per shard at V4-Flash widths and N = 2, ~6 GiB of temporaries.
# On 2 H200s at 512K tokens 32K left 8.3% of the layer time in exposed communication, 16K 10.6% (BENCHMARKS.md).
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
#               gate_up [E_l, 2I, D], down [E_l, D, I]) → float32 [n, D]
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def routed_experts_ep(
    local_experts: LocalExperts,
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    comm: str = "ppermute",
    unroll: bool | None = None,
    combine_dtype=F32,
    mesh: Mesh | None = None,
    axis: str | None = None,
) -> jax.Array:
    """Dropless expert-parallel routed experts over the ring (module docstring). → [B, S, D] in x's dtype.

    x: [B, S, D] and expert_ids [B, S, K] int32 (global expert ids), weights [B, S, K] f32, all split over the
    sequence axis; gate_up [E, 2I, D], down [E, D, I] split over the expert axis (the same mesh axis).
    S need not divide by N: padded tokens route nowhere (id -1) and are cut from the result.
    chunk_tokens: tokens per ring step per device. unroll: one straight-line program over the chunks (default when
    there are at most MAX_UNROLLED_CHUNKS) or a `lax.scan` over them. combine_dtype: the dtype the partial sums
    travel in (float32 by default; bfloat16 halves the combine bytes and rounds each hop's partial sum).
    """
    if comm not in ("ppermute", "local"):
        raise ValueError(f"comm={comm!r}; expected 'ppermute' or 'local'")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    e = gate_up.shape[0]
    layout = ep_layout(e, mesh, axis)
    if layout is None:
        raise ValueError(f"routed_experts_ep: no mesh axis splits both the sequence and the {e} experts")
    mesh, axis, n = layout
    b, s, d = x.shape
    pad = -s % n
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        expert_ids = jnp.pad(expert_ids, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
        weights = jnp.pad(weights, ((0, 0), (0, pad), (0, 0)))
    program = _ring_program(local_experts, mesh, axis, n, chunk_tokens, comm, unroll, jnp.dtype(combine_dtype))
    out = program(x, expert_ids, weights.astype(F32), gate_up, down)
    return out[:, :s] if pad else out


@functools.lru_cache(maxsize=64)
def _ring_program(local_experts, mesh, axis, n, chunk_tokens, comm, unroll, combine_dtype):
    """The jitted shard_map, cached: inside an outer jit it is inlined; called eagerly (the model's
    `prefill_chunk` / `decode` outside jit) it is compiled once instead of dispatched op by op, which took minutes
    per call. Pass the same `local_experts` object for the same math (dsv4.moe does) to hit the cache."""
    body = functools.partial(_ring_body, local_experts, axis=axis, n=n, chunk_tokens=chunk_tokens, comm=comm,
                             unroll=unroll, combine_dtype=combine_dtype)  # fmt: skip
    seq = P(None, axis)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(seq, seq, seq, P(axis), P(axis)), out_specs=seq,
                                 check_vma=False))  # fmt: skip


def _ring_body(local_experts, x, expert_ids, weights, gate_up, down, *, axis, n, chunk_tokens, comm, unroll,
               combine_dtype):  # fmt: skip
    b, s_l, d = x.shape
    e_l = gate_up.shape[0]
    first = jax.lax.axis_index(axis) * e_l  # this shard's experts are [first, first + e_l)
    tokens = b * s_l
    size = min(tokens, chunk_tokens)
    chunks = -(-tokens // size)
    extra = chunks * size - tokens

    def flat(a, fill):
        a = a.reshape(tokens, *a.shape[2:])
        if extra:
            a = jnp.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(chunks, size, *a.shape[1:])

    xs, ids, ws = flat(x, 0), flat(expert_ids, -1), flat(weights, 0)
    forward = [(j, (j + 1) % n) for j in range(n)]

    def send(a):
        if comm == "local":  # same shape and bytes, no transfer: for measuring exposed communication only
            return local_stand_in(a)
        return jax.lax.ppermute(a, axis, forward)

    def mine(x_c, ids_c, w_c):
        local = ids_c - first
        local = jnp.where((local >= 0) & (local < e_l), local, -1)  # another shard's expert (or padding): skipped
        return local_experts(x_c, local, w_c, gate_up, down)

    def ring(chunk):
        in_hand = chunk  # (x, ids, weights) of the chunk at this step: own at t = 0
        y = None
        for t in range(n):
            if t < n - 1:
                nxt = tuple(send(a) for a in in_hand)  # issued before the compute it overlaps with
            part = mine(*in_hand)
            y = part if y is None else y.astype(F32) + part
            # to i + 1, who adds to it after its own next step; at t = N − 1 this is the way home
            y = send(y.astype(combine_dtype))
            if t < n - 1:
                in_hand = nxt
        return y

    if unroll is None:
        unroll = chunks <= MAX_UNROLLED_CHUNKS
    if unroll:  # one program: a chunk's last hop home can overlap the next chunk's compute
        ys = jnp.stack([ring((xs[j], ids[j], ws[j])) for j in range(chunks)])
    else:  # bounded program size; each chunk's last hop is exposed
        _, ys = jax.lax.scan(lambda _, c: (None, ring(c)), None, (xs, ids, ws))
    ys = ys.reshape(chunks * size, d)[:tokens]
    return ys.reshape(b, s_l, d).astype(x.dtype)
