"""GPU benchmark phases for benchmarks/gpu_check.sh (one phase per process, so each starts with
an empty GPU). Each phase prints one JSON line prefixed with ``RESULT``.

Phases:
  ceilings  measured device-to-device copy bandwidth and bf16 matmul rate
  kvflow    GPU-W1 (256 x 512 prompt -> 128 output, all at once) and GPU-W2 (1 request, TPOT),
            ``--repeats`` rounds on one engine, each round lock-step then with async
            scheduling (toggled between runs), reporting each variant's median run
  batch1    GPU-W2 (TPOT) on one engine across kernel variants, ``--repeats`` rounds, the
            variants alternating inside each round: CUDA graphs with the separate rotary and
            KV-store kernels, graphs with them fused (``KVFLOW_FUSED_KERNELS``' switch,
            graphs recaptured on each toggle), eager, eager fused, and eager with the
            FlashInfer attention backend when flashinfer is importable; every variant's
            median run, its ratios to the unfused graphs and eager runs, and whether its
            greedy tokens equal the unfused graphs run's
  hf        the same two workloads with HF transformers ``generate`` (static batch)
Workloads use the Llama-3.1-8B-shaped config in benchmarks/configs with dummy bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

CONFIG_DIR = os.environ.get("KVFLOW_BENCH_CONFIG",
                            os.path.join(os.path.dirname(__file__), "configs", "llama-3.1-8b"))
_SCALE = int(os.environ.get("KVFLOW_BENCH_SCALE", "1"))  # >1 shrinks the workloads (dry runs)
W1 = {"num_prompts": 256 // _SCALE, "input_len": 512 // _SCALE, "output_len": 128 // _SCALE}
W2 = {"num_prompts": 1, "input_len": 512 // _SCALE, "output_len": 128 // _SCALE}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu only for dry runs


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    return np.random.default_rng(seed).integers(3, 32000, (num, length)).tolist()


def emit(name: str, payload: dict) -> None:
    print("RESULT " + json.dumps({"phase": name, **payload}), flush=True)


def phase_ceilings() -> None:
    n = 2 * 2**30  # 2 GiB each way
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    bandwidth = 2 * n / float(np.median(times[2:]))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    flops = 10 * 2 * 8192**3 / (time.perf_counter() - t0)
    emit("ceilings", {"copy_bytes_per_s": bandwidth, "bf16_matmul_flops": flops,
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__})


def phase_kvflow(args: argparse.Namespace) -> None:
    from kvflow import LLM

    t0 = time.perf_counter()
    llm = LLM(model=CONFIG_DIR, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384,
              gpu_memory_utilization=0.85, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False, async_scheduling=False)
    init_s = time.perf_counter() - t0
    core = llm.engine.core
    print(f"kvflow init {init_s:.1f}s, {core.num_blocks} KV blocks", flush=True)
    result = {"init_s": init_s, "num_blocks": core.num_blocks,
              "enforce_eager": args.enforce_eager, "repeats": args.repeats}
    workloads = {"w2": (prompts(1, W2["input_len"], 2), W2["output_len"])}
    if not args.w2_only:
        workloads["w1"] = (prompts(W1["num_prompts"], W1["input_len"], 1), W1["output_len"])
    variants = [False] if args.no_async else [False, True]
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):  # alternate the variants inside each round
        for on in variants:
            core.scheduler.async_scheduling = on  # no step is in flight between generates
            for name, (batch, output_len) in workloads.items():
                key = name + ("_async" if on else "")
                runs.setdefault(key, []).append(run_kvflow(llm, batch, output_len))
                print(f"round {r + 1} {key}: {runs[key][-1]['output_tok_per_s']:.1f} tok/s, "
                      f"TPOT {runs[key][-1]['tpot_s_first_request'] * 1e3:.2f} ms", flush=True)
    for key, rs in runs.items():
        result[key] = median_run(rs, "tpot_s_first_request" if key.startswith("w2")
                                 else "elapsed_s")
        result[key].pop("token_ids")
    emit("kvflow", result)


BATCH1_VARIANTS = {  # name -> (CUDA graphs, fused rotary + KV store, attention backend)
    "graphs": (True, False, "triton"), "graphs_fused": (True, True, "triton"),
    "eager": (False, False, "triton"), "eager_fused": (False, True, "triton"),
    "eager_flashinfer": (False, False, "flashinfer"),  # no CUDA graphs for this backend yet
}


def batch1_backends(device) -> dict:
    """The attention backends the batch-1 variants switch between: Triton always, FlashInfer
    when importable and not turned off by ``GPU_CHECK_FLASHINFER=0``."""
    from kvflow.attention.triton_paged import TritonPagedAttentionBackend

    backends = {"triton": TritonPagedAttentionBackend(False)}
    if os.environ.get("GPU_CHECK_FLASHINFER", "1") != "0":
        try:
            from kvflow.attention.flashinfer_paged import FlashInferPagedAttentionBackend

            backends["flashinfer"] = FlashInferPagedAttentionBackend(device)
        except ValueError as exc:  # not installed, or not on CUDA
            print(f"batch1: FlashInfer variant skipped: {exc}", flush=True)
    return backends


def set_batch1_variant(llm, backend, graphs: bool, fused: bool) -> None:
    """Switch one engine between the batch-1 variants: the attention backend (every layer reads
    it from the shared context per call) and the Triton backend's fused switch, then CUDA
    graphs recaptured (they hold the kernels in force at capture) or dropped (eager)."""
    core = llm.engine.core
    runner = core.executor.runner
    runner.attn_ctx.backend = backend
    if hasattr(backend, "fuse_rotary"):
        backend.fuse_rotary = fused
    runner.graph_runner = None
    if graphs:
        core.executor.capture_graphs(core.max_model_len)


def batch1_summary(runs: dict[str, list[dict]], repeats: int, init_s: float) -> dict:
    """Per variant: the median-TPOT run, its ratio to the first variant's (``graphs`` on a
    GPU) and to ``eager``'s, and whether every run's greedy tokens equal the first variant's
    first run's."""
    result: dict = {"init_s": init_s, "repeats": repeats}
    base = next(iter(runs))
    medians = {name: median_run(rs, "tpot_s_first_request") for name, rs in runs.items()}
    for name, summary in medians.items():
        for ref in dict.fromkeys((base, "eager")):
            if ref in medians:
                summary["tpot_over_" + ref] = summary["tpot_s_first_request"] / \
                    medians[ref]["tpot_s_first_request"]
        summary["tokens_equal_" + base] = all(x["token_ids"] == runs[base][0]["token_ids"]
                                              for x in runs[name])
        summary.pop("token_ids")
        result["w2_" + name] = summary
    return result


