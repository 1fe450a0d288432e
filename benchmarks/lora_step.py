"""Decode ms/step with LoRA adapters against the same model without LoRA, offline engine.

Adapters are made with peft from the model (random A and B, ``init_lora_weights=False``),
rank 8 and rank 16, on q, k, v, o, gate, up and down, 4 of each rank, saved under ``--adapters``
(default /tmp/loraperf/). Each round starts one process per mode, the modes alternating:

* ``base``: an engine without LoRA (CPU step graphs on where they apply);
* ``r8`` / ``r16``: an engine with ``enable_lora`` (``max_loras`` 4, ``max_lora_rank`` the
  rank), measuring rows without an adapter (``none``), all rows on one adapter (``one``) and
  the rows spread round-robin over 4 adapters (``four``).

Decode ms/step at batch B is ``(t(32 tokens) - t(1 token)) / 31`` for the first B prompts of
CPU-W1's random 128-token prompts, greedy, EOS ignored, the median of ``--runs`` runs. The last
lines give each figure's median over the rounds and its ratio to ``base`` at the same batch::

    .venv/bin/python benchmarks/lora_step.py out/smollm2-hf [--rounds 3] [--batches 1,16]

The engine's ``KVFLOW_CPU_LORA`` (``native``: LoRA decode steps replay as CPU step graphs;
``torch``: eager steps, as before session 49; ``auto``, the default: whichever was timed faster
on this CPU, ``kvflow/lora/cpu_kernel_choice.py``) is inherited by the processes: run the
script once with ``native`` and once with ``torch``, alternating, to compare the two.

``--before-after RANK`` instead runs one LoRA engine whose steps alternate between the grouped
LoRA of session 48 (fp32 slots on CPU) and the one before it (slots in the model dtype);
``--graphs RANK`` runs one LoRA engine (``KVFLOW_CPU_LORA=native``) whose steps alternate
between eager and replayed CPU step graphs; since session 50 eager steps run the native LoRA
kernel too, so the ratio is the replay's own saving (what ``cpu_kernel_choice.GRAPH_MARGIN``
prices), not the kernel's;
``--layers`` times one SmolLM2 layer's four LoRA matmuls the ``--before-after`` two ways,
without an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

OUTPUT_LEN = 32
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16)
ADAPTERS_PER_RANK = 4


def timed_generate(llm, params_cls, batch: list, max_tokens: int, adapters: list) -> float:
    """Seconds for one greedy ``llm.generate`` of ``batch`` (``max_tokens`` each, EOS
    ignored), the rows taking ``adapters`` in turn (none: the base model)."""
    import time

    p = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    lora = [adapters[i % len(adapters)] for i in range(len(batch))] if adapters else None
    start = time.perf_counter()
    llm.generate(batch, p, use_tqdm=False, lora_request=lora)
    return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="runs per figure in a process")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--adapters", default="/tmp/loraperf", help="where the adapters are saved")
    p.add_argument("--modes", default="base,r8,r16")
    p.add_argument("--before-after", type=int, default=None, metavar="RANK",
                   help="instead: one LoRA engine of this rank, steps alternating between "
                        "session 48's grouped LoRA and the one before it (bf16 slots)")
    p.add_argument("--graphs", type=int, default=None, metavar="RANK",
                   help="instead: one LoRA engine of this rank, steps alternating between "
                        "eager and CPU step graphs (the native LoRA kernel in both)")
    p.add_argument("--layers", action="store_true",
                   help="instead: one SmolLM2-135M layer's four LoRA matmuls (qkv, o, gate_up, "
                        "down at max_rank 16), session 48's grouped LoRA against the one "
                        "before it, alternating in one process, no engine")
    p.add_argument("--threads", type=int, default=1, help="torch threads for --layers")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_adapters(model_dir: str, root: Path) -> None:
    """Write ``ADAPTERS_PER_RANK`` random peft adapters of each rank under ``root`` (kept
    when already there)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for rank in RANKS:
        for i in range(ADAPTERS_PER_RANK):
            folder = root / f"r{rank}_{i}"
            if (folder / "adapter_config.json").exists():
                continue
            torch.manual_seed(1000 * rank + i)
            model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                                init_lora_weights=False, task_type="CAUSAL_LM")
            get_peft_model(model, config).save_pretrained(str(folder))


