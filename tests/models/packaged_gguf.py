"""Helpers shared by the opt-in tests of real packaged GGUF models (gemma-3-270m,
Qwen2.5-Coder-0.5B-Instruct): resolve the joined file, and transformers' greedy reference."""

from __future__ import annotations

import os


def packaged_gguf_path(model: str, size: int) -> str:
    """The joined GGUF of packaged ``model``; asserts its size in bytes."""
    from kvflow.models.model_resolver import resolve_model

    source = resolve_model(model)
    assert source.kind == "gguf" and os.path.getsize(source.path) == size
    return source.path


def transformers_greedy(gguf_path: str, prompt_ids: list[int], recorded: list[int],
                        live_env: str) -> list[int]:
    """``recorded`` (transformers' greedy ids, stored in the test), or, when ``$live_env`` is
    "1", the same recomputed now: transformers loads the GGUF in float32 and generates
    ``len(recorded)`` tokens greedily after ``prompt_ids``."""
    if os.environ.get(live_env) != "1":
        return recorded
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=len(recorded))
    return out[0, len(prompt_ids):].tolist()


def assert_generates_like_transformers(model: str, prompt: str, prompt_ids: list[int],
                                       hf_greedy: list[int], hf_text: str, capsys,
                                       monkeypatch) -> None:
    """``kvflow generate --model MODEL --prompt PROMPT --temperature 0 --dtype float32`` prints
    prompt + transformers' text, and the ``LLM.generate`` call it makes (recorded by a spy that
    passes it through) returns transformers' prompt and output token ids and text (float32 like
    the reference: in the CPU's default bf16 the greedy pick can follow whichever GEMM kernel
    the per-shape timing chose, a near-tie the reference avoids). One engine: the CLI's (a
    second ``LLM(model)`` would load the model again, ~15 s of CPU)."""
    from kvflow import LLM
    from kvflow.entrypoints.cli import main

    outputs = []
    real_generate = LLM.generate

    def recording_generate(self, *args, **kwargs):
        result = real_generate(self, *args, **kwargs)
        outputs.extend(result)
        return result

    monkeypatch.setattr(LLM, "generate", recording_generate)
    max_tokens = len(hf_greedy)
    assert main(["generate", "--model", model, "--prompt", prompt, "--temperature", "0",
                 "--max-tokens", str(max_tokens), "--kv-cache-memory", "64MiB",
                 "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == prompt + hf_text
    (out,) = outputs
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == hf_greedy
    assert out.outputs[0].text == hf_text
