"""Generate the reference fixtures in tests/fixtures/ from the public transformers DeepSeek-V4 model.

dsv4 is checked against `transformers.DeepseekV4ForCausalLM` (transformers 5.23.0, the model's public
definition). CI does not run this script: it needs torch, and its outputs are committed. Run it again
only when a fixture has to change, and commit the result.

Reference environment (Python 3.11; a CPU build of torch is enough):

    python3 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy

Run from the repository root:

    .venv-ref/bin/python scripts/make_reference_fixtures.py              # all fixtures
    .venv-ref/bin/python scripts/make_reference_fixtures.py --only tiny_long
    .venv-ref/bin/python scripts/make_reference_fixtures.py --quantized    # only tiny_mixed_fp8 / _fp4

The quantized fixtures (FP8 block scales, FP4 experts, DeepSeek's released tensor names) are made from the float
fixtures on disk; transformers needs `accelerate` to load FP8 checkpoints (`pip install accelerate`).

Each fixture directory tests/fixtures/<name>/ holds
  config.json        exactly as `model.save_pretrained` writes it;
  model.safetensors  the transformers-named state dict (parameters and persistent buffers), float32 except
                     the integer `tid2eid` tables (int64). Written with safetensors directly because
                     `save_pretrained` renames to DeepSeek's checkpoint scheme and splits the experts;
  reference.npz      input_ids, logits, hidden_states, final_hidden_state, generated, generate_logits.
tests/fixtures/README.md, written last, documents the arrays and records each fixture's seed and checks.

Every parameter, including the constant-initialized 1-D ones (sinks, norms, hyper-connection
base/scale, position biases, router correction bias) is re-drawn after construction, otherwise a
whole class of bugs cancels out. A seed is accepted only when every top-k decision the reference
makes (lightning-indexer selection and routed-expert selection, in the full forward and in every
`generate` step) has a clear gap between the k-th and (k+1)-th candidates, so that JAX's top_k and
torch.topk cannot legitimately disagree; otherwise the next seed is tried.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GenerationConfig
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4_ref

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"
NUM_NEW_TOKENS = 6
MAX_SEED_ATTEMPTS = 500

# Acceptance thresholds for the tie checks: gap between the k-th and (k+1)-th score relative to the largest
# |score| of the row. float32 implementations differ by ~1e-6 relative, so these leave a wide margin.
INDEXER_MIN_REL_GAP = 1e-3
ROUTER_MIN_REL_GAP = 3e-4
MIN_LOGITS_STD = 0.1
# Each greedy step's winning logit must beat the runner-up by this much, so that float32 rounding
# differences cannot change a generated token.
MIN_GREEDY_MARGIN = 1e-3

# Init scales: linear weights small enough that activations stay O(1) and nothing saturates trivially.
LINEAR_STD = 0.08
EMBED_STD = 1.0
NORM_WEIGHT_STD = 0.1  # norm weights are 1 + NORM_WEIGHT_STD * N(0, 1)
SINK_STD = 1.0  # attention logits are O(1) after the q/kv norms, so sinks of O(1) matter
POSITION_BIAS_STD = 0.5
HC_FN_STD = 0.05
HC_BASE_STD = 0.5
HC_SCALE_STD = 0.3  # scales are 1 + HC_SCALE_STD * N(0, 1)


TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
    sliding_window=16,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "partial_rotary_factor": 0.25,
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    max_position_embeddings=4096,
)

SIGMOID_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "scoring_func": "sigmoid",
    "hc_mult": 2,
    "hc_sinkhorn_iters": 5,
    "o_groups": 4,
    "num_attention_heads": 8,
    "index_topk": 3,
    "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "num_hidden_layers": 5,
    "layer_types": [
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25},
    },
    "routed_scaling_factor": 2.5,
    "swiglu_limit": 0.5,
}


@dataclasses.dataclass(frozen=True)
class FixtureSpec:
    name: str
    config: dict[str, Any]
    batch: int
    seq_len: int
    base_seed: int
    # Selection-only router bias; its scale is relative to the spread of the router scores.
    router_bias_std: float
    description: str
    # The fixture is rejected unless the SwiGLU clamp changes some pre-activations.
    require_swiglu_clamp: bool = False
    # Reuse the weights of this (earlier) fixture; then only the input seed is searched. Same-config fixtures
    # share one byte-identical model.safetensors, which git stores once.
    weights_of: str | None = None


FIXTURES = (
    FixtureSpec(
        name="tiny_mixed",
        config=TINY_CONFIG,
        batch=2,
        seq_len=37,
        base_seed=1000,
        router_bias_std=0.15,
        description="REFERENCE.md tiny config: sliding, CSA, HCA, CSA; hash_moe then moe; YaRN on 'compress'.",
    ),
    FixtureSpec(
        name="tiny_long",
        config=TINY_CONFIG,
        batch=1,
        seq_len=83,
        base_seed=2000,
        router_bias_std=0.15,
        description="Tiny config, 83 tokens: several HCA windows of 16, 20 CSA entries > index_topk 8, "
        "past the sliding window 16.",
    ),
    FixtureSpec(
        name="tiny_sigmoid",
        config=SIGMOID_CONFIG,
        batch=3,
        seq_len=29,
        base_seed=3000,
        router_bias_std=0.1,
        description="Sigmoid routing, hc_mult 2, 5 Sinkhorn iterations, 8 heads in 4 output groups, index_topk 3, "
        "sliding window 8, CSA 4 / HCA 8, HCA-CSA-sliding-CSA-HCA, two hash layers, plain RoPE on both, "
        "routed_scaling_factor 2.5, swiglu_limit 0.5 (the clamp bites).",
        require_swiglu_clamp=True,
    ),
    FixtureSpec(
        name="tiny_short",
        config=TINY_CONFIG,
        batch=2,
        seq_len=3,
        base_seed=4000,
        router_bias_std=0.15,
        weights_of="tiny_mixed",
        description="Tiny config, 3 tokens: shorter than every compression window, so the forward has no "
        "compressed entries at all (generation then crosses the first CSA window boundaries).",
    ),
)


# --------------------------------------------------------------------------------------------------
# Randomization
# --------------------------------------------------------------------------------------------------


def _normal(shape: torch.Size, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return mean + std * torch.randn(shape, generator=gen, dtype=torch.float32)


@torch.no_grad()
def randomize_(model: DeepseekV4ForCausalLM, spec: FixtureSpec, gen: torch.Generator) -> None:
    """Re-draw every saved tensor of `model` in place; raise if a tensor matches no rule."""
    cfg = model.config
    for name, tensor in model.state_dict(keep_vars=True).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":  # [vocab, top_k]: distinct experts within each row
            rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: tensor.shape[1]] for _ in range(len(tensor))]
            new = torch.stack(rows).to(tensor.dtype)
        elif leaf == "e_score_correction_bias":
            new = _normal(tensor.shape, spec.router_bias_std, gen)
        elif leaf == "sinks":
            new = _normal(tensor.shape, SINK_STD, gen)
        elif leaf == "position_bias":
            new = _normal(tensor.shape, POSITION_BIAS_STD, gen)
        elif leaf in ("fn", "hc_fn"):
            new = _normal(tensor.shape, HC_FN_STD, gen)
        elif leaf in ("base", "hc_base"):
            new = _normal(tensor.shape, HC_BASE_STD, gen)
        elif leaf in ("scale", "hc_scale"):
            new = _normal(tensor.shape, HC_SCALE_STD, gen, mean=1.0)
        elif leaf == "weight" and tensor.ndim == 1 and "norm" in name:
            new = _normal(tensor.shape, NORM_WEIGHT_STD, gen, mean=1.0)
        elif name == "model.embed_tokens.weight":
            new = _normal(tensor.shape, EMBED_STD, gen)
        elif tensor.ndim >= 2 and leaf in ("weight", "gate_up_proj", "down_proj"):
            new = _normal(tensor.shape, LINEAR_STD, gen)
        else:
            raise ValueError(f"no randomization rule for {name} {tuple(tensor.shape)}")
        tensor.copy_(new)


# --------------------------------------------------------------------------------------------------
# Probes: forward hooks that observe the reference's top-k decisions and SwiGLU clamps
# --------------------------------------------------------------------------------------------------


def _topk_boundary_gaps(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [N, C] with -inf for unavailable candidates; only rows with more than k finite entries count.

    Returns the gap between the k-th and (k+1)-th largest score of each row, relative to the row's largest
    |score| (the scale that float rounding in the terms of a score follows), and the absolute gap.
    """
    finite = torch.isfinite(scores)
    rows = scores[finite.sum(-1) > k]
    if rows.numel() == 0:
        return torch.empty(0), torch.empty(0)
    top = rows.topk(k + 1, dim=-1).values  # [N', k+1], sorted descending
    abs_gap = top[:, k - 1] - top[:, k]
    scale = rows.abs().masked_fill(~torch.isfinite(rows), 0).amax(-1).clamp_min(1e-30)
    return abs_gap / scale, abs_gap