def adapter_paths(root: Path, rank: int) -> list[str]:
    return [str(root / f"r{rank}_{i}") for i in range(ADAPTERS_PER_RANK)]


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One process's figures: {"<kind>_b<B>": decode ms/step}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    from kvflow.lora.request import LoRARequest

    mode = args.child
    options = {} if mode == "base" else {
        "enable_lora": True, "max_loras": ADAPTERS_PER_RANK, "max_lora_rank": int(mode[1:])}
    llm, params_cls, _ = offline_engine.load_engine("kvflow", args.model_dir, args.dtype,
                                                    **options)
    vocab = llm.get_tokenizer().vocab_size
    batches = [int(x) for x in args.batches.split(",")]
    ids = offline_engine.cpu_w1_token_ids(vocab, max(batches))
    kinds: dict[str, list] = {"none": []}
    if mode != "base":
        requests = [LoRARequest(f"a{i}", i + 1, path)
                    for i, path in enumerate(adapter_paths(Path(args.adapters), int(mode[1:])))]
        kinds = {"none": [], "one": requests[:1], "four": requests}

    def run(batch: list, max_tokens: int, adapters: list) -> float:
        return timed_generate(llm, params_cls, batch, max_tokens, adapters)

    for adapters in kinds.values():
        run(ids[:2], 4, adapters)  # warm-up (and the adapters' first load)
    result = {}
    for b in batches:
        for kind, adapters in kinds.items():
            one = statistics.median(run(ids[:b], 1, adapters) for _ in range(args.runs))
            full = statistics.median(run(ids[:b], OUTPUT_LEN, adapters)
                                     for _ in range(args.runs))
            result[f"{kind}_b{b}"] = (full - one) / (OUTPUT_LEN - 1) * 1e3
    graphs = llm.engine.core.executor.runner.graph_runner
    result["replayed"] = float(getattr(graphs, "replayed_steps", 0))
    return result


def _grouped_lora_before(y, x, lora_a, lora_b, mapping):
    """kvflow.lora.layers.grouped_lora before session 48: slots in the model's dtype, rows
    always gathered and scattered."""
    import torch

    rows = x.index_select(0, mapping.token_index)
    delta = torch.empty(rows.shape[0], y.shape[1], dtype=x.dtype, device=x.device)
    for slot, start, end in mapping.segments:
        torch.matmul(rows[start:end] @ lora_a[slot].T, lora_b[slot].T, out=delta[start:end])
    return y.index_add_(0, mapping.token_index, delta.to(y.dtype))


