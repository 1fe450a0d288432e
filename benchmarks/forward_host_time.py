"""Host time of one CPU decode step's model forward: the Python around the native kernels.

Runs CPU-W1's shape (``offline_engine.py``: 64 prompts of 128 random tokens, greedy, EOS
ignored, prefix caching off; 16 output tokens) up to the first step in which all 64 decode,
then replays that step's model
forward (64 rows, the step's attention metadata bound, its K/V written again to the same slots)
``--reps`` times. Two timings, each the median over the replays (milliseconds):

* ``real_ms``: the forward as the engine runs it (kernels included);
* ``host_ms``: the same forward with every native C entry point of the kernels object replaced
  by a no-op Python callable (outputs are garbage, shapes are not): the Python layers, the
  wrappers' checks, tensor allocations and views - the host time the kernels wait on. It does
  not count ctypes' own argument conversion (the stub takes the Python values as they are).
* ``calls_ms``: the native calls of one such forward (``calls`` of them), recorded with their
  arguments and replayed back to back from a list, with no Python layers between them: the
  kernels plus ctypes' dispatch, what a step would cost if its kernel sequence were replayed
  like a CUDA graph. Every tensor the recorded forward allocated with ``torch.empty`` is kept
  alive for the replays, so the calls write where they wrote then (other inputs, e.g. the
  embedding's output, are read from memory that may since have been reused: values are
  garbage, addresses stay valid).
* ``cold_host_ms`` (with ``--sweep-bytes N``): ``host_ms`` again, with each stub reading an
  N-byte buffer (``numpy.sum``) the way a kernel sweeps the caches, less the time of the
  same sweeps alone (``sweep_ms``): the Python's time when it runs between cache-evicting
  kernels, as it does in the engine.

The replays run in the engine's own step (the model thread, inside its thread pinning), after
the step's real forward. The engine runs with ``enforce_eager=True``: this measures the eager
forward, whose Python CPU step graphs (``kvflow/worker/cpu_graphs.py``) take out of decode
steps. Run one tree (the kvflow on ``sys.path``)::

    .venv/bin/python benchmarks/forward_host_time.py MODEL_DIR

or compare source trees, one process per tree and round, rounds alternating::

    .venv/bin/python benchmarks/forward_host_time.py MODEL_DIR --trees /work/wt/base . --rounds 3

With ``--trees`` the last lines give each tree's medians over its rounds (``host_ms=X real_ms=Y
calls_ms=Z``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 128, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=300, help="replays per timing")
    p.add_argument("--trees", nargs="*", help="kvflow source trees to compare (subprocesses)")
    p.add_argument("--rounds", type=int, default=3, help="processes per tree (--trees)")
    p.add_argument("--sweep-bytes", type=int, default=0,
                   help="also time cold_host_ms: each stub reads this many bytes (0: off)")
    return p.parse_args(argv)


def native_entry_points(kernels) -> dict[str, ctypes._CFuncPtr]:
    """{attribute name: ctypes function} of every C entry point bound on ``kernels`` (a
    NativeCpuKernels)."""
    return {name: value for name, value in vars(kernels).items()
            if isinstance(value, ctypes._CFuncPtr)}


def replace_entry_points(kernels, names, make) -> None:
    """Set each entry point ``names`` on ``kernels`` to ``make(name)``: for this process only,
    after the timed real forward."""
    for name in names:
        setattr(kernels, name, make(name))


def no_op(*args) -> int:
    """A stub entry point: does nothing, returns 0 (success)."""
    return 0


def sweeper(sweep_bytes: int):
    """(stub, buffer): a stub entry point that reads a float64 ``buffer`` of ``sweep_bytes``
    bytes (evicting the caches as a kernel does) and returns 0."""
    import numpy as np

    buffer = np.ones(max(sweep_bytes // 8, 1))

    def sweep(*args) -> int:
        buffer.sum()
        return 0
    return sweep, buffer


def sweeps_ms(buffer, count: int, reps: int = 20) -> float:
    """Milliseconds of ``count`` sweeps of ``buffer`` (median of ``reps`` repetitions)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(count):
            buffer.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def record_native_calls(kernels, forward) -> tuple[list, list]:
    """Run ``forward()`` once with every ctypes entry point on ``kernels`` recording its
    arguments and ``torch.empty`` keeping its tensors; returns ([(function, args), ...] in
    call order, the kept tensors). ``kernels`` and ``torch.empty`` are restored after."""
    import torch

    calls, kept, saved = [], [], native_entry_points(kernels)

    def recorder(name: str):
        def record(*args, fn=saved[name]):
            calls.append((fn, args))
            return fn(*args)
        return record
    replace_entry_points(kernels, saved, recorder)
    empty = torch.empty

    def keeping_empty(*args, **kwargs):
        kept.append(empty(*args, **kwargs))
        return kept[-1]
    torch.empty = keeping_empty
    try:
        forward()
    finally:
        torch.empty = empty
        replace_entry_points(kernels, saved, saved.get)
    return calls, kept