def phase_batch1(args: argparse.Namespace) -> None:
    from kvflow import LLM

    t0 = time.perf_counter()
    llm = LLM(model=CONFIG_DIR, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=2048,
              gpu_memory_utilization=0.5, attention_backend="triton",
              enable_prefix_caching=False, async_scheduling=False,
              **({} if DEVICE == "cuda" else {"kv_cache_memory": "256MiB"}))
    init_s = time.perf_counter() - t0
    backends = batch1_backends(llm.engine.core.executor.runner.device)
    batch, output_len = prompts(1, W2["input_len"], 2), W2["output_len"]
    variants = {name: v for name, v in BATCH1_VARIANTS.items()
                if v[2] in backends and (DEVICE == "cuda" or not v[0])}  # graphs need a GPU
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):  # ABBA order: no variant always runs first
        for name, (graphs, fused, backend) in list(variants.items())[::-1 if r % 2 else 1]:
            set_batch1_variant(llm, backends[backend], graphs, fused)
            runs.setdefault(name, []).append(run_kvflow(llm, batch, output_len))
            print(f"round {r + 1} {name}: TPOT "
                  f"{runs[name][-1]['tpot_s_first_request'] * 1e3:.3f} ms", flush=True)
        # after every round, so a phase cut short by its timeout still reports (the report
        # keeps the last RESULT line of a phase)
        emit("batch1", batch1_summary(runs, r + 1, init_s))


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose ``key`` is the median (the lower middle one for an even count), with
    every run's ``key`` and output tok/s beside it."""
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[(len(ordered) - 1) // 2], "runs_" + key: [r[key] for r in runs],
            "runs_output_tok_per_s": [r["output_tok_per_s"] for r in runs],
            "median_output_tok_per_s": statistics.median(r["output_tok_per_s"] for r in runs)}


