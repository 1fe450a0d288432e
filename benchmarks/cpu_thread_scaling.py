"""Where a kvflow CPU run's second thread goes (issue 23): CPU-W1 with per-phase CPU time split
into the calling (model) thread's and the other threads' (the OpenMP workers), so that a
one-thread and a two-thread run can be compared phase by phase on a loaded machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_thread_scaling.py out/smollm2-hf bfloat16
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/cpu_thread_scaling.py out/smollm2-hf bfloat16

Workload CPU-W1 (64 x 128 random token ids -> 64 greedy tokens, EOS ignored, prefix caching
off), one batch after a two-prompt warm-up, as ``benchmarks/cpu_op_profile.py`` (whose op
wrappers it reuses). Each step phase (scheduling, the forward launch with its input building,
sampling, collecting, the scheduler's update, output processing) and each op inside the
forward pass (each GEMM kind, attention, norms, ..., a replayed CPU step graph as one op) is
timed on four clocks: ``time.thread_time`` (the calling thread's CPU time: it runs the model
and every serial host step), ``time.process_time`` (every thread's), wall, and the calling
thread's runqueue wait (``/proc/thread-self/schedstat``: runnable, but another task had its
CPU). The other threads' CPU is the difference of the first two: work, and spinning at OpenMP
barriers (GOMP_SPINCOUNT). "main blocked" is wall - main CPU - main queued: the time the
calling thread slept, in an OpenMP barrier waiting for a worker (or any other block). CPU time
is what the threads ran, so the one-thread figures survive a loaded machine; the queued and
blocked columns are the load's effect on a two-thread run (they are ~0 on an idle machine). At the end, every thread's run and runqueue-wait
time (``/proc/self/task/*/schedstat``) and its voluntary context switches (each a sleep:
how often an OpenMP worker slept instead of spinning).

Reading it: a phase costs ``main`` s of the calling thread, which is (on an idle machine) about
its wall time; a perfectly parallel phase would cost ``cpu(1 thread) / 2`` there. The per-phase
excess ``main(2) - cpu(1)/2`` is where the two-thread run loses to ideal scaling.
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import os
import pathlib
import time

import cpu_op_profile


def _runqueue_wait() -> float:
    """The calling thread's cumulative runqueue wait in s (/proc/thread-self/schedstat's second
    field: time it was runnable but another task had its CPU); 0.0 where unavailable."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


CLOCKS = (time.thread_time, time.process_time, time.perf_counter, _runqueue_wait)
TOTALS: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
CALLS: collections.Counter = collections.Counter()
_DEPTH = {"phase": [0], "op": [0]}


def _timed_at(level: str):
    """A wrapper factory like ``cpu_op_profile._timed`` but on the three CLOCKS; ``level``
    ("phase" or "op") keeps a separate nesting counter, so ops nest inside phases and only the
    outermost call of a level counts."""

    def timed(key_fn, fn):
        depth = _DEPTH[level]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = [clock() for clock in CLOCKS]
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                key = f"{level}: {key_fn(*args, **kwargs)}"
                row = TOTALS[key]
                for i, clock in enumerate(CLOCKS):
                    row[i] += clock() - start[i]
                CALLS[key] += 1

        return wrapper

    return timed


def _patch() -> None:
    """Wrap the step phases and (through cpu_op_profile) the ops of the forward pass."""
    from kvflow.core.scheduler import Scheduler
    from kvflow.engine.output_processor import OutputProcessor
    from kvflow.worker.cpu_graphs import CpuGraphRunner
    from kvflow.worker.model_runner import ModelRunner

    phase = _timed_at("phase")
    Scheduler.schedule = phase(lambda *a, **k: "schedule", Scheduler.schedule)
    Scheduler.update_from_output = phase(lambda *a, **k: "update_from_output",
                                         Scheduler.update_from_output)
    ModelRunner.launch_forward = phase(lambda *a, **k: "launch_forward (inputs, forward, logits)",
                                       ModelRunner.launch_forward)
    ModelRunner.launch_sampling = phase(lambda *a, **k: "launch_sampling",
                                        ModelRunner.launch_sampling)
    ModelRunner.collect_output = phase(lambda *a, **k: "collect_output",
                                       ModelRunner.collect_output)
    OutputProcessor.process = phase(lambda *a, **k: "output_processor.process",
                                    OutputProcessor.process)
    cpu_op_profile._timed = _timed_at("op")
    cpu_op_profile._patch()
    CpuGraphRunner.run = cpu_op_profile._timed(lambda *a, **k: "step graph replay (decode)",
                                               CpuGraphRunner.run)


