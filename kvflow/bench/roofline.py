"""``kvflow bench roofline``: lower bounds on TTFT and TPOT and an upper bound on offline
output throughput, from the model config and two machine ceilings (Williams et al., "Roofline",
CACM 2009): every step takes at least max(FLOPs / peak FLOP rate, bytes moved / memory
bandwidth).

Counts (decoder-only transformer, dense attention):
- matmul parameters = layers x (q/k/v/o + gate/up/down) + the LM head (vocab x hidden); the
  embedding lookup reads one row per token and is ignored. Linear FLOPs per token = 2 x that.
- weight bytes = matmul parameters x bytes per weight, read once per step whatever the batch.
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element.
- attention FLOPs of a query at position c (attending to c + 1 keys) = 4 x layers x heads x
  head_dim x (c + 1) (QK^T and PV, 2 FLOPs per multiply-add).
Workload: ``num_prompts`` prompts of ``input_len`` tokens, ``output_len`` output tokens each; the
first output token comes from prefill, then ``output_len - 1`` decode steps.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

DTYPE_BYTES = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})


@dataclass(frozen=True)
class ModelShape:
    """The shape numbers the bounds need (from an HF config)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, heads,
                   getattr(cfg, "num_key_value_heads", None) or heads, head_dim, cfg.vocab_size)

    def matmul_params(self) -> int:
        """Weights used in matmuls per token (attention, MLP, LM head)."""
        attn = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn += self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cached per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, first_pos: int, num_tokens: int) -> float:
        """Attention FLOPs of ``num_tokens`` consecutive queries starting at position
        ``first_pos`` (causal: the query at c attends to c + 1 keys)."""
        keys = num_tokens * first_pos + num_tokens * (num_tokens + 1) / 2
        return 4 * self.num_layers * self.num_heads * self.head_dim * keys


@dataclass(frozen=True)
class Machine:
    """Ceilings: memory bandwidth in bytes/s and peak FLOP/s (None = not limiting)."""

    bandwidth: float | None
    flops: float | None

    def step_time(self, flops: float, nbytes: float) -> float:
        """Seconds of one step that does ``flops`` FLOPs and moves ``nbytes`` bytes."""
        compute = flops / self.flops if self.flops else 0.0
        memory = nbytes / self.bandwidth if self.bandwidth else 0.0
        return max(compute, memory)


def _prefill_time(m: ModelShape, hw: Machine, n: int, input_len: int, wbytes: int) -> float:
    flops = n * (2 * m.matmul_params() * input_len + m.attention_flops(0, input_len))
    return hw.step_time(flops, m.matmul_params() * wbytes + n * input_len *
                        m.kv_bytes_per_token(wbytes))


def _decode_time(m: ModelShape, hw: Machine, n: int, input_len: int, output_len: int,
                 wbytes: int) -> float:
    """Sum over decode steps j = 1..output_len-1: the token at position input_len + j - 1
    reads the weights once and every sequence's input_len + j cached K/V."""
    total = 0.0
    for j in range(1, output_len):
        ctx = input_len + j
        flops = n * (2 * m.matmul_params() + m.attention_flops(ctx - 1, 1))
        nbytes = m.matmul_params() * wbytes + n * ctx * m.kv_bytes_per_token(wbytes)
        total += hw.step_time(flops, nbytes)
    return total


def roofline(m: ModelShape, hw: Machine, num_prompts: int, input_len: int, output_len: int,
             dtype_bytes: int = 2) -> dict[str, float]:
    """Bounds for the workload: ``ttft_s`` and ``tpot_s`` of one request alone (lower bounds,
    seconds), ``offline_s`` for all prompts in one batch (lower bound) and
    ``output_tok_per_s`` = num_prompts x output_len / offline_s (upper bound)."""
    ttft = _prefill_time(m, hw, 1, input_len, dtype_bytes)
    decode1 = _decode_time(m, hw, 1, input_len, output_len, dtype_bytes)
    offline = (_prefill_time(m, hw, num_prompts, input_len, dtype_bytes) +
               _decode_time(m, hw, num_prompts, input_len, output_len, dtype_bytes))
    return {"ttft_s": ttft, "tpot_s": decode1 / max(output_len - 1, 1), "offline_s": offline,
            "output_tok_per_s": num_prompts * output_len / offline if offline else float("inf")}


