"""Compiles dsv4's Triton-lowered Pallas kernels to Hopper machine code without a GPU, and prints each one's
registers and spills: a check for machines that have no GPU.

    scripts/dev python scripts/triton_compile_check.py --triton-python /tmp/tvenv/bin/python            # every kernel
    scripts/dev python scripts/triton_compile_check.py --triton-python /tmp/tvenv/bin/python --cases kv_write

The compiler is the upstream `triton` package in another interpreter (set up once, ~285 MB, not a dependency of
the project: `python3.12 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton`). It runs in a separate process
because its MLIR must not share one with jaxlib's.

How: each case of tests/test_triton_masks.py (every Triton kernel of dsv4, at lengths its blocks do not divide) is
lowered for an abstract H200, as the CPU tests lower it. The Triton IR of each `pallas_call` is written to
--workdir with that call's num_warps and num_stages. The upstream compiler then builds it for sm_90a (IR → PTX →
cubin), and the cubin's resource usage is read back (`cuobjdump -res-usage`: registers, local memory and the stack
frame, where spills go) with the shared memory Triton launches it with. A kernel whose ptxas run outlasts --timeout
is reported as such.

What a pass means: the IR is valid upstream Triton and assembles for Hopper, inline assembly included (e.g. the
quantize-and-write kernel's `div.rn.f32`). It does not
mean that XLA's own pipeline (jaxlib bundles another Triton) gives the same machine code, so the register counts are
indicative only, and nothing here runs the code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# Runs under --triton-python, one kernel a process: compiles the IR file for sm_90a (IR → PTX → cubin), then reads the
# cubin's resource usage (cuobjdump -res-usage: registers, stack, local memory = spills, shared). JSON in and out.
COMPILER = r"""
import glob, json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as tcompile

job = json.loads(sys.argv[1])
kernel = tcompile(job["path"], target=GPUTarget("cuda", 90, 32),
                  options=dict(num_warps=job["num_warps"], num_stages=job["num_stages"]))
with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
    f.write(kernel.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
fields = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
print(json.dumps(dict(fields, shared=kernel.metadata.shared)))  # dynamic shared memory, as Triton launches it
"""


def lowered_kernels(case_names: list[str], workdir: Path) -> list[dict]:
    """Lowers each case for an abstract H200. → one job per pallas_call: IR path, num_warps, num_stages."""
    import jax
    from gpu_mesh import abstract_gpu_mesh
    from jax._src.pallas.triton import lowering as triton_lowering
    from test_triton_masks import OVERHANGING, WHOLE_BLOCKS
    from triton_masks import pallas_calls

    cases = {**OVERHANGING, **WHOLE_BLOCKS}
    jobs = []
    for case in case_names:
        fn, args = cases[case]()
        modules = []
        original = triton_lowering.lower_jaxpr_to_triton_module
        triton_lowering.lower_jaxpr_to_triton_module = lambda *a, **k: modules.append(original(*a, **k)) or modules[-1]
        try:
            with abstract_gpu_mesh():
                traced = jax.jit(fn).trace(*args.values())
                traced.lower(lowering_platforms=("cuda",))
        finally:
            triton_lowering.lower_jaxpr_to_triton_module = original
        for i, (eqn, result) in enumerate(zip(pallas_calls(traced.jaxpr.jaxpr), modules)):
            params = eqn.params["compiler_params"]
            params = params.get("triton", params) if isinstance(params, dict) else params
            path = workdir / f"{case}.{i}.ttir"
            path.write_text(str(result.module))
            jobs.append(dict(case=case, kernel=eqn.params.get("name", "?"), path=str(path),
                             num_warps=getattr(params, "num_warps", None) or 4,
                             num_stages=getattr(params, "num_stages", None) or 1))  # fmt: skip
    return jobs


def main() -> None:
    from test_triton_masks import OVERHANGING, WHOLE_BLOCKS

    known = sorted({**OVERHANGING, **WHOLE_BLOCKS})
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--triton-python", required=True, help="a Python interpreter with the upstream triton package")
    p.add_argument("--cases", default="", help=f"substrings of case names (default: all of {known})")
    p.add_argument("--workdir", type=Path, default=None, help="where the IR files go (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per kernel (ptxas takes minutes on some)")
    args = p.parse_args()
    wanted = [w for w in args.cases.split(",") if w]
    names = [c for c in known if not wanted or any(w in c for w in wanted)]
    if not names:
        p.error(f"--cases {args.cases!r} matches none of {known}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4-ttir-"))
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = lowered_kernels(names, workdir)
    print(f"{'case':>20} {'kernel':>22} {'warps':>5} {'stages':>6} {'result':>7} {'regs':>5} {'local B':>7} "
          f"{'stack B':>7} {'smem B':>7}")  # fmt: skip
    results = []
    for job in jobs:
        try:
            run = subprocess.run([args.triton_python, "-c", COMPILER, json.dumps(job)], capture_output=True, text=True,
                                 timeout=args.timeout)  # fmt: skip
            ok = run.returncode == 0
            usage = json.loads(run.stdout.strip().splitlines()[-1]) if ok else {}
            result = dict(job, ok=ok, **usage, error=None if ok else run.stderr.strip()[-1500:])
        except subprocess.TimeoutExpired:
            result = dict(job, ok=False, error=f"no cubin within {args.timeout} s (ptxas)", timeout=True)
        results.append(result)
        status = "ok" if result["ok"] else ("timeout" if result.get("timeout") else "FAIL")
        print(f"{job['case']:>20} {job['kernel'][:22]:>22} {job['num_warps']:>5} {job['num_stages']:>6} {status:>7} "
              f"{result.get('reg', '-')!s:>5} {result.get('local', '-')!s:>7} {result.get('stack', '-')!s:>7} "
              f"{result.get('shared', '-')!s:>7}", flush=True)  # fmt: skip
    for r in results:
        if r["error"]:
            print(f"\n{r['case']} / {r['kernel']}: {r['error']}")
    print(f"\nIR files: {workdir}")
    if not all(r["ok"] or r.get("timeout") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
