"""Write a random-weight GeGLU decoder (Llama architecture, ``hidden_act`` a GELU form) for the
CPU decode benchmarks: by default hidden 512, 8 layers, 8 query / 4 KV heads of 64, MLP 1536,
Gemma's ``gelu_pytorch_tanh``, bf16, with another model folder's tokenizer (its vocabulary sets
the embedding size)::

    .venv/bin/python benchmarks/make_geglu_model.py out/smollm2-hf /tmp/geglu-512x8

then e.g. ``benchmarks/cpu_step_graphs.py /tmp/geglu-512x8 --before OLD_TREE``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokenizer_dir", help="a model folder whose tokenizer files are copied")
    p.add_argument("out_dir")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--hidden-act", default="gelu_pytorch_tanh")
    args = p.parse_args()
    import transformers

    src, out = Path(args.tokenizer_dir), Path(args.out_dir)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128), hidden_act=args.hidden_act,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    print(f"wrote {out}: {sum(t.numel() for t in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
