"""vLLM 0.32's ``LLM.get_world_size``, ``apply_model``, ``reset_mm_cache`` (text-only: a no-op;
the vision case is tests/multimodal/test_reset_mm_cache.py) and ``release_kv_cache_memory``
(refused: kvflow has no level-0 sleep) on the tiny Llama. ``apply_model``'s oracle:
transformers' model of the same weights (its embedding table and parameter count)."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=32, block_size=4)


def test_world_size_of_one_rank(llm):
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1


def test_world_size_counts_every_parallel_dimension(llm, monkeypatch):
    pc = llm.engine.config.parallel_config
    for name, value in (("tensor_parallel_size", 2), ("pipeline_parallel_size", 3),
                        ("data_parallel_size", 4)):
        monkeypatch.setattr(pc, name, value)
    assert (llm.get_world_size(), llm.get_world_size(include_dp=False)) == (24, 6)


def test_apply_model_runs_func_on_the_model(llm, tiny_llama):
    hf = tiny_llama.hf_model
    (found,) = llm.apply_model(lambda model: [
        p.detach().clone() for p in model.parameters()
        if tuple(p.shape) == tuple(hf.model.embed_tokens.weight.shape)])
    assert any(torch.equal(p, hf.model.embed_tokens.weight) for p in found)
    (is_module,) = llm.apply_model(lambda model: isinstance(model, torch.nn.Module))
    assert is_module is True
    with pytest.raises(ValueError, match="apply_model needs a callable"):
        llm.apply_model("model")


def test_reset_mm_cache_of_a_text_model_is_a_no_op(llm):
    assert llm.reset_mm_cache() is None
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 2


def test_release_kv_cache_memory_is_refused_naming_the_way(llm):
    with pytest.raises(ValueError, match=r"sleep\(level=0\).*wake_up\(tags=\['weights'\]\)"):
        llm.release_kv_cache_memory()