class StepTimer:
    """Wraps the engine core's schedule / execute / update calls and records, per step, the
    scheduled tokens and requests and the seconds spent in each (execute ends in a host sync:
    the sampled token ids are copied back). With async scheduling there is no execute call:
    ``launch`` (forward and sampling launches) and ``collect`` (the wait for the previous
    step's tokens) are timed instead, and step N's collect and update are added to step N+1's
    entry (N+1 is scheduled before them)."""

    CALLS = (("scheduler", "schedule", "schedule"), ("executor", "execute_model", "execute"),
             ("executor", "launch_forward", "launch"), ("executor", "launch_sampling", "launch"),
             ("executor", "collect_output", "collect"),
             ("scheduler", "update_from_output", "update"))

    def __init__(self, core) -> None:
        self.steps: list[dict] = []

        def timed(name, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                out = fn(*a, **k)
                if name == "schedule":
                    self.steps.append({"tokens": out.total_num_scheduled_tokens,
                                       "reqs": out.num_scheduled_reqs})
                if self.steps:
                    step = self.steps[-1]
                    step[name] = step.get(name, 0.0) + time.perf_counter() - t0
                return out
            return wrapper

        self._wrapped = []
        for owner, attr, name in self.CALLS:
            obj = getattr(core, owner)
            setattr(obj, attr, timed(name, getattr(obj, attr)))
            self._wrapped.append((obj, attr))

    def restore(self) -> None:
        for obj, attr in self._wrapped:
            del obj.__dict__[attr]

    def summary(self) -> dict:
        decode = [s for s in self.steps if s["tokens"] == s["reqs"] and s["reqs"] > 0]
        mixed = [s for s in self.steps if s["tokens"] > s["reqs"]]

        def agg(steps):
            if not steps:
                return {}
            return {"n": len(steps), **{k: float(np.sum([s.get(k, 0) for s in steps]))
                                        for k in ("schedule", "execute", "launch", "collect",
                                                  "update")},
                    "max_reqs": max(s["reqs"] for s in steps)}
        return {"decode_steps": agg(decode), "prefill_or_mixed_steps": agg(mixed),
                "first_steps": self.steps[:3]}


def run_kvflow(llm, batch: list[list[int]], output_len: int) -> dict:
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up (Triton compiles, allocator settles)
    sync()
    timer = StepTimer(llm.engine.core)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = timer.summary()
    timer.restore()
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    m = outs[0].metrics
    tpot = (m.finished_time - m.first_token_time) / (output_len - 1)
    return {"elapsed_s": elapsed, "output_tokens": ntok, "output_tok_per_s": ntok / elapsed,
            "ttft_s_first_request": m.ttft, "tpot_s_first_request": tpot, "steps": steps,
            "token_ids": list(outs[0].outputs[0].token_ids)}


def phase_hf() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(CONFIG_DIR)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()

    def generate(batch: list[list[int]], n: int) -> float:
        ids = torch.tensor(batch, device=DEVICE)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    generate(prompts(2, 16), 4)  # warm-up
    w1 = generate(prompts(W1["num_prompts"], W1["input_len"], 1), W1["output_len"])
    w2_full = generate(prompts(1, W2["input_len"], 2), W2["output_len"])
    w2_first = generate(prompts(1, W2["input_len"], 2), 1)
    emit("hf", {"w1": {"elapsed_s": w1, "output_tok_per_s": W1["num_prompts"] *
                       W1["output_len"] / w1},
                "w2": {"tpot_s": (w2_full - w2_first) / (W2["output_len"] - 1)}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["ceilings", "kvflow", "batch1", "hf"])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--w2-only", action="store_true", help="skip GPU-W1")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (medians are reported)")
    parser.add_argument("--no-async", action="store_true",
                        help="lock-step runs only (no --async-scheduling variant)")
    args = parser.parse_args()
    {"ceilings": phase_ceilings, "kvflow": lambda: phase_kvflow(args),
     "batch1": lambda: phase_batch1(args), "hf": phase_hf}[args.phase]()


if __name__ == "__main__":
    main()
