"""CacheLayout (dsv4/cache/layout.py): bytes per request and per token, checked three ways.

1. Against what the model allocates: `DeepseekV4.init_cache` under `jax.eval_shape` (nothing allocated), array
   by array, for bf16 / float32 caches, and for FP8 caches (per request and shared scale states), dense and paged.
2. Against arithmetic done by hand for V4-Flash, independent of the implementation.
3. Against the tables in docs/BENCHMARKS.md ("KV cache bytes per token"), so the docs cannot drift.
"""

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dsv4.cache.layout import CSA, HCA, SLIDING, CacheLayout, KVFormat
from dsv4.cache.manager import PageSpec
from dsv4.cache.quant import FORMAT_NAMES
from dsv4.config import Config
from dsv4.model import DeepseekV4

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"tiny": lambda: Config.preset("tiny"),
           "tiny_sigmoid": lambda: Config.from_hf(REPO_ROOT / "tests" / "fixtures" / "tiny_sigmoid")}  # fmt: skip


def abstract_cache(config, batch, max_len, build):
    """`build(model)` under eval_shape, on an abstract model: shapes and dtypes only, nothing allocated."""
    return jax.eval_shape(lambda: build(DeepseekV4(config, rngs=nnx.Rngs(0))))


def _key(k) -> str:
    return k.key if hasattr(k, "key") else k.name  # DictKey / SequenceKey, or a KVStore field (GetAttrKey)


def is_scale_state(path) -> bool:
    """A `KVStore`'s per-array scale state: shared by all requests, not per request."""
    return any(getattr(k, "name", None) == "scale" for k in path)


def bytes_by_path(tree) -> dict[str, int]:
    """Leaf bytes summed per top-level array path ("window", "compressor.entries", ...) of one layer's state:
    a `KVStore` ("window" → its nope / rope / scale leaves) counts as its array; scale states are left out."""
    out: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_scale_state(path):
            continue
        keys = [str(_key(k)) for k in path]
        name = ".".join(keys[:2] if keys[0] in ("compressor", "indexer") else keys[:1])
        out[name] = out.get(name, 0) + leaf.size * leaf.dtype.itemsize
    return out


def shared_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
               if is_scale_state(path))  # fmt: skip


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("dtype, max_len", [("bfloat16", 64), ("float32", 70)])
def test_layout_matches_what_init_cache_allocates(config_name, dtype, max_len):
    """max_len 70 is no multiple of the rates: the dense cache keeps complete entries only ("floor")."""
    config, batch = CONFIGS[config_name](), 3
    cache = abstract_cache(config, batch, max_len, lambda m: m.init_cache(batch, max_len, jnp.dtype(dtype)))
    layout = CacheLayout.from_config(config, KVFormat(dtype, dtype=dtype), state_dtype=dtype)
    assert [layer.layer_type for layer in layout.layers] == list(config.layer_types)
    for i, (layer, state) in enumerate(zip(layout.layers, cache.layers, strict=True)):
        want = {path: batch * n for path, n in layer.breakdown(max_len, rounding="floor").items()}
        assert bytes_by_path(state) == want, f"layer {i} ({layer.layer_type})"
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache))
    assert total == layout.dense_cache_bytes(batch, max_len)


@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if n != "bf16"])
def test_fp8_cache_matches_the_layout(name):
    """The model's cache stored in `name`: its bytes are the layout's, per request and shared (scale states)."""
    config, batch, max_len = Config.preset("tiny"), 2, 64
    fmt = KVFormat.named(name, rope_dim=config.qk_rope_head_dim)
    cache = abstract_cache(config, batch, max_len, lambda m: m.init_cache(batch, max_len, jnp.bfloat16, kv_format=name))
    layout = CacheLayout.from_config(config, fmt)
    for layer, state in zip(layout.layers, cache.layers, strict=True):
        assert bytes_by_path(state) == {p: batch * n for p, n in layer.breakdown(max_len, rounding="floor").items()}
    assert shared_bytes(cache) == layout.shared_bytes
    assert (layout.shared_bytes > 0) == (fmt.scaling in ("tensor", "channel"))


