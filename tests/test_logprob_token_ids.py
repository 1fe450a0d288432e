"""vLLM 0.32's ``logprob_token_ids``: at every generated position the logprobs of the listed
token ids (and of the sampled one), in place of the top ``logprobs``. Checked against the
log-softmax of the transformers model's float32 logits over the prompt and the generated
tokens (the independent oracle), greedy and sampled, alone and batched with a plain top-k
request; and the refusals (no logprobs, an empty list, an id outside the vocabulary)."""

from __future__ import annotations

import pytest
import torch

from kvflow.sampling_params import SamplingParams

PROMPT = [5, 17, 33, 100, 200, 7, 9, 42]
LISTED = [66, 200, 7, 3]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from kvflow import LLM
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
               block_size=4)


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """float32 [len(output), V]: the log-softmax the model gives each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_listed_logprobs_match_transformers(llm, tiny_llama, temperature):
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=6, ignore_eos=True,
                            logprobs=5, logprob_token_ids=LISTED)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}],
                        [params, plain])
    out = outs[0].outputs[0]
    ref = _reference(tiny_llama.hf_model, PROMPT, out.token_ids)
    for pos, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
        assert list(step) == list(dict.fromkeys([token, *LISTED]))  # sampled, then listed
        for tid, lp in step.items():
            assert lp.logprob == pytest.approx(float(ref[pos, tid]), abs=1e-4)
        assert step[token].rank == int((ref[pos] > ref[pos, token]).sum()) + 1
    other = outs[1].outputs[0]  # the batched top-2 request keeps its own top tokens
    other_ref = _reference(tiny_llama.hf_model, PROMPT[:5], other.token_ids)
    for pos, step in enumerate(other.logprobs):
        top2 = other_ref[pos].topk(2).indices.tolist()
        assert set(step) == {other.token_ids[pos], *top2}


@pytest.mark.parametrize("kwargs,match", [
    ({"logprob_token_ids": [5]}, "needs logprobs set"),
    ({"logprob_token_ids": [], "logprobs": 0}, "must name at least one token id"),
    ({"logprob_token_ids": [5, "6"], "logprobs": 0}, "a list of integer token ids"),
])
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_id_outside_the_vocabulary(llm, tiny_llama):
    with pytest.raises(ValueError, match=r"logprob_token_ids has token id \d+ outside"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            max_tokens=2, logprobs=0, logprob_token_ids=[1, tiny_llama.vocab_size]))