def measured_from_json(path: str) -> dict[str, float]:
    """Measured figures from a ``bench serve`` (median TTFT/TPOT, output throughput),
    ``bench latency`` (batch-1 TTFT/TPOT, best throughput) or ``bench throughput`` result:
    keys ``ttft_s``, ``tpot_s``, ``output_tok_per_s`` (those present)."""
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):  # bench throughput
        return {"output_tok_per_s": doc[0]["output_tokens_per_s"]}
    if "batches" in doc:  # bench latency
        first = doc["batches"][0]
        best = max(b["output_tok_per_s"] for b in doc["batches"])
        return {"ttft_s": first["ttft_s"], "tpot_s": first["tpot_s"],
                "output_tok_per_s": best}
    return {"ttft_s": doc["median_ttft_ms"] / 1e3, "tpot_s": doc["median_tpot_ms"] / 1e3,
            "output_tok_per_s": doc["output_throughput"]}


def report(bounds: dict[str, float], measured: dict[str, float]) -> list[str]:
    """Lines "name  bound  [measured  bound/measured %]" (for throughput measured/bound)."""
    rows = [("TTFT, one request (ms)", "ttft_s", 1e3), ("TPOT, one request (ms)", "tpot_s", 1e3),
            ("offline output throughput (tok/s)", "output_tok_per_s", 1.0)]
    lines = []
    for name, key, scale in rows:
        line = f"{name:<36}{bounds[key] * scale:>12.2f}"
        if key in measured:
            got = measured[key]
            pct = got / bounds[key] if key == "output_tok_per_s" else bounds[key] / got
            line += f"  measured {got * scale:>10.2f} = {100 * pct:5.1f}% of roofline"
        lines.append(line)
    return lines


def _cmd_roofline(args: argparse.Namespace) -> int:
    from kvflow.models.loader import load_hf_config
    from kvflow.models.model_resolver import resolve_model

    shape = ModelShape.from_hf_config(load_hf_config(resolve_model(args.model)))
    nbytes = DTYPE_BYTES[args.dtype]
    print(f"model {args.model}: {shape}")
    print(f"matmul parameters {shape.matmul_params():,}  weight bytes "
          f"{shape.matmul_params() * nbytes:,}  KV bytes/token {shape.kv_bytes_per_token(nbytes):,}"
          f"  linear FLOPs/token {2 * shape.matmul_params():,}")
    if not args.bandwidth and not args.flops:
        print("give --bandwidth GB/s and/or --flops TFLOP/s for time bounds")
        return 0
    hw = Machine(args.bandwidth * 1e9 if args.bandwidth else None,
                 args.flops * 1e12 if args.flops else None)
    bounds = roofline(shape, hw, args.num_prompts, args.input_len, args.output_len, nbytes)
    measured = measured_from_json(args.measured_json) if args.measured_json else {}
    for key, value in (("ttft_s", args.measured_ttft_ms), ("tpot_s", args.measured_tpot_ms)):
        if value:
            measured[key] = value / 1e3
    if args.measured_tok_s:
        measured["output_tok_per_s"] = args.measured_tok_s
    print(f"workload {args.num_prompts} x {args.input_len} -> {args.output_len} tokens, "
          f"bandwidth {args.bandwidth} GB/s, {args.flops} TFLOP/s")
    print("\n".join(report(bounds, measured)))
    return 0


def add_roofline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roofline", help="lower bounds on TTFT/TPOT and throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="packaged model name, HF folder or GGUF")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                   help="weight and KV dtype")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth, GB/s")
    p.add_argument("--flops", type=float, default=None, help="peak matmul rate, TFLOP/s")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--measured-json", default=None,
                   help="a bench serve / latency / throughput result to compare")
    p.add_argument("--measured-ttft-ms", type=float, default=None)
    p.add_argument("--measured-tpot-ms", type=float, default=None)
    p.add_argument("--measured-tok-s", type=float, default=None)
    p.set_defaults(func=_cmd_roofline)
