"""vLLM's ``--disable-sliding-window`` (``LLM(disable_sliding_window=True)``): max_model_len is
capped at the model's sliding window (the tiny Mistral's: 8 tokens), as vLLM's
``get_and_verify_max_len`` caps it, so every context fits the window and the outputs equal
the model's own (greedy tokens checked against transformers); a longer prompt is refused; a
larger ``max_model_len`` is refused; a model without a sliding window is left as it is."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.entrypoints.cli import build_parser

WINDOW = 8  # the tiny specs' window (tests/models/test_sliding_window.py)


def _llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", num_kv_blocks=64, block_size=4, **kw)


def _hf_greedy(tiny, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                     min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_context_capped_at_the_window(tiny_model_factory):
    tiny = tiny_model_factory("mistral_sliding_window")
    assert _llm(tiny.path).engine.core.max_model_len > WINDOW  # without the flag
    llm = _llm(tiny.path, disable_sliding_window=True)
    assert llm.engine.core.max_model_len == WINDOW
    prompt = [5, 9, 13, 2, 77]
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                   ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == _hf_greedy(tiny, prompt, 3)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(5, 5 + WINDOW + 1))], SamplingParams(max_tokens=1),
                     use_tqdm=False)


def test_larger_max_model_len_refused(tiny_model_factory):
    tiny = tiny_model_factory("mistral_sliding_window")
    with pytest.raises(ValueError, match=r"max_model_len=16 exceeds the model's sliding "
                                         r"window \(8 tokens\)"):
        _llm(tiny.path, disable_sliding_window=True, max_model_len=16)


def test_no_window_no_effect(tiny_llama):
    assert _llm(tiny_llama.path, disable_sliding_window=True).engine.core.max_model_len == \
        _llm(tiny_llama.path).engine.core.max_model_len


def test_flag():
    args = build_parser().parse_args(["serve", "--disable-sliding-window"])
    assert EngineConfig.from_cli_args(args).model_config.disable_sliding_window is True
