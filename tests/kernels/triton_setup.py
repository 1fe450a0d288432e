"""Triton's interpreter for the kernel tests on a machine without CUDA: ``TRITON_INTERPRET``
(read when triton is first imported) and a numpy 2.4 fix. Applied by conftest.py at import and
by the worker process that runs the engine tests' runs ahead (engine_runs.py)."""

from __future__ import annotations

import os

import torch


def use_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` unless CUDA is visible (or it is set already), and patch
    the interpreter when it is on."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_interpreter_for_numpy_2_4()


def _patch_interpreter_for_numpy_2_4() -> None:
    """Work around triton-lang/triton#9171 (triton <= 3.6 interpreter + numpy >= 2.4).

    The interpreter stores scalars as 1-element arrays and converts them with
    ``int(array)``, which numpy 2.4 rejects, so ``range(runtime_scalar)`` inside a kernel
    fails.  Re-register ``__index__`` with an explicit ``.item()`` (the upstream fix).
    """
    try:
        import triton.runtime.interpreter as interp
    except ImportError:  # no triton: the test modules skip themselves
        return
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvflow_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._kvflow_patched = True
    interp._patch_lang_tensor = patched

