"""Checkpoint reading: safetensors files (single or sharded) in transformers' tensor layout.

Everything is checked before anything is placed on a device: every tensor the model declares must be
present with its declared shape, nothing unexpected may be left over, every file must be whole. Tensors
are then read one at a time through a memory map, so host RAM holds one tensor at a time, not the model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

log = logging.getLogger("dsv4.weights")

SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}  # fmt: skip
# Tensors of released checkpoints that dsv4 does not run: the multi-token-prediction layers.
SKIPPED_PREFIXES = ("mtp.", "model.mtp.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and the file."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in `file`
    end: int


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
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if end - start != expected:
            raise CheckpointError(f"tensor {name} in {path}: {end - start} bytes for {dtype}{list(shape)}")
        if base + end > size:
            raise CheckpointError(f"tensor {name} in {path}: file truncated ({size} bytes, tensor ends at {base + end})")
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


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor through a read-only memory map (no copy until the caller converts it)."""
    dtype = np.dtype(SAFETENSORS_DTYPES[entry.dtype])
    count = int(np.prod(entry.shape, dtype=np.int64))
    mm = np.memmap(entry.file, dtype=np.uint8, mode="r", offset=entry.start, shape=(entry.end - entry.start,))
    return mm.view(dtype)[:count].reshape(entry.shape) if count else np.zeros(entry.shape, dtype)


# ---------------------------------------------------------------------------------------------
# Tensor layouts. dsv4's canonical names are transformers' (`model.layers.N.self_attn.q_a_proj.weight`).
# DeepSeek's releases (and transformers' own save_pretrained, which writes that layout back) use
# `layers.N.attn.wq_a.weight`, one tensor per expert, and so on; the renaming below is applied in order.
# ---------------------------------------------------------------------------------------------
_DEEPSEEK_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"), (r"^hc_head_scale$", "hc_head.hc_scale"),
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
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]  # fmt: skip
_EXPERT_RE = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


@dataclass(frozen=True)
class Source:
    """Where one model tensor comes from: a checkpoint tensor, or per-expert tensors stacked.

    parts[e] lists the tensors concatenated (along dim 0) for expert e; `stacked` stacks the experts.
    """

    name: str
    parts: tuple[tuple[TensorEntry, ...], ...]
    stacked: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        rows = sum(p.shape[0] for p in first)
        inner = (rows, *first[0].shape[1:])
        return (len(self.parts), *inner) if self.stacked else inner

    @property
    def where(self) -> str:
        return self.parts[0][0].file

    def read(self) -> np.ndarray:
        def one(entries):
            arrays = [read_tensor(e) for e in entries]
            return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)

        return np.stack([one(p) for p in self.parts]) if self.stacked else one(self.parts[0])


def canonical_sources(entries: dict[str, TensorEntry]) -> dict[str, Source]:
    """Maps either layout onto transformers' names (without the leading `model.`, `lm_head.` kept)."""
    out: dict[str, Source] = {}
    experts: dict[str, dict[int, dict[str, TensorEntry]]] = {}
    for raw, entry in entries.items():
        name = raw[len("model."):] if raw.startswith("model.") else raw
        for pattern, repl in _DEEPSEEK_RENAMES:
            name = re.sub(pattern, repl, name)
        m = _EXPERT_RE.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = entry
            continue
        if name in out:
            raise CheckpointError(f"tensor {raw} in {entry.file} duplicates {out[name].parts[0][0].name}")
        out[name] = Source(name, ((entry,),))
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
        out[f"{prefix}.down_proj"] = Source(f"{prefix}.down_proj", tuple((by_expert[e]["w2"],) for e in ids), stacked=True)
        for e in ids:  # every expert's pieces must agree, or the stacked tensor is nonsense
            for w, ref in (("w1", by_expert[0]["w1"]), ("w2", by_expert[0]["w2"]), ("w3", by_expert[0]["w1"])):
                if by_expert[e][w].shape != ref.shape:
                    bad = by_expert[e][w]
                    raise CheckpointError(f"tensor {bad.name} in {bad.file} has shape {list(bad.shape)}, "
                                          f"expected {list(ref.shape)}")  # fmt: skip
    return out


