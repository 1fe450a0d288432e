"""LLM.beam_search with LoRA adapters against the torch beam search of
``tests/test_beam_search.py`` run over transformers + peft logits (the adapter applied by peft
itself): a prompt with an adapter and one on the base model in one call each give the
reference's beams; a bad adapter is refused before any step runs."""

from __future__ import annotations

import pytest

from kvflow import LLM
from kvflow.beam_search import BeamSearchParams
from kvflow.lora.request import LoRARequest
from tests.lora.adapters import make_adapter
from tests.test_beam_search import TOLERANCE, reference_beam_search

PROMPTS = [[274, 310, 77, 160, 52, 39, 171], [43, 165, 262, 252, 17]]
WIDTH, MAX_TOKENS = 3, 6


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    return make_adapter(tiny_llama.path, str(tmp_path_factory.mktemp("beam_lora") / "a"), 5,
                        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=256,
               block_size=4, enable_lora=True, max_loras=1, max_lora_rank=8)


def _peft_model(base_path: str, adapter: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def test_adapter_and_base_prompts_match_peft_beams(llm, tiny_llama, adapter, assert_no_leaks):
    lora = LoRARequest("a", 1, adapter)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    outs = llm.beam_search(PROMPTS, params, lora_request=[lora, None])
    models = [_peft_model(tiny_llama.path, adapter), tiny_llama.hf_model]
    for prompt, out, model in zip(PROMPTS, outs, models):
        ref = reference_beam_search(model, prompt, WIDTH, MAX_TOKENS,
                                    tiny_llama.eos_token_id, 1.0)
        assert [s.tokens for s in out.sequences] == [b.tokens for b in ref]
        for seq, beam in zip(out.sequences, ref):
            assert seq.cum_logprob == pytest.approx(beam.cum_logprob, abs=TOLERANCE)
    # the adapter changes the search: the base model's beams for the first prompt differ
    base = reference_beam_search(tiny_llama.hf_model, PROMPTS[0], WIDTH, MAX_TOKENS,
                                 tiny_llama.eos_token_id, 1.0)
    assert [b.tokens for b in base] != [s.tokens for s in outs[0].sequences]


def test_bad_lora_requests_are_refused_before_a_step(llm, tmp_path, assert_no_leaks):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest, None, or a list "
                                         "of 2"):
        llm.beam_search(PROMPTS, params, lora_request=[None])
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.beam_search(PROMPTS[:1], params,
                        lora_request=LoRARequest("missing", 7, str(tmp_path)))