class Probes:
    """Hooks on the reference modules; `phase` tags what they record ("forward" or "generate")."""

    def __init__(self, model: DeepseekV4ForCausalLM):
        self.model = model
        self.phase = "forward"
        self.handles: list[Any] = []
        self.indexer_rel_gaps: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
        self.indexer_abs_gaps: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
        self.indexer_zero_scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # [exact zeros, visible]
        self.indexer_queries_over_k: dict[str, int] = defaultdict(int)
        self.router_rel_gaps: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.router_bias_changes: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # [changed sets, tokens]
        self.clamp_counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # [gate>lim, |up|>lim, total]
        self.final_layer_output: torch.Tensor | None = None
        self._positions: dict[int, torch.Tensor] = {}

        for layer_idx, layer in enumerate(model.model.layers):
            compressor = layer.self_attn.compressor
            if isinstance(compressor, dsv4_ref.DeepseekV4CSACompressor):
                indexer = compressor.indexer
                self.handles.append(indexer.register_forward_pre_hook(self._indexer_pre_hook(layer_idx)))
                self.handles.append(indexer.scorer.register_forward_hook(self._scorer_hook(layer_idx, indexer)))
            gate = layer.mlp.gate
            if isinstance(gate, dsv4_ref.DeepseekV4TopKRouter):
                self.handles.append(gate.register_forward_hook(self._router_hook(gate)))
            self._wrap_expert_gate(layer.mlp.experts)
            shared = layer.mlp.shared_experts
            self.handles.append(shared.gate_proj.register_forward_hook(self._linear_clamp_hook(shared.limit, "gate")))
            self.handles.append(shared.up_proj.register_forward_hook(self._linear_clamp_hook(shared.limit, "up")))
        last_layer = model.model.layers[-1]
        self.handles.append(last_layer.register_forward_hook(self._final_layer_hook))

    # Lightning indexer -------------------------------------------------------------------------

    def _indexer_pre_hook(self, layer_idx: int):
        def hook(module, args):
            self._positions[layer_idx] = args[2]  # position_ids: [1 or B, S]

        return hook

    def _scorer_hook(self, layer_idx: int, indexer):
        def hook(module, args, scores):  # scores: [B, S, T]
            batch, seq_len, num_entries = scores.shape
            if num_entries == 0:  # nothing compressed yet
                return
            positions = self._positions[layer_idx].expand(batch, seq_len)
            # Entry t summarizes tokens up to (t + 1) * rate - 1, so a query at `pos` sees t < (pos + 1) // rate,
            # exactly the indexer's own causal mask.
            visible_count = (positions + 1) // indexer.compress_rate  # [B, S]
            visible = torch.arange(num_entries).view(1, 1, -1) < visible_count.unsqueeze(-1)
            masked = scores.detach().float().masked_fill(~visible, float("-inf")).reshape(-1, num_entries)
            rel, abs_gap = _topk_boundary_gaps(masked, indexer.index_topk)
            self.indexer_rel_gaps[(self.phase, layer_idx)].append(rel)
            self.indexer_abs_gaps[(self.phase, layer_idx)].append(abs_gap)
            self.indexer_queries_over_k[self.phase] += rel.numel()
            zeros = self.indexer_zero_scores[self.phase]
            zeros[0] += int(((scores == 0) & visible).sum())
            zeros[1] += int(visible.sum())

        return hook

    # Routers ------------------------------------------------------------------------------------

    def _router_hook(self, gate):
        def hook(module, args, output):
            logits = output[0]  # [N, E]
            scores = gate.score_fn(logits)
            biased = scores + gate.e_score_correction_bias
            rel, _ = _topk_boundary_gaps(biased.detach(), gate.top_k)
            self.router_rel_gaps[self.phase].append(rel)
            with_bias = biased.topk(gate.top_k, dim=-1).indices.sort(-1).values
            without_bias = scores.topk(gate.top_k, dim=-1).indices.sort(-1).values
            counts = self.router_bias_changes[self.phase]
            counts[0] += int((with_bias != without_bias).any(-1).sum())
            counts[1] += logits.shape[0]

        return hook

    # SwiGLU clamps --------------------------------------------------------------------------------

    def _wrap_expert_gate(self, experts) -> None:
        """Count routed-expert pre-activations beyond `swiglu_limit` by wrapping `_apply_gate`."""
        original = experts._apply_gate

        def counting_apply_gate(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            counts = self.clamp_counts["routed"]
            counts[0] += int((gate > experts.limit).sum())
            counts[1] += int((up.abs() > experts.limit).sum())
            counts[2] += gate.numel()
            return original(gate_up)

        experts._apply_gate = counting_apply_gate

    def _linear_clamp_hook(self, limit: float, which: str):
        def hook(module, args, output):
            counts = self.clamp_counts["shared"]
            if which == "gate":
                counts[0] += int((output > limit).sum())
                counts[2] += output.numel()
            else:
                counts[1] += int((output.abs() > limit).sum())

        return hook

    # Hidden states ------------------------------------------------------------------------------

    def _final_layer_hook(self, module, args, output):
        if self.phase == "forward":
            self.final_layer_output = output.detach().clone()

    # Summaries ----------------------------------------------------------------------------------

    def min_indexer_gap(self, phase: str) -> tuple[float, float]:
        rel = [g for (p, _), gaps in self.indexer_rel_gaps.items() if p == phase for g in gaps]
        absolute = [g for (p, _), gaps in self.indexer_abs_gaps.items() if p == phase for g in gaps]
        rel_all, abs_all = torch.cat(rel) if rel else torch.empty(0), torch.cat(absolute) if absolute else None
        if rel_all.numel() == 0:
            return math.inf, math.inf
        return float(rel_all.min()), float(abs_all.min())

    def min_router_gap(self, phase: str) -> float:
        gaps = torch.cat(self.router_rel_gaps[phase]) if self.router_rel_gaps[phase] else torch.empty(0)
        return float(gaps.min()) if gaps.numel() else math.inf

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# --------------------------------------------------------------------------------------------------
# One fixture
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FixtureResult:
    spec: FixtureSpec
    weight_seed: int
    input_seed: int
    attempts: list[str]
    model: DeepseekV4ForCausalLM
    arrays: dict[str, np.ndarray]
    stats: dict[str, Any]


def build_model(spec: FixtureSpec, weight_seed: int, input_seed: int) -> tuple[DeepseekV4ForCausalLM, torch.Tensor]:
    torch.manual_seed(weight_seed)
    config = DeepseekV4Config(**json.loads(json.dumps(spec.config)))  # deep copy: the config mutates dicts
    model = DeepseekV4ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # nothing may stop generation early
    randomize_(model, spec, torch.Generator().manual_seed(weight_seed))
    input_gen = torch.Generator().manual_seed(input_seed)
    input_ids = torch.randint(0, config.vocab_size, (spec.batch, spec.seq_len), generator=input_gen)
    return model, input_ids


@torch.no_grad()
def run_reference(
    spec: FixtureSpec, weight_seed: int, input_seed: int
) -> tuple[DeepseekV4ForCausalLM, dict[str, np.ndarray], dict[str, Any], list[str]]:
    """Full forward, then (only if the forward passes the checks) greedy generation.

    Returns the model, the reference arrays, the check statistics and the reasons to reject the seed.
    """
    model, input_ids = build_model(spec, weight_seed, input_seed)
    probes = Probes(model)
    try:
        probes.phase = "forward"
        out = model(input_ids, use_cache=False, output_hidden_states=True)
        logits = out.logits.float()
        hf_hidden = out.hidden_states
        num_layers = model.config.num_hidden_layers
        assert len(hf_hidden) == num_layers + 1, len(hf_hidden)
        # transformers replaces the last recorded layer output with `last_hidden_state` (after hc_head and the
        # final norm, [B, S, D]); keep the raw last-layer streams from our own hook instead, and that one apart.
        streams = list(hf_hidden[:num_layers]) + [probes.final_layer_output]
        hidden_states = torch.stack(streams).float()  # [L+1, B, S, hc, D]
        final_hidden_state = hf_hidden[-1].float()  # [B, S, D]
        torch.testing.assert_close(model.lm_head(final_hidden_state), logits, rtol=0, atol=0)
        torch.testing.assert_close(
            model.model.norm(model.model.hc_head(hidden_states[-1])), final_hidden_state, rtol=0, atol=0
        )
        stats = forward_stats(probes, logits)
        reasons = rejection_reasons(spec, stats)
        if reasons:  # generation is the slow part; skip it for a seed that is rejected already
            return model, {}, stats, reasons

        probes.phase = "generate"
        generation_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            min_new_tokens=NUM_NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        gen_out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
        )
    finally:
        probes.remove()

    generated = gen_out.sequences
    generate_logits = torch.stack(gen_out.logits, dim=1).float()  # [B, N, V]
    assert generated.shape == (spec.batch, spec.seq_len + NUM_NEW_TOKENS), generated.shape
    assert torch.equal(generated[:, : spec.seq_len], input_ids)
    # Greedy decoding of the raw logits: nothing (e.g. an EOS processor) may have altered the choice.
    assert torch.equal(generated[:, spec.seq_len :], generate_logits.argmax(-1)), "generate != argmax(logits)"

    stats.update(generate_stats(probes, spec, logits, generated, generate_logits))
    arrays = {
        "input_ids": input_ids.numpy().astype(np.int32),
        "logits": logits.numpy().astype(np.float32),
        "hidden_states": hidden_states.numpy().astype(np.float32),
        "final_hidden_state": final_hidden_state.numpy().astype(np.float32),
        "generated": generated.numpy().astype(np.int32),
        "generate_logits": generate_logits.numpy().astype(np.float32),
    }
    return model, arrays, stats, rejection_reasons(spec, stats)


