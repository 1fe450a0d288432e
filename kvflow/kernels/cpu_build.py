"""Compiling kvflow's native CPU kernels, one shared library per instruction-set level, and
caching them.

The C sources under ``kernels/csrc/`` are compiled with the system C compiler into one shared
library per ISA level of :data:`ISA_LEVELS` (x86-64: AVX512 with AMX bf16 tiles, AVX512 with
bf16 dot products, AVX512, AVX2 + FMA, and the x86-64 baseline; other machines: the
compiler's baseline). Each level's flags name the instruction sets it may use
(``-march=x86-64-v4 -mavx512bf16``, ...), never ``-march=native``: a library depends only on
the sources, the flags and the compiler, so one cache directory serves every CPU that shares
it, and :func:`isa_levels_for_cpu` picks, at run time, the best level the CPU's features
(CPUID, as Linux reports them in ``/proc/cpuinfo``) allow. Only the levels a process loads are built (about a second each).

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
from dataclasses import dataclass
from pathlib import Path

SOURCES = ("cpu_argmax.c", "cpu_attention.c", "cpu_attention_kvq.c", "cpu_elementwise.c",
           "cpu_gemm.c", "cpu_gguf.c", "cpu_pool.c", "cpu_quant_gemm.c", "cpu_threads.c")
HEADERS = ("cpu_common.h", "cpu_attention_tiled.h", "cpu_attention_dp.h",
           "cpu_attention_decode.h", "cpu_attention_decode_bf16.h", "cpu_pool.h",
           "cpu_gemm_amx.h", "cpu_elementwise_avx512.h")
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=gnu11", "-Wno-psabi")


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: its name, the compiler flags that enable its instruction
    sets, and the CPU features (``/proc/cpuinfo`` flag names) a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    cpu_features: frozenset[str]


_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma",
                     "f16c"})
X86_LEVELS = (
    IsaLevel("amx_bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
             _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
    IsaLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16"), _AVX512 | {"avx512_bf16"}),
    IsaLevel("avx512", ("-march=x86-64-v4",), _AVX512),
    IsaLevel("avx2", ("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    IsaLevel("x86-64", (), frozenset()),
)
GENERIC_LEVELS = (IsaLevel("generic", (), frozenset()),)


def isa_levels() -> tuple[IsaLevel, ...]:
    """The ISA levels built for this machine's architecture, best first."""
    return X86_LEVELS if platform.machine().lower() in ("x86_64", "amd64") else GENERIC_LEVELS


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def isa_levels_for_cpu(features: frozenset[str] | None = None) -> list[IsaLevel]:
    """The levels this CPU can run, best first (the last one needs nothing)."""
    features = cpu_features() if features is None else features
    return [level for level in isa_levels() if level.cpu_features <= features]


def forced_isa_level() -> str | None:
    """The level ``$KVFLOW_CPU_ISA`` forces (None: unset or empty, the best this CPU runs).

    Raises:
        ValueError: for a name that is not a level, or a level this CPU cannot run, naming
            the levels it can.
    """
    forced = os.environ.get("KVFLOW_CPU_ISA")
    if not forced:
        return None
    runnable = [level.name for level in isa_levels_for_cpu()]
    if forced not in runnable:
        known = forced in [level.name for level in isa_levels()]
        why = "is a level this CPU cannot run" if known else "is invalid"
        raise ValueError(f"KVFLOW_CPU_ISA={forced!r} {why}; choose one of {runnable} (or "
                         "leave it unset for the best)")
    return forced


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
    without its digest).

    Raises:
        RuntimeError: when the compiler fails (its last 2,000 characters of stderr quoted).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_lib = Path(tmp) / target.name
        cmd = [cc, *FLAGS, *level.flags, "-o", str(tmp_lib), *map(str, sources), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not tmp_lib.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        tmp_digest = digest_path(tmp_lib)
        tmp_digest.write_text(hashlib.sha256(tmp_lib.read_bytes()).hexdigest() + "\n")
        os.replace(tmp_digest, digest_path(target))
        os.replace(tmp_lib, target)


def library_path(cc: str, sources: list[Path], cache_dir: str, level: IsaLevel) -> Path:
    """The cached library of ``level`` for these sources under ``cc``, in ``cache_dir``/kernels
    (it may not exist yet). The name depends on the sources, flags and compiler only."""
    digest = hashlib.sha256()
    headers = [sources[0].parent / name for name in HEADERS]
    for part in [*(s.read_bytes() for s in sources + headers),
                 " ".join(FLAGS + level.flags).encode(), _compiler_version(cc).encode()]:
        digest.update(part)
    return Path(cache_dir) / "kernels" / f"kvflow_cpu_{level.name}_{digest.hexdigest()[:16]}.so"
