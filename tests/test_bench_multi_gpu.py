"""scripts/bench_multi_gpu.py --smoke: the multi-GPU run's steps on 8 CPU host devices at tiny shapes.

The device memory is set between what `dsv4.memory_plan` says the second and the third prompt length need, so the run
must decide from the plan, before loading anything, that the third does not fit. Times and ceilings on a CPU mean
nothing and are not checked; what is checked is what each step decides and records: the plan's verdicts, the engine's
tokens (the same on every mesh and in two processes), the profile, the ledger against the planner's own numbers."""

import gzip
import json
import os
import subprocess
import sys

import pytest
from host_devices import host_devices_env
from opt_in import slow_opt_in

from dsv4.config import CSA, HCA, SLIDING, Config
from dsv4.memory_plan import CHUNK_TOKENS_PER_DEVICE, GIB, plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_multi_gpu.py")
# the smoke model: the tiny preset's widths, one layer of each type (hash routing in the first)
SMOKE = Config.preset("tiny").replace(num_hidden_layers=3, layer_types=(SLIDING, CSA, HCA),
                                      mlp_layer_types=("hash_moe", "moe", "moe"))  # fmt: skip


def _required(context: int, devices: int = 8, layers: int = 3) -> int:
    config = SMOKE.replace(num_hidden_layers=layers, layer_types=SMOKE.layer_types[:layers],
                           mlp_layer_types=SMOKE.mlp_layer_types[:layers])  # fmt: skip
    return plan_memory(config, context=context, devices=devices, kv_format="fp8-channel", weights="fp8",
                       chunk_size=min(32, context), device_memory_gib=1.0).required_bytes  # fmt: skip


# prompts of 64, 128, 256 tokens and 1 + 1 generated: contexts 66, 130, 258
CAPACITY_GIB = (_required(130) + _required(258)) / 2 / GIB


def _run(tmp_path, *extra) -> dict:
    out = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path), "--device-memory-gib",
                          repr(CAPACITY_GIB), *extra], env=host_devices_env(8), cwd=ROOT, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return json.loads((tmp_path / "bench_multi_gpu.json").read_text())


def _check_full_model(step1) -> None:
    assert step1["status"] == "ok" and step1["layers"] == 3 and step1["devices"] == 8
    # fp8 as released: the 7 dense matrices of every layer, CSA's indexer q and the 2 expert tensors, kept as made
    assert step1["quantized_leaves"] == {"made": 3 * 9 + 1, "in_engine": 3 * 9 + 1}
    rows = step1["lengths"]
    assert set(rows) == {"64", "128", "256"}
    assert rows["256"]["status"] == "skipped" and not rows["256"]["plan"]["fits"], "the plan must refuse 256 tokens"
    assert any("memory plan" in s["why"] for s in step1["skips"])
    for length in ("64", "128"):
        row = rows[length]
        assert row["status"] == "ok" and row["plan"]["fits"] and row["context"] == int(length) + 2
        assert len(row["tokens"]) == 2 and row["ttft_s"] > 0 and row["tpot_s"] > 0
        assert row["memory"]["measured"].startswith("unavailable")  # a CPU keeps no allocator statistics
        assert row["pred"]["flops"] > 0 and row["pred"]["exchange_s"] > 0 and row["pred"]["gather_s"] > 0


def _check_ledger(step5) -> None:
    flash = Config.preset("v4-flash")
    rows = {(r["device"], r["weights"], r["context"]): r for r in step5["rows"]}
    assert len(rows) == 27
    names = {"bf16": "bf16", "fp8": "fp8", "fp8-fp4-experts": "fp4-experts"}
    for (device, weights, context), r in rows.items():
        if device == "this device":
            continue
        want = plan_memory(flash, context=context, devices=8, kv_format="fp8-channel", weights=names[weights],
                           chunk_size=8 * CHUNK_TOKENS_PER_DEVICE, device=device)  # fmt: skip
        assert r["fits"] == want.fits and r["required_gib"] == pytest.approx(want.required_bytes / GIB)
    h20 = step5["h20_512k"]
    assert h20["weights"] == "fp8" and h20["fits"] == rows[("h20", "fp8", 512 << 10)]["fits"]
    assert not rows[("h20", "bf16", 512 << 10)]["fits"] and rows[("h200", "bf16", 512 << 10)]["fits"]


def test_smoke_full_model_profile_scaling_and_ledger(tmp_path):
    """Steps 1, 3, 2 (on the 8-device mesh only: step 1's engine, no second compilation) and 5."""
    data = _run(tmp_path, "--steps", "1,2,3,5", "--meshes", "8")
    steps = data["steps"]
    _check_full_model(steps["1"])
    profile = steps["3"]
    assert profile["status"] == "ok" and (profile["prompt_len"], profile["offset"]) == (128, 96)
    trace = [os.path.join(r, f) for r, _, fs in os.walk(profile["trace_dir"]) for f in fs if f.endswith(".json.gz")]
    with gzip.open(trace[0], "rt") as f:
        assert json.load(f)["traceEvents"], "a profile was written"
    assert profile["per_gpu"] == {} and "no GPU kernels" in profile["note"]
    scaling = steps["2"]
    assert scaling["layers"] == 3 and scaling["meshes"]["8"]["reused"] == "step 1's model and engine"
    for length in ("64", "128"):
        row = scaling["meshes"]["8"]["lengths"][length]
        assert row["first_token"] == steps["1"]["lengths"][length]["tokens"][0]  # the same prompt, the same engine
        assert row["efficiency"] == pytest.approx(1.0)
    _check_ledger(steps["5"])
    assert data["runs"][-1]["summary"] == {"1": "ok", "3": "ok", "2": "ok", "5": "ok"}


@slow_opt_in("every step, ~80-95 s on 2 cores")
def test_smoke_every_step(tmp_path):
    """All five steps, scaling over meshes of 1 and 8 devices, two processes × 4 devices under jax.distributed."""
    data = _run(tmp_path)
    steps = data["steps"]
    _check_full_model(steps["1"])
    scaling = steps["2"]
    # the most layers the plan fits on 1 device at 128 + 1 tokens, between the two capacities: 1 of 3
    assert _required(129, 1, 1) <= CAPACITY_GIB * GIB < _required(129, 1, 2)
    assert scaling["layers"] == 1 and set(scaling["meshes"]) == {"1", "8"} and scaling["same_first_token"]
    assert scaling["meshes"]["1"]["lengths"]["128"]["efficiency"] == pytest.approx(1.0)
    processes = steps["4"]
    assert processes["status"] == "ok" and processes["result"]["processes"] == 2
    assert processes["result"]["local_devices"] == 4 and processes["result"]["devices"] == 8
    assert processes["same_tokens"] and processes["reference"] == "step 1 of this run"
    assert processes["result"]["tokens"] == steps["1"]["lengths"]["128"]["tokens"]
    _check_ledger(steps["5"])
