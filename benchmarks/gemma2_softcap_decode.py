"""Decode ms/token of a tiny-ish random Gemma 2 (attention-logit soft-capping on) on the native
"cpu" attention backend vs the plain "torch" one.

Usage: PYTHONPATH=. .venv/bin/python benchmarks/gemma2_softcap_decode.py [--threads 2]

The model: SmolLM2-135M's shape in Gemma 2 form (hidden 576, 9 query / 3 KV heads of 64,
intermediate 1536, 12 layers alternating sliding window 512 / global, vocab 8192,
attn_logit_softcapping 50, final 30), random weights, bfloat16. Per backend: a batch of
``--batch`` prompts of ``--prompt`` tokens, generated once with 1 token and once with
``--tokens`` tokens (greedy, EOS ignored); decode ms/token = the difference / (tokens - 1),
best of ``--repeats``. Prints one line per backend.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _model(folder: str) -> None:
    import transformers

    config = transformers.Gemma2Config(
        vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=512, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)


def _decode_ms(folder: str, backend: str, args: argparse.Namespace) -> float:
    from kvflow import LLM, SamplingParams

    llm = LLM(model=folder, dtype="bfloat16", device="cpu", attention_backend=backend,
              skip_tokenizer_init=True, num_kv_blocks=512, block_size=16)
    assert llm.engine.core.executor.runner.attn_ctx.backend.name == backend
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 8192, (args.prompt,), generator=gen).tolist()
               for _ in range(args.batch)]

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    run(args.tokens)  # warm-up
    best = min(run(args.tokens) - run(1) for _ in range(args.repeats))
    return best / (args.tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        _model(folder)
        for backend in ("cpu", "torch"):
            print(f"{backend:6s} batch {args.batch} prompt {args.prompt}: "
                  f"{_decode_ms(folder, backend, args):.2f} ms/token (decode step)")


if __name__ == "__main__":
    main()
