"""Compile Triton kernels for an NVIDIA GPU without one: Triton's own compiler (its bundled
LLVM NVPTX backend and ptxas) runs on the host, so the PTX a GPU would run and the shared
memory a launch would ask for can be checked on CPU.

The compile runs in a child process: under ``TRITON_INTERPRET=1`` (set for the kernel tests
before triton is imported) ``@triton.jit`` makes interpreter functions, which the compiler
cannot take, so the child imports the kernels with the variable unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys, importlib
import triton
from triton.backends import backends
if "nvidia" not in backends:
    sys.exit(3)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for spec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    sig = dict(spec["signature"], **{name: "constexpr" for name in spec["constexprs"]})
    src = ASTSource(fn=fn, signature=sig, constexprs=spec["constexprs"])
    k = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32),
                       options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]})
    out.append({"ptx": k.asm["ptx"], "shared": k.metadata.shared})
json.dump(out, sys.stdout)
"""


@dataclass
class GpuKernelSpec:
    """One kernel build: ``module``.``kernel`` (a ``@triton.jit`` function) with its
    non-constexpr argument types (``signature``: name -> Triton type such as ``"*bf16"``,
    ``"i32"``, ``"fp32"``) and constexpr values, for CUDA compute capability ``arch``."""

    module: str
    kernel: str
    signature: dict[str, str]
    constexprs: dict = field(default_factory=dict)
    arch: int = 90
    num_warps: int = 4
    num_stages: int = 2


def compile_for_gpu(specs: list[GpuKernelSpec], timeout_s: float = 600.0) -> list[dict]:
    """Each spec compiled (in one child process): ``{"ptx": PTX text, "shared": bytes of
    shared memory a launch needs}`` per spec, in order. Skips the calling test where triton
    is missing or has no NVIDIA backend. ``timeout_s`` only catches a hung child: three
    builds took over 120 s on 2 cores at load average 20 (session 51), ~10-20 s quiet.

    Raises:
        AssertionError: with the child's error output when a kernel fails to compile.
    """
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    payload = json.dumps([spec.__dict__ for spec in specs])
    done = subprocess.run([sys.executable, "-c", _CHILD], input=payload, capture_output=True,
                          text=True, env=env, cwd=_ROOT, timeout=timeout_s, check=False)
    if done.returncode == 3:
        pytest.skip("this triton build has no NVIDIA backend")
    if done.returncode != 0:
        raise AssertionError(f"compiling for a GPU failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)
