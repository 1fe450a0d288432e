"""Combine the RESULT lines of benchmarks/gpu_check.sh into one JSON and a printed table with
kvflow's fraction of the roofline, the async-scheduling variants beside lock-step, and served
GPU-W1 (benchmarks/gpu_serve.py) against offline GPU-W1. kvflow figures are each variant's
median run of ``--repeats``.

Roofline (lower bound on time) for the Llama-3.1-8B shape, bf16, from the measured ceilings,
through ``kvflow.bench.roofline`` (per operation: each step's linear layers take
max(FLOPs / matmul rate, weight bytes / copy bandwidth) and its attention max(FLOPs / rate,
K/V bytes / bandwidth), one after the other):
  GPU-W1 = the prefill step (256 x 512 tokens) + the 127 decode steps at batch 256.
  GPU-W2 = the TPOT floor of one request (512 -> 128 tokens).
"""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

from kvflow.bench.roofline import Machine, ModelShape, roofline

LLAMA_8B = ModelShape.from_hf_config(SimpleNamespace(
    num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256))
BYTES = 2  # bf16
BATCH1_ROWS = ("graphs", "graphs_fused", "eager", "eager_fused", "eager_flashinfer")
ATTENTION_SHAPES = ("decode_b1", "decode_b256", "prefill_32x512", "mixed")
ATTENTION_VARIANTS = ("triton", "triton_1pass", "triton_graph_plan", "flashinfer")


def w1_roofline_s(flops_rate: float, bandwidth: float, n=256, prompt=512, out=128) -> float:
    return roofline(LLAMA_8B, Machine(bandwidth, flops_rate), n, prompt, out, BYTES)["offline_s"]


def w2_tpot_floor_s(flops_rate: float, bandwidth: float, prompt=512, out=128) -> float:
    return roofline(LLAMA_8B, Machine(bandwidth, flops_rate), 1, prompt, out, BYTES)["tpot_s"]


def table(s: dict) -> str:
    """A short human-readable summary of the figures that matter."""
    def get(*keys):
        cur = s
        for k in keys:
            cur = cur.get(k) if isinstance(cur, dict) else None
        return cur

    rows = [("copy bandwidth GB/s", get("ceilings", "copy_bytes_per_s"), 1e-9),
            ("bf16 matmul TFLOP/s", get("ceilings", "bf16_matmul_flops"), 1e-12),
            ("W1 roofline tok/s", get("roofline", "w1_tok_per_s"), 1),
            ("W1 kvflow tok/s", get("kvflow", "w1", "output_tok_per_s"), 1),
            ("W1 kvflow fraction of roofline", get("kvflow", "w1", "fraction_of_roofline"), 1),
            ("W1 kvflow tok/s (async sched.)", get("kvflow", "w1_async", "output_tok_per_s"), 1),
            ("W1 HF tok/s", get("hf", "w1", "output_tok_per_s"), 1),
            ("W2 TPOT floor ms", get("roofline", "w2_tpot_s"), 1e3),
            ("W2 kvflow TPOT ms (graphs)", get("kvflow", "w2", "tpot_s_first_request"), 1e3),
            ("W2 kvflow TPOT ms (async sched.)",
             get("kvflow", "w2_async", "tpot_s_first_request"), 1e3),
            ("W2 kvflow TPOT ms (eager)", get("kvflow_eager", "w2", "tpot_s_first_request")
             or get("batch1", "w2_eager", "tpot_s_first_request"), 1e3),
            ("W2 kvflow TPOT / floor", get("kvflow", "w2", "tpot_over_floor"), 1),
            ("W2 HF TPOT ms", get("hf", "w2", "tpot_s"), 1e3)]
    for variant in BATCH1_ROWS:  # the batch-1 kernel A/B (gpu_bench.py batch1)
        rows += [(f"W2 {variant} {label}", get("batch1", "w2_" + variant, key), scale)
                 for label, key, scale in (("TPOT ms", "tpot_s_first_request", 1e3),
                                           ("/ graphs", "tpot_over_graphs", 1),
                                           ("/ eager", "tpot_over_eager", 1),
                                           ("same tokens", "tokens_equal_graphs", 1))
                 if variant.startswith("eager") or label != "/ eager"]
    for shape in ATTENTION_SHAPES:  # gpu_attention.py: one layer's attention call
        rows += [(f"attn {shape} {name} us", get("attention", "shapes", shape, name,
                                                 "us_per_layer_call"), 1)
                 for name in ATTENTION_VARIANTS]
        rows += [(f"attn {shape} {name}/triton", get("attention", "shapes", shape, name,
                                                     "time_over_triton"), 1)
                 for name in ATTENTION_VARIANTS[1:]]
    for variant in ("lockstep", "async", "tpot-cap"):
        rows += [(f"served W1 {variant} tok/s", get("serve", variant, "output_tok_per_s"), 1),
                 (f"served W1 {variant} / offline W1",
                  get("serve", variant, "fraction_of_offline"), 1),
                 (f"served W1 {variant} p99/median ITL",
                  get("serve", variant, "p99_over_median_itl"), 1)]
    return "\n".join(f"{name:34s} {'n/a' if v is None else f'{v * scale:.3f}'}"
                     for name, v, scale in rows)


