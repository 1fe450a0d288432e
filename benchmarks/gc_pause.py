"""What one full collection of CPython's cyclic garbage collector costs a process that holds a
model, with and without the start-up heap frozen (``kvflow/runtime/gc_heap.py``).

    .venv/bin/python benchmarks/gc_pause.py out/smollm2-hf [--dtype bfloat16]

Loads the model with the offline ``LLM`` (the heap an engine-core process holds, plus the
tokenizer), generates once, times three full collections (``gc.collect()``: what an
oldest-generation collection costs whenever CPython starts one), then freezes the heap as
kvflow's own processes do (``freeze_startup_heap``) and times three again. The offline ``LLM``
itself does not freeze (it runs in the caller's process); the script does it by hand to show
what the engine-core, worker and API processes gain. Prints the tracked-object counts.
"""

from __future__ import annotations

import argparse
import gc
import time

from kvflow import LLM, SamplingParams
from kvflow.runtime.gc_heap import freeze_startup_heap


def full_collections_ms(count: int = 3) -> list[float]:
    """Wall time (ms) of ``count`` full collections."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        gc.collect()
        times.append(round((time.perf_counter() - start) * 1e3, 1))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(args.model_dir, dtype=args.dtype, enable_prefix_caching=False)
    llm.generate(["The capital of France is"] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
    print(f"tracked objects: {len(gc.get_objects())}")
    print(f"heap not frozen: full collections ms {full_collections_ms()}")
    frozen = freeze_startup_heap("benchmark")
    print(f"frozen {frozen} objects; tracked objects left: {len(gc.get_objects())}")
    print(f"start-up heap frozen: full collections ms {full_collections_ms()}")


if __name__ == "__main__":
    main()
