#!/usr/bin/env python3
"""Two versions of dsv4 timed by `scripts/bench_ttft.py` in alternating processes on one machine: the A/B behind the
"each further step" rows of docs/BENCHMARKS.md.

    python3 scripts/ab_ttft.py prepare 35ff56f            # here: that commit's dsv4/ and scripts/ into .ab/35ff56f
    python3 scripts/ab_ttft.py run --base .ab/35ff56f --rounds 2 --out $OUT -- \\
        --lengths 512k --chunk 16384 --variants chunked-fp8idx --weights fp8 --no-breakdown --no-chunk-split \\
        --no-whole-check --ceiling-sizes 8192 --target-s 4 --budget 245
                                                          # on the GPU (with .ab/): the base against this tree

`prepare` needs the repository's history, so it runs in a checkout; a GPU machine that gets only a copy of the working
tree needs `.ab/` (git-ignored) copied along with it. `run` starts one bench_ttft.py process per version and round,
the base first in odd rounds and this tree first in even ones (the first process on a fresh machine can run a little
slower), each from its own tree (`PYTHONPATH` and working directory), each with the same arguments and its own
`--out`. Nothing carries over from one process to the next unless the arguments say `--compile-cache`.

It prints, per variant and length, each process's TTFT, the medians and the ratio base / this tree (> 1: this tree is
faster), with compile times and MFUx beside; and writes OUT/ab_ttft.json with every process's own bench_ttft.json,
after every process, so a command stopped by its time limit keeps what finished (each process's TTFT is printed as it
ends, too). `--new DIR` times another prepared tree in place of this one. `--new-env KEY=VALUE` (repeatable) sets
variables for the new side's processes only: with `--base .` the two sides are this tree with and without them, an
A/B of XLA flags:

    python3 scripts/ab_ttft.py run --base . --new-env XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,WHILE \
        --rounds 1 --out $OUT -- --lengths 512k --chunk 16384 --variants chunked ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / ".ab"


def prepare(rev: str, into: Path = AB_DIR) -> Path:
    """`git archive REV dsv4 scripts` into INTO/REV (replacing it). → the folder."""
    dest = into / rev
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, "dsv4", "scripts"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode:
        shutil.rmtree(dest)
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def order(rounds: int) -> list[tuple[int, str]]:
    """(round, "base" | "new") in running order: the base first in odd rounds, this tree first in even ones."""
    return [(r, name) for r in range(1, rounds + 1) for name in (("base", "new") if r % 2 else ("new", "base"))]


def run_one(tree: Path, bench_args: list[str], out: Path, timeout_s: float, extra_env: dict | None = None) -> dict:
    """One bench_ttft.py process from `tree`, with `extra_env` set. → its bench_ttft.json (or {"error": ...})."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(tree / "scripts" / "bench_ttft.py"), *bench_args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree), **(extra_env or {})}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    (out / "stdout.log").write_text(proc.stdout + proc.stderr)
    result = out / "bench_ttft.json"
    if proc.returncode or not result.exists():
        return {"error": f"rc {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"}
    data = json.loads(result.read_text())
    data["wall_s"] = time.perf_counter() - t0
    return data


def ttft_rows(data: dict) -> dict[tuple[str, str, int, str], dict]:
    """bench_ttft.json → {(setup, length, variant): the variant's record} for every variant timed."""
    rows = {}
    for setup, body in data.get("setups", {}).items():
        for length, variants in body.get("variants", {}).items():
            for variant, rec in variants.items():
                if isinstance(rec, dict) and rec.get("status") == "ok" and rec.get("ttft_s") is not None:
                    rows[(setup, int(length), variant)] = rec
    return rows


