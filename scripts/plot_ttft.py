#!/usr/bin/env python3
"""Plots TTFT against prompt length, one line per ablation variant, from `bench_ttft.py`'s JSON output.

    python scripts/plot_ttft.py RUN/bench_ttft.json [MORE.json ...] [--sp SP.json ...] --out docs/ttft.png

Needs matplotlib (not a dsv4 dependency: `pip install matplotlib`). Every file's measured variants are drawn;
a variant measured in several files keeps the first file's points (name the main run first). Only rows with
status "ok" are drawn; the title names the device, the measured depth and the files' dates. `--sp` adds the
N-device rows of `bench_ttft_sp.py` runs (the same model, sequence + expert parallelism) as one more line.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "xla": "(1) XLA baseline",
    "xla-cap": "(1c) XLA, capacity MoE (baseline)",
    "pallas-attn": "(2) + Pallas attention",
    "pallas-attn-cap": "(2c) + Pallas attention",
    "pallas": "(3) + Pallas MoE",
    "chunked": "(4) + chunked prefill (8K)",
    "chunked-fp8": "(5) + FP8 paged KV",
}


def load_points(paths: list[str]) -> tuple[dict[str, dict[int, float]], list[str], str]:
    """→ ({variant: {length: ttft_s}}, run dates, a description of the setup)."""
    points: dict[str, dict[int, float]] = {}
    dates, setup = [], ""
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        header = run["header"]
        dates.append(header["date"][:10])
        for name, s in run["setups"].items():
            layers = ",".join(s["config"]["layer_types"])
            setup = f"{header['device_kind']}, {name}, {len(s['config']['layer_types'])} layers ({layers}), B=1, bf16"
            for length, variants in s["variants"].items():
                for key, row in variants.items():
                    if row.get("status") != "ok":
                        continue
                    series = points.setdefault(key, {})
                    if path == paths[0] or key not in _first_file_keys(paths[0]):
                        series.setdefault(int(length), row["ttft_s"])
    return points, sorted(set(dates)), setup


def _first_file_keys(path: str) -> set[str]:
    with open(path) as f:
        run = json.load(f)
    return {key for s in run["setups"].values() for variants in s["variants"].values() for key in variants}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="bench_ttft.json files (the main run first)")
    p.add_argument("--sp", nargs="*", default=[], help="bench_ttft_sp.json files: their N-device rows")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    points, dates, setup = load_points(args.files)
    for path in args.sp:
        with open(path) as f:
            run = json.load(f)
        n = run["devices"]
        series = {f"{n}dev": f"(6) + sequence + expert parallelism, {n} GPUs",
                  f"{n}dev-zigzag": f"(6') the same in zigzag token order, {n} GPUs"}  # fmt: skip
        for row in run["rows"]:
            for name, key in series.items():
                if "ttft_s" in row.get(name, {}):
                    points.setdefault(key, {}).setdefault(int(row["s"]), row[name]["ttft_s"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for key in [k for k in LABELS if k in points] + [k for k in points if k not in LABELS]:
        xs = sorted(points[key])
        ax.plot([x / 1024 for x in xs], [points[key][x] * 1e3 for x in xs], marker="o", label=LABELS.get(key, key))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lengths = sorted({x for series in points.values() for x in series})
    ax.set_xticks([x / 1024 for x in lengths], [f"{x // 1024}K" for x in lengths])
    ax.minorticks_off()
    lo = min(t for series in points.values() for t in series.values()) * 1e3
    hi = max(t for series in points.values() for t in series.values()) * 1e3
    ticks = [t for t in (100, 200, 300, 500, 1000, 2000, 3000, 5000, 10000, 20000, 50000) if lo / 1.5 <= t <= hi * 1.5]
    ax.set_yticks(ticks, [f"{t:,}" for t in ticks])
    ax.set_xlabel("prompt length (K tokens)")
    ax.set_ylabel("TTFT of the measured layers (ms)")
    total = len(args.files) + len(args.sp)
    runs = f"{total} runs" if total > 1 else "one run"
    ax.set_title(f"TTFT by ablation step — {setup}\n{', '.join(dates)}, {runs} (docs/BENCHMARKS.md)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}: {', '.join(f'{k} {sorted(v)}' for k, v in points.items())}")


if __name__ == "__main__":
    main()