def thread_stats() -> dict[int, tuple[str, int, int, int]]:
    """tid -> (name, run ns, runqueue wait ns, voluntary context switches) of every thread of
    this process (Linux /proc)."""
    stats = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            run, wait, _ = pathlib.Path(f"{task}/schedstat").read_text().split()
            name = pathlib.Path(f"{task}/comm").read_text().strip()
            switches = next(int(line.split()[1])
                            for line in pathlib.Path(f"{task}/status").read_text().splitlines()
                            if line.startswith("voluntary_ctxt_switches"))
        except (OSError, ValueError, StopIteration):
            continue
        stats[int(os.path.basename(task))] = (name, int(run), int(wait), switches)
    return stats


def main() -> None:
    parser = cpu_op_profile.workload_parser(__doc__)
    parser.add_argument("--options", default="{}", help="kvflow LLM options (JSON object)")
    parser.add_argument("--json", default=None, help="also write the totals here")
    args = parser.parse_args()
    from kvflow import LLM, SamplingParams

    _patch()
    import numpy as np
    import torch

    llm = LLM(model=args.model_dir, dtype=args.dtype, enable_prefix_caching=False,
              kv_cache_memory="1GiB", **json.loads(args.options))
    ids = np.random.default_rng(0).integers(3, 32000, (args.prompts, args.input_len)).tolist()
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(ids[:2], params(4), use_tqdm=False)
    TOTALS.clear()
    CALLS.clear()
    before = thread_stats()
    start = [clock() for clock in CLOCKS]
    outs = llm.generate(ids, params(args.output_len), use_tqdm=False)
    main_s, cpu_s, wall_s, queued_s = (clock() - s for clock, s in zip(CLOCKS, start))
    after = thread_stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.dtype}, {torch.get_num_threads()} threads: {produced} tokens, wall "
          f"{wall_s:.2f} s, process CPU {cpu_s:.2f} s (calling thread {main_s:.2f} s, "
          f"others {cpu_s - main_s:.2f} s), load {os.getloadavg()[0]:.1f}")
    print("| phase / op | calls | main CPU s | other threads' CPU s | all CPU s | wall s "
          "| main queued s | main blocked s |")
    print("|---|---|---|---|---|---|---|---|")
    phases = [v for k, v in TOTALS.items() if k.startswith("phase")]
    rest = [t - sum(v[i] for v in phases)
            for i, t in enumerate((main_s, cpu_s, wall_s, queued_s))]
    rows = sorted(TOTALS.items(), key=lambda kv: -kv[1][1])
    for key, (main_t, cpu_t, wall_t, queued_t) in rows + [
            ("phase: rest of generate (LLM loop, detokenizer, ...)", rest)]:
        print(f"| {key} | {CALLS.get(key, '-')} | {main_t:.3f} | {cpu_t - main_t:.3f} "
              f"| {cpu_t:.3f} | {wall_t:.3f} | {queued_t:.3f} "
              f"| {wall_t - main_t - queued_t:.3f} |")
    print("| thread | name | run s | runqueue wait s | voluntary switches |")
    print("|---|---|---|---|---|")
    for tid, (name, run, wait, switches) in sorted(after.items()):
        old = before.get(tid, (name, 0, 0, 0))
        print(f"| {tid} | {name} | {(run - old[1]) / 1e9:.2f} | {(wait - old[2]) / 1e9:.2f} "
              f"| {switches - old[3]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "wall": wall_s, "cpu": cpu_s,
                       "main": main_s, "queued": queued_s, "totals": dict(TOTALS), "calls": dict(CALLS)}, f)


if __name__ == "__main__":
    main()