@pytest.mark.parametrize("name", ["bf16", "fp8-channel", "fp8-tile"])
def test_paged_pools_match_the_layout(name):
    """Paged: each compressed array is one pool of num_pages pages of page_tokens // rate rows, shared by all
    slots (so a page of every pool holds the same token span); rings and open windows stay per slot."""
    config, batch, max_len, page_tokens, num_pages = Config.preset("tiny"), 2, 64, 32, 9
    fmt = KVFormat.named(name, rope_dim=config.qk_rope_head_dim)
    cache = abstract_cache(config, batch, max_len, lambda m: m.init_cache(
        batch, max_len, jnp.bfloat16, kv_format=name, page_tokens=page_tokens, num_pages=num_pages))
    assert cache.block_table.shape == (batch, max_len // page_tokens)
    layout = CacheLayout.from_config(config, fmt)
    for layer, state in zip(layout.layers, cache.layers, strict=True):
        want = {}
        for a in layer.arrays:
            rows = num_pages * page_tokens // a.tokens_per_row if a.tokens_per_row else batch * a.rows
            want[a.path] = rows * a.row_bytes
        assert bytes_by_path(state) == want, layer.layer_type


def test_v4_flash_bytes_by_hand():
    """Arithmetic from the architecture, not from the code: V4-Flash, fp8-channel, one request of 512K tokens."""
    cfg = Config.preset("v4-flash")
    n, w, d, di = 512 * 1024, 128, 512, 128
    row, index_row = 448 + 2 * 64, 64 + 2 * 64  # fp8 nope + bf16 rope
    ring = w * row + w * 4  # K=V rows + their positions
    csa = ring + (n // 4) * row + 4 * 2 * (2 * d) * 2 + 4 * d * 2 + 4 * d * 4 \
        + (n // 4) * index_row + 4 * 2 * (2 * di) * 2 + 4 * di * 2 + 4 * di * 4  # fmt: skip
    hca = ring + (n // 128) * row + 128 * 2 * d * 2
    layout = CacheLayout.from_config(cfg, KVFormat.named("fp8-channel", rope_dim=64))
    per_type = layout.by_layer_type(n)
    assert {t: (v["layers"], v["per_layer"]) for t, v in per_type.items()} == {
        SLIDING: (2, ring), CSA: (21, csa), HCA: (20, hca)}  # fmt: skip
    assert layout.bytes_per_request(n) == 4 + 2 * ring + 21 * csa + 20 * hca
    assert layout.shared_bytes == 43 * 448 * 8 + 21 * 64 * 8 + 41 * 448 * 8  # scale + amax per array, float32
    growth = {layer.layer_type: layer.growth_bytes_per_token for layer in layout.layers}
    assert growth == {SLIDING: 0, CSA: (row + index_row) / 4, HCA: row / 128}
    bf16 = CacheLayout.from_config(cfg, KVFormat.named("bf16", rope_dim=64))
    assert {layer.layer_type: layer.growth_bytes_per_token for layer in bf16.layers} == {
        SLIDING: 0, CSA: (1024 + 256) / 4, HCA: 1024 / 128}  # fmt: skip


def test_page_entry_bytes_use_the_page_spec_group_names():
    cfg = Config.preset("v4-flash")
    layout = CacheLayout.from_config(cfg, KVFormat.named("fp8-tile-e8m0", rope_dim=64))
    spec = PageSpec.deepseek_v4(sliding_window=cfg.sliding_window, compress_rates=dict(cfg.compress_rates).values(),
                                entries_per_page=64)  # fmt: skip
    assert layout.page_entry_bytes() == {"sliding_window": 43 * 583, "compressed_4": 21 * (583 + 193),
                                         "compressed_128": 20 * 583}  # fmt: skip
    assert set(layout.page_entry_bytes()) == {group.name for group in spec.groups}


def _docs_section(title: str) -> str:
    text = (REPO_ROOT / "docs" / "BENCHMARKS.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def test_docs_bytes_tables_match_the_layout():
    """Every number in the docs' bytes tables, recomputed (512K tokens; formats in the header's order)."""
    section = _docs_section("KV cache bytes per token")
    n = 512 * 1024
    labels = {"sliding": SLIDING, "CSA": CSA, "HCA": HCA}
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if re.match(r"\| V4-(Flash|Pro) \|", line)]  # fmt: skip
    headers = [line for line in section.splitlines() if line.startswith("| model |")]
    per_layer_formats = re.findall(r"([\w-]+) B/token/layer", headers[0])
    total_formats = re.findall(r"([\w-]+) GiB/request", headers[1])
    presets = {"V4-Flash": "v4-flash", "V4-Pro": "v4-pro"}
    expected_rows = sum(len(set(Config.preset(p).layer_types)) + 1 for p in presets.values())  # types + a total
    assert len(rows) == expected_rows and per_layer_formats and total_formats
    checked = 0
    for row in rows:
        cfg = Config.preset(presets[row[0]])

        def layout(name):
            return CacheLayout.from_config(cfg, KVFormat.named(name, rope_dim=cfg.qk_rope_head_dim))

        if row[1] in labels:
            per_type = {f: layout(f).by_layer_type(n)[labels[row[1]]] for f in per_layer_formats}
            assert int(row[2]) == per_type[per_layer_formats[0]]["layers"]
            assert row[3:] == [f"{per_type[f]['per_layer_per_token']:.2f}" for f in per_layer_formats], row
        else:
            want = [f"{layout(f).bytes_per_request(n) / 2**30:.3f}" for f in total_formats]
            want += [f"{layout(f).bytes_per_token(n):.1f}" for f in total_formats]
            assert row[1:] == want, row
        checked += 1
    assert checked == expected_rows
    assert os.path.basename(__file__) in section  # the section says which test keeps it honest