def module_name(path: tuple) -> str:
    """Module path → canonical tensor name: transformers' name without its `model.` prefix."""
    return ".".join(str(p) for p in path)


def declared_tensors(model: nnx.Module) -> Iterator[tuple[tuple, nnx.Variable]]:
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        yield path, var


def load_into(abstract_model: nnx.Module, model_dir: str, *, sharding_for=None) -> nnx.Module:
    """Fills an abstract (`nnx.eval_shape`) model from `model_dir` and returns the concrete model.

    `sharding_for(path, var)` may return a `jax.sharding.Sharding` for each tensor (default: the
    default device). Raises CheckpointError naming the tensor and file before touching any device.
    """
    entries = checkpoint_index(model_dir)
    skipped = [n for n in entries if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        log.info("skipping %d multi-token-prediction tensors (mtp.*): dsv4 does not run MTP", len(skipped))
    sources = canonical_sources({n: e for n, e in entries.items() if not n.startswith(SKIPPED_PREFIXES)})
    graphdef, state = nnx.split(abstract_model)
    flat = nnx.to_flat_state(state)

    plan = []
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
        source_dtype = np.dtype(SAFETENSORS_DTYPES[source.parts[0][0].dtype])
        if np.issubdtype(target, np.integer) != np.issubdtype(source_dtype, np.integer):
            raise CheckpointError(f"tensor {name} in {source.where} is {source.parts[0][0].dtype}; "
                                  f"expected a {target} tensor")  # fmt: skip
        plan.append((path, var, source))
    if sources:
        unexpected = sorted(sources)
        first = sources[unexpected[0]]
        raise CheckpointError(
            f"{len(unexpected)} unexpected tensors in {model_dir}, e.g. {first.parts[0][0].name} in {first.where}: "
            "config and checkpoint disagree"
        )

    values = {}
    for path, var, source in plan:
        host = source.read()
        if np.issubdtype(host.dtype, np.integer) and host.size:
            lo, hi = int(host.min()), int(host.max())
            if lo < np.iinfo(var.dtype).min or hi > np.iinfo(var.dtype).max:
                raise CheckpointError(f"tensor {source.name} in {source.where} has values outside {var.dtype}")
        array = np.asarray(host, dtype=var.dtype)
        sharding = sharding_for(path, var) if sharding_for is not None else None
        values[path] = jax.device_put(array, sharding) if sharding is not None else jnp.asarray(array)
    for path, var in flat:
        var.set_value(values[path]) if hasattr(var, "set_value") else setattr(var, "value", values[path])
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# Writing checkpoints (tests, conversions): either layout, float tensors in the model's dtypes.
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
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.self_attn\.q_b_proj\.", ".self_attn.wq_b."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."), (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.mlp\.", ".ffn."), (r"\.self_attn\.", ".attn."),
]  # fmt: skip


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


def save(model: nnx.Module, model_dir: str, *, layout: str = "transformers") -> None:
    """Writes config.json + model.safetensors; `layout` is "transformers" or "deepseek" (as released)."""
    from safetensors.numpy import save_file

    if layout not in ("transformers", "deepseek"):
        raise ValueError(f"layout={layout!r}: choose 'transformers' or 'deepseek'")
    os.makedirs(model_dir, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, var in declared_tensors(model):
        name, value = module_name(path), np.ascontiguousarray(np.asarray(var[...]))
        if layout == "deepseek":
            tensors.update((n, np.ascontiguousarray(v)) for n, v in deepseek_tensors(name, value))
        else:
            tensors[name if name.startswith("lm_head.") else f"model.{name}"] = value
    save_file(tensors, os.path.join(model_dir, "model.safetensors"))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model.config.to_hf(), f, indent=2)