HOST_CPU_KEEP = re.compile(r"^(Model name|CPU\(s\)|avx|amx|\| |\|-|kvflow |rate 4,)"
                           r"|\d+ (passed|failed|skipped)|error")


def host_cpu_lines(lines: list[str]) -> list[str]:
    """The host-CPU phases' results in gpu_check.sh's log (the lines after its ``host CPU``
    marker, up to the report): the CPU's name and flags, the kernel tests' summary, and
    cpu_decode_floor.py's figures and table."""
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("== ") and line.endswith("host CPU, CUDA hidden")), None)
    if start is None:
        return []
    kept = []
    for line in lines[start + 1:]:
        if line.startswith("== ") and line.endswith(" report"):
            break
        if HOST_CPU_KEEP.search(line):
            kept.append(line)
    return kept


def main(path: str) -> None:
    results = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            phase = r.pop("phase")
            if phase == "serve":
                results.setdefault("serve", {})[r["variant"]] = r
            else:
                results[phase + ("_eager" if r.get("enforce_eager") else "")] = r
    c = results.get("ceilings", {})
    bw, rate = c.get("copy_bytes_per_s"), c.get("bf16_matmul_flops")
    summary = {"ceilings": c}
    if bw and rate:
        w1_floor = w1_roofline_s(rate, bw)
        w2_floor = w2_tpot_floor_s(rate, bw)
        summary["roofline"] = {"w1_s": w1_floor, "w1_tok_per_s": 256 * 128 / w1_floor,
                               "w2_tpot_s": w2_floor}
        for name in ("kvflow", "kvflow_eager"):
            k = results.get(name)
            if k and "w1" in k:
                k["w1"]["fraction_of_roofline"] = w1_floor / k["w1"]["elapsed_s"]
            if k:
                k["w2"]["tpot_over_floor"] = k["w2"]["tpot_s_first_request"] / w2_floor
    offline = results.get("kvflow", {}).get("w1", {}).get("output_tok_per_s")
    for r in results.get("serve", {}).values():
        r["p99_over_median_itl"] = r["p99_itl_ms"] / r["median_itl_ms"]
        if offline:
            r["fraction_of_offline"] = r["output_tok_per_s"] / offline
    summary.update(results)
    summary["skipped"] = [line[3:] for line in lines  # phases gpu_check.sh had no budget for
                          if line.startswith("== ") and " skipped, " in line]
    summary["timed_out"] = [line[3:] for line in lines
                            if line.startswith("== ") and " timed out after " in line]
    summary["host_cpu"] = host_cpu_lines(lines)
    print(json.dumps(summary, indent=2))
    print(table(summary))
    for line in summary["skipped"]:
        print(f"not run: {line}")
    for line in summary["timed_out"]:
        print(f"cut short: {line}")
    if summary["host_cpu"]:
        print("host CPU (CUDA hidden):")
        print("\n".join(summary["host_cpu"]))
    out = sys.argv[2] if len(sys.argv) > 2 else None
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
