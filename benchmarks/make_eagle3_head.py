"""Write a random-weight EAGLE-3 head for a Llama-family target folder (vLLM's
``Eagle3LlamaForCausalLM`` layout: ``fc`` [H, 3H], one layer whose q/k/v read 2H, ``hidden_norm``,
its own ``lm_head`` over ``draft_vocab_size`` tokens with ``d2t``; the target's embedding
shared), for the speculative-decoding step benchmarks. Its drafts are nearly never accepted: it
measures what an EAGLE-3 engine's steps cost (the target's verification steps, the head's
passes), not what speculation gains::

    .venv/bin/python benchmarks/make_eagle3_head.py out/smollm2-hf /tmp/eagle3-head

then e.g. ``benchmarks/cpu_step_graphs.py out/smollm2-hf --speculative-config
'{"method": "eagle3", "model": "/tmp/eagle3-head", "num_speculative_tokens": 3,
"adaptive": false}'``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def head_tensors(config: dict, draft_vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """The head's tensors (bf16; ``d2t`` int64) for target ``config`` (an HF config dict)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    ids = torch.randperm(config["vocab_size"], generator=g)[:draft_vocab].sort().values
    norms = {f"midlayer.{n}.weight": torch.ones(h, dtype=torch.bfloat16)
             for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    return {"fc.weight": rand(h, 3 * h), "norm.weight": torch.ones(h, dtype=torch.bfloat16),
            "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
            "midlayer.mlp.gate_proj.weight": rand(inter, h),
            "midlayer.mlp.up_proj.weight": rand(inter, h),
            "midlayer.mlp.down_proj.weight": rand(h, inter),
            "lm_head.weight": rand(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab),
            **norms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target_dir")
    p.add_argument("out_dir")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = json.loads((Path(args.target_dir) / "config.json").read_text())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(config, args.draft_vocab, args.seed), str(out / "model.safetensors"))
    head = {**config, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": args.draft_vocab, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(head, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
