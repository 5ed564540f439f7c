"""Sequence-parallel (context-parallel) V4 attention cores: `shard_map` with hand-written communication.

`core_attention_sp` has `core_attention_jnp`'s signature and semantics (dsv4/attention.py) and can be
selected as the attention core ("sp": `Kernels.attention`). Without an active mesh whose sequence axis ("sp")
has more than one device, or for a call that is not a full-sequence forward (`kv_aligned=False`: the
cached / chunked path, where kv is a ring plus a chunk), it simply calls `core_attention_jnp`.

Otherwise the sequence is split evenly over the N shards of the sp axis and each shard computes the
attention of its own queries, communicating only through `jax.lax.ppermute`:

(a) Halo. The window of a query at p reaches back W - 1 rows, so each shard receives the last W - 1 kv
    rows (and positions) of the shard before it (several hops if a shard holds fewer than W - 1 rows),
    then attends locally over [halo ‖ own rows] exactly as `core_attention_jnp(kv_aligned=True)` does.
(b) Compressed entries ([B, C, D], HCA and CSA) are split along the entry axis as well (C is padded to
    N · C_l with C_l a multiple of `entry_block`; padding is never visible). They travel around the
    ring i → i + 1: at step t shard i holds entry chunk (i - t) mod N. Each step issues the `ppermute`
    of the chunk in hand first and then computes a partial attention over it; the two are independent,
    so XLA's async collective-permute overlaps the transfer with the compute.
      HCA: per query chunk, only the entry sub-blocks (`entry_block` wide) below the chunk's causal
           count are computed (a dynamic-trip loop), and a whole step is skipped (`lax.cond`) for a block
           whose queries see none of the chunk in hand (its causal future).
      CSA, csa_mode="ring": the top-k indices are global; at each step a query uses only the picks that
           fall in the chunk's entry range (masked gather), and a query chunk with no pick in the range
           skips the step. Exact, but each step still gathers / multiplies all K slots of a query chunk
           that has any pick in range, so the CSA work is up to (steps with a pick) × K per query: with
           realistic picks spread over the past this does not scale with N.
      CSA, csa_mode="gather" (default): the same ring, but the chunks are assembled into the full
           [B, C, D] entry buffer (C · D bytes: 128 MiB at 512K, D = 512, bf16) while the window part is
           computed, and the picks are then attended to in one pass: K slots per query once, so the CSA
           work splits exactly N ways and the transfers hide behind the window compute.
    Every part yields log-sum-exp statistics (running max m, denominator l, unnormalized output o, all
    float32; `_merge`) that start from the sink (m = sink, l = 1, o = 0) and are combined exactly; the
    last step divides o by l. The statistics live in float32 buffers of the shard's size (the
    accumulator is 4 bytes per output element: 2× a bf16 output).
(c) balance="zigzag": the padded sequence is cut into 2N blocks of L rows and shard i computes blocks i and
    2N-1-i (one early, one late), so the causal work of HCA (and of anything else causal, e.g. the lightning
    indexer) is the same on every shard. Contiguous shard i sees (i + 1/2)/N of the entries on average, so
    the last shard does (2N-1)/N × the mean HCA work (1.5× at N = 2, 1.9× at N = 8) and
    sets the time; zigzag brings every shard to the mean. What it costs: inside the shard_map each shard's
    contiguous blocks (2i, 2i+1) are moved to (i, 2N-1-i) by ppermutes (`_relayout`: q, kv, positions,
    top-k in; the output back out): about half of q and half of the output cross devices, each S·H·D
    elements (at 512K, H = 64, D = 512, bf16 and N = 2: 8 GiB out of and into each GPU for q, the same for
    the output, i.e. ~2 × 20+ ms on NVLink per layer, not overlapped with compute since the window needs q).
    What it saves: for HCA at N = 2 a third of the HCA core time (the max shard goes from 0.75 to 0.5 of
    the entries); for sliding and CSA layers nothing (their work has no causal imbalance: K picks per query),
    so there it is pure cost. It pays off fully when the whole model runs in zigzag token order (permute the
    token ids once at the input, `zigzag_permute`, and the final hidden states back once: every per-token op
    is order-free, positions are explicit, and the compressors pool whole `rate`-token windows that never
    straddle a block when L is a multiple of the rate) and the core is called with `inputs_permuted=True`,
    so the per-layer relayout disappears. Zigzag needs W - 1 <= L; otherwise it falls back to contiguous.

(d) local_core="pallas": each shard runs a Pallas kernel once over its queries, kv = [halo ‖ block] for each of its
    blocks, and the WHOLE compressed entry array, all-gathered by GSPMD (a replicated shard_map input) instead of
    ring-passed: at 512K that is 2 MiB (HCA) or 128 MiB (CSA, D = 512, bf16) per layer, under a millisecond on
    NVLink. Window and HCA layers on Hopper take the Mosaic kernel (`v4_attention_mgpu` with each token's window
    rows, `_mosaic_per_shard`); CSA layers and other GPUs the Triton kernel (`core_attention_pallas` with
    kv_aligned=False), which takes global positions for q and kv, so the halo rows, the empty halo of shard 0
    (position -1) and the causal visibility of entries need nothing else. Scaling and exposed communication:
    docs/BENCHMARKS.md; design: docs/kernels/parallelism.md. Checked against the 1-device model by
    tests/test_gpu_sequence_parallel.py and tests/test_context_parallel.py (`-m gpu`).

Whole-model zigzag. Under a layout whose rules say `seq_order="zigzag"` (`SEQUENCE_PARALLEL_ZIGZAG`), every
[B, S, ...] activation of the full-sequence forward is in zigzag order: `DeepseekV4.hidden_states` pads S so that a
block holds L rows (a multiple of every compress rate, at least W - 1), permutes the token ids and positions once,
and permutes the final hidden states back once. In between:
    - per-token work (projections, norms, hyper-connections, the MoE) does not care about the order;
    - the compressors pool each block on its own (windows never straddle a block) and put the entries in sequence
      order (`dsv4.attention.pool_windows_zigzag`; CSA's overlap takes the previous block's last window);
    - the indexer reads each query's global position, so its causal work splits evenly too;
    - this core takes the zigzag layout from the active rules (`balance=None`) with `inputs_permuted=True`, so no
      per-layer relayout: each shard attends for its two blocks, each with its own halo (`_halo_zigzag`), with
      the jnp body or (local_core="pallas") one kernel call over both blocks.
  What it costs: the ids and positions permutation (4 bytes a token) and the final hidden states' (D · 2 bytes a
  token); the compressors' entries are gathered in sequence order (at 512K, 2 MiB for HCA, 128 MiB for CSA).

Sequence length: S need not be divisible by N (or 2N for zigzag): the wrapper pads S up to a multiple
(queries and kv rows with position -1, top-k -1: never visible, outputs dropped); S divisible needs no
padding and no resharding.
Numerics: float32 inputs agree with `core_attention_jnp` to ~1e-6; bf16 differs only by where the
unnormalized probabilities are rounded (relative to the running max of each step instead of the global
row max) and the float32 accumulation order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dsv4.attention.core import CompressedKeys, core_attention_jnp
from dsv4.attention.pallas_core import core_attention_pallas, mosaic_applies
from dsv4.pallas.attention_common import scale_queries
from dsv4.pallas.attention_mgpu import v4_attention_mgpu
from dsv4.sharding.sequence import local_stand_in, sp_layout, zigzag_shards

F32 = jnp.float32
NEG_INF = float("-inf")


def core_attention_sp(
    q: jax.Array,
    kv: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    sinks: jax.Array,
    *,
    sliding_window: int,
    scale: float,
    compressed: CompressedKeys | None = None,
    kv_aligned: bool = False,
    query_chunk: int = 512,
    mesh: Mesh | None = None,
    axis: str | None = None,
    balance: str | None = None,
    csa_mode: str = "gather",
    entry_block: int = 512,
    comm: str = "ppermute",
    inputs_permuted: bool = False,
    local_core: str = "jnp",
    q_scale: jax.Array | None = None,
) -> jax.Array:
    """`core_attention_jnp` split over the sequence axis of the active (or given) mesh. → [B, S, H, D].

    q: [B, S, H, D]; kv: [B, S, D]; q_pos, kv_pos: [B, S] global positions; sinks: [H]. Extra options:
    mesh / axis: the mesh and its sequence axis (default: the active `use_mesh` layout's "seq" axis).
    balance: "contiguous", "zigzag" (module docstring (c)), or None: the active layout's `seq_order`, and under a
    zigzag layout the inputs are already in zigzag order ("Whole-model zigzag"). csa_mode: "gather" or "ring".
    entry_block: HCA entries per inner step (the causal-skip granularity). comm: "ppermute", or "local"
    (every transfer replaced by a local array of the same shape: wrong values, same compute; for measuring
    exposed communication only). inputs_permuted: with zigzag, the inputs already are (and the output
    stays) in zigzag order. local_core: "jnp" (the body with ring-passed entries) or "pallas" (module
    docstring (d)). q_scale: [B, S, H] float32, applied to q first (`scale_queries`: not folded here).
    """
    q = scale_queries(q, q_scale)
    layout = sp_layout(mesh, axis)
    if balance is None:
        balance = "contiguous"
        if layout is not None and layout[2] == zigzag_shards():  # the layers run in zigzag order
            balance, inputs_permuted = "zigzag", True
    if compressed is not None and compressed.entries.shape[1] == 0:
        compressed = None
    if layout is None or not kv_aligned:
        return core_attention_jnp(q, kv, q_pos, kv_pos, sinks, sliding_window=sliding_window, scale=scale,
                                  compressed=compressed, kv_aligned=kv_aligned, query_chunk=query_chunk)  # fmt: skip
    bad = balance not in ("contiguous", "zigzag") or csa_mode not in ("gather", "ring")
    if bad or comm not in ("ppermute", "local"):
        raise ValueError(f"balance={balance!r}, csa_mode={csa_mode!r}, comm={comm!r}")
    if local_core not in ("jnp", "pallas"):
        raise ValueError(f"local_core={local_core!r}; available: 'jnp', 'pallas'")
    mesh, axis, n = layout
    b, s, h, d = q.shape
    halo = min(sliding_window - 1, s)
    zigzag = balance == "zigzag"
    if zigzag:
        block = -(-s // (2 * n))
        if halo > block:
            if inputs_permuted:
                raise ValueError(f"zigzag needs sliding_window - 1 <= S / 2N; got {halo} > {block}")
            zigzag = False
    n_blocks = 2 * n if zigzag else n
    s_pad = -(-s // n_blocks) * n_blocks
    if zigzag and inputs_permuted and s_pad != s:
        raise ValueError(f"inputs_permuted needs S divisible by 2N = {2 * n}; got {s}")
    pad = s_pad - s

    def padded(x, value):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value) if pad else x

    args = {"q": padded(q, 0), "kv": padded(kv, 0), "q_pos": padded(q_pos.astype(jnp.int32), -1),
            "kv_pos": padded(kv_pos.astype(jnp.int32), -1)}  # fmt: skip
    kind, rate, c_total, c_local, eb = None, 1, 0, 0, 1
    if compressed is not None:
        kind = "hca" if compressed.topk_indices is None else "csa"
        rate, c_total = compressed.rate, compressed.entries.shape[1]
        per_shard = -(-c_total // n)
        eb = max(1, min(entry_block, per_shard))
        c_local = -(-per_shard // eb) * eb
        args["entries"] = jnp.pad(compressed.entries, [(0, 0), (0, n * c_local - c_total), (0, 0)])
        if kind == "csa":
            args["topk"] = padded(compressed.topk_indices.astype(jnp.int32), -1)

    if local_core == "pallas":
        return _core_pallas_per_shard(args, compressed, sinks, mesh=mesh, axis=axis, n=n, s=s, halo=halo,
                                      sliding_window=sliding_window, scale=scale, comm=comm, zigzag=zigzag,
                                      relayout=zigzag and not inputs_permuted)  # fmt: skip

    cfg = _Config(n=n, axis=axis, n_blocks_local=2 if zigzag else 1, block=s_pad // n_blocks, halo=halo,
                  window=sliding_window, scale=scale, query_chunk=query_chunk, kind=kind, rate=rate,
                  c_total=c_total, c_local=c_local, entry_block=eb, csa_mode=csa_mode, comm=comm,
                  relayout=zigzag and not inputs_permuted)  # fmt: skip
    names = list(args)
    seq = P(None, axis)
    body = functools.partial(_shard_body, cfg=cfg, names=tuple(names))
    out = jax.shard_map(body, mesh=mesh, in_specs=(tuple(seq for _ in names), P()), out_specs=seq,
                        check_vma=False)(tuple(args[k] for k in names), sinks)  # fmt: skip
    return out[:, :s] if pad else out


def _core_pallas_per_shard(args, compressed, sinks, *, mesh, axis, n, s, halo, sliding_window, scale, comm, zigzag,
                           relayout):  # fmt: skip
    """local_core="pallas" (module docstring (d)). args: the padded q, kv, q_pos, kv_pos ([B, S_pad, ...]). One
    kernel call per shard over all its queries and kv = [halo ‖ block] for each of its blocks (one contiguous, two
    zigzag): on Hopper for window and HCA layers the Mosaic kernel (each token's window rows given), else the Triton
    kernel (windows found by position). No slice of q and no concatenation of outputs: at 512K, q is 16 GiB a shard."""
    s_pad = args["q"].shape[1]
    n_local = 2 if zigzag else 1
    rows = s_pad // (n * n_local)
    cfg = _Config(n=n, axis=axis, n_blocks_local=n_local, block=rows, halo=halo, window=sliding_window, scale=scale,
                  query_chunk=0, kind=None, rate=1, c_total=0, c_local=0, entry_block=1, csa_mode="gather",
                  comm=comm, relayout=relayout)  # fmt: skip
    seq = P(None, axis)
    names = ["q", "kv", "q_pos", "kv_pos"]
    sharded = [args[k] for k in names]
    replicated = []
    if compressed is not None:
        replicated.append(compressed.entries)
        if compressed.topk_indices is not None:
            topk = compressed.topk_indices.astype(jnp.int32)
            sharded.append(jnp.pad(topk, [(0, 0), (0, s_pad - s), (0, 0)], constant_values=-1) if s_pad > s else topk)

    csa = compressed is not None and compressed.topk_indices is not None
    mosaic = (not csa and halo == sliding_window - 1 and rows >= halo
              and mosaic_applies(args["q"], args["kv"], compressed, layout_ok=True))  # fmt: skip

    def body(*arrays):
        local_arrays = arrays[: len(sharded)]
        if relayout:
            local_arrays = [_relayout(x, cfg, forward=True) for x in local_arrays]
        q, kv, q_pos, kv_pos, *rest = local_arrays
        shard_sinks, *entries = arrays[len(sharded) :]
        me = jax.lax.axis_index(axis)
        spans = [slice(i * rows, (i + 1) * rows) for i in range(n_local)]
        if halo == 0:
            halos = [(kv[:, :0], kv_pos[:, :0])] * n_local
        elif zigzag:
            halos = _halo_zigzag(kv[:, spans[0]], kv_pos[:, spans[0]], kv[:, spans[1]], kv_pos[:, spans[1]], cfg)
        else:
            halos = [_halo_contiguous(kv, kv_pos, cfg)]
        # kv = [halo ‖ block] per block. On the last zigzag shard block B's halo is block A's tail, already in kv:
        # its positions become -1 there (the Triton kernel masks by position: no key twice; Mosaic reads rows).
        kv_parts, pos_parts = [], []
        for i, (span, (halo_kv, halo_pos)) in enumerate(zip(spans, halos)):
            if zigzag and i == 1 and halo:
                halo_pos = jnp.where(me == n - 1, -1, halo_pos)
            kv_parts += [halo_kv, kv[:, span]]
            pos_parts += [halo_pos, kv_pos[:, span]]
        kv_ext, pos_ext = jnp.concatenate(kv_parts, 1), jnp.concatenate(pos_parts, 1)
        if mosaic:
            out = _mosaic_per_shard(q, kv_ext, q_pos, shard_sinks, entries[0] if entries else None, me, rows=rows,
                                    halo=halo, compressed=compressed, sliding_window=sliding_window, scale=scale)
        else:
            local = None
            if compressed is not None:
                local = CompressedKeys(entries[0], compressed.rate, rest[0] if rest else None)
            out = core_attention_pallas(q, kv_ext, q_pos, pos_ext, shard_sinks, sliding_window=sliding_window,
                                        scale=scale, compressed=local, kv_aligned=False)  # fmt: skip
        return _relayout(out, cfg, forward=False) if relayout else out

    out = jax.shard_map(body, mesh=mesh, in_specs=(*(seq for _ in sharded), P(), *(P() for _ in replicated)),
                        out_specs=seq, check_vma=False)(*sharded, sinks, *replicated)  # fmt: skip
    return out[:, :s] if s_pad > s else out


def _mosaic_per_shard(q, kv_ext, q_pos, sinks, entries, me, *, rows, halo, compressed, sliding_window, scale):
    """The Mosaic kernel once over the shard's queries: kv_ext = [halo ‖ block] per block, so token t of block
    b = t // rows sits at kv row b·(rows + halo) + halo + t % rows and sees W rows back from it, never before its
    block's halo; the halo of global block 0 (block A of shard 0) holds nothing."""
    t = jnp.arange(q.shape[1], dtype=jnp.int32)
    blk = t // rows
    row = blk * (rows + halo) + halo + t % rows
    region = blk * (rows + halo) + jnp.where((blk == 0) & (me == 0), halo, 0)
    lo = jnp.maximum(row - (sliding_window - 1), region)
    b = q.shape[0]
    window_rows = (jnp.broadcast_to(lo, (b, t.size)), jnp.broadcast_to(row + 1, (b, t.size)))
    extra = {} if compressed is None else dict(compressed=entries, compress_rate=compressed.rate)
    return v4_attention_mgpu(q, kv_ext, q_pos, sinks.astype(F32), sliding_window=sliding_window, scale=scale,
                             check_positions=False, window_rows=window_rows, **extra)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Per-shard body.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Config:
    n: int
    axis: str
    n_blocks_local: int
    block: int  # L: rows per block (contiguous: S / N; zigzag: S / 2N)
    halo: int
    window: int
    scale: float
    query_chunk: int
    kind: str | None  # None (sliding), "hca", "csa"
    rate: int
    c_total: int  # real entries (the rest of n · c_local is padding)
    c_local: int
    entry_block: int
    csa_mode: str
    comm: str
    relayout: bool  # zigzag: move blocks (2i, 2i+1) → (i, 2N-1-i) on entry, and back on exit


def _permute(x, cfg: _Config, pairs):
    """ppermute, or (comm="local") a local stand-in of the same shape for the exposed-comm measurement."""
    if cfg.comm == "local":
        return local_stand_in(x)
    return jax.lax.ppermute(x, cfg.axis, pairs)


def _relayout(x, cfg: _Config, *, forward: bool):
    """Shard i's rows [B, 2L, ...]: contiguous blocks (2i, 2i+1) → zigzag blocks (i, 2N-1-i) (or back), by
    ppermutes: one per (source slot, destination slot) pair, each a partial permutation of the shards; a
    block that stays on its shard is a self pair (a local copy)."""
    n, rows = cfg.n, cfg.block
    home = lambda g: (g // 2, g % 2)  # noqa: E731  (shard, slot) of global block g, contiguous
    zig = lambda g: (g, 0) if g < n else (2 * n - 1 - g, 1)  # noqa: E731  ... and in zigzag order
    src_of, dst_of = (home, zig) if forward else (zig, home)
    slots = [x[:, :rows], x[:, rows:]]
    me = jax.lax.axis_index(cfg.axis)
    out = []
    for t in (0, 1):
        got = None
        for s in (0, 1):
            blocks = [g for g in range(2 * n) if src_of(g)[1] == s and dst_of(g)[1] == t]
            if not blocks:
                continue
            pairs = [(src_of(g)[0], dst_of(g)[0]) for g in blocks]
            if cfg.comm == "local":
                recv = local_stand_in(slots[s])
            else:
                recv = jax.lax.ppermute(slots[s], cfg.axis, pairs)
            if got is None:
                got = recv
            else:  # shards whose slot t comes from source slot s take this one
                takes = jnp.asarray([any(dst_of(g)[0] == i for g in blocks) for i in range(n)])
                got = jnp.where(takes[me], recv, got)
        out.append(got)
    return jnp.concatenate(out, axis=1)


def _shift_positions(pos, cfg: _Config, pairs):
    # Shards that receive nothing get zeros: send pos + 1 so that they read as -1 (empty).
    if cfg.comm == "local":  # the stand-in keeps them sorted (positions one block back), so the kernels' window
        return pos - cfg.block  # searches do the work they do with the real transfer
    return _permute(pos + 1, cfg, pairs) - 1


def _halo_contiguous(kv, pos, cfg: _Config):
    """The `halo` kv rows and positions just before this shard's rows (possibly from several shards back)."""
    halo, rows, n = cfg.halo, cfg.block, cfg.n
    take = min(halo, rows)
    hops = min(-(-halo // rows), n - 1)
    kv_parts, pos_parts = [], []
    for k in range(hops, 0, -1):  # farthest first: shard i receives from i - k
        pairs = [(j, j + k) for j in range(n - k)]
        kv_parts.append(_permute(kv[:, rows - take :], cfg, pairs))
        pos_parts.append(_shift_positions(pos[:, rows - take :], cfg, pairs))
    got = hops * take
    if got < halo:  # the sequence start: nothing further back
        kv_parts.insert(0, jnp.zeros((kv.shape[0], halo - got, kv.shape[2]), kv.dtype))
        pos_parts.insert(0, jnp.full((pos.shape[0], halo - got), -1, pos.dtype))
    return jnp.concatenate(kv_parts, 1)[:, -halo:], jnp.concatenate(pos_parts, 1)[:, -halo:]


def _halo_zigzag(kv_a, pos_a, kv_b, pos_b, cfg: _Config):
    """Block A of shard i is global block i (halo: block i-1 = shard i-1's A); block B is 2N-1-i (halo:
    block 2N-2-i = shard i+1's B, or for the last shard its own A)."""
    halo, rows, n = cfg.halo, cfg.block, cfg.n
    fwd = [(j, j + 1) for j in range(n - 1)]
    bwd = [(j + 1, j) for j in range(n - 1)]
    tail = slice(rows - halo, rows)
    halo_a = (_permute(kv_a[:, tail], cfg, fwd), _shift_positions(pos_a[:, tail], cfg, fwd))
    last = jax.lax.axis_index(cfg.axis) == n - 1
    from_b = (_permute(kv_b[:, tail], cfg, bwd), _shift_positions(pos_b[:, tail], cfg, bwd))
    halo_b = (jnp.where(last, kv_a[:, tail], from_b[0]), jnp.where(last, pos_a[:, tail], from_b[1]))
    return halo_a, halo_b


def _merge(stats, logits, mask, equation, values):
    """Folds one key set into the running (max, denominator, unnormalized output). logits: [B, Q, H, T] f32,
    already scaled; mask: [B, Q, T]. The running max starts at the sink, so it is always finite."""
    m, den, o = stats
    logits = jnp.where(mask[:, :, None, :], logits, NEG_INF)
    m_new = jnp.maximum(m, logits.max(-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[..., None])
    den_new = den * alpha + p.sum(-1)
    o_new = o * alpha[..., None] + jnp.einsum(equation, p.astype(values.dtype), values, preferred_element_type=F32)
    return m_new, den_new, o_new


def _window_part(stats, qc, pos, keys, key_pos, cfg: _Config):
    logits = jnp.einsum("bqhd,btd->bqht", qc, keys, preferred_element_type=F32) * cfg.scale
    kp = key_pos[:, None, :]
    mask = (kp >= 0) & (kp <= pos[..., None]) & (kp > pos[..., None] - cfg.window)
    return _merge(stats, logits, mask, "bqht,btd->bqhd", keys)


def _hca_part(stats, qc, pos, chunk, lo, cfg: _Config):
    """HCA entries chunk [B, C_l, D] holding global entries lo + [0, C_l): only the `entry_block`-wide
    sub-blocks below the query chunk's causal count are computed."""
    eb = cfg.entry_block
    visible = jnp.minimum((pos + 1) // cfg.rate, cfg.c_total)  # [B, Q]
    n_sub = (jnp.clip(visible.max() - lo, 0, cfg.c_local) + eb - 1) // eb

    def sub_block(k, st):
        e = jax.lax.dynamic_slice_in_dim(chunk, k * eb, eb, axis=1)
        idx = lo + k * eb + jnp.arange(eb)
        logits = jnp.einsum("bqhd,bcd->bqhc", qc, e, preferred_element_type=F32) * cfg.scale
        return _merge(st, logits, idx[None, None, :] < visible[..., None], "bqhc,bcd->bqhd", e)

    return jax.lax.fori_loop(0, n_sub, sub_block, stats)


def _csa_part(stats, qc, idx, chunk, lo, cfg: _Config):
    """CSA: the picks idx [B, Q, K] (global, -1 = none) that fall in chunk [B, C, D] = entries lo + [0, C)."""
    c = chunk.shape[1]
    local = idx - lo
    in_range = (idx >= 0) & (local >= 0) & (local < c)

    def compute(st):
        gathered = jax.vmap(lambda e, i: e[i])(chunk, jnp.clip(local, 0, c - 1))  # [B, Q, K, D]
        logits = jnp.einsum("bqhd,bqkd->bqhk", qc, gathered, preferred_element_type=F32) * cfg.scale
        return _merge(st, logits, in_range, "bqhk,bqkd->bqhd", gathered)

    if cfg.csa_mode == "gather":  # one pass over all entries: nearly every chunk has a pick
        return compute(stats)
    return jax.lax.cond(in_range.any(), compute, lambda st: st, stats)


class _Block(dict):
    """One contiguous run of this shard's queries, in query chunks: q [nq, B, Qc, H, D], pos [nq, B, Qc],
    topk [nq, B, Qc, K], band / band_pos (halo ‖ rows ‖ chunk padding), max_pos (scalar)."""


def _make_block(q, pos, kv, halo_kv, halo_pos, topk, cfg: _Config) -> _Block:
    b, rows = pos.shape
    n_chunks = -(-rows // cfg.query_chunk)
    chunk = -(-rows // n_chunks)
    pad = n_chunks * chunk - rows

    def chunks(x, value):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value) if pad else x
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    blk = _Block(q=chunks(q, 0), pos=chunks(pos, -1), chunk=chunk, n_chunks=n_chunks, max_pos=pos.max())
    kv_rows = jnp.pad(kv, [(0, 0), (0, pad), (0, 0)]) if pad else kv
    pos_rows = jnp.pad(pos, [(0, 0), (0, pad)], constant_values=-1) if pad else pos
    blk["band"] = jnp.concatenate([halo_kv, kv_rows], 1) if cfg.halo else kv_rows
    blk["band_pos"] = jnp.concatenate([halo_pos, pos_rows], 1) if cfg.halo else pos_rows
    if topk is not None:
        blk["topk"] = chunks(topk, -1)
    return blk


def _run_step(blk: _Block, stats, cfg: _Config, *, window: bool, entries=None, lo=None, final: bool, dtype):
    """One pass over the block's query chunks, folding the window (if `window`) and the entries in hand
    into the statistics. → new statistics, or (`final`) the normalized output [nq, B, Qc, H, D]."""
    qlen, halo = blk["chunk"], cfg.halo

    def one_chunk(c, st):
        qc, pos = blk["q"][c], blk["pos"][c]
        if window:
            keys = jax.lax.dynamic_slice_in_dim(blk["band"], c * qlen, qlen + halo, axis=1)
            key_pos = jax.lax.dynamic_slice_in_dim(blk["band_pos"], c * qlen, qlen + halo, axis=1)
            st = _window_part(st, qc, pos, keys, key_pos, cfg)
        if entries is not None and cfg.kind == "hca":
            st = _hca_part(st, qc, pos, entries, lo, cfg)
        elif entries is not None:
            st = _csa_part(st, qc, blk["topk"][c], entries, lo, cfg)
        return st

    if final:

        def body(c, out):
            _, den, o = one_chunk(c, tuple(x[c] for x in stats))
            return out.at[c].set((o / den[..., None]).astype(dtype))

        return jax.lax.fori_loop(0, blk["n_chunks"], body, jnp.zeros(stats[2].shape, dtype))

    def body(c, st_all):
        st = one_chunk(c, tuple(x[c] for x in st_all))
        return tuple(x.at[c].set(y) for x, y in zip(st_all, st))

    return jax.lax.fori_loop(0, blk["n_chunks"], body, stats)


def _shard_body(arrays, sinks, *, cfg: _Config, names):
    a = dict(zip(names, arrays))
    if cfg.relayout:
        a = {k: v if k == "entries" else _relayout(v, cfg, forward=True) for k, v in a.items()}
    q, kv, q_pos, kv_pos = a["q"], a["kv"], a["q_pos"], a["kv_pos"]
    b, _, h, d = q.shape
    rows = cfg.block
    me = jax.lax.axis_index(cfg.axis)

    # (a) halo exchange, then the shard's blocks of queries.
    if cfg.n_blocks_local == 1:
        halos = [_halo_contiguous(kv, kv_pos, cfg)] if cfg.halo else [(None, None)]
        spans = [slice(0, rows)]
    else:
        spans = [slice(0, rows), slice(rows, 2 * rows)]
        halos = (list(_halo_zigzag(kv[:, spans[0]], kv_pos[:, spans[0]], kv[:, spans[1]], kv_pos[:, spans[1]], cfg))
                 if cfg.halo else [(None, None)] * 2)  # fmt: skip
    topk = a.get("topk")
    blocks = [_make_block(q[:, sp], q_pos[:, sp], kv[:, sp], hk, hp, None if topk is None else topk[:, sp], cfg)
              for sp, (hk, hp) in zip(spans, halos)]  # fmt: skip

    def init(blk):
        shape = blk["q"].shape[:-1]  # [nq, B, Qc, H]
        m = jnp.broadcast_to(sinks.astype(F32), shape)
        return m, jnp.ones(shape, F32), jnp.zeros((*shape, d), F32)

    def finish(outs):
        out = jnp.concatenate([jnp.moveaxis(o, 0, 1).reshape(b, -1, h, d)[:, :rows] for o in outs], axis=1)
        return _relayout(out, cfg, forward=False) if cfg.relayout else out

    stats = [init(blk) for blk in blocks]
    step = functools.partial(_run_step, cfg=cfg, dtype=q.dtype)
    if cfg.kind is None:  # sliding only: no ring
        return finish([step(blk, st, window=True, final=True) for blk, st in zip(blocks, stats)])

    # (b) the entries ring: shard i holds chunk (i - t) mod N at step t; send first, then compute.
    ring = [(j, (j + 1) % cfg.n) for j in range(cfg.n)]
    chunk = a["entries"]
    c_local = cfg.c_local

    if cfg.kind == "csa" and cfg.csa_mode == "gather":
        buffer = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((b, cfg.n * c_local, d), chunk.dtype), chunk, me * c_local, axis=1
        )
        stats = [step(blk, st, window=True, final=False) for blk, st in zip(blocks, stats)]  # overlaps the ring
        for t in range(1, cfg.n):
            chunk = _permute(chunk, cfg, ring)
            buffer = jax.lax.dynamic_update_slice_in_dim(buffer, chunk, ((me - t) % cfg.n) * c_local, axis=1)
        return finish([step(blk, st, window=False, entries=buffer, lo=0, final=True) for blk, st in zip(blocks, stats)])

    for t in range(cfg.n):
        incoming = _permute(chunk, cfg, ring) if t < cfg.n - 1 else None  # in flight during this step's compute
        lo = ((me - t) % cfg.n) * c_local
        final = t == cfg.n - 1
        new = []
        for blk, st in zip(blocks, stats):
            run = functools.partial(step, blk, window=t == 0, entries=chunk, lo=lo, final=final)
            if t == 0 or final:
                new.append(run(st))
            else:  # skip a step that lies wholly in this block's causal future
                if cfg.kind == "hca":
                    useful = jnp.minimum((blk["max_pos"] + 1) // cfg.rate, cfg.c_total) > lo
                else:
                    useful = ((blk["topk"] >= lo) & (blk["topk"] < lo + c_local)).any()
                new.append(jax.lax.cond(useful, run, lambda s: s, st))
        stats = new
        chunk = incoming
    return finish(stats)


def core_attention_sp_pallas(*args, **kwargs) -> jax.Array:
    """`core_attention_sp` with a Pallas kernel for each shard's own attention (entries all-gathered instead of
    ring-passed; module docstring (d))."""
    return core_attention_sp(*args, local_core="pallas", **kwargs)


def chunk_core_per_shard(core, q, keys, q_pos, key_pos, sinks, *, sliding_window: int, scale: float,
                         compressed: CompressedKeys | None = None, **kwargs) -> jax.Array:  # fmt: skip
    """A cached chunk's attention with its queries split over the active mesh's sequence axis: the chunk's K=V rows
    are gathered with the ring (`keys` [B, W + n, D] in the cached-chunk layout: the W positions before the chunk,
    then the chunk's own), the compressed entries go whole to every shard, and each shard attends for its own
    queries over the W rows before its first query and its own rows — the same layout, so `kv_prefix` = W holds
    per shard. CSA's picks and q's factors (`q_scale`) travel with their queries. Without a sequence axis, or a
    chunk that does not split evenly (a decode step), `core` runs as is."""
    layout = sp_layout()
    b, n = q.shape[:2]
    if layout is None or n % layout[2]:
        return core(q, keys, q_pos, key_pos, sinks, sliding_window=sliding_window, scale=scale, compressed=compressed,
                    **kwargs)  # fmt: skip
    mesh, axis, shards = layout
    rows, w = n // shards, keys.shape[1] - n
    topk = None if compressed is None else compressed.topk_indices
    q_scale = kwargs.pop("q_scale", None)  # q's inverse RMS (`Kernels.q_norm` "fold") splits with its queries
    sharded = [q, q_pos] + ([topk] if topk is not None else []) + ([q_scale] if q_scale is not None else [])
    replicated = [keys, key_pos, sinks] + ([compressed.entries] if compressed is not None else [])

    def body(*arrays):
        q_, q_pos_ = arrays[:2]
        topk_ = arrays[2] if topk is not None else None
        factors = {} if q_scale is None else dict(q_scale=arrays[len(sharded) - 1])
        keys_, key_pos_, sinks_, *entries = arrays[len(sharded):]
        first = jax.lax.axis_index(axis) * rows
        keys_ = jax.lax.dynamic_slice_in_dim(keys_, first, w + rows, axis=1)
        key_pos_ = jax.lax.dynamic_slice_in_dim(key_pos_, first, w + rows, axis=1)
        local = None if compressed is None else CompressedKeys(entries[0], compressed.rate, topk_)
        return core(q_, keys_, q_pos_, key_pos_, sinks_, sliding_window=sliding_window, scale=scale, compressed=local,
                    **factors, **kwargs)  # fmt: skip

    seq = P(None, axis)
    return jax.shard_map(body, mesh=mesh, in_specs=(*(seq for _ in sharded), *(P() for _ in replicated)),
                         out_specs=seq, check_vma=False)(*sharded, *replicated)  # fmt: skip