def forward_stats(probes: Probes, logits: torch.Tensor) -> dict[str, Any]:
    indexer_rel, indexer_abs = probes.min_indexer_gap("forward")
    return {
        "logits_std": float(logits.std()),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "indexer_min_rel_gap_forward": indexer_rel,
        "indexer_min_abs_gap_forward": indexer_abs,
        "indexer_queries_over_k_forward": probes.indexer_queries_over_k["forward"],
        "indexer_exact_zero_scores_forward": tuple(probes.indexer_zero_scores["forward"]),
        "router_min_rel_gap_forward": probes.min_router_gap("forward"),
        "router_bias_changed_sets_forward": tuple(probes.router_bias_changes["forward"]),
        "swiglu_clamped_routed": tuple(probes.clamp_counts["routed"]),
        "swiglu_clamped_shared": tuple(probes.clamp_counts["shared"]),
    }


def generate_stats(
    probes: Probes, spec: FixtureSpec, logits: torch.Tensor, generated: torch.Tensor, generate_logits: torch.Tensor
) -> dict[str, Any]:
    indexer_rel, indexer_abs = probes.min_indexer_gap("generate")
    top2 = generate_logits.topk(2, dim=-1).values
    return {
        "generate_logits_finite": bool(torch.isfinite(generate_logits).all()),
        "prefill_vs_forward_max_abs_diff": float((generate_logits[:, 0] - logits[:, -1]).abs().max()),
        "min_greedy_margin": float((top2[..., 0] - top2[..., 1]).min()),
        "distinct_generated_tokens": int(generated[:, spec.seq_len :].unique().numel()),
        "indexer_min_rel_gap_generate": indexer_rel,
        "indexer_min_abs_gap_generate": indexer_abs,
        "indexer_queries_over_k_generate": probes.indexer_queries_over_k["generate"],
        "router_min_rel_gap_generate": probes.min_router_gap("generate"),
    }


