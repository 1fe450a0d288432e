"""Decode step time at small batches against the memory-bandwidth floor of a CPU (issue 23).

    python benchmarks/cpu_decode_floor.py --engine kvflow|vllm MODEL_DIR [--dtype bfloat16]
        [--batches 1,4,8,16] [--rounds 3]

Runs in the engine's own virtualenv (as ``offline_engine.py``, whose loader and CPU-W1 prompts it
shares). A decode step of a dense model reads every weight once: all the layers' matrices and
the LM head's [vocab, hidden] whole (the embedding table only for the step's tokens, unless it
is tied to the LM head and so read whole as the head), and its GEMMs do 2 x B x (weight
elements) FLOPs for B rows. With weights far larger than the last-level cache a step takes at
least the larger of bytes / read bandwidth and FLOPs / GEMM rate (a roofline: Williams et al.,
"Roofline", CACM 2009). Per round: the read bandwidth (``torch.sum`` of a 1 GiB fp32 tensor,
best of 5), the GEMM rate (``torch.mm`` of [2048, 1024] x [1024, 4096] in --dtype, oneDNN,
best of 5), both on the process's torch threads, and, per batch size B, decode ms/step =
(t(65 tokens) - t(1 token)) / 64 on the first B prompts of CPU-W1, each the median of 3.
Prints per B the median step, the floor (from the medians of the rounds' rates) and
floor / step (1.0: the step runs at the floor). ``--cpu-time`` (kvflow): one compute thread,
steps timed by process CPU time, for A/Bs on a busy machine (the floor's rates stay wall-time
figures on the process's threads).

Served at a fixed rate, the last of N requests is sent at N / rate seconds
(``kvflow.bench.datasets.arrival_intervals`` scales the gaps so), so a run of compare_cpu.sh's
rate 4 (64 requests, 64 output tokens) lasts at least 16 s + the last request's prefill + 63
decode steps: the script prints that bound with the floor's step and the batch-1 step measured.
The weight bytes come from the checkpoint's safetensors headers (element count x the --dtype's
size); an embedding table is found by name (``embed_tokens``, ``wte``, ``word_embeddings``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from offline_engine import NUM_PROMPTS, cpu_w1_token_ids, greedy_run, load_engine

EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings")
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def decode_weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes of weights one decode step reads (see the module docstring)."""
    from safetensors import safe_open

    tied = json.loads((Path(model_dir) / "config.json").read_text()).get(
        "tie_word_embeddings", True)
    elements = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if not tied and any(e in name for e in EMBEDDING_NAMES):
                    continue  # an untied table: only the step's rows are read
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                elements += count
    return elements * BYTES[dtype]


def best_seconds(fn) -> float:
    """The shortest of 5 timed calls of ``fn`` (after one untimed call), in seconds."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    """Bytes per second ``torch.sum`` reads a 1 GiB fp32 tensor at (best of 5)."""
    import torch

    x = torch.ones(1 << 28)
    return x.numel() * 4 / best_seconds(x.sum)


def gemm_rate(dtype: str) -> float:
    """FLOP/s of ``torch.mm`` on a [2048, 1024] x [1024, 4096] product in ``dtype`` (best of
    5): a GEMM rate a well-blocked kernel reaches, below the machine's peak."""
    import torch

    a = torch.randn(2048, 1024).to(getattr(torch, dtype))
    b = torch.randn(1024, 4096).to(a.dtype)
    return 2 * 2048 * 1024 * 4096 / best_seconds(lambda: torch.mm(a, b))


