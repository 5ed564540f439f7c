"""DeepSeek-V4 model configuration: one frozen, hashable dataclass.

Field names follow the ``config.json`` that ``transformers`` writes for ``DeepseekV4Config`` (5.23.0).
:meth:`Config.from_hf` also reads the legacy keys DeepSeek's own releases ship (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``, ``compress_rate_csa`` / ``_hca``).
Presets (``tiny``, ``v4-flash``, ``v4-pro``) live at the bottom of this file and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
ROPE_TYPES = ("default", "yarn")

# DeepSeek-V4.1 keys with no public reference implementation; refuse rather than silently ignore.
_UNSUPPORTED_KEYS = ("kv_source_layer_ids", "engram_layer_ids", "engram_config", "kv_cache_dtype_fp4")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One RoPE setting ("main" for sliding layers, "compress" for CSA/HCA layers and compressors)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    # YaRN only.
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type={self.rope_type!r}: dsv4 supports {ROPE_TYPES}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_parameters.rope_theta={self.rope_theta} must be > 0")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"rope_parameters.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.rope_type == "yarn":
            if self.factor is None or self.factor <= 0:
                raise ValueError(f"rope_parameters.factor={self.factor} must be > 0 for YaRN")
            if not self.original_max_position_embeddings:
                raise ValueError("rope_parameters.original_max_position_embeddings is required for YaRN")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str) -> RopeConfig:
        d = dict(d)
        if "type" in d and "rope_type" not in d:
            d["rope_type"] = d.pop("type")
        d.pop("type", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"rope_parameters[{where!r}] has unknown keys {unknown}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Config:
    """Every DeepSeek-V4 architecture field, named as in transformers' config.json."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    layer_types: tuple[str, ...] = ()
    # Stored as sorted (layer_type, rate) pairs so the config stays hashable; see `compress_rate()`.
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    mlp_layer_types: tuple[str, ...] = ()
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    rope_main: RopeConfig = RopeConfig(rope_theta=10000.0, partial_rotary_factor=64 / 512)
    rope_compress: RopeConfig = RopeConfig(rope_theta=160000.0, partial_rotary_factor=64 / 512)
    # Kept verbatim (as sorted JSON) for the checkpoint loader; the model itself does not read it.
    quantization_config_json: str | None = None

    def __post_init__(self):
        def fail(field: str, value: Any, why: str):
            raise ValueError(f"config field {field}={value!r}: {why}")

        for name in (
            "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "max_position_embeddings",
            "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
            "index_head_dim", "index_topk",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(name, value, "must be a positive integer")
        if self.num_key_value_heads != 1:
            fail("num_key_value_heads", self.num_key_value_heads, "DeepSeek-V4 has one shared KV head")
        if self.n_shared_experts != 1:
            # The reference builds exactly one shared expert of width moe_intermediate_size.
            fail("n_shared_experts", self.n_shared_experts, "only 1 is supported (as in the reference)")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", self.qk_rope_head_dim, f"must be even and in (0, head_dim={self.head_dim}]")
        if self.index_head_dim < self.qk_rope_head_dim:
            fail("index_head_dim", self.index_head_dim, f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            fail("num_experts_per_tok", self.num_experts_per_tok, f"exceeds n_routed_experts={self.n_routed_experts}")
        if self.num_attention_heads % self.o_groups:
            fail("o_groups", self.o_groups, f"must divide num_attention_heads={self.num_attention_heads}")
        if self.scoring_func not in SCORING_FUNCS:
            fail("scoring_func", self.scoring_func, f"must be one of {SCORING_FUNCS}")
        if self.hidden_act != "silu":
            fail("hidden_act", self.hidden_act, "DeepSeek-V4 experts are SwiGLU ('silu')")
        if not self.swiglu_limit > 0:
            fail("swiglu_limit", self.swiglu_limit, "must be > 0")
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", self.layer_types, f"needs num_hidden_layers={self.num_hidden_layers} entries")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            fail("layer_types", bad, f"entries must be in {LAYER_TYPES}")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            fail("mlp_layer_types", self.mlp_layer_types, f"needs num_hidden_layers={self.num_hidden_layers} entries")
        bad = [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        if bad:
            fail("mlp_layer_types", bad, f"entries must be in {MLP_LAYER_TYPES}")
        rates = dict(self.compress_rates)
        for layer_type in (CSA, HCA):
            rate = rates.get(layer_type)
            if layer_type in self.layer_types and (not isinstance(rate, int) or rate <= 0):
                fail("compress_rates", rates, f"needs a positive integer rate for {layer_type!r}")
        for label, rope in (("main", self.rope_main), ("compress", self.rope_compress)):
            rope_dim = int(self.head_dim * rope.partial_rotary_factor)
            if rope_dim != self.qk_rope_head_dim:
                fail(
                    f"rope_parameters[{label!r}].partial_rotary_factor", rope.partial_rotary_factor,
                    f"head_dim * factor = {rope_dim} but qk_rope_head_dim = {self.qk_rope_head_dim}",
                )  # fmt: skip

    # ---- derived values -------------------------------------------------------------------
    def compress_rate(self, layer_type: str) -> int:
        """Tokens pooled into one compressed entry for `layer_type` (0 for sliding layers)."""
        return 0 if layer_type == SLIDING else dict(self.compress_rates)[layer_type]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return None if self.quantization_config_json is None else json.loads(self.quantization_config_json)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    # ---- reading and writing config.json --------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> Config:
        """Reads config.json as DeepSeek released it or as transformers writes it.

        `path_or_dict` is a model directory, a path to a config.json, or the parsed dict.
        """
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"no config.json at {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls._from_raw(raw)

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> Config:
        model_type = raw.get("model_type", "deepseek_v4")
        if model_type == "deepseek_v41" or "text_config" in raw:
            raise ValueError(
                f"model_type={model_type!r}: DeepSeek-V4.1 (cross-layer KV sharing, Engram layers, FP4 KV) has no "
                "public reference implementation; dsv4 supports model_type 'deepseek_v4'"
            )
        if model_type != "deepseek_v4":
            raise ValueError(f"config field model_type={model_type!r}: dsv4 reads 'deepseek_v4' configs")
        unsupported = [k for k in _UNSUPPORTED_KEYS if raw.get(k)]
        if unsupported:
            raise ValueError(f"config keys {unsupported} are DeepSeek-V4.1 features dsv4 does not support")

        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in raw.items() if k in fields and k not in _STRUCTURED}
        n = int(raw.get("num_hidden_layers", cls.num_hidden_layers))
        head_dim = int(raw.get("head_dim", cls.head_dim))

        # Compression rates: dict (transformers) with legacy scalar overrides folded in.
        rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        kw["compress_rates"] = tuple(sorted((str(k), v) for k, v in rates.items()))

        # Layer schedule: explicit > legacy per-layer `compress_ratios` (0/4/128) > the reference's default.
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            ratios = list(raw["compress_ratios"])[:n]
            bad = [r for r in ratios if r not in _RATIO_TO_LAYER_TYPE]
            if bad:
                raise ValueError(f"config field compress_ratios has values {bad}; expected 0, 4 or 128")
            layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        kw["layer_types"] = tuple(layer_types[:n])

        mlp_layer_types = raw.get("mlp_layer_types")
        if mlp_layer_types is None:
            n_hash = raw.get("num_hash_layers", 3)
            mlp_layer_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        kw["mlp_layer_types"] = tuple(mlp_layer_types[:n])

        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])

        # Rotary dims: `partial_rotary_factor` (transformers) or legacy `qk_rope_head_dim`.
        rp = raw.get("rope_parameters") or {}
        nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
        if nested:
            # NOTE: transformers also writes top-level `partial_rotary_factor` / `qk_rope_head_dim` that can
            # disagree with the nested ones; its model only reads the nested factor (default 1.0).
            rope_dim = int(head_dim * rp["main"].get("partial_rotary_factor", 1.0))
        elif raw.get("qk_rope_head_dim") is not None:
            rope_dim = int(raw["qk_rope_head_dim"])
        elif raw.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * raw["partial_rotary_factor"])
        else:  # the reference's default: 64 of 512 channels
            rope_dim = int(head_dim * 64 / 512)
        kw["qk_rope_head_dim"] = rope_dim
        factor = rope_dim / head_dim

        if nested:
            # Taken as written: in particular no `attention_factor` default is injected for YaRN, so the
            # reference scales cos/sin by YaRN's mscale here (unlike the flat form below).
            main, compress = dict(rp["main"]), dict(rp["compress"])
        else:
            # Flat form: the scaling (YaRN) applies to the compress rope only, as in the reference.
            merged = {**(raw.get("rope_scaling") or {}), **rp}
            scaling = {k: v for k, v in merged.items() if k not in ("main", "compress")}
            scaling.pop("rope_theta", None)
            scaling.pop("partial_rotary_factor", None)
            main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", cls.rope_theta)}
            compress = {**scaling, "rope_theta": raw.get("compress_rope_theta", cls.compress_rope_theta)}
            if compress.get("type") is not None and "rope_type" not in compress:
                compress["rope_type"] = compress.pop("type")
            compress.setdefault("rope_type", "default")
            if compress["rope_type"] == "yarn":
                # The V4 reference does not multiply cos/sin by YaRN's mscale.
                compress.setdefault("attention_factor", 1.0)
        for d in (main, compress):
            d.setdefault("partial_rotary_factor", factor)
            if d.get("rope_type", d.get("type", "default")) == "default":
                for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                          "mscale", "mscale_all_dim", "truncate"):  # fmt: skip
                    d.pop(k, None)
        kw["rope_main"] = RopeConfig.from_dict(main, where="main")
        kw["rope_compress"] = RopeConfig.from_dict(compress, where="compress")
        kw["rope_theta"] = kw["rope_main"].rope_theta
        kw["compress_rope_theta"] = kw["rope_compress"].rope_theta

        qc = raw.get("quantization_config")
        if qc is not None:
            if raw.get("expert_dtype") is not None and "expert_dtype" not in qc:
                qc = {**qc, "expert_dtype": raw["expert_dtype"]}
            kw["quantization_config_json"] = json.dumps(qc, sort_keys=True)
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The config.json transformers would write for this model (round-trips through from_hf)."""
        out: dict[str, Any] = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}
        for f in dataclasses.fields(self):
            if f.name in ("rope_main", "rope_compress", "compress_rates", "qk_rope_head_dim",
                          "quantization_config_json"):  # fmt: skip
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["compress_rates"] = dict(self.compress_rates)
        out["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        out["rope_parameters"] = {"main": self.rope_main.to_dict(), "compress": self.rope_compress.to_dict()}
        if self.quantization_config is not None:
            out["quantization_config"] = self.quantization_config
        return out

    # ---- presets ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> Config:
        try:
            return _PRESETS[name]()
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(_PRESETS)}") from None


# Fields filled from structured / legacy keys in `_from_raw` rather than copied through.
_STRUCTURED = frozenset({"compress_rates", "layer_types", "mlp_layer_types", "rope_main", "rope_compress"})


def _tiny() -> Config:
    """The tiny config of REFERENCE.md: every layer type, hash + routed MoE, YaRN. CPU tests in seconds."""
    return Config.from_hf({
        "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
        "sliding_window": 16, "compress_rates": {CSA: 4, HCA: 16},
        "layer_types": [SLIDING, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 16.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
        },
        "max_position_embeddings": 1 << 20,
    })  # fmt: skip


def _v4_flash() -> Config:
    """DeepSeek-V4-Flash shapes (284B total): 2 sliding + 21 CSA + 20 HCA layers, as in ANCHORS.md."""
    n = 43
    layer_types = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(n - 2)]
    return Config.from_hf({
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": n,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "o_groups": 8, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
        "layer_types": layer_types, "num_hash_layers": 3, "routed_scaling_factor": 1.5,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
    })  # fmt: skip


def _v4_pro() -> Config:
    """DeepSeek-V4-Pro shapes (about 1.6T total). Widths from the reference's docstrings (hidden 7168,
    128 heads of 512, 16 output groups); depth, experts and index_topk as publicly described —
    a released config.json read with `Config.from_hf` is authoritative."""
    n = 61
    layer_types = [HCA] * 2 + [CSA if i % 2 else HCA for i in range(n - 2)]
    return Config.from_hf({
        "vocab_size": 129280, "hidden_size": 7168, "moe_intermediate_size": 3072, "num_hidden_layers": n,
        "num_attention_heads": 128, "head_dim": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "n_routed_experts": 384, "num_experts_per_tok": 6, "o_groups": 16, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 1024, "sliding_window": 128,
        "layer_types": layer_types, "num_hash_layers": 3, "routed_scaling_factor": 2.5,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576,
    })  # fmt: skip


_PRESETS = {"tiny": _tiny, "v4-flash": _v4_flash, "v4-pro": _v4_pro}