def rejection_reasons(spec: FixtureSpec, stats: dict[str, Any]) -> list[str]:
    """Why this seed's fixture would be fragile; checks only the statistics present (forward, then all)."""
    reasons = []
    if not stats["logits_finite"] or not stats.get("generate_logits_finite", True):
        reasons.append("non-finite logits")
    if stats["logits_std"] <= MIN_LOGITS_STD:
        reasons.append(f"logits std {stats['logits_std']:.3g} <= {MIN_LOGITS_STD}")
    for phase in ("forward", "generate"):
        if f"indexer_min_rel_gap_{phase}" not in stats:
            continue
        if stats[f"indexer_min_rel_gap_{phase}"] <= INDEXER_MIN_REL_GAP:
            reasons.append(f"indexer top-k boundary gap in {phase} {stats[f'indexer_min_rel_gap_{phase}']:.3g} rel")
        if stats[f"router_min_rel_gap_{phase}"] <= ROUTER_MIN_REL_GAP:
            reasons.append(f"router top-k boundary gap in {phase} {stats[f'router_min_rel_gap_{phase}']:.3g} rel")
    if stats.get("min_greedy_margin", math.inf) <= MIN_GREEDY_MARGIN:
        reasons.append(f"greedy top-1/top-2 logit margin {stats['min_greedy_margin']:.3g}")
    if stats["router_bias_changed_sets_forward"][0] == 0:
        reasons.append("e_score_correction_bias changes no expert choice")
    if spec.require_swiglu_clamp:
        routed, shared = stats["swiglu_clamped_routed"], stats["swiglu_clamped_shared"]
        if min(routed[0], routed[1], shared[0], shared[1]) == 0:
            reasons.append(f"SwiGLU clamp does not bite (routed {routed}, shared {shared})")
    return reasons


