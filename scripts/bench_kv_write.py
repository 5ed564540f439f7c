"""The cache write on a GPU: XLA's quantize + scatter (`KVStore.write(impl="jnp")`) against the quantize-and-write
kernel (`impl="pallas"`, dsv4/pallas/kv_write.py), side by side, with the device copy bandwidth of the same run.

    PYTHONPATH=. python3 scripts/bench_kv_write.py --out $OUT      # one H200 (~1-2 min)
    PYTHONPATH=. python3 scripts/bench_kv_write.py --smoke         # CPU: tiny shapes, the kernel interpreted

What one item times: a jitted write whose store is donated (updated in place, as in the model's step), V4's 512-wide
rows (448 e4m3 channels + 64 bf16 RoPE channels for FP8 formats) into a pool of 256-row pages through a permuted
block table (a pool of 512K rows for B = 1), in rounds that alternate the two routes; the median of each route's
per-round time. Items: a CSA layer's compressed entries from an 8K-token prefill chunk (B = 1, n = 2048 rows, the
largest write of a chunk: the window ring keeps only the chunk's last 128 rows), 32K rows at once (where bandwidth,
not launch, sets the time), and a decode step of 32 requests (B = 32, n = 1). Formats: bf16, fp8-channel (the engine's
FP8 default; scales from a bound), fp8-tile (float32 scales), fp8-tile-e8m0.

Bandwidth: bytes the write must move (the rows read in their dtype + the stored row bytes written) / time, next to a
copy ceiling (`x + 1` over a 1 GiB uint32 buffer, read + written) timed in the same run.

Before timing, each item's two routes are run on the same store and their stored bytes compared with the spec: the
jnp route run by XLA on the host CPU, whose float32 division is IEEE (`x / scale` rounded to nearest), as the
kernel's inline `div.rn.f32` is. XLA's GPU backend compiles float32 division as `div.full.f32` (LLVM's
`-nvptx-prec-divf32=1`: within 2 ulp, not rounded to nearest), so on a GPU the jnp route itself can store a different
e4m3 byte where a quotient sits at a rounding boundary; the table counts those bytes for each route. The kernel must
match the spec exactly (the run fails otherwise); the jnp route's count is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4.cache.layout import KVFormat  # noqa: E402
from dsv4.cache.store import KVStore  # noqa: E402

FORMATS = ("bf16", "fp8-channel", "fp8-tile", "fp8-tile-e8m0")


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    batch: int
    rows: int
    pages_per_request: int


GPU_ITEMS = (Item("chunk-csa-entries", 1, 2048, 2048), Item("bulk-32k-rows", 1, 32768, 2048),
             Item("decode-b32", 32, 1, 64))  # fmt: skip
SMOKE_ITEMS = (Item("prefill", 1, 37, 4), Item("decode", 3, 1, 4))


def make_case(item: Item, fmt_name: str, width: int, page_rows: int, seed: int):
    fmt = KVFormat.named(fmt_name, rope_dim=64 if width >= 128 else 8)
    rng = np.random.default_rng(seed)
    num_pages = item.batch * item.pages_per_request + 1
    bound = 4.0 if fmt.scaling in ("tensor", "channel") else None
    store = KVStore.paged_pool(num_pages, page_rows, width, fmt, bound=bound)
    table = rng.permutation(np.arange(1, num_pages)).reshape(item.batch, item.pages_per_request)
    capacity = item.pages_per_request * page_rows
    start = rng.integers(0, capacity - item.rows + 1, item.batch)
    index = (start[:, None] + np.arange(item.rows)[None]).astype(np.int32)  # consecutive rows, as a chunk writes
    rows = jnp.asarray(rng.standard_normal((item.batch, item.rows, width)), jnp.bfloat16)
    return store, rows, jnp.asarray(index), jnp.asarray(table, jnp.int32)


def spec_write(store: KVStore, rows: jax.Array, index: jax.Array, table: jax.Array) -> KVStore:
    """The write as `dsv4.cache.quant` defines it, run by XLA on the host CPU (IEEE float32 division)."""
    cpu = jax.devices("cpu")[0]
    args = jax.device_put((store, rows, index, table), cpu)
    return jax.jit(lambda s, r, i, t: s.write(r, i, t, impl="jnp"))(*args)


def differing_bytes(a: KVStore, b: KVStore) -> int:
    """How many stored bytes (every leaf, the scale state included) differ between two stores."""
    return int(sum(np.count_nonzero(np.asarray(x).view(np.uint8) != np.asarray(y).view(np.uint8))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)))  # fmt: skip


def moved_bytes(store: KVStore, rows: jax.Array) -> int:
    b, n, width = rows.shape
    return b * n * (width * rows.dtype.itemsize + store.fmt.row_bytes(width))


def copy_bandwidth(nbytes: int, reps: int) -> float:
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    x = jax.block_until_ready(step(x))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        x = jax.block_until_ready(step(x))
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, the kernel interpreted")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=20, help="writes per route per round")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out", type=Path, help="also write bench_kv_write.json here")
    args = p.parse_args()
    smoke = args.smoke
    items, width, page_rows = (SMOKE_ITEMS, 40, 16) if smoke else (GPU_ITEMS, 512, 256)
    rounds, calls = (2, 2) if smoke else (args.rounds, args.calls)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    copy = None if smoke else copy_bandwidth(1 << 30, 9)
    if copy:
        print(f"copy ceiling: {copy / 1e12:.3f} TB/s (read + write, 1 GiB uint32, median of 9)")
    results = []
    header = f"{'item':>20} {'format':>14} {'rows':>7} {'MiB':>7} {'jnp us':>9} {'pallas us':>10} {'ratio':>6} " \
             f"{'pallas TB/s':>11} {'% copy':>7} {'bytes off spec: jnp':>20} {'pallas':>6}"  # fmt: skip
    print(header)
    for item in items:
        for fmt_name in args.formats.split(","):
            store, rows, index, table = make_case(item, fmt_name, width, page_rows, seed=len(results))
            writes = {impl: jax.jit(lambda s, r, i, t, impl=impl: s.write(r, i, t, impl=impl), donate_argnums=0)
                      for impl in ("jnp", "pallas")}  # fmt: skip
            out = {impl: writes[impl](jax.tree.map(jnp.copy, store), rows, index, table) for impl in writes}
            spec = spec_write(store, rows, index, table)
            differ = {impl: differing_bytes(out[impl], spec) for impl in writes}
            stores = {impl: out[impl] for impl in writes}
            times = {impl: [] for impl in writes}
            for _ in range(rounds):
                for impl in writes:
                    s = stores[impl]
                    t = time.perf_counter()
                    for _ in range(calls):
                        s = writes[impl](s, rows, index, table)
                    jax.block_until_ready(s)
                    times[impl].append((time.perf_counter() - t) / calls)
                    stores[impl] = s
            med = {impl: statistics.median(v) for impl, v in times.items()}
            nbytes = moved_bytes(store, rows)
            rate = nbytes / med["pallas"]
            row = dict(item=item.name, format=fmt_name, batch=item.batch, rows=item.rows, bytes=nbytes,
                       jnp_s=med["jnp"], pallas_s=med["pallas"], ratio=med["pallas"] / med["jnp"], pallas_Bps=rate,
                       copy_Bps=copy, bytes_off_spec=differ, rounds=times)  # fmt: skip
            results.append(row)
            pct = f"{100 * rate / copy:6.1f}%" if copy else "      -"
            print(f"{item.name:>20} {fmt_name:>14} {item.batch * item.rows:>7} {nbytes / 2**20:>7.2f} "
                  f"{med['jnp'] * 1e6:>9.1f} {med['pallas'] * 1e6:>10.1f} {row['ratio']:>6.3f} {rate / 1e12:>11.3f} "
                  f"{pct} {differ['jnp']:>20} {differ['pallas']:>6}")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kv_write.json").write_text(json.dumps(dict(device=device.device_kind,
                                                                      jax=jax.__version__, results=results), indent=1))
    if any(r["bytes_off_spec"]["pallas"] for r in results):
        sys.exit("the kernel stored bytes that differ from the spec (XLA's jnp route on the host CPU)")


if __name__ == "__main__":
    main()
