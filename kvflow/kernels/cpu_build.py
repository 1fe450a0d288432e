"""Compiling kvflow's native CPU kernels and caching the shared library.

The C sources under ``kernels/csrc/`` are compiled with the system C compiler and
``-O3 -march=native -fopenmp`` into one shared library, cached under
the cache directory the caller passes (``kvflow.config.cache_dir()``) ``/kernels`` and named by a hash of the sources,
the flags, the compiler's version and the CPU's model/flags, so a rebuild happens only when one
of them changes. Each build records the library's SHA-256 beside it; :func:`intact` checks it
before the library is handed to the dynamic loader (a truncated library can kill the process
with SIGBUS inside ``dlopen``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

SOURCES = ("cpu_attention.c", "cpu_attention_kvq.c", "cpu_elementwise.c", "cpu_gemm.c",
           "cpu_gguf.c", "cpu_threads.c")
HEADERS = ("cpu_common.h",)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared",
         "-fPIC", "-std=gnu11")


def cpu_fingerprint() -> str:
    """The CPU's model name and feature flags (``-march=native`` code depends on both)."""
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


def build(cc: str, sources: list[Path], target: Path) -> None:
    """Compile to a temporary file beside ``target``, record its SHA-256 beside it, and rename
    both into place (digest first, so a reader never trusts a library without its digest).

    Raises:
        RuntimeError: when the compiler fails or writes no library (its stderr tail included).
        OSError: when the cache folder or files cannot be written, or ``cc`` cannot be run.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_lib = Path(tmp) / target.name
        cmd = [cc, *FLAGS, "-o", str(tmp_lib), *map(str, sources), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not tmp_lib.is_file():
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        tmp_digest = digest_path(tmp_lib)
        tmp_digest.write_text(hashlib.sha256(tmp_lib.read_bytes()).hexdigest() + "\n")
        os.replace(tmp_digest, digest_path(target))
        os.replace(tmp_lib, target)


def library_path(cc: str, sources: list[Path], cache_dir: str) -> Path:
    """The cached library for these sources under ``cc`` on this CPU, in ``cache_dir``/kernels
    (it may not exist yet)."""
    digest = hashlib.sha256()
    headers = [sources[0].parent / name for name in HEADERS]
    for part in [*(s.read_bytes() for s in sources + headers), " ".join(FLAGS).encode(),
                 _compiler_version(cc).encode(), cpu_fingerprint().encode()]:
        digest.update(part)
    return Path(cache_dir) / "kernels" / f"kvflow_cpu_{digest.hexdigest()[:16]}.so"
