"""``--dtype auto`` / ``--cpu-gemm auto``: what a first start (no timings cached) spends timing
GEMM kernels, and what it chooses.

Each run is a fresh process with a fresh ``KVFLOW_CACHE_DIR`` (holding only a link to the
compiled kernels of ``~/.cache/kvflow/kernels``, so nothing is rebuilt and no GEMM timing is
cached) that starts ``LLM(MODEL, dtype=..., cpu_gemm="auto")`` with ``PYTHONPATH`` at one of
``--trees`` (its working directory too). The child wraps ``gemm_timing.time_candidates`` and
``time_dtypes`` where the tree has it (every GEMM timing goes through one of them, neither
through the other) with ``time.process_time`` and ``time.perf_counter``, and
``cpu_setup.choose`` (each GEMM module's kernel) to list the kernel of each shape class;
it prints one JSON line: the timing's CPU and wall seconds, the engine's dtype and the
kernels. Runs alternate the trees (their order flips each round, as a shared machine drifts);
medians per (tree, dtype) at the end, with the CPU model and load average.
``--assume-bf16-units`` makes a tree that reads the CPU's flags for bf16 units
(``platforms/cpu.py: cpu_features``) see AVX512-BF16, so ``--dtype auto`` times bf16 against
fp32 as on a CPU with bf16 units (on a CPU without them oneDNN's bf16 is emulated: its times
are not such a CPU's, the timing's cost roughly is).

    PYTHONPATH=. .venv/bin/python benchmarks/dtype_auto_startup.py out/smollm2-hf \\
        --trees /tmp/base . --dtypes auto,bfloat16,float32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from kvflow.kernels import gemm_timing
from kvflow.core import engine_startup
from kvflow.worker import cpu_setup

spent = {"cpu": 0.0, "wall": 0.0}
def counted(timed):
    def timing(*args, **kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return timed(*args, **kwargs)
        finally:
            spent["cpu"] += time.process_time() - cpu
            spent["wall"] += time.perf_counter() - wall
    return timing
gemm_timing.time_candidates = counted(gemm_timing.time_candidates)
if hasattr(gemm_timing, "time_dtypes"):  # dtypes of a shape timed together (session 53)
    gemm_timing.time_dtypes = counted(gemm_timing.time_dtypes)

kernels = {}
chose = cpu_setup.choose
def choose(shape, *args, **kwargs):
    kernel = chose(shape, *args, **kwargs)
    kernels[f"{shape.n}x{shape.k}"] = str(kernel)
    return kernel
cpu_setup.choose = choose

engine = {}
resolved = engine_startup.resolve_dtype
def resolve_dtype(*args, **kwargs):
    engine["dtype"] = resolved(*args, **kwargs)
    return engine["dtype"]
engine_startup.resolve_dtype = resolve_dtype

if sys.argv[3] == "1":  # --assume-bf16-units: the CPU flags claim AVX512-BF16
    from kvflow.platforms import cpu
    if hasattr(cpu, "cpu_features"):
        flags = cpu.cpu_features()
        cpu.cpu_features = lambda: flags | {"avx512_bf16"}

from kvflow import LLM
llm = LLM(sys.argv[1], dtype=sys.argv[2], cpu_gemm="auto", kv_cache_memory="64MiB")
print(json.dumps({"timing_cpu_s": round(spent["cpu"], 3), "timing_wall_s": round(spent["wall"], 3),
                  "engine_dtype": str(engine["dtype"]).removeprefix("torch."),
                  "kernels": kernels}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--trees", nargs="+", default=["."], help="kvflow source trees")
    p.add_argument("--dtypes", default="auto,bfloat16,float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--assume-bf16-units", action="store_true",
                   help="the child's CPU flags claim avx512_bf16 (where the tree reads them), "
                        "so --dtype auto times bf16 against fp32 as on a CPU with bf16 units")
    return p.parse_args(argv)


def fresh_cache_dir() -> str:
    """A temporary cache dir holding only a link to the compiled kernels."""
    path = tempfile.mkdtemp(prefix="kvflow-first-start-")
    kernels = Path(os.path.expanduser("~/.cache/kvflow/kernels"))
    if kernels.is_dir():
        os.symlink(kernels, os.path.join(path, "kernels"))
    return path


def run_once(tree: str, model: str, dtype: str, assume_bf16: bool = False) -> dict:
    """One first start in a fresh process; its JSON line, with the load average at its start."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "KVFLOW_CACHE_DIR": fresh_cache_dir()}
    load = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(model), dtype,
                          "1" if assume_bf16 else "0"],
                         cwd=tree, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{tree} {dtype}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return {"tree": tree, "dtype": dtype, "load": round(load, 1),
            **json.loads(out.stdout.strip().splitlines()[-1])}


def cpu_model() -> str:
    """The CPU's model name and whether it has bf16 / AMX units (from /proc/cpuinfo)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    units = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags]
    return f"{name} ({', '.join(units) or 'no avx512'})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs", flush=True)
    results = []
    for rnd in range(args.rounds):
        trees = args.trees if rnd % 2 == 0 else args.trees[::-1]
        for dtype in args.dtypes.split(","):
            for tree in trees:
                row = run_once(tree, args.model_dir, dtype, args.assume_bf16_units)
                results.append(row)
                print(json.dumps(row), flush=True)
    print("\nmedians (tree, --dtype): timing CPU s, wall s; engine dtype and kernels per run")
    for dtype in args.dtypes.split(","):
        for tree in args.trees:
            rows = [r for r in results if r["tree"] == tree and r["dtype"] == dtype]
            cpu = statistics.median(r["timing_cpu_s"] for r in rows)
            wall = statistics.median(r["timing_wall_s"] for r in rows)
            picks = sorted({json.dumps([r["engine_dtype"], r["kernels"]]) for r in rows})
            print(f"{tree} {dtype}: {cpu:.2f} CPU s, {wall:.2f} wall s "
                  f"(loads {[r['load'] for r in rows]}); choices: {'; '.join(picks)}")


if __name__ == "__main__":
    main()
