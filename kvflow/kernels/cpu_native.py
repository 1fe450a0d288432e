"""Native CPU kernels: C sources under ``kernels/csrc/``, compiled on first use, called via ctypes.

The C code is plain C11 + OpenMP (no torch headers), so it builds in about a second with the
system C compiler (``$CC``, else ``cc``); building and caching one library per instruction-set
level is :mod:`kvflow.kernels.cpu_build`'s job. :func:`native_cpu_kernels` loads the best level
this CPU runs (AMX bf16 tiles, AVX512 with bf16 dot products, AVX512, AVX2, baseline;
``KVFLOW_CPU_ISA=avx2`` etc. picks a lower one, for tests and comparisons). ``-fopenmp`` links ``libgomp.so.1``; torch's
CPU build has already loaded a library of that name, so the kernels run on torch's OpenMP
runtime and thread count instead of a second pool competing for the cores.

Where no compiler is available or every build fails, :func:`native_cpu_kernels` returns None
(the reason is logged once) and callers fall back to the plain-torch kernels.

This module loads the library and picks the ISA level; the wrappers live by job in
:mod:`~kvflow.kernels.cpu_native_attention` (paged attention, K/V store),
:mod:`~kvflow.kernels.cpu_native_elementwise` (RMSNorm, SiLU-and-mul, GELU, rotary) and
:mod:`~kvflow.kernels.cpu_native_gemm` (packed and GGUF GEMMs) and
:mod:`~kvflow.kernels.cpu_native_lora` (the batched multi-LoRA matmul), with the shared dtype codes and
checks in :mod:`~kvflow.kernels.cpu_native_common`; :class:`NativeCpuKernels` joins them.
"""

from __future__ import annotations

import _ctypes
import atexit
import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvflow.config import cache_dir, native_cpu_choice
from kvflow.kernels import cpu_build
from kvflow.kernels.cpu_native_attention import AttentionKernels
from kvflow.kernels.cpu_native_common import DTYPE_CODES, bind, c_int, gemm_out_code, ptr
from kvflow.kernels.cpu_native_elementwise import ElementwiseKernels
from kvflow.kernels.cpu_native_gemm import GemmKernels
from kvflow.kernels.cpu_native_lora import LoRAKernels
from kvflow.kernels.cpu_native_replay import CallReplayer

__all__ = ["NativeCpuKernels", "gemm_out_code", "native_cpu_kernels",
           "native_cpu_kernels_for_isa", "native_kernels_for"]

logger = logging.getLogger(__name__)


class NativeCpuKernels(AttentionKernels, ElementwiseKernels, GemmKernels, LoRAKernels):
    """The compiled library's entry points, with argument checks done in Python.

    Raises:
        AttributeError: (construction) when the library lacks one of kvflow's entry points.
    """

    def __init__(self, lib: ctypes.CDLL, isa: str = "native") -> None:
        self.lib = lib  # entry points bound elsewhere (kernels/cpu_attention_kvq.py)
        self.isa = isa  # the instruction-set level the library was built for
        self.pool = None  # a kernels.cpu_pool.CpuPool that shares gemm's work, when set
        self._bind_attention(lib)
        self._bind_elementwise(lib)
        self._bind_gemm(lib)
        self._bind_lora(lib)
        self._bind_threads = bind(lib, "kvflow_bind_threads", c_int, [ptr, c_int])
        self.replayer = CallReplayer(lib)  # runs step graphs' calls from C (cpu_replay.c)

    def bind_threads(self, cpus: list[int | None]) -> bool:
        """Pin the OpenMP threads of the calling thread's parallel regions, thread i to
        ``cpus[i]`` (``len(cpus)`` threads; the caller is thread 0; None leaves that thread's
        mask as it is). Call it from the thread that runs the model, after
        ``torch.set_num_threads(len(cpus))``. Returns False when a thread could not be pinned
        (a CPU outside the affinity mask or the machine)."""
        ids = torch.tensor([-1 if cpu is None else cpu for cpu in cpus], dtype=torch.int32)
        return self._bind_threads(ids.data_ptr(), len(cpus)) == 0