def calls_replay_ms(calls: list, reps: int, warmup: int = 20) -> float:
    """Median milliseconds of ``reps`` back-to-back replays (after ``warmup`` ones) of the
    recorded native ``calls``."""
    times = []
    for _ in range(reps + warmup):
        start = time.perf_counter()
        for fn, args in calls:
            fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def replay_ms(model, attn_ctx, metadata, block_size, input_ids, positions, extra,
              reps: int, warmup: int = 20) -> float:
    """Median milliseconds of ``reps`` forwards (after ``warmup`` ones) with ``metadata``
    bound and prepared as ``run_model`` does each step."""
    import torch

    from kvflow.worker.forward_pass import prepare_attention

    times = []
    with torch.inference_mode(), attn_ctx.forward_context.bind(metadata):
        for _ in range(reps + warmup):
            start = time.perf_counter()
            prepare_attention(attn_ctx, metadata, block_size)
            model(input_ids, positions, **extra)
            times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]) * 1e3


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Run the workload in this process; return {"real_ms", "host_ms"}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    from kvflow.kernels.cpu_native import native_cpu_kernels
    from kvflow.worker import model_runner

    # eager steps: the forward this measures is the one CPU step graphs replay without its Python
    llm, sampling_params, _ = offline_engine.load_engine("kvflow", args.model_dir, args.dtype,
                                                         enforce_eager=True)
    run_model, result = model_runner.run_model, {}

    def timed_run_model(model, attn_ctx, cp_size, block_size, counters, inputs, *rest):
        out = run_model(model, attn_ctx, cp_size, block_size, counters, inputs, *rest)
        # the first step in which all prompts decode (the prefill steps carry the decodes of
        # the prompts already in, so it comes a few steps after the last prompt's tokens)
        if inputs.input_ids.shape[0] == NUM_PROMPTS and not result \
                and counters.dense_tokens >= NUM_PROMPTS * (INPUT_LEN + 3):
            positions, extra = rest[1], rest[2]
            step = (model, attn_ctx, inputs.attn_metadata, block_size, inputs.input_ids,
                    positions, extra, args.reps)
            result["real_ms"] = replay_ms(*step)
            kernels = native_cpu_kernels()
            calls, kept = record_native_calls(kernels,
                                              lambda: replay_ms(*step[:-1], reps=1, warmup=0))
            result["calls_ms"], result["calls"] = calls_replay_ms(calls, args.reps), len(calls)
            del calls, kept
            names = list(native_entry_points(kernels))
            replace_entry_points(kernels, names, lambda name: no_op)
            result["host_ms"] = replay_ms(*step)
            if args.sweep_bytes:
                sweep, buffer = sweeper(args.sweep_bytes)
                replace_entry_points(kernels, names, lambda name: sweep)
                result["sweep_ms"] = sweeps_ms(buffer, result["calls"])
                result["cold_host_ms"] = replay_ms(*step) - result["sweep_ms"]
        return out

    model_runner.run_model = timed_run_model  # this process only: the engine's step calls it
    vocab = llm.get_tokenizer().vocab_size
    params = sampling_params(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(offline_engine.cpu_w1_token_ids(vocab, NUM_PROMPTS), params, use_tqdm=False)
    if not result:
        raise RuntimeError("no 64-row decode step was seen (another scheduler policy?)")
    return result


def compare(args: argparse.Namespace) -> None:
    """One child process per tree and round, trees alternating within each round."""
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for rnd in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            cmd = [sys.executable, os.path.abspath(__file__), args.model_dir, "--dtype",
                   args.dtype, "--reps", str(args.reps), "--sweep-bytes", str(args.sweep_bytes)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd} {tree}: {runs[tree][-1]}", flush=True)
    for tree, results in runs.items():
        host, real, calls = (statistics.median(r[key] for r in results)
                             for key in ("host_ms", "real_ms", "calls_ms"))
        cold = f" cold_host_ms={statistics.median(r['cold_host_ms'] for r in results):.2f}" \
            if args.sweep_bytes else ""
        print(f"{tree}: host_ms={host:.2f} real_ms={real:.2f} calls_ms={calls:.2f} "
              f"(real / calls {real / calls:.3f}){cold}")


def main() -> None:
    args = parse_args()
    if args.trees:
        compare(args)
    else:
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
