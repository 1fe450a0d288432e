"""Decode speed and weight memory of an MoE GGUF under ``--quantization gguf``: experts kept
as their GGML blocks (the default) against experts dequantized at load
(``KVFLOW_GGUF_MOE=dequantized``), in one process, rounds interleaved.

    python benchmarks/gguf_moe_decode.py --type q8_0 --batch 1,8 --threads 2

The model is a random Qwen3-MoE written as a GGUF here (gguf-py's quantizer: Q8_0, Q4_0,
Q4_1 or Q5_0; the router and norms F32): ``--layers`` blocks of ``--hidden`` width, each with
``--experts`` experts of width ``--moe-inter`` (top ``--top-k``), attention and the vocabulary
table in the same type. For each path and batch size the engine generates ``--tokens`` tokens
per request from 8-token prompts (greedy, EOS ignored); decode tokens/s is the batch's
generated tokens over the wall time of the ``generate`` call, median over ``--repeats``
rounds. Weight bytes are the engine's ``weight_bytes`` (every parameter's storage once).
Ratios are kept / dequantized.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import numpy as np

TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0"}


def write_model(path: str, args: argparse.Namespace) -> None:
    """A random qwen3moe GGUF of the sizes in ``args``, weights normal(0, 0.02)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, TYPES[args.type])
    h, f, e, heads, kv, hd = (args.hidden, args.moe_inter, args.experts, args.heads,
                              args.kv_heads, args.head_dim)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in {"block_count": args.layers, "context_length": 512,
                       "embedding_length": h, "feed_forward_length": f,
                       "expert_feed_forward_length": f, "attention.head_count": heads,
                       "attention.head_count_kv": kv, "attention.key_length": hd,
                       "attention.value_length": hd, "expert_count": e,
                       "expert_used_count": args.top_k, "vocab_size": args.vocab}.items():
        w.add_uint32(f"qwen3moe.{key}", value)
    w.add_float32("qwen3moe.rope.freq_base", 10000.0)
    w.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)

    def add(name: str, *shape: int, quantize: bool = True) -> None:
        array = rng.normal(0.0, 0.02, shape).astype(np.float32)
        if quantize:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ones(shape, np.float32) if "norm" in name else array)

    add("token_embd.weight", args.vocab, h)
    add("output.weight", args.vocab, h)
    add("output_norm.weight", h, quantize=False)
    for i in range(args.layers):
        b = f"blk.{i}"
        add(f"{b}.attn_q.weight", heads * hd, h)
        add(f"{b}.attn_k.weight", kv * hd, h)
        add(f"{b}.attn_v.weight", kv * hd, h)
        add(f"{b}.attn_output.weight", h, heads * hd)
        for norm in ("attn_norm", "ffn_norm"):
            add(f"{b}.{norm}.weight", h, quantize=False)
        for norm in ("attn_q_norm", "attn_k_norm"):
            add(f"{b}.{norm}.weight", hd, quantize=False)
        add(f"{b}.ffn_gate_inp.weight", e, h, quantize=False)
        add(f"{b}.ffn_gate_exps.weight", e, f, h)
        add(f"{b}.ffn_up_exps.weight", e, f, h)
        add(f"{b}.ffn_down_exps.weight", e, h, f)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def build(path: str, choice: str, args: argparse.Namespace):
    from kvflow import LLM

    os.environ["KVFLOW_GGUF_MOE"] = choice
    return LLM(model=path, skip_tokenizer_init=True, quantization="gguf", dtype=args.dtype,
               device="cpu", num_kv_blocks=256, block_size=16, seed=0)