def make_fixture(spec: FixtureSpec, shared_weight_seed: int | None) -> FixtureResult:
    attempts = []
    for attempt in range(MAX_SEED_ATTEMPTS):
        input_seed = spec.base_seed + attempt
        weight_seed = input_seed if shared_weight_seed is None else shared_weight_seed
        model, arrays, stats, reasons = run_reference(spec, weight_seed, input_seed)
        if not reasons:
            return FixtureResult(spec, weight_seed, input_seed, attempts, model, arrays, stats)
        attempts.append(f"seed {input_seed}: " + "; ".join(reasons))
        print(f"  [{spec.name}] rejected {attempts[-1]}")
    raise RuntimeError(f"{spec.name}: no acceptable seed in {MAX_SEED_ATTEMPTS} attempts:\n" + "\n".join(attempts))


def write_fixture(result: FixtureResult, out_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    fixture_dir = out_dir / result.spec.name
    if fixture_dir.exists():
        shutil.rmtree(fixture_dir)
    fixture_dir.mkdir(parents=True)
    # config.json as `model.save_pretrained` writes it (with `architectures` and `dtype`, which
    # `config.save_pretrained` alone leaves out). NOTE: its weights are not used: in transformers 5.23 it
    # reverses the checkpoint conversion mapping and writes DeepSeek's names (`head.weight`,
    # `layers.N.attn.wq_a`, per-expert w1/w2/w3), so the transformers-named state dict is saved directly.
    with tempfile.TemporaryDirectory() as tmp:
        result.model.save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(Path(tmp) / "config.json", fixture_dir / "config.json")
    state = {name: tensor.detach().contiguous().clone() for name, tensor in result.model.state_dict().items()}
    for name, tensor in state.items():
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32, (name, tensor.dtype)
    save_file(state, str(fixture_dir / "model.safetensors"), metadata={"format": "pt"})
    (fixture_dir / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    np.savez_compressed(fixture_dir / "reference.npz", **result.arrays)
    return {name: (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for name, tensor in state.items()}


# --------------------------------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------------------------------

README_HEAD = """\
# Reference fixtures for dsv4

Generated by `scripts/make_reference_fixtures.py` (see its docstring for the reference venv) from
`transformers.DeepseekV4ForCausalLM`, transformers {transformers_version}, torch {torch_version}, on CPU in float32.
Do not edit by hand; rerun the script. Tests read these files with numpy/safetensors only.

## Files in each `<name>/`

- `config.json`: the one `model.save_pretrained` writes (what `from_hf` must accept).
- `model.safetensors`: `model.state_dict()` with transformers names: all parameters plus the persistent
  buffers `model.layers.N.mlp.gate.tid2eid` (hash layers, int64 `[vocab, num_experts_per_tok]`) and
  `model.layers.N.mlp.gate.e_score_correction_bias` (top-k layers, float32 `[n_routed_experts]`).
  Everything else is float32. RoPE `inv_freq` buffers are not persistent and not stored.
- `reference.npz` (B = batch, S = prompt length, L = layers, V = vocab, N = {num_new_tokens}):
  - `input_ids` int32 `[B, S]`.
  - `logits` float32 `[B, S, V]`: `model(input_ids, use_cache=False).logits`, one full forward, no cache.
  - `hidden_states` float32 `[L+1, B, S, hc_mult, hidden]`: the hyper-connection residual streams.
    Index 0 is the input of layer 0: the token embedding copied into all `hc_mult` streams
    (`embed_tokens(ids)[:, :, None, :]` broadcast). Index i (1..L) is the output of decoder layer i-1.
    Entries 0..L-1 are `output_hidden_states=True` entries 0..L-1 exactly; entry L (last layer output,
    before `hc_head`) comes from a forward hook, because transformers replaces its last entry with
    `final_hidden_state`.
  - `final_hidden_state` float32 `[B, S, hidden]`: `norm(hc_head(hidden_states[L]))`, what
    transformers returns as `hidden_states[-1]`; `logits == lm_head(final_hidden_state)` exactly.
  - `generated` int32 `[B, S+N]`: `model.generate(input_ids, attention_mask=ones, do_sample=False,
    max_new_tokens=N, min_new_tokens=N)` with `eos_token_id=None`, i.e. cached greedy decoding
    (prefill with the cache, then N-1 one-token steps). `generated[:, :S] == input_ids`.
  - `generate_logits` float32 `[B, N, V]`: the raw logits of each generation step
    (`output_logits=True`); `generated[:, S:] == generate_logits.argmax(-1)` (checked).
    `generate_logits[:, 0]` is the cached prefill's last position, equal to `logits[:, -1]` up to
    float rounding.

## How the weights were drawn

Every stored tensor is re-drawn after construction (the script raises on a tensor no rule covers):
linear and expert weights N(0, {linear_std}²), embeddings N(0, {embed_std}²), all RMSNorm weights
1 + {norm_std}·N(0, 1), attention sinks N(0, {sink_std}²), compressor/indexer `position_bias` N(0, {pb_std}²),
hyper-connection `fn`/`hc_fn` N(0, {hc_fn_std}²), `base`/`hc_base` N(0, {hc_base_std}²), `scale`/`hc_scale`
1 + {hc_scale_std}·N(0, 1), `e_score_correction_bias` N(0, σ²) with σ per fixture (below), and `tid2eid` rows
that are prefixes of random permutations of the experts (distinct within a row). `torch.manual_seed(weight seed)`
precedes construction and a `torch.Generator` seeded with the weight seed draws the weights; input ids are
uniform over the vocabulary from a generator seeded with the input seed. A fixture listed below as using
another fixture's weights has a byte-identical `model.safetensors` (git stores one blob); only its input
seed was searched.

## Tie checks

The lightning indexer keeps the top `index_topk` of `Σ_h w_h·ReLU(q_h·k_s)` over the causally visible
compressed entries (entry t visible to position p iff t < (p+1) // compress_rate). Exact ties are common
(the score is exactly 0 whenever every head's dot product is negative), and a tie at the k-th/(k+1)-th
boundary makes the selected set implementation-dependent. A seed is accepted only if, for every query
with more than k visible entries, in the full forward and in every `generate` step, the k-th and
(k+1)-th scores differ by more than {indexer_gap:g} times the largest |score| among that query's visible
entries ("rel" below); the routed-expert top-k over `score + e_score_correction_bias` must have a gap above
{router_gap:g} times the row's largest |score + bias|, and every greedy step's top
logit must beat the runner-up by more than {greedy_margin:g}. A rejected seed is replaced by the next one
(the input seed only, for fixtures that share weights); rejected seeds are summarized below.

## Reading config.json: what the reference actually uses

- RoPE dimensions and bases come from `rope_parameters["main"|"compress"]` (`partial_rotary_factor`,
  `rope_theta`): here 0.25 × head_dim 32 = 8 rope channels. The top-level `partial_rotary_factor` (0.125,
  the class default 64/512), `qk_rope_head_dim` (4), `rope_theta` and `compress_rope_theta` are written
  too, but the modeling code does not read them, and in these tiny configs the first two disagree with
  the nested value.
- YaRN `attention_factor`: `DeepseekV4Config` injects `attention_factor: 1.0` only when it builds the
  nested dict itself from a flat/legacy `rope_parameters` (as for released checkpoints). The tiny configs
  pass the nested dict directly, so `compress` has no `attention_factor`, and transformers derives
  0.1·ln(factor) + 1 = 1.2773 (factor 16) and multiplies the compress cos **and** sin by it: q/kv RoPE
  in CSA/HCA layers, compressor and indexer RoPE, and the conjugate RoPE on the attention output.
  The fixtures with YaRN include that scale; `main` (default RoPE) has scale 1.
- transformers warns that `factor` (16) differs from `max_position_embeddings /
  original_max_position_embeddings` (64); the explicit `factor` is used.
"""


def _format_stats(stats: dict[str, Any]) -> list[str]:
    def gap(rel: float, absolute: float) -> str:
        return "n/a" if math.isinf(rel) else f"{rel:.3g} rel ({absolute:.3g} abs)"

    zeros = stats["indexer_exact_zero_scores_forward"]
    indexer_forward = gap(stats["indexer_min_rel_gap_forward"], stats["indexer_min_abs_gap_forward"])
    indexer_generate = gap(stats["indexer_min_rel_gap_generate"], stats["indexer_min_abs_gap_generate"])
    changed = stats["router_bias_changed_sets_forward"]
    routed, shared = stats["swiglu_clamped_routed"], stats["swiglu_clamped_shared"]
    return [
        f"- logits std {stats['logits_std']:.3f}; smallest greedy top-1/top-2 logit margin in `generate` "
        f"{stats['min_greedy_margin']:.3g}; {stats['distinct_generated_tokens']} distinct generated tokens",
        "- cached prefill vs full forward, last position: max |Δlogit| = "
        f"{stats['prefill_vs_forward_max_abs_diff']:.2g}",
        f"- indexer boundary gap, forward: {indexer_forward} "
        f"over {stats['indexer_queries_over_k_forward']} queries with more than k visible entries; "
        f"exactly-zero visible scores {zeros[0]}/{zeros[1]}",
        f"- indexer boundary gap, generate: {indexer_generate} over {stats['indexer_queries_over_k_generate']} queries",
        f"- router boundary gap (score + bias): forward {stats['router_min_rel_gap_forward']:.3g} rel, "
        f"generate {stats['router_min_rel_gap_generate']:.3g} rel; the bias changes the expert set of "
        f"{changed[0]}/{changed[1]} token-layer pairs in the forward",
        f"- SwiGLU clamp, elements beyond swiglu_limit in the forward (gate > limit, |up| > limit, of total): "
        f"routed {routed[0]}, {routed[1]} of {routed[2]}; shared {shared[0]}, {shared[1]} of {shared[2]}",
    ]


def _config_highlights(config: DeepseekV4Config) -> str:
    compress = config.rope_parameters["compress"]
    rope = compress["rope_type"]
    if rope == "yarn":
        rope += f" factor {compress['factor']}, original_max_position_embeddings "
        rope += str(compress["original_max_position_embeddings"])
    return (
        f"layers {config.layer_types}; mlp {config.mlp_layer_types}; scoring {config.scoring_func}; "
        f"hc_mult {config.hc_mult}; sinkhorn iters {config.hc_sinkhorn_iters}; heads {config.num_attention_heads}; "
        f"o_groups {config.o_groups}; index_topk {config.index_topk}; sliding_window {config.sliding_window}; "
        f"compress_rates {config.compress_rates}; compress rope {rope}; "
        f"routed_scaling_factor {config.routed_scaling_factor}; swiglu_limit {config.swiglu_limit}"
    )


def write_readme(out_dir: Path, results: list[FixtureResult], tensors: dict[str, dict]) -> None:
    lines = [
        README_HEAD.format(
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
            num_new_tokens=NUM_NEW_TOKENS,
            linear_std=LINEAR_STD,
            embed_std=EMBED_STD,
            norm_std=NORM_WEIGHT_STD,
            sink_std=SINK_STD,
            pb_std=POSITION_BIAS_STD,
            hc_fn_std=HC_FN_STD,
            hc_base_std=HC_BASE_STD,
            hc_scale_std=HC_SCALE_STD,
            indexer_gap=INDEXER_MIN_REL_GAP,
            router_gap=ROUTER_MIN_REL_GAP,
            greedy_margin=MIN_GREEDY_MARGIN,
        ),
        "## Fixtures\n",
    ]
    for result in results:
        spec = result.spec
        lines.append(f"### `{spec.name}`\n")
        lines.append(spec.description + "\n")
        shared = f" (the weights of `{spec.weights_of}`, byte-identical file)" if spec.weights_of else ""
        lines.append(f"- weight seed {result.weight_seed}{shared}; input seed {result.input_seed}")
        lines.append(f"- config: {_config_highlights(result.model.config)}")
        lines.append(f"- e_score_correction_bias σ = {spec.router_bias_std}")
        shapes = ", ".join(f"`{k}` {list(v.shape)}" for k, v in result.arrays.items())
        lines.append(f"- arrays: {shapes}")
        lines.extend(_format_stats(result.stats))
        if result.attempts:
            tally: dict[str, int] = defaultdict(int)
            for attempt in result.attempts:
                for reason in attempt.split(": ", 1)[1].split("; "):
                    tally[re.sub(r"[-+]?\d[\d.e+-]*", "#", reason)] += 1
            reasons = ", ".join(f"{reason} ×{count}" for reason, count in sorted(tally.items(), key=lambda x: -x[1]))
            first, last = (a.split(":")[0].removeprefix("seed ") for a in (result.attempts[0], result.attempts[-1]))
            lines.append(f"- rejected seeds {first}..{last} ({len(result.attempts)}): {reasons}")
        lines.append("")

    lines.append("## Tensors in `model.safetensors`\n")
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, table in tensors.items():
        groups[tuple(sorted(table.items()))].append(name)
    for table, names in groups.items():
        lines.append(f"{', '.join(f'`{n}`' for n in names)} ({len(table)} tensors):\n")
        lines.append("```")
        lines.extend(f"{name} {dtype} {list(shape)}" for name, (dtype, shape) in dict(table).items())
        lines.append("```\n")
    (out_dir / "README.md").write_text("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Quantized fixtures: a float fixture's weights stored as DeepSeek releases store them (DeepSeek tensor names,
# FP8 e4m3 with block scales, optionally FP4 e2m1 routed experts), with the logits transformers computes
# from those files. The quantization here is torch's and this script's own, independent of dsv4's.
# ---------------------------------------------------------------------------------------------
QUANT_BLOCK = [16, 16]  # small enough that the tiny shapes (32..256) hold several blocks per matrix
QUANTIZED_FIXTURES = (  # (name, float fixture it quantizes, expert_dtype)
    ("tiny_mixed_fp8", "tiny_mixed", None),
    ("tiny_mixed_fp4", "tiny_mixed", "fp4"),
)
# The weights DeepSeek-V4 stores in FP8 (its inference/model.py: every `Linear` of the default dtype) and the
# routed experts (FP8, or FP4 when expert_dtype is "fp4"); embeddings, head, router, compressor projections,
# the indexer's weights_proj and wo_a stay in float.
_RELEASED_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.shared_experts\.w[123]\.weight$"
    r"|\.experts\.\d+\.w[123]\.weight$"
)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# transformers' save_pretrained maps most names back to DeepSeek's but keeps a `model.` prefix and a few
# transformers names; a release has neither (`embed.weight`, `hc_head_fn`, `layers.0.attn.wq_a.weight`).
_RELEASED_NAMES = [
    (r"^model\.", ""),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
]
QUANTIZED_README_MARK = "<!-- quantized fixtures (make_reference_fixtures.py --quantized) -->"


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales: the power of two at least x (1 for all-zero blocks)."""
    x = torch.where(x > 0, x, torch.ones_like(x))
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8_torch(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b0), ceil(in/b1)]), w ≈ q · scale."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.nn.functional.pad(w, (0, -cols % b1, 0, -rows % b0))
    tiles = padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale = _pow2_at_least(tiles.abs().amax(dim=(1, 3)) / 448.0)
    q = (tiles / scale[:, None, :, None]).clamp(-448.0, 448.0).reshape(padded.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4_torch(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float → (int8 [out, in/2]: two e2m1 codes per byte, even column in the low nibble;
    float8_e8m0fnu [out, in/group]), w ≈ e2m1 · scale."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    scale = _pow2_at_least(groups.abs().amax(dim=2) / 6.0)
    scaled = (groups / scale[:, :, None]).reshape(rows, cols)
    codes = (scaled[..., None] - _E2M1).abs().argmin(dim=-1).to(torch.uint8)  # nearest e2m1 value
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def write_quantized_fixtures(out_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import FineGrainedFP8Config

    sections = [QUANTIZED_README_MARK, "## Quantized fixtures\n"]
    for name, base, expert_dtype in QUANTIZED_FIXTURES:
        print(f"[{name}] quantizing {base}")
        config = DeepseekV4Config.from_pretrained(out_dir / base)
        model = DeepseekV4ForCausalLM(config).eval()
        model.load_state_dict(load_file(out_dir / base / "model.safetensors"), strict=True)
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": QUANT_BLOCK,
                 "scale_fmt": "ue8m0"}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)  # transformers' own reverse mapping to DeepSeek's tensor names
            float_tensors = load_file(Path(tmp) / "model.safetensors")
        tensors, counts = {}, defaultdict(int)
        for key, value in sorted(float_tensors.items()):
            for pattern, repl in _RELEASED_NAMES:
                key = re.sub(pattern, repl, key)
            if not _RELEASED_FP8.search(key):
                tensors[key] = value.contiguous()
                continue
            if expert_dtype == "fp4" and ".experts." in key:
                q, scale = quantize_fp4_torch(value.float())
                counts["fp4"] += 1
            else:
                q, scale = quantize_fp8_torch(value.float(), QUANT_BLOCK)
                counts["fp8"] += 1
            tensors[key], tensors[key.removesuffix(".weight") + ".scale"] = q.contiguous(), scale.contiguous()
        fixture_dir = out_dir / name
        if fixture_dir.exists():
            shutil.rmtree(fixture_dir)
        fixture_dir.mkdir(parents=True)
        save_file(tensors, fixture_dir / "model.safetensors")
        raw = json.loads((out_dir / base / "config.json").read_text())
        raw["quantization_config"] = quant
        if expert_dtype:
            raw["expert_dtype"] = expert_dtype  # top level, as DeepSeek's config.json has it
        (fixture_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

        reference = DeepseekV4ForCausalLM.from_pretrained(
            fixture_dir, quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=QUANT_BLOCK,
                                                                  scale_fmt="ue8m0"),
            dtype=torch.float32,
        ).eval()  # fmt: skip
        input_ids = np.load(out_dir / base / "reference.npz")["input_ids"]
        with torch.no_grad():
            logits = reference(torch.tensor(input_ids, dtype=torch.long), use_cache=False).logits.float().numpy()
        base_logits = np.load(out_dir / base / "reference.npz")["logits"]
        np.savez(fixture_dir / "reference.npz", input_ids=input_ids, logits=logits)
        drift = float(np.abs(logits - base_logits).max())
        print(f"[{name}] {dict(counts)}; max |logits - {base} logits| = {drift:.3g}")
        sections += [
            f"### `{name}`\n",
            f"The weights of `{base}` in DeepSeek's released layout (transformers' `save_pretrained` names without "
            "its `model.` prefix, `embed.weight`, `hc_head_fn`/`_base`/`_scale`), "
            f"with {counts['fp8']} weights in FP8 e4m3 + `.scale` (float8_e8m0fnu, ue8m0 powers of two, blocks "
            f"{QUANT_BLOCK})" + (f" and the {counts['fp4']} routed-expert weights in FP4 e2m1 (int8, two per byte, "
            "even column in the low nibble) + `.scale` (float8_e8m0fnu, one per row and 32 columns)"
            if counts["fp4"] else "") + "; config.json is the base's plus `quantization_config` "
            f"{json.dumps(quant)}" + (f" and top-level `expert_dtype: {expert_dtype!r}`" if expert_dtype else "") + ".",
            f"`reference.npz`: `input_ids` (the base's) and `logits` from transformers loading these files with "
            f"`FineGrainedFP8Config(dequantize=True)`; max |logits − {base}'s logits| = {drift:.3g} (the "
            "quantization error).\n",
        ]
    readme = out_dir / "README.md"
    text = readme.read_text() if readme.exists() else ""
    text = text.split(QUANTIZED_README_MARK)[0].rstrip("\n") + "\n\n" + "\n".join(sections) + "\n"
    readme.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default tests/fixtures)")
    parser.add_argument("--only", nargs="*", help="fixture names to generate (README is written only for a full run)")
    parser.add_argument("--quantized", action="store_true",
                        help="only (re)write the quantized fixtures (FP8 / FP4 experts) from the float ones on disk")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    if args.quantized:
        write_quantized_fixtures(args.out)
        return

    wanted = set(args.only or [s.name for s in FIXTURES])
    # A fixture that shares weights needs its source's accepted seed, so the source runs first either way.
    needed = wanted | {s.weights_of for s in FIXTURES if s.name in wanted and s.weights_of}
    results, tensors, weight_seeds = [], {}, {}
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in (s for s in FIXTURES if s.name in needed):
        print(f"[{spec.name}] generating")
        result = make_fixture(spec, weight_seeds[spec.weights_of] if spec.weights_of else None)
        weight_seeds[spec.name] = result.weight_seed
        if spec.name not in wanted:
            continue
        tensors[spec.name] = write_fixture(result, args.out)
        if spec.weights_of and spec.weights_of in wanted:
            shared = [(args.out / n / "model.safetensors").read_bytes() for n in (spec.name, spec.weights_of)]
            assert shared[0] == shared[1], f"{spec.name}: weights differ from {spec.weights_of}"
        results.append(result)
        s = result.stats
        shapes = {k: list(v.shape) for k, v in result.arrays.items()}
        print(
            f"[{spec.name}] weight seed {result.weight_seed}, input seed {result.input_seed} "
            f"({len(result.attempts)} rejected); {shapes}\n"
            f"    logits std {s['logits_std']:.3f}; indexer min rel gap "
            f"fwd {s['indexer_min_rel_gap_forward']:.3g} gen {s['indexer_min_rel_gap_generate']:.3g}; "
            f"router min rel gap fwd {s['router_min_rel_gap_forward']:.3g} gen {s['router_min_rel_gap_generate']:.3g}; "
            f"prefill-vs-forward {s['prefill_vs_forward_max_abs_diff']:.2g}; "
            f"clamp routed {s['swiglu_clamped_routed']} shared {s['swiglu_clamped_shared']}"
        )
    if not args.only:
        write_readme(args.out, results, tensors)
        write_quantized_fixtures(args.out)


if __name__ == "__main__":
    main()
