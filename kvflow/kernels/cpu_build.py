"""Compiling kvflow's native CPU kernels, one shared library per instruction-set level, and
caching them.

The C sources under ``kernels/csrc/`` are compiled with the system C compiler into one shared
library per ISA level of :data:`ISA_LEVELS` (x86-64: AVX512 with AMX bf16 tiles, AVX512 with
bf16 dot products, AVX512, AVX2 + FMA, and the x86-64 baseline; other machines: the
compiler's baseline). Each level's flags name the instruction sets it may use
(``-march=x86-64-v4 -mavx512bf16``, ..., ``-march=x86-64`` for the baseline, whatever target
the compiler defaults to), never ``-march=native``: a library depends only on
the sources, the flags and the compiler, so one cache directory serves every CPU that shares
it, and :func:`isa_levels_for_cpu` picks, at run time, the best level the CPU's features
(CPUID, as Linux reports them in ``/proc/cpuinfo``) allow. Only the levels a process loads are built (each
~10 s of CPU on a Zen 4 EPYC, its sources compiled side by side).

Libraries are cached under the cache directory the caller passes
(``kvflow.config.cache_dir()``) ``/kernels``, named by a hash of the sources, the flags and the
compiler's version. Each build records the library's SHA-256 beside it; :func:`intact` checks
it before the library is handed to the dynamic loader (a truncated library can kill the process
with SIGBUS inside ``dlopen``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvflow.config.cpu_isa import (  # noqa: F401  (re-exported for the kernel loaders)
    GENERIC_LEVELS,
    X86_LEVELS,
    IsaLevel,
    cpu_features,
    forced_isa_level,
    isa_levels,
    isa_levels_for_cpu,
)

SOURCES = ("cpu_argmax.c", "cpu_attention.c", "cpu_attention_kvq.c", "cpu_elementwise.c",
           "cpu_gelu.c", "cpu_gemm.c", "cpu_gguf.c", "cpu_lora.c", "cpu_pool.c",
           "cpu_quant_embed.c", "cpu_quant_gemm.c", "cpu_replay.c", "cpu_threads.c")
HEADERS = ("cpu_common.h", "cpu_attention_tiled.h", "cpu_attention_dp.h",
           "cpu_attention_decode.h", "cpu_attention_decode_bf16.h", "cpu_pool.h",
           "cpu_gemm_amx.h", "cpu_elementwise_avx512.h", "cpu_entry_points.h")
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=gnu11", "-Wno-psabi")


def cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (what kernel timings depend on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cc: str) -> str:
    result = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True)
    return result.stdout


def digest_path(lib: Path) -> Path:
    """Where the SHA-256 of ``lib`` is recorded (``<lib>.sha256``)."""
    return lib.with_name(lib.name + ".sha256")


def intact(lib: Path) -> bool:
    """True when ``lib`` exists and matches the SHA-256 recorded beside it at build time: a
    truncated or foreign file is rebuilt instead of handed to the dynamic loader (which can
    die with SIGBUS on a truncated library)."""
    try:
        recorded = digest_path(lib).read_text().strip()
        return hashlib.sha256(lib.read_bytes()).hexdigest() == recorded
    except OSError:
        return False


def build(cc: str, sources: list[Path], target: Path, level: IsaLevel) -> None:
    """Compile ``level``'s library to a temporary file beside ``target``, record its SHA-256
    beside it, and rename both into place (digest first, so a reader never trusts a library
    without its digest). The sources compile side by side, one compiler process per CPU this
    process may run on (:func:`_compile_objects`), then link.

    Raises:
        RuntimeError: when the compiler fails (its last 2,000 characters of stderr quoted).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = _compile_objects(cc, sources, Path(tmp), level)
        tmp_lib = Path(tmp) / target.name
        link = [cc, "-shared", "-fopenmp", *level.flags, "-o", str(tmp_lib), *objects, "-lm"]
        _run(link)
        if not tmp_lib.is_file():
            raise RuntimeError(f"{' '.join(link)} wrote no library")
        tmp_digest = digest_path(tmp_lib)
        tmp_digest.write_text(hashlib.sha256(tmp_lib.read_bytes()).hexdigest() + "\n")
        os.replace(tmp_digest, digest_path(target))
        os.replace(tmp_lib, target)


def _compile_objects(cc: str, sources: list[Path], folder: Path, level: IsaLevel) -> list[str]:
    """Compile each source to an object file in ``folder``, as many at once as this process
    has CPUs (a first build on 2 Zen 4 cores: 6.1 s instead of 10.0 s serially,
    benchmarks/native_build_time.py); returns their paths.

    Raises:
        RuntimeError: when a compile fails (the first failure's command and stderr).
    """
    flags = [flag for flag in FLAGS if flag != "-shared"]
    commands = [[cc, *flags, *level.flags, "-c", "-o", str(folder / f"{src.stem}.o"), str(src)]
                for src in sources]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(max(1, min(len(commands), cpus or 1))) as pool:
        list(pool.map(_run, commands))
    return [cmd[cmd.index("-o") + 1] for cmd in commands]


def _run(cmd: list[str]) -> None:
    """Run one compiler command.

    Raises:
        RuntimeError: when it exits non-zero (its last 2,000 characters of stderr quoted).
    """
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")


def library_path(cc: str, sources: list[Path], cache_dir: str, level: IsaLevel) -> Path:
    """The cached library of ``level`` for these sources under ``cc``, in ``cache_dir``/kernels
    (it may not exist yet). The name depends on the sources, flags and compiler only."""
    digest = hashlib.sha256()
    headers = [sources[0].parent / name for name in HEADERS]
    for part in [*(s.read_bytes() for s in sources + headers),
                 " ".join(FLAGS + level.flags).encode(), _compiler_version(cc).encode()]:
        digest.update(part)
    return Path(cache_dir) / "kernels" / f"kvflow_cpu_{level.name}_{digest.hexdigest()[:16]}.so"
