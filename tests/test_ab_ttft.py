"""scripts/ab_ttft.py: the alternating order, the medians and ratio, and `prepare`'s tree, with stand-in
bench_ttft.py scripts whose TTFTs are set by hand (no model runs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ab_ttft", ROOT / "scripts" / "ab_ttft.py")
ab_ttft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_ttft)

# A stand-in bench_ttft.py: appends "<tree> <out> <PYTHONPATH is its tree> [AB_TEST_FLAG]" to LOG, and writes a
# bench_ttft.json whose TTFT of each variant is TTFT[tree][round - 1] (the round is the digit its --out folder ends
# with); "fails" in its args: exit 3.
FAKE = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
tree = Path(__file__).resolve().parents[1].name
with open(os.environ["AB_TEST_LOG"], "a") as f:
    f.write(f"{tree} {out.name} {os.environ['PYTHONPATH'] == str(Path(__file__).resolve().parents[1])}"
            f"{' ' + os.environ['AB_TEST_FLAG'] if 'AB_TEST_FLAG' in os.environ else ''}\\n")
if "fails" in args and tree == "new":
    sys.exit(3)
ttft = json.loads(os.environ["AB_TEST_TTFT"])[tree][int(out.name[-1]) - 1]
rec = {"status": "ok", "ttft_s": ttft, "compile_s": 30.0, "mfu_mixed": 0.5}
out.mkdir(parents=True, exist_ok=True)
(out / "bench_ttft.json").write_text(json.dumps({"setups": {"v4-flash [fp8 weights]": {"variants": {
    "524288": {"chunked-fp8idx": rec, "xla-cap": {"status": "skipped"}}}}}}))
"""


def fake_tree(root: Path, name: str) -> Path:
    tree = root / name
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "bench_ttft.py").write_text(textwrap.dedent(FAKE))
    return tree


@pytest.fixture
def trees(tmp_path, monkeypatch):
    monkeypatch.setenv("AB_TEST_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("AB_TEST_TTFT", json.dumps({"base": [3.5, 3.6, 3.4], "new": [3.2, 3.0, 3.1]}))
    return fake_tree(tmp_path, "base"), fake_tree(tmp_path, "new"), tmp_path


def test_order_alternates_which_version_goes_first():
    assert ab_ttft.order(3) == [(1, "base"), (1, "new"), (2, "new"), (2, "base"), (3, "base"), (3, "new")]


def test_run_alternates_and_gives_the_medians_ratio(trees, capsys):
    base, new, tmp = trees
    out = tmp / "out"
    rc = ab_ttft.main(["run", "--base", str(base), "--new", str(new), "--rounds", "3", "--out", str(out), "--",
                       "--lengths", "512k"])  # fmt: skip
    assert rc == 0
    log = (tmp / "log").read_text().split("\n")[:-1]
    assert log == [f"{t} {t}{r} True" for r, t in ab_ttft.order(3)], "each process from its own tree, in order"
    record = json.loads((out / "ab_ttft.json").read_text())
    (row,) = record["summary"]  # xla-cap was skipped in every process: no row
    assert (row["setup"], row["length"], row["variant"]) == ("v4-flash [fp8 weights]", 524288, "chunked-fp8idx")
    assert row["base_ttft_s"] == [3.5, 3.6, 3.4] and row["new_ttft_s"] == [3.2, 3.0, 3.1]
    assert row["ratio"] == pytest.approx(3.5 / 3.1)
    assert len(record["runs"]) == 6 and record["bench_args"] == ["--lengths", "512k"]
    printed = capsys.readouterr().out
    assert "1.129x" in printed and "chunked-fp8idx: TTFT 3600.0 ms" in printed  # each process's TTFT as it ends


def test_new_env_reaches_the_new_side_only(trees):
    """--new-env sets its variables in the new side's processes and nowhere else (an A/B of XLA flags with one
    tree on both sides), and the record names them."""
    base, new, tmp = trees
    rc = ab_ttft.main(["run", "--base", str(base), "--new", str(new), "--new-env", "AB_TEST_FLAG=--xla_x=A,B",
                       "--rounds", "2", "--out", str(tmp / "o"), "--"])  # fmt: skip
    assert rc == 0
    log = (tmp / "log").read_text().split("\n")[:-1]
    assert log == ["base base1 True", "new new1 True --xla_x=A,B", "new new2 True --xla_x=A,B", "base base2 True"]
    assert json.loads((tmp / "o" / "ab_ttft.json").read_text())["new_env"] == {"AB_TEST_FLAG": "--xla_x=A,B"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        ab_ttft.main(["run", "--base", str(base), "--new-env", "NOVALUE", "--out", str(tmp / "p")])


def test_a_run_cut_off_keeps_what_finished(trees, monkeypatch):
    """The record is written after every process: a command stopped by its time limit during the third process
    leaves the first two, and their ratio."""
    base, new, tmp = trees
    run_one, calls = ab_ttft.run_one, []

    def cut_off(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as the command's timeout would stop it
        return run_one(*args)

    monkeypatch.setattr(ab_ttft, "run_one", cut_off)
    with pytest.raises(KeyboardInterrupt):
        ab_ttft.main(["run", "--base", str(base), "--new", str(new), "--rounds", "2", "--out", str(tmp / "o"), "--"])
    record = json.loads((tmp / "o" / "ab_ttft.json").read_text())
    assert [(r["version"], r["round"]) for r in record["runs"]] == [("base", 1), ("new", 1)]
    assert record["summary"][0]["ratio"] == pytest.approx(3.5 / 3.2)


def test_a_failed_process_leaves_no_ratio(trees, capsys):
    base, new, tmp = trees
    rc = ab_ttft.main(["run", "--base", str(base), "--new", str(new), "--rounds", "1", "--out", str(tmp / "o"), "--",
                       "fails"])  # fmt: skip
    assert rc == 1
    assert "rc 3" in capsys.readouterr().out
    assert json.loads((tmp / "o" / "ab_ttft.json").read_text())["summary"] == []


def test_run_rejects_what_it_cannot_do(trees):
    base, new, tmp = trees
    with pytest.raises(SystemExit, match="--out before"):
        ab_ttft.main(["run", "--base", str(base), "--out", str(tmp), "--", "--out", "x"])
    with pytest.raises(SystemExit, match="holds no scripts/bench_ttft.py"):
        ab_ttft.main(["run", "--base", str(tmp), "--out", str(tmp / "o")])


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's git history")
def test_prepare_writes_that_commits_tree(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    rev = head.stdout.strip()
    dest = ab_ttft.prepare(rev, tmp_path)
    assert dest == tmp_path / rev
    committed = subprocess.run(["git", "show", f"{rev}:scripts/ab_ttft.py"], cwd=ROOT, capture_output=True,
                               check=False)  # fmt: skip
    if committed.returncode == 0:
        assert (dest / "scripts" / "ab_ttft.py").read_bytes() == committed.stdout
    assert (dest / "dsv4" / "__init__.py").exists() and not (dest / "tests").exists()
    with pytest.raises(SystemExit, match="git archive"):
        ab_ttft.prepare("no-such-revision", tmp_path)
    assert os.listdir(tmp_path) == [rev], "a failed prepare leaves nothing behind"