def parse_batches(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """``--batches`` as batch sizes, each 1..NUM_PROMPTS (CPU-W1's prompts); a bad list exits
    through ``parser.error`` naming it."""
    try:
        batches = [int(b) for b in text.split(",")]
    except ValueError:
        parser.error(f"--batches must be comma-separated integers, got {text!r}")
    if len(set(batches)) != len(batches):
        parser.error(f"--batches lists a size twice: {text!r}")
    if not all(1 <= b <= NUM_PROMPTS for b in batches):
        parser.error(f"--batches must each be in 1..{NUM_PROMPTS} (CPU-W1's prompts), got {text!r}")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["kvflow", "vllm"], required=True)
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES))
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true",
                        help="kvflow on one compute thread (cpu_threads=1), timed by process "
                        "CPU time: an A/B little disturbed by other processes")
    args = parser.parse_args()
    if args.cpu_time and args.engine != "kvflow":
        parser.error("--cpu-time is for --engine kvflow")
    batches = parse_batches(parser, args.batches)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not list(Path(args.model_dir).glob("*.safetensors")) or \
            not (Path(args.model_dir) / "config.json").is_file():
        parser.error(f"{args.model_dir} is not an HF folder with config.json and *.safetensors "
                     "(export one: benchmarks/export_hf.py out/smollm2-hf)")
    options = {"cpu_threads": 1} if args.cpu_time else {}
    llm, sampling_params, wrap = load_engine(args.engine, args.model_dir, args.dtype, **options)
    prompts = [wrap(row) for row in cpu_w1_token_ids(llm.get_tokenizer().vocab_size)]

    def seconds(batch: list, max_tokens: int) -> float:
        if args.cpu_time:
            start = time.process_time()
            greedy_run(llm, sampling_params, batch, max_tokens)
            return time.process_time() - start
        return greedy_run(llm, sampling_params, batch, max_tokens)[0]

    seconds(prompts[:2], 4)  # warm-up
    weight_bytes = decode_weight_bytes(args.model_dir, args.dtype)
    bandwidth, flops, steps = [], [], {b: [] for b in batches}
    for _ in range(args.rounds):
        bandwidth.append(read_bandwidth())
        flops.append(gemm_rate(args.dtype))
        for b in batches:
            steps[b].append(statistics.median(
                (seconds(prompts[:b], 65) - seconds(prompts[:b], 1)) / 64 for _ in range(3)))
    report(args, batches, weight_bytes, bandwidth, flops, steps)


def report(args, batches: list[int], weight_bytes: int, bandwidth: list[float],
           flops: list[float], steps: dict[int, list[float]]) -> None:
    """Prints the rates, the per-batch table against the floor and the rate-4 bound."""
    import torch

    gbs, rate = statistics.median(bandwidth), statistics.median(flops)
    elements = weight_bytes // BYTES[args.dtype]

    def floor_ms(b: int) -> float:
        return max(weight_bytes / gbs, 2 * b * elements / rate) * 1e3

    print(f"{args.engine} {args.dtype}: {weight_bytes / 1e6:.1f} MB of weights per decode step; "
          f"read {', '.join(f'{x / 1e9:.1f}' for x in bandwidth)} GB/s, GEMM "
          f"{', '.join(f'{x / 1e9:.0f}' for x in flops)} GFLOP/s ({torch.get_num_threads()} "
          f"threads); memory floor {weight_bytes / gbs * 1e3:.2f} ms/step")
    print("| batch | decode ms/step (rounds) | median | floor ms | floor / step |")
    print("|---|---|---|---|---|")
    for b in batches:
        med = statistics.median(steps[b]) * 1e3
        runs = ", ".join(f"{s * 1e3:.2f}" for s in steps[b])
        print(f"| {b} | {runs} | {med:.2f} | {floor_ms(b):.2f} | {floor_ms(b) / med:.2f} |")
    step1 = statistics.median(steps[batches[0]]) * 1e3
    print(f"rate 4, 64 x 64 tokens: a run lasts >= 16 s + 63 steps + the last prefill: "
          f"{16 + 0.063 * floor_ms(1):.2f} s + prefill at the floor, "
          f"{16 + 0.063 * step1:.2f} s + prefill at batch {batches[0]}'s step")


if __name__ == "__main__":
    main()
