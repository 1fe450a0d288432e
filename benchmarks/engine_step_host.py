"""Host time per decode step of a real model through ``LLMEngine.step``: the core step
(schedule, input preparation, update) plus the output processing (incremental
detokenization, stop strings, ``RequestOutput``), without the device work.

``--batch`` requests of ``--input-len`` random prompt tokens decode greedily (EOS ignored);
after 8 warm-up steps (the prefill among them) ``--steps`` decode steps are timed. A step's
host time is its thread CPU time minus that spent inside the model's forward, the replay of
its recorded CPU step graph, ``compute_logits`` and the sampler
(``benchmarks/host_overhead.py``'s ``Stopwatch``). Prints the median host ms per step and
the median step wall ms; ``--profile N`` prints cProfile's top N functions by own time too;
``--phases`` the median host ms of each phase of the step (schedule, the runner's three
calls, update_from_output, the output processor; device time subtracted from each).

    .venv/bin/python benchmarks/engine_step_host.py --model out/smollm2-hf --batch 64 --steps 30

Compare trees by running it with ``PYTHONPATH`` set to each in turn, several times.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from host_overhead import PHASES, PhaseTimer, Stopwatch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="out/smollm2-hf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed decode steps")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile", type=int, default=0, help="print cProfile's top N")
    p.add_argument("--phases", action="store_true", help="print each phase's host ms")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace):
    """An LLM whose device calls are timed by the returned Stopwatch."""
    import torch

    from kvflow import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch,
              max_model_len=args.max_model_len)
    runner, device = llm.engine.core.executor.runner, Stopwatch()
    runner.model.forward = device.wrap(runner.model.forward)
    runner.model.compute_logits = device.wrap(runner.model.compute_logits)
    if runner.graph_runner is not None:  # a replayed decode step is device work too
        runner.graph_runner.run = device.wrap(runner.graph_runner.run)
    sampler_call = device.wrap(type(runner.sampler).__call__)
    runner.sampler.__class__ = type("TimedSampler", (type(runner.sampler),),
                                    {"__call__": sampler_call})
    return llm, device


def main(argv: list[str] | None = None) -> None:
    import numpy as np

    import kvflow
    from kvflow import SamplingParams

    args = parse_args(argv)
    llm, device = build_engine(args)
    phases = PhaseTimer(device) if args.phases else None
    if phases:
        phases.install()
    per_phase: dict[str, list[float]] = {name: [] for name in PHASES.values()}
    engine = llm.engine
    prompts = np.random.default_rng(0).integers(100, 20000, (args.batch, args.input_len))
    params = SamplingParams(max_tokens=args.steps + 20, ignore_eos=True, temperature=0)
    for prompt in prompts.tolist():
        engine.add_request({"prompt_token_ids": prompt}, params)
    for _ in range(8):  # the prefill and the first decode steps
        engine.step()
    profile = cProfile.Profile() if args.profile else None
    host_ms, wall_ms = [], []
    for _ in range(args.steps):
        device.cpu = device.wall = 0.0
        if phases:
            phases.cpu = {}
        if profile:
            profile.enable()
        c0, w0 = time.thread_time(), time.perf_counter()
        outputs = engine.step()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        if profile:
            profile.disable()
        assert len(outputs) == args.batch, "every request must decode in every timed step"
        host_ms.append((cpu - device.cpu) * 1e3)
        wall_ms.append(wall * 1e3)
        if phases:
            for name, times in per_phase.items():
                times.append(phases.cpu.get(name, 0.0) * 1e3)
    print(f"{kvflow.__file__}: batch {args.batch}: host {statistics.median(host_ms):.3f} "
          f"ms/step (median of {args.steps}), step wall {statistics.median(wall_ms):.3f} ms")
    if phases:
        for name, times in per_phase.items():
            print(f"  {name}: {statistics.median(times):.3f} ms")
    if profile:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
