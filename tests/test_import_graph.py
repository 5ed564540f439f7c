"""dsv4's modules import downward only: the import graph of `dsv4/` (function-local imports included) has no cycle, and
every import follows the layer order below. The host layer loads no JAX, so `import dsv4.scheduler` stays cheap."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsv4"

# Bottom to top. A module may import modules of its own layer or of a layer below, never above.
LAYERS = [
    # host side: the config, the planner, the scheduler and the page bookkeeping (standard library only)
    # (the indexer's slab rule is plain Python that the planner shares with the kernel)
    ("host", ["dsv4.config", "dsv4.tokenizer", "dsv4.memory_plan", "dsv4.scheduler", "dsv4.cache",
              "dsv4.cache.layout", "dsv4.cache.block_pool", "dsv4.cache.manager", "dsv4.pallas.indexer_slab",
              "dsv4.flops"]),
    # the kernels, each with its jnp reference (jax only)
    ("kernels", ["dsv4.pallas", "dsv4.pallas.*", "dsv4.topk"]),
    # device-side formats, the kernel choice, meshes and their rules
    ("device", ["dsv4.quantization", "dsv4.cache.quant", "dsv4.cache.store", "dsv4.cache.state", "dsv4.kernels",
                "dsv4.sharding",
                "dsv4.sharding.*"]),
    ("model", ["dsv4.layers", "dsv4.attention", "dsv4.attention.*", "dsv4.moe", "dsv4.model"]),
    ("loading", ["dsv4.weights", "dsv4.orbax_checkpoint", "dsv4.random_weights", "dsv4.api"]),
    ("engine", ["dsv4.generate", "dsv4.runner", "dsv4.engine", "dsv4.distributed"]),
    # the HTTP server and its load generator, over the engine
    ("serve", ["dsv4.serve", "dsv4.serve.*"]),
    ("cli", ["dsv4.cli", "dsv4"]),
]
HOST_MODULES = ["dsv4.scheduler", "dsv4.cache", "dsv4.cache.manager", "dsv4.cache.block_pool", "dsv4.config",
                "dsv4.memory_plan", "dsv4.tokenizer", "dsv4.cache.layout", "dsv4.pallas.indexer_slab",
                "dsv4.flops"]  # fmt: skip


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def layer_of(name: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
                return i
    raise AssertionError(f"{name} is in no layer of tests/test_import_graph.py: add it where it belongs")


def import_graph() -> dict[str, set[str]]:
    """module → the dsv4 modules it imports anywhere in its body (`from a.b import c` counts as a.b.c when c is a
    module, else a.b). The package itself is left out as a target: `import dsv4.x` names dsv4.x."""
    modules = module_names()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.startswith("dsv4.")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                if base == "dsv4" or base.startswith("dsv4."):
                    for alias in node.names:
                        full = f"{base}.{alias.name}"
                        targets.add(full if full in modules else known(base))
        targets.discard(name)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (cycle := visit(w)):
                return cycle
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_imports_follow_the_layer_order():
    wrong = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
             for a, targets in import_graph().items() for b in targets
             if b != "dsv4" and layer_of(b) > layer_of(a)]  # fmt: skip
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_kernels_import_nothing_from_the_model_or_the_planner():
    wrong = [f"{a} imports {b}" for a, targets in import_graph().items() if a.startswith("dsv4.pallas")
             for b in targets if not (b.startswith("dsv4.pallas") or b == "dsv4.topk")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_function_local_imports_and_cycles():
    """The two rules above on small graphs worked out by hand, and on a function-local import of this package."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph = import_graph()
    assert "dsv4.pallas.attention" in graph["dsv4.attention.pallas_core"]
    assert layer_of("dsv4.scheduler") < layer_of("dsv4.kernels") < layer_of("dsv4.model") < layer_of("dsv4.engine")


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_modules_load_no_jax(module):
    code = f"import sys, {module}; bad = [m for m in ('jax', 'numpy', 'flax') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "jax" not in out.stdout and "flax" not in out.stdout, f"import {module} loads {out.stdout.strip()}"