def _open(lib_path: Path, isa: str) -> NativeCpuKernels:
    """dlopen ``lib_path`` and bind the entry points; a library without them is closed again,
    or the loader would hand back that same library for the path after a rebuild."""
    lib = ctypes.CDLL(str(lib_path))
    try:
        return NativeCpuKernels(lib, isa)
    except AttributeError:
        dlclose = getattr(_ctypes, "dlclose", None)
        if dlclose is not None:
            dlclose(lib._handle)
        raise


def _load(cc: str, sources: list[Path], level: cpu_build.IsaLevel) -> NativeCpuKernels:
    """The kernels of ISA ``level``, building its library when missing or not intact, and
    rebuilding once when a cached library fails to load (a foreign file, missing symbols)."""
    target = cpu_build.library_path(cc, sources, cache_dir(), level)
    built = not cpu_build.intact(target)
    if built:
        target = _writable_target(target)
        cpu_build.build(cc, sources, target, level)
    try:
        return _open(target, level.name)
    except (OSError, AttributeError) as exc:
        if built:
            raise
        logger.warning("cached native CPU kernels %s do not load (%s); rebuilding", target, exc)
    cpu_build.build(cc, sources, target, level)
    return _open(target, level.name)


def _writable_target(target: Path) -> Path:
    """``target`` when its folder (the kernel cache) can be created and written to, else the
    same name in a temporary folder of this process, with a warning: an unwritable
    ``KVFLOW_CACHE_DIR`` or home (a read-only container) then costs a compile per start, not
    the native kernels (the build used to fail there and torch's kernels ran instead, under a
    warning that blamed the compiler)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent):
            return target
    except OSError as exc:
        folder = _process_kernel_dir()
        logger.warning("cannot write the kernel cache %s (%s): building kvflow's native CPU "
                       "kernels in %s for this process only, so each start compiles them "
                       "again; point KVFLOW_CACHE_DIR at a writable folder to keep them",
                       target.parent, exc, folder)
        return folder / target.name


@functools.cache
def _process_kernel_dir() -> Path:
    """A temporary folder for kernels built by this process, removed at its exit."""
    folder = Path(tempfile.mkdtemp(prefix="kvflow-kernels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def native_kernels_for(x: torch.Tensor) -> NativeCpuKernels | None:
    """The native kernels when ``x`` is a CPU tensor of a dtype they handle and they could be
    built, else None (the caller runs its torch code)."""
    if not x.is_cpu or x.dtype not in DTYPE_CODES:
        return None
    return native_cpu_kernels()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def native_cpu_kernels_for_isa(name: str) -> NativeCpuKernels | None:
    """The kernels built for ISA level ``name`` (:data:`kvflow.kernels.cpu_build.X86_LEVELS`),
    or None when this CPU cannot run it, no compiler is found or the build fails (for tests and
    comparisons; the engine uses :func:`native_cpu_kernels`)."""
    cc = _compiler()
    level = next((lv for lv in cpu_build.isa_levels_for_cpu() if lv.name == name), None)
    if cc is None or level is None:
        return None
    sources = [Path(__file__).parent / "csrc" / src for src in cpu_build.SOURCES]
    try:
        return _load(cc, sources, level)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels for %s unavailable: %s", name, exc)
        return None


class _Build:
    """The outcome of building (or loading) the kernels once: ``kernels``, or None with the
    ``failure`` to warn about (None too when ``KVFLOW_NATIVE_CPU=0`` turned them off), and
    whether that warning was logged yet."""

    def __init__(self, kernels: NativeCpuKernels | None, failure: str | None = None) -> None:
        self.kernels, self.failure, self.warned = kernels, failure, False


@functools.cache
def _build() -> _Build:
    """Build or load the kernels of the best ISA level this CPU runs, once per process (a
    level whose build fails falls back to the next, each failure logged).

    Raises:
        ValueError: for a ``KVFLOW_CPU_ISA`` this CPU cannot run.
    """
    if not native_cpu_choice():
        return _Build(None)
    cc = _compiler()
    if cc is None:
        return _Build(None, "no C compiler ($CC, cc or gcc) found: kvflow's native CPU "
                            "kernels cannot be built")
    levels = cpu_build.isa_levels_for_cpu()
    forced = cpu_build.forced_isa_level()
    if forced is not None:
        levels = [lv for lv in levels if lv.name == forced]
    sources = [Path(__file__).parent / "csrc" / name for name in cpu_build.SOURCES]
    for level in levels:
        try:
            return _Build(_load(cc, sources, level))
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            logger.warning("native CPU kernels for %s unavailable: %s", level.name, exc)
    return _Build(None, f"kvflow's native CPU kernels did not build with {cc} (for "
                        f"{', '.join(lv.name for lv in levels)})")


def native_cpu_kernels(asked_by: tuple[str, ...] = ()) -> NativeCpuKernels | None:
    """The compiled kernels of the best ISA level this CPU runs, building them on first use
    (a level whose build fails falls back to the next); None if unavailable, with one warning
    per process that names the compiler, the levels tried, the settings that asked for the
    kernels and how to run without them (README: the documented fallback to torch's kernels).

    ``KVFLOW_NATIVE_CPU=0`` disables them (the torch kernels are used instead);
    ``KVFLOW_CPU_ISA=<level>`` (amx_bf16, avx512_bf16, avx512, avx2, x86-64) asks for a lower level
    than the best, e.g. to test the AVX2 path on an AVX512 machine. ``cache_clear()`` forgets
    the outcome (tests re-read those variables).

    Args:
        asked_by: engine options the user gave that need the kernels, as given (e.g.
            ``("--cpu-gemm native",)``, :meth:`kvflow.config.DeviceConfig.native_kernel_flags`),
            named in the warning beside the environment settings. The engine's first calls
            pass them; the warning is logged by whichever call first finds the kernels missing.

    Raises:
        ValueError: for a ``KVFLOW_CPU_ISA`` this CPU cannot run (checked by ``DeviceConfig``
            first, before a model loads).
    """
    build = _build()
    if build.failure is not None and not build.warned:
        build.warned = True
        logger.warning("%s, torch's kernels are used instead; %s", build.failure,
                       _asked_by(asked_by))
    return build.kernels


native_cpu_kernels.cache_clear = _build.cache_clear  # type: ignore[attr-defined]


# Settings that need the native kernels, by variable: the values that ask for them.
_NEED_NATIVE = (("KVFLOW_CPU_GEMM", ("native",)), ("KVFLOW_CPU_ATTENTION", ("native",)),
                ("KVFLOW_CPU_GEMM_POOL", ("1",)))


def _asked_by(flags: tuple[str, ...] = ()) -> str:
    """For the warning when the native kernels cannot be built: the settings that asked for
    them (engine options ``flags`` as given, ``KVFLOW_NATIVE_CPU``, set or by default, a
    forced ``KVFLOW_CPU_ISA`` level, and the kernel choices that need them) and how to run
    without them."""
    native = os.environ.get("KVFLOW_NATIVE_CPU")
    asked = [*flags, f"KVFLOW_NATIVE_CPU={native}" if native is not None else
             "KVFLOW_NATIVE_CPU unset (on by default)"]
    forced = cpu_build.forced_isa_level()
    need = ([f"KVFLOW_CPU_ISA={forced}"] if forced is not None else []) + \
        [f"{name}={os.environ[name]}" for name, on in _NEED_NATIVE if os.environ.get(name) in on]
    asked += need
    off = "set KVFLOW_NATIVE_CPU=0 to use torch's kernels without trying to build them"
    if need or flags:  # KVFLOW_NATIVE_CPU=0 refuses each of these
        names = [n.split("=")[0] for n in need]
        parts = ([f"drop {', '.join(flags)}"] if flags else []) + \
            ([f"unset {', '.join(names)}"] if names else [])
        one = len(names) + len(flags) == 1
        off += f" (and {' and '.join(parts)}, which need{'s' if one else ''} them)"
    if forced is not None:
        off += ", or unset KVFLOW_CPU_ISA to let kvflow try the other levels"
    return f"asked for by {', '.join(asked)}: {off}"
