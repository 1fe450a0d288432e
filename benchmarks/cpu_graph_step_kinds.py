"""Wall time of each decode step of CPU-W1 by what the CPU step graphs did with it: ``eager``
(a batch size's first step, no recorder), ``record`` (run under a recorder; a size's second
recording also plans and check-replays its program) or ``replay``.

One kvflow process (the tree on ``PYTHONPATH``), ``offline_engine.py``'s workload after its
two-prompt warm-up: 64 x 128 random token ids -> 64 greedy tokens, EOS ignored, prefix caching
off. Prints the measured ``generate``'s throughput, then per (kind, rows) the step count, the
first four steps' ms and the median::

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_graph_step_kinds.py out/smollm2-hf [bfloat16]

A tree from before session 42 (every untrusted size recorded from its first step) shows no
``eager`` rows. Steps the runner does not take (prefill and mixed steps) are not listed.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

from offline_engine import cpu_w1_token_ids, greedy_run, load_engine


def time_graph_steps() -> list[tuple[str, int, float]]:
    """A list that gets ``(kind, rows, ms)`` for every step the CPU step graphs take from now
    on (``CpuGraphRunner.run`` wrapped): ``eager`` (a size's first step; every untrusted step
    counts as ``record`` on a tree from before session 42), ``record`` or ``replay``. Shared
    with cpu_first_request.py."""
    from kvflow.worker import cpu_graphs

    steps: list[tuple[str, int, float]] = []
    run = cpu_graphs.CpuGraphRunner.run

    def timed(self, input_ids, positions, meta):
        key = self._key(meta)
        kind = "replay" if key in self.programs else \
            "record" if key in getattr(self, "seen", {key}) else "eager"
        start = time.perf_counter()
        out = run(self, input_ids, positions, meta)
        steps.append((kind, meta.num_actual_tokens, 1e3 * (time.perf_counter() - start)))
        return out
    cpu_graphs.CpuGraphRunner.run = timed
    return steps


def main() -> None:
    model_dir, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    steps = time_graph_steps()
    llm, sampling_params, _ = load_engine("kvflow", model_dir, dtype)
    prompts = cpu_w1_token_ids(llm.get_tokenizer().vocab_size)
    greedy_run(llm, sampling_params, prompts[:2], 4)  # warm-up, as offline_engine.py
    steps.clear()
    elapsed, produced = greedy_run(llm, sampling_params, prompts, 64)
    print(f"{produced / elapsed:.1f} out tok/s ({elapsed:.2f} s)")
    by_kind = collections.defaultdict(list)
    for kind, rows, ms in steps:
        by_kind[(kind, rows)].append(ms)
    print("| kind | rows | steps | first ms | median ms |\n|---|---|---|---|---|")
    for (kind, rows), ms in sorted(by_kind.items(), key=lambda item: (-item[0][1], item[0][0])):
        print(f"| {kind} | {rows} | {len(ms)} | {', '.join(f'{x:.0f}' for x in ms[:4])} | "
              f"{statistics.median(ms):.1f} |")


if __name__ == "__main__":
    main()
