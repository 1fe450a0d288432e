"""The native CPU kernels of another kvflow source tree, for before/after figures in one run.

    from tree_kernels import tree_kernels
    before = tree_kernels("/work/wt/baseline")   # NativeCpuKernels bound to that tree's C code

Builds every ``kvflow/kernels/csrc/*.c`` of ``tree`` at the ISA level this tree's kernels use
(same compiler and flags, ``kvflow.kernels.cpu_build``) into a temporary directory and binds it
with this tree's Python wrappers, so the two libraries differ only in their C sources. The
entry points the wrappers bind must exist in both (true for the attention and elementwise
kernels since the AMX session).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from kvflow.kernels import cpu_build, cpu_native


def tree_kernels(tree: str) -> cpu_native.NativeCpuKernels:
    """``tree``'s C kernels at this process's ISA level, bound to this tree's wrappers.

    Raises:
        RuntimeError: when the kernels of this tree are unavailable or the build fails.
    """
    current = cpu_native.native_cpu_kernels()
    cc = cpu_native._compiler()
    if current is None or cc is None:
        raise RuntimeError("native CPU kernels unavailable")
    level = next(lv for lv in cpu_build.isa_levels_for_cpu() if lv.name == current.isa)
    sources = sorted((Path(tree) / "kvflow" / "kernels" / "csrc").glob("*.c"))
    out = Path(tempfile.mkdtemp(prefix="kvflow_tree_kernels_"))
    atexit.register(shutil.rmtree, out, True)
    target = out / f"kvflow_cpu_{level.name}_tree.so"
    cpu_build.build(cc, sources, target, level)
    return cpu_native._open(target, level.name)


def kernels_and_baseline(baseline_tree: str | None
                         ) -> tuple[cpu_native.NativeCpuKernels,
                                    cpu_native.NativeCpuKernels | None]:
    """This tree's native CPU kernels and, when ``baseline_tree`` is given, that tree's
    (:func:`tree_kernels`); exits (``SystemExit``) when this tree's are unavailable."""
    kernels = cpu_native.native_cpu_kernels()
    if kernels is None:
        raise SystemExit("native CPU kernels unavailable")
    return kernels, tree_kernels(baseline_tree) if baseline_tree else None
