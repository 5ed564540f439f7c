"""Checkpoint reading and writing: safetensors files (single or sharded), in either tensor layout, plain or
block-quantized (FP8 e4m3 with block scales, FP4 e2m1 experts; see `dsv4/quantization.py`).

Everything is checked before anything is placed on a device: every tensor the model declares must be
present with its declared shape, every quantized weight must have a scale of the right grid, nothing
unexpected may be left over, every file must be whole. Tensors are then streamed one at a time through a
memory map straight to their devices (each device's slice only, when a sharding splits a tensor), so host
RAM holds about one tensor at a time, not the model.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dsv4.quantization import (
    FP4_GROUP,
    BlockQuantized,
    dequantize_np,
    fp4_scale_shape,
    fp8_scale_shape,
    quantize_fp4,
    quantize_fp8,
    scale_to_float32,
)

log = logging.getLogger("dsv4.weights")

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    # torch's float4_e2m1fn_x2: the header gives the logical (unpacked) shape, the data holds two per byte.
    "F4": np.uint8,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")  # U8: raw e8m0 exponent bytes
# Tensors of released checkpoints that dsv4 does not run: the multi-token-prediction layers.
SKIPPED_PREFIXES = ("mtp.", "model.mtp.")
DEFAULT_FP8_BLOCK = (128, 128)  # DeepSeek's `weight_block_size` when a config names none


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and the file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]  # as the header gives it (logical for F4)
    start: int  # absolute byte offsets in `file`
    end: int

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the bytes as numpy reads them: F4 packs the last dim two values per byte."""
        return (*self.shape[:-1], self.shape[-1] // 2) if self.dtype == "F4" else self.shape

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_safetensors_header(path: str) -> dict[str, TensorEntry]:
    """Parses one .safetensors header and checks every tensor's byte range lies inside the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: truncated (header of {header_len} bytes, file of {size})")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"tensor {name} in {path} has unsupported dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64))
        if dtype == "F4":
            if not shape or shape[-1] % 2:
                raise CheckpointError(f"tensor {name} in {path}: F4{list(shape)} needs an even last dim")
            expected = count // 2
        else:
            expected = count * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if end - start != expected:
            raise CheckpointError(f"tensor {name} in {path}: {end - start} bytes for {dtype}{list(shape)}")
        if base + end > size:
            raise CheckpointError(f"tensor {name} in {path}: file truncated ({size} bytes, tensor ends at "
                                  f"{base + end})")  # fmt: skip
        entries[name] = TensorEntry(name, path, dtype, shape, base + start, base + end)
    return entries


def checkpoint_index(model_dir: str) -> dict[str, TensorEntry]:
    """All tensors of a checkpoint directory: `model.safetensors`, or the shards its index names."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from None
        entries: dict[str, TensorEntry] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(model_dir, shard)
            if not os.path.exists(shard_path):
                missing_for = next(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(f"{index_path} names shard {shard} (e.g. for {missing_for}), which is missing")
            entries.update(read_safetensors_header(shard_path))
        for name, shard in weight_map.items():
            if name not in entries:
                raise CheckpointError(f"tensor {name}: index.json says {shard}, but that file does not hold it")
        return entries
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {model_dir}")
    entries = {}
    for file in files:
        entries.update(read_safetensors_header(os.path.join(model_dir, file)))
    return entries


def read_tensor(entry: TensorEntry, index: tuple = ()) -> np.ndarray:
    """One tensor (or `index` of it) through a read-only memory map: a view, no copy (F4 stays packed uint8)."""
    dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
    shape = entry.stored_shape
    count = int(np.prod(shape, dtype=np.int64))
    if not count:
        return np.zeros(shape, dtype)[index]
    mm = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=(entry.end - entry.start,))
    return mm.view(dtype)[:count].reshape(shape)[index]


# ---------------------------------------------------------------------------------------------
# Quantization: what the config says, and which stored tensors are block-quantized weights.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantSpec:
    """The parts of a config's `quantization_config` the loader uses."""

    block: tuple[int, int] = DEFAULT_FP8_BLOCK
    scale_fmt: str | None = None
    expert_dtype: str | None = None
    declared: bool = False  # the config has a quantization_config at all

    @classmethod
    def from_config(cls, qc: dict | None) -> QuantSpec:
        if not qc:
            return cls()
        block = qc.get("weight_block_size") or DEFAULT_FP8_BLOCK
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise CheckpointError(f"config field quantization_config.weight_block_size={block!r}: needs two positive "
                                  "integers")  # fmt: skip
        return cls(tuple(block), qc.get("scale_fmt"), qc.get("expert_dtype"), True)


@dataclass(frozen=True)
class Piece:
    """One stored weight: plain, or quantized (`fmt` "fp8" / "fp4") with its scale tensor."""

    weight: TensorEntry
    scale: TensorEntry | None = None
    fmt: str | None = None
    block: tuple[int, int] = (1, 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape: FP4 weights stored as int8/uint8 hold two values per byte."""
        w = self.weight
        if self.fmt == "fp4" and w.dtype != "F4":
            return (*w.shape[:-1], 2 * w.shape[-1])
        return w.shape

    @property
    def is_integer(self) -> bool:
        return self.fmt is None and np.issubdtype(np.dtype(SAFETENSORS_DTYPES[self.weight.dtype]), np.integer)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def read(self, dtype, index: tuple = ()) -> np.ndarray:
        """Values as `dtype` (dequantized), a fresh array; `index` (one slice per dim, or ()) selects a part.

        A quantized weight reads only the rows (and their row blocks of scales) that `index` asks for.
        """
        if self.fmt is None:
            return np.array(read_tensor(self.weight, index), dtype=dtype, copy=True)
        index = _full_index(index, self.shape)
        lead, rows, cols = index[:-2], index[-2], index[-1]
        r0, r1 = rows.start, rows.stop  # normalized by _full_index: explicit bounds, step 1
        b0 = self.block[0]
        first, last = r0 // b0, -(-r1 // b0)  # the row blocks that hold rows [r0, r1)
        q = read_tensor(self.weight, (*lead, slice(first * b0, min(last * b0, self.shape[-2]))))
        scale = read_tensor(self.scale, (*lead, slice(first, last)))
        values = dequantize_np(q.view(np.uint8) if self.fmt == "fp4" else q, scale, self.fmt, self.block, dtype)
        return np.ascontiguousarray(values[..., r0 - first * b0 : r1 - first * b0, cols])

    def read_q(self, index: tuple = ()) -> np.ndarray:
        q = read_tensor(self.weight, index)
        return np.array(q.view(np.uint8) if self.fmt == "fp4" else q, copy=True)

    def read_scale(self, index: tuple = ()) -> np.ndarray:
        return scale_to_float32(read_tensor(self.scale, index))


def _full_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (slices, possibly fewer than dims) → one slice per dim with explicit bounds and step 1."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided index {s} is not supported")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


_SCALE_SUFFIXES = ((".weight_scale_inv", ".weight"), ("_scale_inv", ""), (".scale", ".weight"))


def _pair_scales(entries: dict[str, TensorEntry]) -> dict[str, str]:
    """weight name → its scale tensor's name: `X.scale` (DeepSeek) or `X.weight_scale_inv` for `X.weight`;
    `X_scale_inv` for `X` (transformers' stacked experts)."""
    scale_of: dict[str, str] = {}
    for raw, entry in entries.items():
        for suffix, weight_suffix in _SCALE_SUFFIXES:
            if not raw.endswith(suffix):
                continue
            weight = raw[: -len(suffix)] + weight_suffix
            if suffix == ".scale" and weight not in entries:
                break  # a parameter that is called `scale` (hyper-connection scales), not a weight's scale
            if weight not in entries:
                raise CheckpointError(f"scale tensor {raw} in {entry.file} has no weight: {weight} is missing")
            if weight in scale_of:
                raise CheckpointError(f"tensor {weight} in {entries[weight].file} has two scale tensors: "
                                      f"{scale_of[weight]} and {raw}")  # fmt: skip
            scale_of[weight] = raw
            break
    return scale_of


def _piece(weight: TensorEntry, scale: TensorEntry | None, quant: QuantSpec) -> Piece:
    """Classifies one stored weight and checks its scale's dtype and grid against the weight."""
    if weight.dtype in ("F8_E4M3", "F8_E5M2"):
        if weight.dtype != "F8_E4M3":
            raise CheckpointError(f"tensor {weight.name} in {weight.file} is {weight.dtype}; FP8 weights must be "
                                  "F8_E4M3 (e4m3)")  # fmt: skip
        if scale is None:
            raise CheckpointError(
                f"tensor {weight.name} in {weight.file} is FP8 ({weight.dtype}) but has no scale tensor "
                f"(expected {weight.name.removesuffix('.weight')}.scale or {weight.name}_scale_inv / .weight_scale_inv)"
            )
        fmt, block = "fp8", quant.block
    elif weight.dtype == "F4" or (weight.dtype in ("I8", "U8") and scale is not None):
        if scale is None:
            raise CheckpointError(f"tensor {weight.name} in {weight.file} is FP4 ({weight.dtype}) but has no scale "
                                  "tensor")  # fmt: skip
        if len(weight.shape) < 2:
            raise CheckpointError(f"tensor {weight.name} in {weight.file}: FP4 weight of shape {list(weight.shape)}")
        fmt, block = "fp4", (1, FP4_GROUP)
    elif scale is not None:
        raise CheckpointError(f"tensor {weight.name} in {weight.file} is {weight.dtype} but has a scale tensor "
                              f"{scale.name} in {scale.file}; only FP8 (F8_E4M3) and FP4 (I8/U8/F4) weights take "
                              "scales")  # fmt: skip
    else:
        return Piece(weight)
    piece = Piece(weight, scale, fmt, block)
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"scale tensor {scale.name} in {scale.file} is {scale.dtype}; expected one of "
                              f"{SCALE_DTYPES}")  # fmt: skip
    if len(piece.shape) < 2:
        raise CheckpointError(f"tensor {weight.name} in {weight.file}: a quantized weight needs 2 or more dims, "
                              f"got {list(piece.shape)}")  # fmt: skip
    want = fp8_scale_shape(piece.shape, block) if fmt == "fp8" else fp4_scale_shape(piece.shape)
    if scale.shape != want:
        grid = f"blocks {list(block)}" if fmt == "fp8" else f"one scale per row and {FP4_GROUP} columns"
        raise CheckpointError(
            f"scale tensor {scale.name} in {scale.file} has shape {list(scale.shape)}, but its weight {weight.name} "
            f"in {weight.file} ({fmt.upper()}, logical shape {list(piece.shape)}, {grid}) needs {list(want)}"
        )
    return piece


# ---------------------------------------------------------------------------------------------
# Tensor layouts. dsv4's canonical names are transformers' (`model.layers.N.self_attn.q_a_proj.weight`).
# DeepSeek's releases (and transformers' own save_pretrained, which writes that layout back) use
# `layers.N.attn.wq_a.weight`, one tensor per expert, and so on; the renaming below is applied in order.
# ---------------------------------------------------------------------------------------------
_DEEPSEEK_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"),
    (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]  # fmt: skip
_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True)
class Source:
    """Where one model tensor comes from: a checkpoint tensor, or per-expert tensors stacked.

    parts[e] lists the pieces concatenated (along dim 0) for expert e; `stacked` stacks the experts.
    """

    name: str
    parts: tuple[tuple[Piece, ...], ...]
    stacked: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        rows = sum(p.shape[0] for p in first)
        inner = (rows, *first[0].shape[1:])
        return (len(self.parts), *inner) if self.stacked else inner

    @property
    def first(self) -> Piece:
        return self.parts[0][0]

    @property
    def where(self) -> str:
        return self.first.weight.file

    @property
    def pieces(self) -> Iterator[Piece]:
        return (p for part in self.parts for p in part)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def is_integer(self) -> bool:
        return self.first.is_integer

    @property
    def quantized_format(self) -> tuple[str, tuple[int, int]] | None:
        """(fmt, block) when every piece is quantized alike and the pieces join on block boundaries."""
        pieces = list(self.pieces)
        first = pieces[0]
        if first.fmt is None or any((p.fmt, p.block) != (first.fmt, first.block) for p in pieces):
            return None
        if any(p.shape[0] % first.block[0] for part in self.parts for p in part[:-1]):
            return None  # w1 ‖ w3 with a partial row block between them: no single scale grid
        return first.fmt, first.block

    def _gather(self, read_one: Callable[[Piece, tuple], np.ndarray], index: tuple | None) -> np.ndarray:
        """Assembles the tensor, or its `index` (one slice per dim), with `read_one(piece, piece_index)`."""
        index = tuple(index) if index is not None else ()
        if not self.stacked:
            return read_one(self.first, index)
        experts = range(len(self.parts))[index[0] if index else slice(None)]
        rest = index[1:]
        out = None
        for j, e in enumerate(experts):
            part = [read_one(p, ()) for p in self.parts[e]]
            block = (part[0] if len(part) == 1 else np.concatenate(part, axis=0))[rest]
            if out is None:
                out = np.empty((len(experts), *block.shape), block.dtype)
            out[j] = block
        return out

    def read(self, dtype, index: tuple | None = None) -> np.ndarray:
        """Values as `dtype` (dequantized), or the `index` slice of them (as `Sharding` index maps give)."""
        return self._gather(lambda p, i: p.read(dtype, i), index)

    def read_for_device(self, dtype, index: tuple | None = None):
        """`read`, except that a quantized tensor's slice that covers whole rows on block boundaries comes
        as stored (`HostQuantized`), to be dequantized on the device: less host work and bus traffic."""
        kept = self.quantized_format
        if kept is None:
            return self.read(dtype, index)
        fmt, block = kept
        index = _full_index(index or (), self.shape)
        *lead, rows, cols = index
        n_rows, n_cols = self.shape[-2:]
        if cols != slice(0, n_cols) or rows.start % block[0] or (rows.stop % block[0] and rows.stop != n_rows):
            return self.read(dtype, index)
        q = self.read_q((*lead, rows, slice(None)))
        scale = self.read_scale((*lead, slice(rows.start // block[0], -(-rows.stop // block[0])), slice(None)))
        return HostQuantized(q, scale, fmt, block, tuple(s.stop - s.start for s in index))

    def read_q(self, index: tuple | None = None) -> np.ndarray:
        """The stored values of a quantized tensor (FP4: packed uint8), or their `index` slice."""
        return self._gather(lambda p, i: p.read_q(i), index)

    def read_scale(self, index: tuple | None = None) -> np.ndarray:
        """Its scales as float32, or their `index` slice."""
        return self._gather(lambda p, i: p.read_scale(i), index)


def canonical_sources(entries: dict[str, TensorEntry], quant: QuantSpec | None = None) -> dict[str, Source]:
    """Maps either layout onto transformers' names (without the leading `model.`, `lm_head.` kept);
    quantized weights are paired with their scale tensors (which then are not tensors of their own)."""
    quant = quant or QuantSpec()
    scale_of = _pair_scales(entries)
    scales = set(scale_of.values())
    out: dict[str, Source] = {}
    experts: dict[str, dict[int, dict[str, Piece]]] = {}
    for raw, entry in entries.items():
        if raw in scales:
            continue
        piece = _piece(entry, entries[scale_of[raw]] if raw in scale_of else None, quant)
        name = raw[len("model."):] if raw.startswith("model.") else raw
        for pattern, repl in _DEEPSEEK_RENAMES:
            name = re.sub(pattern, repl, name)
        m = _EXPERT_RE.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = piece
            continue
        if name in out:
            raise CheckpointError(f"tensor {raw} in {entry.file} duplicates {out[name].first.weight.name}")
        out[name] = Source(name, ((piece,),))
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise CheckpointError(f"tensors {prefix}.{missing[0]}.w1/w2/w3 are missing (experts {missing})")
        for e in ids:
            absent = [w for w in ("w1", "w2", "w3") if w not in by_expert[e]]
            if absent:
                raise CheckpointError(f"tensor {prefix}.{e}.{absent[0]}.weight is missing")
        out[f"{prefix}.gate_up_proj"] = Source(
            f"{prefix}.gate_up_proj", tuple((by_expert[e]["w1"], by_expert[e]["w3"]) for e in ids), stacked=True
        )
        down = tuple((by_expert[e]["w2"],) for e in ids)
        out[f"{prefix}.down_proj"] = Source(f"{prefix}.down_proj", down, stacked=True)
        for e in ids:  # every expert's pieces must agree, or the stacked tensor is nonsense
            for w, ref in (("w1", by_expert[0]["w1"]), ("w2", by_expert[0]["w2"]), ("w3", by_expert[0]["w1"])):
                if by_expert[e][w].shape != ref.shape:
                    bad = by_expert[e][w].weight
                    raise CheckpointError(f"tensor {bad.name} in {bad.file} has shape {list(by_expert[e][w].shape)}, "
                                          f"expected {list(ref.shape)}")  # fmt: skip
    return out


def module_name(path: tuple) -> str:
    """Module path → canonical tensor name: transformers' name without its `model.` prefix."""
    return ".".join(str(p) for p in path)


def declared_tensors(model: nnx.Module) -> Iterator[tuple[tuple, nnx.Variable]]:
    yield from nnx.to_flat_state(nnx.state(model, nnx.Variable))  # (path, variable) pairs


# ---------------------------------------------------------------------------------------------
# Progress: one stderr line for long loads and conversions (no dependency).
# ---------------------------------------------------------------------------------------------
class Progress:
    """`label: 3.2/12.5 GB (26%), 1.4 GB/s, 2 s` on stderr: redrawn in place on a terminal, else a line a
    `every_s` seconds. Shown only when `enabled` (default: at least `min_bytes` to go)."""

    def __init__(self, label: str, total_bytes: int, *, enabled: bool | None = None, min_bytes: int = 1 << 30,
                 stream=None, every_s: float = 10.0):  # fmt: skip
        self.label, self.total, self.done = label, max(total_bytes, 1), 0
        self.stream = stream or sys.stderr
        self.enabled = total_bytes >= min_bytes if enabled is None else enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.2 if self.tty else every_s
        self.start = self.last = time.perf_counter()

    def _line(self) -> str:
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed / 1e9 if elapsed > 0 else 0.0
        return (f"{self.label}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB ({100 * self.done / self.total:.0f}%), "
                f"{rate:.2f} GB/s, {elapsed:.0f} s")  # fmt: skip

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self.stream.write(("\r" if self.tty else "") + self._line() + ("" if self.tty else "\n"))
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------------
def fit_sharding(sharding, shape: tuple[int, ...]):
    """`sharding` for an array of `shape`: a NamedSharding keeps its spec where the dim divides its mesh
    axes, and replicates the others (for a quantized weight's `q` / `scale`, whose shapes differ)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for i, axes in enumerate(spec[: len(shape)]):
        if axes is None:
            continue
        size = math.prod(sharding.mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
        if shape[i] % size:
            spec[i] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[: len(shape)]))


CHUNK_BYTES = 256 << 20  # a shard larger than this is sent to its device in row slices of about this size


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buffer: jax.Array, rows: jax.Array, start) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, axis=0)


@dataclass(frozen=True)
class HostQuantized:
    """A slice of a quantized weight as stored (q, float32 scales), to be dequantized on its device."""

    q: np.ndarray
    scale: np.ndarray
    fmt: str
    block: tuple[int, int]
    shape: tuple[int, ...]  # logical shape of the slice


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _dequantize_on_device(q, scale, fmt, block, shape, dtype_name) -> jax.Array:
    return BlockQuantized(q, scale, fmt, block, shape, dtype_name).dequantize()


def _to_device(host, device, dtype) -> jax.Array:
    if isinstance(host, HostQuantized):  # 1 or 0.5 bytes per weight cross the bus; the device expands them
        q, scale = jax.device_put(host.q, device), jax.device_put(host.scale, device)
        return _dequantize_on_device(q, scale, host.fmt, host.block, host.shape, np.dtype(dtype).name)
    return jax.device_put(host, device)


def _put_shard(shape, dtype, index: tuple, devices: list, read, align: int = 1) -> list[jax.Array]:
    """One shard (`index` of the global array) onto each of `devices`: in one piece, or for a large shard in
    row slices (multiples of `align` rows) written into a device buffer, so that host memory holds one slice
    at a time."""
    index = _full_index(index, shape)
    shard_shape = tuple(s.stop - s.start for s in index)
    row_bytes = math.prod(shard_shape[1:]) * np.dtype(dtype).itemsize
    if not shard_shape or shard_shape[0] <= align or shard_shape[0] * row_bytes <= CHUNK_BYTES:
        host = read(index)
        return [_to_device(host, d, dtype) for d in devices]
    rows = max(align, CHUNK_BYTES // max(row_bytes, 1) // align * align)
    buffers = [jnp.zeros(shard_shape, dtype, device=d) for d in devices]
    with warnings.catch_warnings():  # CPU has no buffer donation; there, host and device memory are one anyway
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        for r0 in range(0, shard_shape[0], rows):
            r1 = min(shard_shape[0], r0 + rows)
            host = read((slice(index[0].start + r0, index[0].start + r1), *index[1:]))
            buffers = [_write_rows(b, _to_device(host, d, dtype), r0) for b, d in zip(buffers, devices)]
            del host
    return buffers


def place(shape: tuple[int, ...], dtype, sharding, read: Callable[[tuple], np.ndarray], align: int = 1) -> jax.Array:
    """Streams one array to its devices: `read(index)` gives the host values of `index` (one slice per dim;
    a `HostQuantized` slice is dequantized on the device), read once per distinct shard, sent to every device
    that holds that shard, then dropped."""
    if sharding is None:  # this process's default device, as jnp.asarray would pick
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    index_map = sharding.addressable_devices_indices_map(shape)
    by_index: dict[tuple, list] = {}
    for device, index in index_map.items():
        by_index.setdefault(_full_index(index, shape), []).append(device)
    shards = {}
    for index, devices in by_index.items():
        shards.update(zip(devices, _put_shard(shape, dtype, index, devices, read, align)))
    return jax.make_array_from_single_device_arrays(shape, sharding, [shards[d] for d in index_map],
                                                    dtype=np.dtype(dtype))  # fmt: skip


def load_into(abstract_model: nnx.Module, model_dir: str, *, sharding_for=None, keep_quantized: bool = False,
              progress: bool | None = None, check_integer=None) -> nnx.Module:  # fmt: skip
    """Fills an abstract (`nnx.eval_shape`) model from `model_dir` and returns the concrete model.

    `sharding_for(path, var)` may return a `jax.sharding.Sharding` for each tensor (default: the default
    device); each device then receives only its slice. Quantized weights are dequantized to the model's
    dtype, or with `keep_quantized` kept as `BlockQuantized` values (q + float32 scales). `check_integer(name,
    array)` may reject an integer tensor's values (e.g. expert ids). Raises CheckpointError naming the tensor
    and file before touching any device.
    """
    config = getattr(abstract_model, "config", None)
    quant = QuantSpec.from_config(config.quantization_config if config is not None else None)
    entries = checkpoint_index(model_dir)
    skipped = [n for n in entries if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("skipping %d multi-token-prediction tensors (mtp.*): dsv4 does not run MTP", len(skipped))
    sources = canonical_sources({n: e for n, e in entries.items() if not n.startswith(SKIPPED_PREFIXES)}, quant)
    graphdef, state = nnx.split(abstract_model)
    flat = nnx.to_flat_state(state)

    plan, integers = [], {}
    for path, var in flat:
        name = module_name(path)
        source = sources.pop(name, None)
        if source is None:
            raise CheckpointError(f"tensor {name} (or its DeepSeek-layout name) is missing from the checkpoint in "
                                  f"{model_dir}")  # fmt: skip
        if source.shape != tuple(var.shape):
            raise CheckpointError(
                f"tensor {name} in {source.where} has shape {list(source.shape)}; the config needs {list(var.shape)}"
            )
        target = np.dtype(var.dtype)
        if np.issubdtype(target, np.integer) != source.is_integer:
            raise CheckpointError(f"tensor {name} in {source.where} is {source.first.weight.dtype}; "
                                  f"expected a {target} tensor")  # fmt: skip
        if source.is_integer:  # small tables (tid2eid): read and checked now, before anything is placed
            host = source.read(SAFETENSORS_DTYPES[source.first.weight.dtype])
            if host.size and (host.min() < np.iinfo(target).min or host.max() > np.iinfo(target).max):
                raise CheckpointError(f"tensor {name} in {source.where} has values outside {target}")
            if check_integer is not None:
                check_integer(name, host, source.where)
            integers[name] = host.astype(target)
        plan.append((path, var, name, source))
    if sources:
        unexpected = sorted(sources)
        first = sources[unexpected[0]]
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensors in {model_dir}, e.g. {first.first.weight.name} in {first.where}: "
            "config and checkpoint disagree"
        )
    quantized = [s for *_, s in plan if s.first.fmt is not None]
    if quantized:
        kinds = sorted({p.fmt for s in quantized for p in s.pieces if p.fmt})
        log.info("%d quantized tensors (%s, blocks %s, scale_fmt %s): %s", len(quantized), "+".join(kinds),
                 list(quant.block), quant.scale_fmt,
                 "kept quantized" if keep_quantized else "dequantized on load")  # fmt: skip

    bar = Progress(f"loading {os.path.basename(os.path.normpath(model_dir))}", sum(s.nbytes for *_, s in plan),
                   enabled=progress)  # fmt: skip
    values = {}
    for path, var, name, source in plan:
        sharding = sharding_for(path, var) if sharding_for is not None else None
        shape, dtype = tuple(var.shape), np.dtype(var.dtype)
        kept = source.quantized_format if keep_quantized else None
        if name in integers:
            host = integers.pop(name)
            values[path] = place(shape, host.dtype, sharding, lambda index, host=host: host[index].copy())
        elif kept is not None:
            fmt, block = kept
            q_shape = (*shape[:-1], shape[-1] // 2) if fmt == "fp4" else shape
            s_shape = fp8_scale_shape(shape, block) if fmt == "fp8" else fp4_scale_shape(shape)
            q_dtype = np.uint8 if fmt == "fp4" else ml_dtypes.float8_e4m3fn
            q = place(q_shape, q_dtype, fit_sharding(sharding, q_shape), source.read_q)
            s = place(s_shape, np.float32, fit_sharding(sharding, s_shape), source.read_scale)
            values[path] = BlockQuantized(q, s, fmt, block, shape, dtype.name)
        else:
            fmt_block = source.quantized_format
            align = fmt_block[1][0] if fmt_block is not None and len(shape) == 2 else 1
            read = functools.partial(source.read_for_device, dtype)
            values[path] = place(shape, dtype, sharding, lambda index, read=read: read(index), align)
        bar.update(source.nbytes)
    bar.close()
    for path, var in flat:
        var.set_value(values[path]) if hasattr(var, "set_value") else setattr(var, "value", values[path])
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Writing checkpoints (tests, conversions): either layout, float tensors in the model's dtypes, or
# quantized as DeepSeek releases are (`quantization=` a quantization_config).
# ---------------------------------------------------------------------------------------------
_TO_DEEPSEEK = [
    (r"^embed_tokens\.weight$", "embed.weight"), (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"), (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.self_attn\.q_b_proj\.", ".self_attn.wq_b."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.mlp\.", ".ffn."), (r"\.self_attn\.", ".attn."),
]  # fmt: skip
# Which weights DeepSeek's releases store in FP8 (DeepSeek-V4-Flash inference/model.py: every `Linear` built
# with the default dtype): attention q/kv/output-b projections, the indexer's q projection, the shared expert,
# and the routed experts (FP8, or FP4 when expert_dtype is "fp4"). Embeddings, the LM head, the router, the
# compressors' projections, the indexer's weights_proj and wo_a stay in higher precision.
RELEASED_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.shared_experts\.w[123]\.weight$"
    r"|\.experts\.\d+\.w[123]\.weight$"
)
RELEASED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def deepseek_tensors(name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One canonical tensor → its DeepSeek-layout tensor(s) (experts split per expert and per w1/w3)."""
    m = re.match(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
    if m:
        prefix = f"{m.group(1)}.ffn.experts"
        if m.group(2) == "down_proj":
            return [(f"{prefix}.{e}.w2.weight", value[e]) for e in range(value.shape[0])]
        half = value.shape[1] // 2
        return [t for e in range(value.shape[0])
                for t in ((f"{prefix}.{e}.w1.weight", value[e, :half]), (f"{prefix}.{e}.w3.weight", value[e, half:]))]
    for pattern, repl in _TO_DEEPSEEK:
        name = re.sub(pattern, repl, name)
    return [(name, value)]


def quantize_released(name: str, value: np.ndarray, quantization: dict) -> dict[str, np.ndarray]:
    """One DeepSeek-layout tensor → itself, or (weight, `.scale`) as a release stores it under `quantization`
    (a quantization_config: `weight_block_size`, `scale_fmt` "ue8m0" → float8_e8m0fnu scales else float32,
    `expert_dtype` "fp4" → routed experts packed FP4 as int8 with per-32 scales)."""
    if not RELEASED_FP8.search(name):
        return {name: value}
    scale_fmt = quantization.get("scale_fmt")
    if RELEASED_EXPERT.search(name) and quantization.get("expert_dtype") == "fp4":
        q, scale = quantize_fp4(value, scale_fmt=scale_fmt)
    else:
        q, scale = quantize_fp8(value, tuple(quantization.get("weight_block_size") or DEFAULT_FP8_BLOCK), scale_fmt)
    if scale_fmt == "ue8m0":
        scale = scale.astype(ml_dtypes.float8_e8m0fnu)
    return {name: q, name.removesuffix(".weight") + ".scale": scale}


def save(model: nnx.Module, model_dir: str, *, layout: str = "transformers", quantization: dict | None = None) -> None:
    """Writes config.json + model.safetensors; `layout` is "transformers" or "deepseek" (as released).

    `quantization` (deepseek layout only; a quantization_config such as `{"quant_method": "fp8",
    "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}`) stores the weights a
    release quantizes in FP8/FP4 with `.scale` tensors, and writes that quantization_config to config.json.
    """
    from safetensors.numpy import save_file

    if layout not in ("transformers", "deepseek"):
        raise ValueError(f"layout={layout!r}: choose 'transformers' or 'deepseek'")
    if quantization is not None and layout != "deepseek":
        raise ValueError("quantized checkpoints are written in the deepseek (released) layout only")
    os.makedirs(model_dir, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, var in declared_tensors(model):
        name, value = module_name(path), np.ascontiguousarray(np.asarray(var[...]))
        if layout == "deepseek":
            for n, v in deepseek_tensors(name, value):
                if quantization is not None:
                    stored = quantize_released(n, v, quantization)
                    tensors.update((k, np.ascontiguousarray(t)) for k, t in stored.items())
                else:
                    tensors[n] = np.ascontiguousarray(v)
        else:
            tensors[name if name.startswith("lm_head.") else f"model.{name}"] = value
    save_file(tensors, os.path.join(model_dir, "model.safetensors"))
    config = model.config
    if quantization is not None:
        config = config.replace(quantization_config_json=json.dumps(quantization, sort_keys=True))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