def decode_rate(llm, batch: int, args: argparse.Namespace) -> float:
    """Generated tokens per second of one ``generate`` call over ``batch`` requests."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * r + j) % args.vocab + 2 for j in range(8)]}
               for r in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def layer_timings(args: argparse.Namespace) -> None:
    """``--layer``: one ``FusedMoE`` forward alone (random router logits each call, so the
    routed experts change), experts kept as Q-blocks vs dequantized float32, over a pool of
    ``--layers`` layers cycled so the weights come from memory as in a forward pass; median
    microseconds per call over ``--calls`` calls per round, rounds interleaved."""
    import gguf
    import torch

    from kvflow.layers.moe import FusedMoE
    from kvflow.quant.gguf_moe import GGUFFusedMoEMethod

    qtype = getattr(gguf.GGMLQuantizationType, TYPES[args.type])
    h, f, e = args.hidden, args.moe_inter, args.experts
    rng = np.random.default_rng(0)
    pools: dict[str, list[FusedMoE]] = {"quantized": [], "dequantized": []}
    for _ in range(args.layers):
        kept = FusedMoE(e, args.top_k, h, f, renormalize=True)
        kept.set_quant_method(GGUFFusedMoEMethod())
        plain = FusedMoE(e, args.top_k, h, f, renormalize=True)
        for expert in range(e):
            for shard, shape in (("w1", (f, h)), ("w3", (f, h)), ("w2", (h, f))):
                raw = gguf.quants.quantize(rng.normal(0, 0.02, shape).astype(np.float32), qtype)
                blocks = torch.from_numpy(raw.copy())
                blocks.ggml_type = int(qtype)
                param = kept.w2_weight if shard == "w2" else kept.w13_weight
                kept.weight_loader(param, blocks, shard, expert)
                values = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
                param = plain.w2_weight if shard == "w2" else plain.w13_weight
                plain.weight_loader(param, values, shard, expert)
        kept.quant_method.process_weights_after_loading(kept)
        pools["quantized"].append(kept)
        pools["dequantized"].append(plain)
    for batch in (int(b) for b in args.batch.split(",")):
        hidden = torch.randn(batch, h)
        times: dict[str, list[float]] = {c: [] for c in pools}
        for _ in range(args.repeats):
            for choice, layers in pools.items():
                gen = torch.Generator().manual_seed(1)
                calls = []
                for i in range(args.calls):
                    logits = torch.randn(batch, e, generator=gen)
                    start = time.perf_counter()
                    layers[i % len(layers)](hidden, logits)
                    calls.append(time.perf_counter() - start)
                times[choice].append(statistics.median(calls) * 1e6)
        med = {c: statistics.median(t) for c, t in times.items()}
        print(f"layer, {batch} rows: kept {med['quantized']:.0f} us, dequantized "
              f"{med['dequantized']:.0f} us (x{med['dequantized'] / med['quantized']:.2f} "
              "speed-up of kept)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="q8_0", choices=sorted(TYPES))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer", action="store_true", help="time one MoE layer alone")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], check=False,
                         capture_output=True, text=True).stdout.split(":", 1)[-1].strip()
    print(f"{cpu}; torch threads {args.threads}; {args.type}, dtype {args.dtype}; "
          f"{args.layers} layers, hidden {args.hidden}, {args.experts} experts of "
          f"{args.moe_inter}, top-{args.top_k}")
    if args.layer:
        layer_timings(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "moe.gguf")
        write_model(path, args)
        llms = {c: build(path, c, args) for c in ("quantized", "dequantized")}
        sizes = {c: llm.engine.core.weight_bytes for c, llm in llms.items()}
        print(f"weight bytes: kept {sizes['quantized'] / 2**20:.1f} MiB, dequantized "
              f"{sizes['dequantized'] / 2**20:.1f} MiB "
              f"(x{sizes['quantized'] / sizes['dequantized']:.3f})")
        for batch in (int(b) for b in args.batch.split(",")):
            for llm in llms.values():
                decode_rate(llm, batch, args)  # warm-up
            rates: dict[str, list[float]] = {c: [] for c in llms}
            for _ in range(args.repeats):
                for c, llm in llms.items():
                    rates[c].append(decode_rate(llm, batch, args))
            med = {c: statistics.median(r) for c, r in rates.items()}
            print(f"batch {batch}: kept {med['quantized']:.1f} tok/s, dequantized "
                  f"{med['dequantized']:.1f} tok/s (x{med['quantized'] / med['dequantized']:.2f})")


if __name__ == "__main__":
    main()
