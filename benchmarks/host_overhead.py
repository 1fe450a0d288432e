"""Host time per decode step: schedule + input preparation + update, without the model.

A tiny dummy-weight Llama (hidden 64, 2 layers, vocab 512) runs 256 requests of 512 random
prompt tokens that each generate 128 tokens (EOS ignored), so every decode step carries 256
running requests whose contexts grow from 512 to 640 tokens (576 on average). A step's host
time is ``EngineCore.step()`` minus the time spent inside the model's forward (or the
replay of its recorded CPU step graph), ``compute_logits`` and the sampler (device work). Only steps in which every request decodes
count. Times are the thread's CPU time (``time.thread_time``): on an idle machine they equal
the wall-clock time (the step's host work is one thread that never waits), and on a shared one
they do not count the time other processes hold the core. Wall-clock medians are printed too.

Run one engine (the kvflow on ``sys.path``)::

    .venv/bin/python benchmarks/host_overhead.py

or compare source trees in one run: one engine process per tree (``PYTHONPATH`` set to it),
stepped in turn, one decode step each, so that every engine sees the same machine load; each
process repeats the workload until it has ``--steps`` decode steps::

    .venv/bin/python benchmarks/host_overhead.py --trees /work/wt/baseline-5e92c6e . --steps 400

The last line is ``host_ms_per_step=X`` (the median of the last tree given). ``--phases``
also times the step's phases (``PHASES``: schedule, the runner's three calls,
update_from_output; device time subtracted from each) and prints each one's median per tree
(with ``--trees``, its ratio to the first tree's)::

    .venv/bin/python benchmarks/host_overhead.py --trees /tmp/base . --steps 150 \
        --num-requests 64 --input-len 128 --phases
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--trees", nargs="*", help="kvflow source trees to compare (subprocesses)")
    p.add_argument("--steps", type=int, default=400, help="decode steps per tree (--trees)")
    p.add_argument("--extra", default="{}", help="JSON object of extra LLM(...) options")
    p.add_argument("--phases", action="store_true", help="time each phase of the step too")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # child process
    return p.parse_args(argv)


class Stopwatch:
    """Accumulates the wall-clock and thread CPU seconds spent inside wrapped callables; a
    wrapped call made inside another (the model's forward inside the step graph runner's
    ``run`` while it records a step) is counted once, by the outer one."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w0
                self.cpu += time.thread_time() - c0
                self.depth -= 1
        return timed


# (module, class, method) -> phase name: the calls timed by --phases (and by
# engine_step_host.py's)
PHASES = {
    ("kvflow.core.scheduler", "Scheduler", "schedule"): "schedule",
    ("kvflow.worker.model_runner", "ModelRunner", "launch_forward"): "runner.launch_forward",
    ("kvflow.worker.model_runner", "ModelRunner", "launch_sampling"): "runner.launch_sampling",
    ("kvflow.worker.model_runner", "ModelRunner", "collect_output"): "runner.collect_output",
    ("kvflow.core.scheduler", "Scheduler", "update_from_output"): "update_from_output",
    ("kvflow.engine.output_processor", "OutputProcessor", "process"): "output_processor",
}


class PhaseTimer:
    """Host CPU seconds per phase of the current step: each wrapped method's thread CPU
    time less the device time (``device``, a Stopwatch) spent inside it."""

    def __init__(self, device: Stopwatch) -> None:
        self.device, self.cpu = device, {}

    def install(self) -> None:
        import importlib

        for (module, cls, method), name in PHASES.items():
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self._wrap(name, getattr(owner, method)))

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            d0, c0 = self.device.cpu, time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0 - \
                    (self.device.cpu - d0)
        return timed


