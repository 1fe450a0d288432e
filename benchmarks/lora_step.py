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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="runs per figure in a process")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--adapters", default="/tmp/loraperf", help="where the adapters are saved")
    p.add_argument("--modes", default="base,r8,r16")
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
        import time

        p = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        lora = [adapters[i % len(adapters)] for i in range(len(batch))] if adapters else None
        start = time.perf_counter()
        llm.generate(batch, p, use_tqdm=False, lora_request=lora)
        return time.perf_counter() - start

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
    if args.child:
        print(json.dumps(measure(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
