"""Two builds of the native LoRA kernel (``kernels/csrc/cpu_lora.c``) against each other in
one process: the ``kvflow_lora`` entry point of two kernel libraries (say, one built from the
tree before a change and one after: the path of ``native_cpu_kernels().lib._name`` run from
each tree), called alternately round by round on the same torch tensors, one thread, thread
CPU time, the median of ``--rounds`` rounds of ``--calls`` calls each; fp32 rows on one
adapter, B as LoRALinear keeps it on CPU (the transpose of a contiguous ``[1, R, out]``), at
SmolLM2-135M's LoRA shapes (``(rows, in, out, rank rows)``: qkv 576->960 with 3 x rank,
gate_up 576->3072 with 2 x rank, down 1536->576 with rank)::

    .venv/bin/python benchmarks/lora_kernel_ab.py OLD.so NEW.so [--calls 10] [--rounds 7]

Separate processes (``benchmarks/lora_kernel.py`` run from each tree) gave old / new figures
that moved by up to 1.5x between processes at load average 17-23 on the shared 2-core box;
one process with the candidates alternating does not depend on that.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

SHAPES = [(rows, *shape) for rows in (1, 16, 64, 128) for shape in
          ((576, 960, 48), (576, 3072, 32), (1536, 576, 16),
           (576, 960, 192), (576, 3072, 128), (1536, 576, 64))]


def entry_point(path: str) -> ctypes._CFuncPtr:
    """``kvflow_lora`` of the library at ``path``, its argument types set."""
    fn = ctypes.CDLL(path).kvflow_lora
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.restype = c_int
    fn.argtypes = [ptr, i64, c_int, ptr, i64, c_int, ptr, ptr, c_int, ptr, i64, i64, i64, i64,
                   i64, c_int]
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    libs = {"old": entry_point(args.old), "new": entry_point(args.new)}
    print(f"us per call, medians of {args.rounds} alternating rounds of {args.calls} calls")
    for rows, inp, out, rank in SHAPES:
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(rows, inp, generator=gen), torch.zeros(rows, out)
        a = torch.randn(1, rank, inp, generator=gen) * 0.01
        b = (torch.randn(1, rank, out, generator=gen) * 0.01).transpose(1, 2)
        slots = torch.zeros(rows, dtype=torch.int32)
        call = (y.data_ptr(), out, 0, x.data_ptr(), inp, 0, a.data_ptr(), b.data_ptr(), 1,
                slots.data_ptr(), rows, inp, out, rank, 1, 1)
        times: dict[str, list[float]] = {name: [] for name in libs}
        for fn in libs.values():
            fn(*call)
        for _ in range(args.rounds):
            for name, fn in libs.items():
                start = time.thread_time()
                for _ in range(args.calls):
                    fn(*call)
                times[name].append((time.thread_time() - start) / args.calls * 1e6)
        us = {name: statistics.median(t) for name, t in times.items()}
        print(f"{rows} rows, {inp} -> {rank} -> {out}: old {us['old']:.1f}, new "
              f"{us['new']:.1f}; new/old {us['new'] / us['old']:.2f}", flush=True)


if __name__ == "__main__":
    main()