class DecodeBench:
    """One engine (the kvflow importable here) and the workload, stepped one step at a time;
    the workload is queued again whenever it has finished."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch

        from kvflow import LLM, SamplingParams

        torch.set_num_threads(args.threads)
        tmp = tempfile.mkdtemp(prefix="kvflow-host-overhead-")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        max_len = args.input_len + args.output_len
        blocks = args.num_requests * (-(-max_len // 16) + 1) + 16
        self.llm = LLM(model=tmp, load_format="dummy", skip_tokenizer_init=True,
                       dtype="float32", max_model_len=max_len + 16,
                       max_num_seqs=args.num_requests, max_num_batched_tokens=16384,
                       num_kv_blocks=blocks, **json.loads(args.extra))
        self.core, self.args = self.llm.engine.core, args
        runner = self.core.executor.runner
        self.device = Stopwatch()
        runner.model.forward = self.device.wrap(runner.model.forward)
        runner.model.compute_logits = self.device.wrap(runner.model.compute_logits)
        if runner.graph_runner is not None:  # a replayed decode step is device work too
            runner.graph_runner.run = self.device.wrap(runner.graph_runner.run)
        timed_call = self.device.wrap(type(runner.sampler).__call__)
        # a subclass, not a wrapped function: the runner reads the sampler's attributes too
        runner.sampler.__class__ = type("TimedSampler", (type(runner.sampler),),
                                        {"__call__": timed_call})
        self.prompts = np.random.default_rng(0).integers(
            3, TINY_LLAMA["vocab_size"], (args.num_requests, args.input_len)).tolist()
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                     temperature=0)
        self.num_out: dict[str, int] = {}
        self.phases = PhaseTimer(self.device) if args.phases else None
        if self.phases:
            self.phases.install()

    def step(self) -> tuple[float, float, dict[str, float]] | None:
        """One engine step; (host CPU ms, host wall ms, host CPU ms per phase timed) if every
        request decoded in it."""
        if not self.core.has_unfinished_requests():
            self.num_out = {}
            for prompt in self.prompts:
                self.llm.engine.add_request(prompt, self.params)
        all_decode = len(self.num_out) == self.args.num_requests and \
            min(self.num_out.values()) < self.args.output_len - 1
        self.device.wall = self.device.cpu = 0.0
        if self.phases:
            self.phases.cpu = {}
        w0, c0 = time.perf_counter(), time.thread_time()
        outputs = self.core.step()
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
        for out in outputs:
            self.num_out[out.request_id] = self.num_out.get(out.request_id, 0) + \
                len(out.new_token_ids)
        if all_decode and len(outputs) == self.args.num_requests:
            phases = {name: t * 1e3 for name, t in self.phases.cpu.items()} \
                if self.phases else {}
            return (cpu - self.device.cpu) * 1e3, (wall - self.device.wall) * 1e3, phases
        return None


def run_one(args: argparse.Namespace) -> dict:
    """All decode steps of one pass of the workload."""
    import kvflow

    bench, samples = DecodeBench(args), []
    while True:
        sample = bench.step()
        if sample is not None:
            samples.append(sample)
        if not bench.core.has_unfinished_requests():
            break
    return {"kvflow": os.path.dirname(os.path.dirname(kvflow.__file__)),
            "steps": len(samples), "host_ms_median": statistics.median(s[0] for s in samples),
            "wall_host_ms_median": statistics.median(s[1] for s in samples),
            "phases_ms_median": phase_medians(samples)}


def serve(args: argparse.Namespace) -> None:
    """Child process: one step per ``step`` line on stdin, one JSON line back."""
    import kvflow

    bench = DecodeBench(args)
    print(json.dumps({"kvflow": os.path.dirname(os.path.dirname(kvflow.__file__))}),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        print(json.dumps(bench.step()), flush=True)


def compare(args: argparse.Namespace) -> None:
    """Step one engine process per tree in turn until each has ``args.steps`` decode steps."""
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--num-requests",
           str(args.num_requests), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--threads", str(args.threads), "--extra", args.extra] + \
        (["--phases"] if args.phases else [])
    procs = {}
    for tree in args.trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        procs[tree] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        ready = json.loads(procs[tree].stdout.readline())
        assert os.path.samefile(ready["kvflow"], tree), (ready, tree)
    samples: dict[str, list[tuple]] = {t: [] for t in args.trees}
    try:
        while min(len(s) for s in samples.values()) < args.steps:
            for tree, proc in procs.items():
                proc.stdin.write("step\n")
                proc.stdin.flush()
                result = json.loads(proc.stdout.readline())
                if result is not None:
                    samples[tree].append(tuple(result))
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    report(args.trees, samples)


def phase_medians(samples: list[tuple]) -> dict[str, float]:
    """The median host CPU ms of each phase timed (``--phases``) over the decode steps."""
    names = {name for s in samples for name in s[2]}
    return {name: statistics.median(s[2].get(name, 0.0) for s in samples)
            for name in sorted(names)}


def report(trees: list[str], samples: dict[str, list[tuple]]) -> None:
    """Medians (CPU and wall, and each phase's with --phases) per tree, and the ratio to the
    first tree."""
    base = statistics.median(s[0] for s in samples[trees[0]])
    base_phases = phase_medians(samples[trees[0]])
    for tree in trees:
        cpu = [s[0] for s in samples[tree]]
        wall = [s[1] for s in samples[tree]]
        print(f"{tree}: median {statistics.median(cpu):.3f} ms/step host CPU "
              f"(p10 {sorted(cpu)[len(cpu) // 10]:.3f}, p90 {sorted(cpu)[9 * len(cpu) // 10]:.3f}"
              f"), wall {statistics.median(wall):.3f} ms, {len(cpu)} decode steps; "
              f"{statistics.median(cpu) / base:.3f}x of {trees[0]}")
        for name, ms in phase_medians(samples[tree]).items():
            ratio = ms / base_phases[name] if base_phases.get(name) else float("nan")
            print(f"  {name}: {ms:.3f} ms ({ratio:.3f}x)")
    print(f"host_ms_per_step={statistics.median(s[0] for s in samples[trees[-1]]):.3f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(args)
    elif args.trees:
        compare(args)
    else:
        res = run_one(args)
        print("RESULT " + json.dumps(res))
        print(f"host_ms_per_step={res['host_ms_median']:.3f}")


if __name__ == "__main__":
    main()
