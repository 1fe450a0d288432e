"""Which instruction-set levels kvflow's native CPU kernels are built for, which of them this
CPU runs (its CPUID features, as Linux reports them in ``/proc/cpuinfo``) and which one
``$KVFLOW_CPU_ISA`` forces.

Pure description and detection, no compiling (that is :mod:`kvflow.kernels.cpu_build`): it
sits with the configuration so that ``DeviceConfig`` can refuse a bad ``KVFLOW_CPU_ISA``
before anything loads.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IsaLevel:
    """One build of the kernels: its name, the compiler flags that enable its instruction
    sets, and the CPU features (``/proc/cpuinfo`` flag names) a CPU needs to run it.

    Every x86 level names its ``-march``, the baseline too (``-march=x86-64``: SSE2), so the
    compiler's default target never adds to it: a GCC configured for x86-64-v2 or -v3 (as some
    distributions ship it) built the baseline with SSE4.2 or AVX2, a library that dies with
    SIGILL on the CPUs the baseline is there for."""

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
    IsaLevel("x86-64", ("-march=x86-64",), frozenset()),
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
