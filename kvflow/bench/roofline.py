"""``kvflow bench roofline``: lower bounds on TTFT and TPOT and an upper bound on offline
output throughput, from the model config and two machine ceilings (Williams et al., "Roofline",
CACM 2009). The bound is taken per operation, not per step: a step runs its linear layers
(weights read once, ``2 x params`` FLOPs per token) and then its attention (every sequence's
K/V read, ``4 x layers x heads x head_dim`` FLOPs per query and key), one after the other, so
it takes at least max(linear FLOPs / peak, weight bytes / bandwidth) + max(attention FLOPs /
peak, K/V bytes / bandwidth). At decode batch 256 on an 8B model the linear layers are
compute-bound while attention is bandwidth-bound; a per-step max(total FLOPs / peak, total
bytes / bandwidth) would let the two overlap and understate the floor (8.2 instead of 9.5 ms
per step on an H200).

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

from kvflow.bench.checks import require_positive

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

    def op_time(self, flops: float, nbytes: float) -> float:
        """Seconds of one operation that does ``flops`` FLOPs and moves ``nbytes`` bytes."""
        compute = flops / self.flops if self.flops else 0.0
        memory = nbytes / self.bandwidth if self.bandwidth else 0.0
        return max(compute, memory)


def step_time(m: ModelShape, hw: Machine, num_tokens: int, attention_flops: float,
              kv_bytes: float, wbytes: int) -> float:
    """Lower bound on one step of ``num_tokens`` tokens: its linear layers (weights read
    once) plus its attention (``attention_flops``, ``kv_bytes`` of K/V moved), each at the
    slower of its two ceilings."""
    linear = hw.op_time(2 * m.matmul_params() * num_tokens, m.matmul_params() * wbytes)
    return linear + hw.op_time(attention_flops, kv_bytes)


def _prefill_time(m: ModelShape, hw: Machine, n: int, input_len: int, wbytes: int) -> float:
    """One step of ``n`` whole prompts: K/V written once, attention within the chunk."""
    return step_time(m, hw, n * input_len, n * m.attention_flops(0, input_len),
                     n * input_len * m.kv_bytes_per_token(wbytes), wbytes)


def _decode_time(m: ModelShape, hw: Machine, n: int, input_len: int, output_len: int,
                 wbytes: int) -> float:
    """Sum over decode steps j = 1..output_len-1: the token at position input_len + j - 1
    reads the weights once and every sequence's input_len + j cached K/V."""
    total = 0.0
    for j in range(1, output_len):
        ctx = input_len + j
        total += step_time(m, hw, n, n * m.attention_flops(ctx - 1, 1),
                           n * ctx * m.kv_bytes_per_token(wbytes), wbytes)
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
    """Measured figures, and the workload they were measured on, from a result file:

    - ``bench serve`` (one run, or the highest-throughput run of a sweep): median TTFT and
      TPOT under load, output throughput; workload = its prompts and mean token counts;
    - ``bench latency``: batch-1 TTFT/TPOT, best output throughput; workload = its lengths
      and largest batch;
    - ``bench throughput``: output throughput; workload = its prompts and lengths.

    Returns keys ``ttft_s``, ``tpot_s``, ``output_tok_per_s`` (those present) and
    ``num_prompts``, ``input_len``, ``output_len`` (those the file records), plus ``source``.

    Raises:
        ValueError: when the file cannot be read or is not one of those results.
    """
    try:
        with open(path) as f:
            doc = json.load(f)
        return _measured(doc)
    except OSError as e:
        raise ValueError(f"--measured-json {path}: cannot read it ({e.strerror})") from e
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"--measured-json {path}: not a kvflow bench serve, latency or "
                         f"throughput result ({e.__class__.__name__}: {e})") from e


