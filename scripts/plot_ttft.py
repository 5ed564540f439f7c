#!/usr/bin/env python3
"""Plots TTFT against prompt length from `bench_ttft.py` and `bench_ttft_sp.py` JSON output.

    python scripts/plot_ttft.py --ttft docs/data/ttft_h200_512k.json docs/data/ttft_h200_128k-512k_fp8_cache.json \\
        docs/data/ttft_h200_32k-512k_ablation.json \\
        --sp docs/data/sp_ep_2xh200_128k_zigzag.json docs/data/sp_ep_2xh200_256k-512k_zigzag.json \\
        docs/data/sp_ep_2xh200_512k.json --out docs/ttft.png

Needs matplotlib (not a dsv4 dependency: `pip install matplotlib`). One line per configuration; chunked variants are
labelled with their chunk size. A point measured in several files keeps the first file's value, so name the newest
run first. Only rows with status "ok" are drawn; variants that repeat another's time (`pallas-attn-cap`,
`chunked-fp8`) are left out to keep the plot readable.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# bench_ttft.py variant -> label (None: not drawn). Chunked labels get ", <chunk> chunks" appended.
LABELS = {
    "xla-cap": "1 GPU: XLA baseline",
    "pallas": "1 GPU: Pallas kernels, whole sequence",
    "chunked": "1 GPU: chunked prefill",
    "chunked-fp8idx": "1 GPU: chunked prefill + FP8 indexer",
}
# bench_ttft_sp.py row key -> label.
SP_LABELS = {
    "2dev-zigzag": "2 GPUs: sequence + expert parallel (zigzag)",
}
SP_FP8_LABEL = "2 GPUs: + FP8 indexer, direct EP schedule"


def add(points: dict[str, dict[int, float]], label: str, length: int, seconds: float) -> None:
    points.setdefault(label, {}).setdefault(length, seconds)


def load_ttft(path: str, points: dict[str, dict[int, float]], dates: set[str]) -> None:
    with open(path) as f:
        run = json.load(f)
    dates.add(run["header"]["date"][:10])
    for setup in run["setups"].values():
        chunk = setup["config"]["chunk"]
        for length, variants in setup["variants"].items():
            for key, row in variants.items():
                label = LABELS.get(key)
                if label is None or row.get("status") != "ok":
                    continue
                if key.startswith("chunked"):
                    label += f", {row.get('chunk', chunk) // 1024}K chunks"
                add(points, label, int(length), row["ttft_s"])


def load_sp(path: str, points: dict[str, dict[int, float]]) -> None:
    with open(path) as f:
        run = json.load(f)
    fp8 = "pallas-fp8" in run.get("argv", [])
    for row in run["rows"]:
        for key, label in SP_LABELS.items():
            if "ttft_s" in row.get(key, {}):
                add(points, SP_FP8_LABEL if fp8 else label, int(row["s"]), row[key]["ttft_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttft", nargs="+", required=True, help="bench_ttft.json files, newest first")
    p.add_argument("--sp", nargs="*", default=[], help="bench_ttft_sp.json files (2-GPU rows)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    points: dict[str, dict[int, float]] = {}
    dates: set[str] = set()
    for path in args.ttft:
        load_ttft(path, points, dates)
    for path in args.sp:
        load_sp(path, points)

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for label in sorted(points, key=lambda k: (not k.startswith("1 GPU"), -max(points[k].values()))):
        xs = sorted(points[label])
        style = "--" if label.startswith("2 GPUs") else "-"
        ax.plot([x / 1024 for x in xs], [points[label][x] for x in xs], style, marker="o", label=label)
        last = xs[-1]
        ax.annotate(f"{points[label][last]:.2f} s", (last / 1024, points[label][last]), textcoords="offset points",
                    xytext=(6, -3), fontsize=7)  # fmt: skip
    lengths = sorted({x for series in points.values() for x in series})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([x / 1024 for x in lengths], [f"{x // 1024}K" for x in lengths])
    ax.set_xlim(lengths[0] / 1024 / 1.3, lengths[-1] / 1024 * 1.6)
    ax.minorticks_off()
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT, DeepSeek-V4-Flash widths, 3 layers (sliding, CSA, HCA), B = 1, bf16 weights, H200\n"
                 f"runs of {', '.join(sorted(dates))}; details in docs/BENCHMARKS.md", fontsize=9)  # fmt: skip
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}: " + "; ".join(f"{k} {sorted(v)}" for k, v in points.items()))


if __name__ == "__main__":
    main()