def before_after(args: argparse.Namespace) -> None:
    """One engine with rank ``--before-after`` adapters; each figure alternates the current
    grouped LoRA (fp32 slots on CPU) and the previous one (slots cast to the model dtype),
    ``--runs`` times each, and prints the medians and after / before."""

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    from kvflow.lora import layers
    from kvflow.lora.request import LoRARequest

    make_adapters(args.model_dir, Path(args.adapters))
    rank = args.before_after
    # both sides are torch paths; the layers' slots are swapped for other tensors, which
    # recorded CPU step graphs (KVFLOW_CPU_LORA=native) would not see
    os.environ["KVFLOW_CPU_LORA"] = "torch"
    llm, params_cls, _ = offline_engine.load_engine(
        "kvflow", args.model_dir, args.dtype, enable_lora=True,
        max_loras=ADAPTERS_PER_RANK, max_lora_rank=rank)
    manager = llm.engine.core.executor.runner.lora_manager
    current = layers.grouped_lora
    dtype = getattr(torch, args.dtype)

    def use(mode: str) -> None:
        slot_dtype = dtype if mode == "before" else torch.float32
        for layer in manager.layers.values():
            layer.lora_a = layer.lora_a.to(slot_dtype)
            layer.lora_b = layer.lora_b.to(slot_dtype)
        layers.grouped_lora = _grouped_lora_before if mode == "before" else current

    batches = [int(x) for x in args.batches.split(",")]
    ids = offline_engine.cpu_w1_token_ids(llm.get_tokenizer().vocab_size, max(batches))
    requests = [LoRARequest(f"a{i}", i + 1, path)
                for i, path in enumerate(adapter_paths(Path(args.adapters), rank))]
    kinds = {"none": [], "one": requests[:1], "four": requests}

    def run(batch: list, max_tokens: int, adapters: list) -> float:
        return timed_generate(llm, params_cls, batch, max_tokens, adapters)

    for mode in ("before", "after"):
        use(mode)
        for adapters in kinds.values():
            run(ids[:2], 4, adapters)
    for b in batches:
        for kind, adapters in kinds.items():
            ms: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.runs):
                for mode in ("before", "after"):
                    use(mode)
                    ms[mode].append((run(ids[:b], OUTPUT_LEN, adapters)
                                     - run(ids[:b], 1, adapters)) / (OUTPUT_LEN - 1) * 1e3)
            before, after = (statistics.median(ms[m]) for m in ("before", "after"))
            print(f"r{rank} {kind}_b{b}: before {before:.2f} ms/step, after {after:.2f}, "
                  f"after / before {after / before:.2f}", flush=True)