def _measured(doc: Any) -> dict[str, Any]:
    if isinstance(doc, list):  # bench throughput
        r = doc[0]
        out = {"output_tok_per_s": r["output_tokens_per_s"], "num_prompts": r["num_prompts"],
               "source": "bench throughput"}
        out.update({k: r[k] for k in ("input_len", "output_len") if k in r})
        return out
    if "batches" in doc:  # bench latency
        first = doc["batches"][0]
        return {"ttft_s": first["ttft_s"], "tpot_s": first["tpot_s"],
                "output_tok_per_s": max(b["output_tok_per_s"] for b in doc["batches"]),
                "num_prompts": max(b["batch_size"] for b in doc["batches"]),
                "input_len": doc["input_len"], "output_len": doc["output_len"],
                "source": "bench latency (TTFT/TPOT at batch 1)"}
    run = max(doc["sweep"], key=lambda r: r["output_throughput"]) if "sweep" in doc else doc
    done = max(run["completed"], 1)
    out = {"output_tok_per_s": run["output_throughput"], "num_prompts": run["num_prompts"],
           "input_len": round(run["total_input_tokens"] / done),
           "output_len": round(run["total_output_tokens"] / done),
           "source": f"bench serve at {run['request_rate']} req/s (TTFT/TPOT: medians under "
                     f"load, not one request alone)"}
    for key, name in (("ttft_s", "median_ttft_ms"), ("tpot_s", "median_tpot_ms")):
        if run.get(name) is not None:
            out[key] = run[name] / 1e3
    return out


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
    from kvflow.config.model import parse_hf_overrides
    from kvflow.models.loader import load_hf_config
    from kvflow.models.model_resolver import resolve_model

    require_positive(bandwidth=args.bandwidth, flops=args.flops, num_prompts=args.num_prompts,
                     input_len=args.input_len, output_len=args.output_len,
                     measured_ttft_ms=args.measured_ttft_ms,
                     measured_tpot_ms=args.measured_tpot_ms, measured_tok_s=args.measured_tok_s)
    measured = measured_from_json(args.measured_json) if args.measured_json else {}
    workload = {key: getattr(args, key) or measured.get(key) or default
                for key, default in (("num_prompts", 64), ("input_len", 128), ("output_len", 64))}
    shape = ModelShape.from_hf_config(load_hf_config(
        resolve_model(args.model), hf_overrides=parse_hf_overrides(args.hf_overrides),
        trust_remote_code=args.trust_remote_code))
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
    bounds = roofline(shape, hw, workload["num_prompts"], workload["input_len"],
                      workload["output_len"], nbytes)
    for key, value in (("ttft_s", args.measured_ttft_ms), ("tpot_s", args.measured_tpot_ms)):
        if value:
            measured[key] = value / 1e3
    if args.measured_tok_s:
        measured["output_tok_per_s"] = args.measured_tok_s
    print(f"workload {workload['num_prompts']} x {workload['input_len']} -> "
          f"{workload['output_len']} tokens, bandwidth {args.bandwidth} GB/s, "
          f"{args.flops} TFLOP/s")
    if "source" in measured:
        print(f"measured: {measured['source']}; workload flags not given are taken from it")
    print("\n".join(report(bounds, measured)))
    return 0


def add_roofline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("roofline", help="lower bounds on TTFT/TPOT and throughput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="packaged model name, HF folder or GGUF")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                   help="weight and KV dtype")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="config.json keys merged in, as `kvflow serve --hf-overrides` (the "
                        "shape bounded is the one the engine would serve)")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="let transformers run the folder's own config class, as kvflow serve")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth, GB/s")
    p.add_argument("--flops", type=float, default=None, help="peak matmul rate, TFLOP/s")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="workload (default: the measured result's, else 64)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (default: the measured result's, else 128)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens (default: the measured result's, else 64)")
    p.add_argument("--measured-json", default=None,
                   help="a bench serve / latency / throughput result to compare")
    p.add_argument("--measured-ttft-ms", type=float, default=None,
                   help="a measured TTFT to compare (ms; overrides --measured-json's)")
    p.add_argument("--measured-tpot-ms", type=float, default=None,
                   help="a measured TPOT to compare (ms; overrides --measured-json's)")
    p.add_argument("--measured-tok-s", type=float, default=None,
                   help="a measured output rate to compare (tokens/s; overrides "
                   "--measured-json's)")
    p.set_defaults(func=_cmd_roofline)
