"""Wall time of one fresh build of kvflow's native CPU library: the sources compiled in one
serial compiler call (the build before 26134cd) against ``cpu_build.build`` (one compiler
process per CPU, then a link), alternated, medians and their ratio.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/native_build_time.py [--rounds 3] [--level avx2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from kvflow.kernels import cpu_build, cpu_native


def _serial(cc: str, sources: list[Path], target: Path, level: cpu_build.IsaLevel) -> None:
    cmd = [cc, *cpu_build.FLAGS, *level.flags, "-o", str(target), *map(str, sources), "-lm"]
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--level", default=None, help="ISA level (default: the CPU's best)")
    args = parser.parse_args()
    cc = cpu_native._compiler()
    if cc is None:
        parser.error("no C compiler (cc/gcc) found")
    levels = cpu_build.isa_levels_for_cpu()
    level = next((lv for lv in levels if lv.name == args.level), None) if args.level else levels[0]
    if level is None:
        parser.error(f"--level {args.level}: this CPU runs {[lv.name for lv in levels]}")
    sources = [Path(cpu_native.__file__).parent / "csrc" / s for s in cpu_build.SOURCES]
    times: dict[str, list[float]] = {"serial": [], "parallel": []}
    builders = {"serial": _serial, "parallel": cpu_build.build}
    for _ in range(args.rounds):
        for name, build in builders.items():
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                build(cc, sources, Path(folder) / "lib.so", level)
                times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name:8s} level {level.name}: " + " ".join(f"{v:.1f}" for v in values)
              + f" s, median {statistics.median(values):.1f} s")
    ratio = statistics.median(times["serial"]) / statistics.median(times["parallel"])
    print(f"serial / parallel: {ratio:.2f}")


if __name__ == "__main__":
    main()