def summarize(runs: list[dict]) -> list[dict]:
    """Per (setup, length, variant) timed in every process: TTFT of each, medians, base / new."""
    keys = None
    for r in runs:
        k = set(ttft_rows(r["bench_ttft"]))
        keys = k if keys is None else keys & k
    table = []
    for key in sorted(keys or ()):
        side = {"base": [], "new": []}
        for r in runs:
            rec = ttft_rows(r["bench_ttft"])[key]
            side[r["version"]].append((r["round"], rec))
        med = {v: statistics.median(rec["ttft_s"] for _, rec in side[v]) for v in side}
        table.append({
            "setup": key[0], "length": key[1], "variant": key[2],
            **{f"{v}_ttft_s": [rec["ttft_s"] for _, rec in side[v]] for v in side},
            **{f"{v}_compile_s": [rec.get("compile_s") for _, rec in side[v]] for v in side},
            **{f"{v}_mfux": [rec.get("mfu_mixed") for _, rec in side[v]] for v in side},
            "base_median_s": med["base"], "new_median_s": med["new"], "ratio": med["base"] / med["new"],
        })  # fmt: skip
    return table


def print_table(table: list[dict]) -> None:
    print(f"{'setup':<28} {'S':>8} {'variant':<16} {'base ms':>22} {'new ms':>22} {'base/new':>8}  compile s "
          f"(base | new)  MFUx (base | new)")  # fmt: skip
    ms = lambda xs: ", ".join(f"{x * 1e3:.1f}" for x in xs)  # noqa: E731
    pct = lambda xs: ", ".join("-" if x is None else f"{100 * x:.0f}%" for x in xs)  # noqa: E731
    sec = lambda xs: ", ".join("-" if x is None else f"{x:.0f}" for x in xs)  # noqa: E731
    for row in table:
        print(f"{row['setup']:<28} {row['length']:>8} {row['variant']:<16} {ms(row['base_ttft_s']):>22} "
              f"{ms(row['new_ttft_s']):>22} {row['ratio']:>7.3f}x  {sec(row['base_compile_s'])} | "
              f"{sec(row['new_compile_s'])}  {pct(row['base_mfux'])} | {pct(row['new_mfux'])}")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="the base version's dsv4/ and scripts/ into .ab/REV (needs git)")
    prep.add_argument("rev")
    prep.add_argument("--into", type=Path, default=AB_DIR, help="parent folder (default .ab, git-ignored)")
    run = sub.add_parser("run", help="alternate bench_ttft.py processes of the base and this tree")
    run.add_argument("--base", type=Path, required=True, help="a folder made by `prepare` (.ab/REV)")
    run.add_argument("--new", type=Path, default=ROOT, help="the other tree (default: this one)")
    run.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE",
                     help="an environment variable for the new side's processes only (repeatable)")
    run.add_argument("--rounds", type=int, default=2, help="processes per version (default 2)")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--timeout", type=float, default=300.0, help="seconds a process (default 300)")
    run.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_ttft.py's arguments (not --out)")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.rev, args.into))
        return 0
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in bench_args:
        raise SystemExit("ab_ttft.py run: pass --out before `--`; each process gets a folder of its own under it")
    if not (args.base / "scripts" / "bench_ttft.py").exists():
        raise SystemExit(f"{args.base} holds no scripts/bench_ttft.py: make it with `ab_ttft.py prepare REV`")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: at least 1")
    if any("=" not in item for item in args.new_env):
        raise SystemExit(f"--new-env {args.new_env}: each is KEY=VALUE")
    new_env = dict(item.split("=", 1) for item in args.new_env)
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    runs, table = [], []
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every process, so a command cut off by its time limit keeps what finished
        record = {"bench_args": bench_args, "base": str(args.base), "new_env": new_env, "rounds": args.rounds,
                  "summary": table, "runs": runs}  # fmt: skip
        (args.out / "ab_ttft.json").write_text(json.dumps(record, indent=1))

    save()
    for rnd, version in order(args.rounds):
        out = args.out / f"{version}{rnd}"
        print(f"round {rnd}: {version} ({trees[version]})", flush=True)
        data = run_one(trees[version], bench_args, out, args.timeout, new_env if version == "new" else None)
        if "error" in data:
            print(f"  {data['error']}", flush=True)
            continue
        for (setup, length, variant), rec in sorted(ttft_rows(data).items()):
            print(f"  {setup} {length} {variant}: TTFT {rec['ttft_s'] * 1e3:.1f} ms", flush=True)
        runs.append({"version": version, "round": rnd, "tree": str(trees[version]), "bench_ttft": data})
        table = summarize(runs) if {r["version"] for r in runs} == {"base", "new"} else []
        save()
    print_table(table)
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