def graphs_on_off(args: argparse.Namespace) -> None:
    """One LoRA engine with rank ``--graphs`` adapters (``KVFLOW_CPU_LORA=native``); each
    figure alternates steps without its CPU step graph runner (eager; the native LoRA kernel
    there too since session 50) and with it (replayed),
    ``--runs`` times each, and prints the medians and graphs / eager."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import offline_engine

    from kvflow.lora.request import LoRARequest

    make_adapters(args.model_dir, Path(args.adapters))
    os.environ["KVFLOW_CPU_LORA"] = "native"
    rank = args.graphs
    llm, params_cls, _ = offline_engine.load_engine(
        "kvflow", args.model_dir, args.dtype, enable_lora=True,
        max_loras=ADAPTERS_PER_RANK, max_lora_rank=rank)
    runner = llm.engine.core.executor.runner
    graphs = runner.graph_runner
    if graphs is None:
        raise SystemExit("this engine has no CPU step graphs (see worker/step_graphs.py)")
    batches = [int(x) for x in args.batches.split(",")]
    ids = offline_engine.cpu_w1_token_ids(llm.get_tokenizer().vocab_size, max(batches))
    requests = [LoRARequest(f"a{i}", i + 1, path)
                for i, path in enumerate(adapter_paths(Path(args.adapters), rank))]
    kinds = {"none": [], "one": requests[:1], "four": requests}
    modes = {"eager": None, "graphs": graphs}

    def step_ms(batch: list, adapters: list) -> float:
        return (timed_generate(llm, params_cls, batch, OUTPUT_LEN, adapters)
                - timed_generate(llm, params_cls, batch, 1, adapters)) / (OUTPUT_LEN - 1) * 1e3

    for b in batches:  # warm-up: adapters loaded, each size recorded and trusted
        for adapters in kinds.values():
            for runner.graph_runner in modes.values():
                timed_generate(llm, params_cls, ids[:b], 8, adapters)
    for b in batches:
        for kind, adapters in kinds.items():
            ms: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.runs):
                for mode, runner.graph_runner in modes.items():
                    ms[mode].append(step_ms(ids[:b], adapters))
            eager, replayed = (statistics.median(ms[m]) for m in modes)
            print(f"r{rank} {kind}_b{b}: eager {eager:.2f} ms/step, graphs {replayed:.2f}, "
                  f"graphs / eager {replayed / eager:.2f}", flush=True)
    runner.graph_runner = graphs
    print(f"replayed steps: {graphs.replayed_steps}, refused: {sorted(graphs.refused)}, "
          f"disabled: {graphs.disabled}")


def layer_costs(args: argparse.Namespace) -> None:
    """Microseconds per layer (qkv 576->960 rank rows 48, o 576->576 16, gate_up 576->3072 32,
    down 1536->576 16) of the grouped LoRA, before (bf16 slots) and after (fp32 slots), at
    each batch with 1 and 4 adapters; 100 calls timed, medians of 7 alternating rounds."""
    import time

    import numpy as np
    import torch

    from kvflow.lora.layers import grouped_lora, make_mapping

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [(576, 960, 48), (576, 576, 16), (576, 3072, 32), (1536, 576, 16)]
    gen = torch.Generator().manual_seed(0)

    def timed(fn, calls: int = 100) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6

    for b in (int(x) for x in args.batches.split(",")):
        for count in (1, ADAPTERS_PER_RANK):
            mapping = make_mapping(np.arange(b) % count, torch.device("cpu"))
            ops = []
            for inp, out, rank in shapes:
                a = torch.randn(4, rank, inp, generator=gen) * 0.01
                w = torch.randn(4, out, rank, generator=gen) * 0.01
                ops.append((torch.randn(b, out, generator=gen).to(dtype),
                            torch.randn(b, inp, generator=gen).to(dtype), a, w))
            cast = [(y, x, a.to(dtype), w.to(dtype)) for y, x, a, w in ops]
            runs = {"before": (_grouped_lora_before, cast), "after": (grouped_lora, ops)}
            us: dict[str, list[float]] = {"before": [], "after": []}
            for fn in runs.values():
                timed(lambda fn=fn, m=mapping: [fn[0](*op, m) for op in fn[1]], 5)
            for _ in range(7):
                for mode, (fn, args_) in runs.items():
                    us[mode].append(timed(lambda fn=fn, args_=args_, m=mapping:
                                          [fn(*op, m) for op in args_]))
            before, after = (statistics.median(us[m]) for m in ("before", "after"))
            print(f"batch {b}, {count} adapter(s): {before:.0f} -> {after:.0f} us per layer "
                  f"(x30 layers: {before * 0.03:.2f} -> {after * 0.03:.2f} ms/step), "
                  f"after / before {after / before:.2f}", flush=True)


def compare(args: argparse.Namespace) -> None:
    modes = args.modes.split(",")
    if any(m != "base" for m in modes):
        make_adapters(args.model_dir, Path(args.adapters))
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for rnd in range(args.rounds):
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), args.model_dir, "--dtype",
                   args.dtype, "--batches", args.batches, "--runs", str(args.runs),
                   "--adapters", args.adapters, "--child", mode]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {rnd} {mode}: " + " ".join(
                f"{k}={v:.2f}" for k, v in runs[mode][-1].items()), flush=True)
    medians = {mode: {k: statistics.median(r[k] for r in results) for k in results[0]}
               for mode, results in runs.items()}
    base = medians.get("base", {})
    for mode, figures in medians.items():
        print(f"{mode}: " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
        ratios = [f"{k}={v / base['none_' + k.split('_')[1]]:.2f}" for k, v in figures.items()
                  if k != "replayed" and base.get("none_" + k.split("_")[1])]
        if ratios and mode != "base":
            print(f"{mode} / base: " + " ".join(ratios))


def main() -> None:
    args = parse_args()
    if args.layers:
        layer_costs(args)
    elif args.before_after:
        before_after(args)
    elif args.graphs:
        graphs_on_off(args)
    elif args.child:
        print(json.dumps(measure(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
