"""Served GPU-W1 for benchmarks/gpu_check.sh: ``kvflow serve`` on the Llama-3.1-8B shape (dummy
bf16 weights, the SmolLM2 tokenizer) and ``kvflow bench serve`` with 256 random 512-token
prompts -> 128 tokens at rate inf, ``--repeats`` times against one server per variant.

Variants (``--variants``, comma-separated): ``lockstep`` (the defaults), ``async``
(``--async-scheduling``) and ``tpot-cap`` (``--target-tpot-ms``, which bounds each step's
prefill tokens by a step-time model; skipped with a message when this kvflow has no such
flag). Each variant prints one line ``RESULT {"phase": "serve", "variant": ...}`` with the
median output throughput and the median of each run's median and p99 inter-token latency
(ITL). benchmarks/roofline_report.py sets them beside offline GPU-W1 (target: served >= 95%
of offline, p99 ITL <= 3x the median). Everything talks to 127.0.0.1 on a free port.

    python benchmarks/gpu_serve.py --out out/serve
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from serve_harness import KVFLOW, bench_serve, start_server, stop_server, wait_ready

CONFIG_DIR = os.environ.get("KVFLOW_BENCH_CONFIG",
                            os.path.join(os.path.dirname(__file__), "configs", "llama-3.1-8b"))
VARIANT_FLAGS = {"lockstep": [], "async": ["--async-scheduling"],
                 "tpot-cap": ["--target-tpot-ms", "{tpot_ms}"]}


def tokenizer_folder(name: str, out: Path) -> str:
    """``name`` if it is a folder, else the tokenizer of the model ``name`` resolves to (a
    packaged name such as SmolLM2-135M-Instruct, a GGUF file) saved as a folder under ``out``:
    ``kvflow serve --tokenizer`` and ``kvflow bench serve --tokenizer`` take folders."""
    if os.path.isdir(name):
        return name
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    folder = out / "tokenizer"
    load_tokenizer(resolve_model(name)).save_pretrained(folder)
    return str(folder)


def start(args: argparse.Namespace, flags: list[str], log: Path
          ) -> tuple[subprocess.Popen, str]:
    """Start ``kvflow serve`` and wait for /health.

    Raises:
        RuntimeError: if the server exits or is not healthy within ``--startup-timeout``.
    """
    proc, url = start_server(
        [CONFIG_DIR, "--served-model-name", "llama-8b-dummy", "--tokenizer", args.tokenizer,
         "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "2048",
         "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
         "--no-enable-prefix-caching", *flags], log)
    try:
        wait_ready(proc, url, args.startup_timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; see {log}") from None
    return proc, url


def bench(args: argparse.Namespace, url: str, result: Path, num_prompts: int,
          input_len: int, output_len: int) -> dict:
    """One ``kvflow bench serve`` run at rate inf; returns its result JSON.

    Raises:
        RuntimeError: if it wrote no result.
    """
    return bench_serve(url, [
        "--model", "llama-8b-dummy", "--tokenizer", args.tokenizer, "--endpoint",
        "completions", "--dataset", "random", "--num-prompts", str(num_prompts),
        "--input-len", str(input_len), "--output-len", str(output_len),
        "--random-vocab-size", "32000", "--ignore-eos", "--request-rate", "inf",
        "--seed", "0"], result)


def has_flag(flag: str) -> bool:
    """Whether this kvflow's ``serve`` accepts ``flag``."""
    done = subprocess.run([*KVFLOW, "serve", "--help"], capture_output=True, text=True,
                          check=False)
    return flag in done.stdout


def run_variant(args: argparse.Namespace, variant: str, out: Path) -> dict:
    """Start a server with the variant's flags, warm it up, run the workload ``--repeats``
    times; returns the medians."""
    flags = [f.format(tpot_ms=args.target_tpot_ms) for f in VARIANT_FLAGS[variant]]
    proc, url = start(args, flags, out / f"server-{variant}.log")
    try:
        bench(args, url, out / f"{variant}-warmup.json", 8, 64, 8)
        runs = [bench(args, url, out / f"{variant}-{i}.json", args.num_prompts,
                      args.input_len, args.output_len) for i in range(args.repeats)]
    finally:
        stop_server(proc, 60)
    return {"variant": variant, "flags": flags, "repeats": args.repeats,
            "output_tok_per_s": statistics.median(r["output_throughput"] for r in runs),
            "median_itl_ms": statistics.median(r["median_itl_ms"] for r in runs),
            "p99_itl_ms": statistics.median(r["p99_itl_ms"] for r in runs),
            "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in runs),
            "runs_output_tok_per_s": [r["output_throughput"] for r in runs],
            "runs_p99_itl_ms": [r["p99_itl_ms"] for r in runs],
            "failed": sum(r["failed"] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="lockstep,async,tpot-cap")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--target-tpot-ms", type=float, default=30.0,
                   help="tpot-cap variant: the TPOT target the step budget is sized for")
    p.add_argument("--tokenizer", default=os.environ.get("KVFLOW_BENCH_TOKENIZER",
                                                         "SmolLM2-135M-Instruct"))
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--out", default="out/serve")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.tokenizer = tokenizer_folder(args.tokenizer, out)
    for variant in args.variants.split(","):
        if variant == "tpot-cap" and not has_flag("--target-tpot-ms"):
            print("tpot-cap: this kvflow serve has no --target-tpot-ms; skipped", flush=True)
            continue
        result = run_variant(args, variant, out)
        print("RESULT " + json.dumps({"phase": "serve", **result}), flush=True)


if __name__ == "__main__":
    main()
