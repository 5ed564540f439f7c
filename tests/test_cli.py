"""The `dsv4` command in-process (`main([...])`), and the `dsv4 plan` ledger checked by hand.

The engine commands run the tiny fixture model with the same engine shapes as tests/test_engine.py, so in
one pytest process they reuse its compiled functions.
"""

import json
import os
import sys

import numpy as np
import pytest

import dsv4
from dsv4.cli import main, parse_count
from dsv4.config import Config
from dsv4.memory_plan import GIB, count_params, plan_memory

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MODEL_DIR = os.path.join(FIXTURES, "tiny_mixed")
ENGINE = ["--model", MODEL_DIR, "--dtype", "float32", "--kv-format", "float32", "--max-slots", "4", "--max-model-len",
          "128", "--chunk-size", "32", "--buckets", "1,8,32", "--max-packed-width", "8"]  # fmt: skip


@pytest.mark.parametrize("argv", [[], ["generate"], ["bench", "ttft"], ["plan"], ["info"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: dsv4" in capsys.readouterr().out


def test_parse_count():
    assert [parse_count(t) for t in ("4096", "32k", "512K", "1m")] == [4096, 32768, 524288, 1 << 20]


def test_generate_streams_the_reference_tokens(capsys):
    ref = np.load(os.path.join(FIXTURES, "tiny_mixed", "reference.npz"))
    prompt, want = ref["input_ids"][0].tolist(), ref["generated"][0, 37:].tolist()
    ids = ",".join(map(str, prompt))
    assert main(["generate", *ENGINE, "--token-ids", ids, "--max-new-tokens", "6", "--json"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["token_ids"] == want and summary["prompt_tokens"] == 37 and summary["finish_reason"] == "length"
    assert summary["ttft_s"] > 0 and summary["tpot_s"] > 0
    assert "prefill 32/37 tokens" in err  # the prompt spans two chunks of 32

    assert main(["generate", *ENGINE, "--token-ids", ids, "--max-new-tokens", "6"]) == 0
    out, _ = capsys.readouterr()
    assert out.splitlines()[0] == " ".join(map(str, want)) and "TTFT" in out and "TPOT" in out


def test_kernel_flags_reach_the_model(monkeypatch, capsys):
    """--kernels is what the engine builds the model with: every part and every choice `dsv4.Kernels` takes."""
    import dsv4.engine
    from dsv4.cli import KERNEL_PARTS
    from dsv4.kernels import CHOICES, Kernels

    seen = {}

    class Stop(BaseException):  # not an Exception: passes main's one-line error handling
        pass

    def capture(model, **kwargs):
        seen.update(kwargs)
        raise Stop("stop here")

    monkeypatch.setattr(dsv4.engine, "_resolve_model", capture)
    with pytest.raises(Stop, match="stop here"):
        main(["generate", *ENGINE, "--token-ids", "1,2,3", "--kernels", "attention=pallas,indexer=pallas-stream"])
    assert seen["kernels"] == Kernels(attention="pallas", indexer="pallas-stream")
    with pytest.raises(Stop, match="stop here"):
        main(["generate", *ENGINE, "--token-ids", "1,2,3"])
    assert seen["kernels"] is None  # auto: resolved by the model for its device
    assert KERNEL_PARTS == tuple(CHOICES)  # the CLI's help names every part
    for part, names in CHOICES.items():
        for name in names:
            with pytest.raises(Stop, match="stop here"):
                main(["generate", *ENGINE, "--token-ids", "1,2,3", "--kernels", f"{part}={name}"])
            assert getattr(seen["kernels"], part) == name
    for bad in ("indexer=fp4", "attention", "speed=pallas"):
        with pytest.raises(SystemExit):
            main(["generate", *ENGINE, "--token-ids", "1,2,3", "--kernels", bad])
    capsys.readouterr()


def test_preset_layers_and_random_weight_formats_reach_the_model(monkeypatch):
    """--layer-types replaces a preset's layers (routed MoE each); --random-weights makes them on the devices."""
    import dsv4.random_weights

    seen = {}

    class Stop(BaseException):
        pass

    def capture(config, seed, **kwargs):
        seen.update(config=config, seed=seed, **kwargs)
        raise Stop

    monkeypatch.setattr(dsv4.random_weights, "random_model", capture)
    with pytest.raises(Stop):
        main(["generate", "--model", "tiny", "--layer-types", "sliding,hca,csa", "--random-weights", "fp8", "--seed",
              "3", "--token-ids", "1,2"])  # fmt: skip
    cfg = seen["config"]
    assert cfg.layer_types == ("sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention")
    assert cfg.num_hidden_layers == 3 and cfg.mlp_layer_types == ("moe",) * 3
    assert seen["weights"] == "fp8" and seen["seed"] == 3 and str(seen["dtype"]) == "float32"


def test_devices_beyond_the_machine_are_refused(capsys):
    assert main(["generate", *ENGINE, "--token-ids", "1,2,3", "--devices", "2"]) == 2
    assert "--devices 2: this machine has 1 device(s)" in capsys.readouterr().err


def test_generate_refuses_a_prompt_over_the_limit(capsys):
    ids = ",".join(["5"] * 130)
    assert main(["generate", *ENGINE, "--token-ids", ids, "--max-new-tokens", "2"]) == 2
    assert "exceeds max_model_len=128" in capsys.readouterr().err


def test_bench_ttft_reports_percentiles(capsys):
    argv = ["bench", "ttft", *ENGINE, "--lengths", "20,40", "--concurrency", "1,3", "--max-new-tokens", "3"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["length"], r["concurrency"]) for r in rows] == [(20, 1), (20, 3), (40, 1), (40, 3)]
    for r in rows:
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and 0 < r["itl_p50_s"] <= r["itl_p99_s"]
        assert r["tpot_p50_s"] > 0 and r["output_tokens_per_s"] > 0
    assert main([*argv[:-4], "--lengths", "20", "--concurrency", "2", "--no-warmup"]) == 0
    assert "TTFT p50" in capsys.readouterr().out


def test_info(capsys):
    assert main(["info", "--model", "tiny"]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_size"] == 64


# ----- dsv4 plan -------------------------------------------------------------------------------------------


def test_param_counts_match_the_model():
    """The ledger counts parameters from the config alone; the model's own count must agree exactly."""
    for model in (dsv4.init_random("tiny"), dsv4.load(os.path.join(FIXTURES, "tiny_sigmoid"))):
        counts = count_params(model.config)
        assert counts.num_params == dsv4.num_params(model)
    tiny = count_params(Config.preset("tiny"))
    assert tiny.routed_experts == 4 * 8 * (2 * 32 * 64 + 64 * 32)  # layers × experts × (gate_up + down)
    assert tiny.embeddings == 2 * 256 * 64
    assert tiny.buffers == 256 * 2 + 3 * 8  # one hash layer's tid2eid table, three routed layers' biases
    assert 284e9 < count_params(Config.preset("v4-flash")).num_params < 285e9  # "284B total"


def test_plan_ledger_by_hand():
    """Tiny config (layers: sliding, CSA, HCA, CSA; head_dim 32, index_head_dim 16, window 16, rates 4 and
    16), 1024 tokens on 2 devices, bf16 KV and weights; the cache replicated on both."""
    cfg = Config.preset("tiny")
    plan = plan_memory(cfg, context=1024, devices=2, kv_format="bf16", weights="bf16", chunk_size=8192)
    b = {line.name: line.bytes_per_device for line in plan.lines}
    ring = 16 * 32 * 2 + 16 * 4  # window rows (bf16) + their int32 positions = 1088
    # CSA: all 1024 / 4 = 256 entries × 64 B + 256 indexer keys × 32 B; open windows: compressor
    # (4 × 64 kv + 4 × 64 gate, bf16; overlap half 4 × 32 bf16 + 4 × 32 float32), indexer (same at 32 / 16 wide)
    open_windows = (2 * 4 * 64 * 2 + 4 * 32 * 2 + 4 * 32 * 4) + (2 * 4 * 32 * 2 + 4 * 16 * 2 + 4 * 16 * 4)
    csa_layer = 256 * 64 + 256 * 32 + ring + open_windows
    hca_layer = 1024 // 16 * 64 + ring + 2 * 16 * 32 * 2  # entries + ring + open window (kv, gate)
    assert b["KV cache: CSA layers"] == 2 * csa_layer == 56704
    assert b["KV cache: HCA layers"] == hca_layer == 7232 and b["KV cache: sliding layers"] == ring == 1088
    assert b["KV cache: scale state (replicated)"] == 0
    # one layer's new K=V rows of the chunk (1024 tokens, 512 a device), gathered; double-buffered
    assert b["communication: chunk K=V all-gather"] == 2 * 2 * 512 * 32 * 2 == 131072
    t = 1024 // 2  # this device's share of the (whole-prompt) chunk
    # the other device's 512 tokens in (bf16, one step) and their float32 partial results out and back
    assert b["communication: MoE exchange"] == 1 * t * (64 * 2 + 2 * 64 * 4) == 327680
    per_token = (2 * 4 * 64 + 32 + 2 * 4 * 32 + 32 + 4 * 16) * 2  # streams, q, out, kv, indexer q: 1792 B
    per_token += 2 * (64 * 2 + 2 * 32 * 4 + 32 * 2 + 64 * 4) + 64 * 4  # MoE pairs (top-2) + combine: 1664 B
    assert b["activations: one chunk"] == t * per_token + t * 256 * 4 + 256 * 4 == 2294784
    assert b["weights: routed experts"] == 4 * 8 * 6144 * 2 // 2 == 196608
    assert b["weights: dequantized layer (transient)"] == 0
    counts = count_params(cfg)
    assert b["weights: dense (replicated)"] == counts.dense_linear * 2
    assert b["weights: embeddings, norms (replicated)"] == 2 * 256 * 64 * 2 + (counts.small_fp32 + counts.buffers) * 4
    assert plan.total_bytes == sum(b.values()) and plan.required_bytes == -(-plan.total_bytes * 12 // 10)

    fp8 = plan_memory(cfg, context=1024, devices=2, kv_format="fp8-channel", weights="fp8")
    # fp8 experts: 1 byte per weight + one float32 scale per 128×128 block (every tiny matrix is one block)
    assert fp8.line("weights: routed experts").bytes_per_device == (4 * 8 * 6144 + 4 * 8 * 2 * 4) // 2
    assert fp8.line("weights: dequantized layer (transient)").bytes_per_device == 4 * 3 * 32 * 64 * 2


def test_plan_refuses_what_does_not_fit(capsys):
    argv = ["plan", "--model", "v4-flash", "--context", "512k", "--devices", "8", "--kv-format", "fp8"]
    assert main([*argv, "--device-memory-gib", "80"]) == 1  # bf16 weights: ~95.8 GiB with headroom
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "--weights fp8" in out and "--devices" in out
    assert main([*argv, "--weights-dtype", "fp8", "--device-memory-gib", "80", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["required_bytes"] < 80 * GIB and plan["suggestions"] == []
    # FP4 experts the engine re-blocks once at build (--fp4-experts fp8) are held, and so planned, as FP8 ones;
    # "auto" (the default) plans them so where that fits (80 GiB), else as stored (48 GiB)
    def ledger(*flags):
        main([*argv, "--json", *flags])
        return json.loads(capsys.readouterr().out)

    for gib in ("80", "48"):
        fp8, fp4 = (ledger("--device-memory-gib", gib, "--weights", w) for w in ("fp8", "fp4-experts"))
        as_fp4 = ledger("--device-memory-gib", gib, "--weights", "fp4-experts", "--fp4-experts", "fp4")
        as_fp8 = ledger("--device-memory-gib", gib, "--weights", "fp4-experts", "--fp4-experts", "fp8")
        assert as_fp8 == fp8 and as_fp4 != fp8 and fp4 == (fp8 if gib == "80" else as_fp4)
        assert fp8["fits"] == (gib == "80") and as_fp4["fits"]
    assert main(["plan", "--model", "tiny", "--context", "2m"]) == 2  # beyond max_position_embeddings (1M)
    assert "max_position_embeddings" in capsys.readouterr().err


# ----- errors: one line for a person ------------------------------------------------------------------------


def _pickle_only(tmp_path):
    (tmp_path / "config.json").write_text(open(os.path.join(MODEL_DIR, "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    return str(tmp_path)


def _truncated_safetensors(tmp_path):
    import shutil

    shutil.copytree(MODEL_DIR, tmp_path / "m")
    (name,) = [f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    data = (tmp_path / "m" / name).read_bytes()
    (tmp_path / "m" / name).write_bytes(data[: len(data) // 2])
    return str(tmp_path / "m")


GEN = ["generate", "--model", "tiny"]
ERROR_TABLE = [
    (["generate", "--model", "/no/such/checkpoint"], "--model /no/such/checkpoint: does not exist", 2),
    (["info", "--model", "no-such-preset"], "not a preset (tiny, v4-flash, v4-pro)", 2),
    ([*GEN, "--token-ids", "1,a"], "argument --token-ids: 'a' is not an integer", 2),
    ([*GEN, "--token-ids", ""], "argument --token-ids: '' holds no token ids", 2),
    ([*GEN, "--token-ids", "1,2", "--prompt", "hi"], "argument --prompt: not allowed with argument --token-ids", 2),
    ([*GEN, "--top-k", "-5"], "argument --top-k: -5 must be >= 0", 2),
    ([*GEN, "--max-slots", "0"], "argument --max-slots: 0 must be >= 1", 2),
    ([*GEN, "--max-new-tokens", "2.5"], "argument --max-new-tokens: '2.5' is not an integer", 2),
    ([*GEN, "--temperature", "nan"], "argument --temperature: 'nan' must be a finite number", 2),
    ([*GEN, "--top-p", "0"], "argument --top-p: 0 must be in (0, 1]", 2),
    ([*GEN, "--token-ids", "1,300"], "--token-ids: token id 300 is out of range [0, 256)", 2),
    (["generate", "--model", "v4-flash", "--token-ids", "1"], "GiB", 2),  # the memory plan, before any weight
    (["generate", "--model", _pickle_only, "--token-ids", "1"], "pytorch_model.bin is PyTorch pickle", 2),
    (["generate", "--model", _truncated_safetensors, "--token-ids", "1"], ".safetensors", 2),
    ([*GEN, "--layer-types", "sliding,xyz"], "'sliding,xyz': give a comma-separated list of sliding, csa, hca", 2),
    (["generate", "--model", MODEL_DIR, "--layer-types", "csa", "--token-ids", "1"], "random weights for a preset", 2),
]


@pytest.mark.parametrize("argv, message, code", ERROR_TABLE, ids=lambda v: None if isinstance(v, list) else "")
def test_user_errors_are_one_line(argv, message, code, capsys, tmp_path):
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's errors
        got = e.code
    out, err = capsys.readouterr()
    assert got == code and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_interrupt_broken_pipe_and_verbose(monkeypatch, capsys):
    import dsv4.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(dsv4.cli, "cmd_info", interrupted)
    assert main(["info"]) == 130
    assert capsys.readouterr().err == "dsv4: interrupted\n"

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):
            raise ValueError("no file")

    monkeypatch.undo()
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["info", "--model", "tiny"]) == 0
    monkeypatch.undo()
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="not a preset"):
        main(["info", "--model", "nope", "--verbose"])
