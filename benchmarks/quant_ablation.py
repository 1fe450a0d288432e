"""Ablations behind issue 16's two gemma-3-270m fixes: which INT8 KV-cache layout, and which
linears at INT4, in one fp32 engine whose weights or K/V rows are rounded in place
(fake quantization), so each variant costs one perplexity pass, not one load.

    python benchmarks/quant_ablation.py --model gemma-3-270m --mode kv \\
        --variants none,token,token/none,none/token,g64,g32,hadamard
    python benchmarks/quant_ablation.py --model gemma-3-270m --mode int4 \\
        --variants all,only:gate_up_proj,only:down_proj,only:o_proj,only:qkv_proj,int8:gate_up_proj

``--mode kv`` (the cache is the model dtype; keys and values are rounded before the attention
backend stores them, ``K/V`` names the key and value rules, one name: both): ``none``;
``token``: one absmax/127 scale per token and KV head (kvflow's rule before rotation);
``gN``: one scale per N channels of a head; ``hadamard``: rows multiplied by the orthonormal
Hadamard matrix, rounded per token and head, multiplied back (QuaRot, arXiv:2404.00456).

``--mode int4`` (the CPU GEMM's weight packing is skipped so weights can be swapped; the
vocabulary table is INT8 per row in every variant, as under ``--quantization int4``):
``all``: every linear INT4 (groups of 32, kvflow's min/max rule); ``only:A+B``: the named
linears INT4, the rest INT8 per channel; ``int8:A+B``: the named linears INT8, the rest INT4;
``none``: unquantized.

Perplexity: ``kvflow bench perplexity``'s windows of the shipped text; ratio to the first
variant. Results in docs/benchmarks.md (issue 16).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch


def round_rows(x: torch.Tensor, rule: str) -> torch.Tensor:
    """``x [..., head_dim]`` as an INT8 cache with ``rule`` gives it back (see module doc).

    Raises:
        ValueError: for an unknown rule.
    """
    from kvflow.kernels.kv_quant import fake_quantize_kv, key_rotation

    if rule == "none":
        return x
    if rule == "token":
        return fake_quantize_kv(x, torch.int8)
    if rule == "hadamard":
        r = key_rotation(x.shape[-1])
        return fake_quantize_kv(x.float() @ r, torch.int8) @ r.T
    if rule.startswith("g") and rule[1:].isdigit():
        group = int(rule[1:])
        grouped = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        return fake_quantize_kv(grouped, torch.int8).reshape(x.shape)
    raise ValueError(f"unknown KV rule {rule!r}")


def kv_ablation(llm, chunks, variants: list[str]) -> Iterator[str]:
    """Each variant in turn, with ``Attention.forward`` rounding K/V by its rules meanwhile."""
    from kvflow.attention.layer import Attention

    rules = {"k": "none", "v": "none"}
    forward = Attention.forward

    def rounded(self, q, k, v):
        return forward(self, q, round_rows(k, rules["k"]), round_rows(v, rules["v"]))

    Attention.forward = rounded
    try:
        for name in variants:
            k, _, v = name.partition("/")
            rules.update(k=k, v=v or k)
            yield name
    finally:
        Attention.forward = forward


def int4_ablation(llm, chunks, variants: list[str]) -> Iterator[str]:
    """Each variant in turn, with the linears' weights swapped in place to its INT4/INT8
    assignment meanwhile."""
    from kvflow.quant.int4 import dequantize_int4, quantize_int4_groupwise
    from kvflow.quant.int8 import quantize_int8_per_channel

    model = llm.engine.core.executor.runner.model
    linears = {n: m for n, m in model.named_modules()
               if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}
    table = model.model.embed_tokens
    original = {n: m.weight.data.clone() for n, m in linears.items()}
    original_table = table.weight.data.clone()

    def int8(w):
        q, s = quantize_int8_per_channel(w)
        return q.float() * s[:, None]

    int4 = {n: dequantize_int4(*quantize_int4_groupwise(w, 32)) for n, w in original.items()}
    for name in variants:
        kind, _, names = name.partition(":")
        table.weight.data.copy_(original_table if kind == "none" else int8(original_table))
        for n, m in linears.items():
            hit = any(n.endswith(x) for x in names.split("+")) if names else False
            at_int4 = {"all": True, "none": False, "only": hit, "int8": not hit}[kind]
            m.weight.data.copy_(original[n] if kind == "none"
                                else int4[n] if at_int4 else int8(original[n]))
        yield name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["kv", "int4"], required=True)
    parser.add_argument("--variants", required=True)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None, help="score fewer windows")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    if args.mode == "int4":  # keep plain weights, which the variants swap
        from kvflow.worker import cpu_setup

        cpu_setup.prepack_gemm_weights = lambda *a, **k: {}
    from kvflow import LLM
    from kvflow.bench.perplexity import DEFAULT_TEXT, perplexity_of, windows

    llm = LLM(model=args.model, dtype="float32", kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False)
    chunks = windows(llm.get_tokenizer().encode(DEFAULT_TEXT.read_text(encoding="utf-8")),
                     args.window)[:args.max_windows]
    run = kv_ablation if args.mode == "kv" else int4_ablation
    base = None
    start = time.perf_counter()
    for name in run(llm, chunks, args.variants.split(",")):
        ppl, scored = perplexity_of(llm, chunks)
        base = base or ppl
        print(f"{name:24s} perplexity {ppl:.4f} x{ppl / base:.4f} ({scored} tokens, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)
        start = time.perf_counter()


if __name__ == "__main__":
    main()
