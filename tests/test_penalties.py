"""Presence / frequency / repetition penalties and logit bias: the vectorized sampler code
against a per-token loop written from the OpenAI / vLLM definitions, the engine's greedy tokens
against that loop over transformers' logits (a batch of different penalties, prefix caching,
chunked prefill, preemption), parameter validation, and the vocabulary check of the input
processor."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM
from kvflow.inputs.processor import InputProcessor
from kvflow.layers.sampler import Sampler, apply_penalties
from kvflow.layers.sampling_metadata import PenaltyMetadata, SamplingMetadata
from kvflow.sampling_params import SamplingParams

VOCAB = 50


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int],
                        p: SamplingParams) -> torch.Tensor:
    """One row, token by token: repetition (CTRL) on prompt + output tokens, then
    ``frequency * count`` and ``presence * (count > 0)`` over output tokens."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / p.repetition_penalty if value > 0 else value * \
            p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_match_the_per_token_definition():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    prompts = [[1, 2, 3, 3], [], [7] * 5 + [8], [9, 10]]
    outputs = [[3, 4, 4, 4, 11], [5, 5], [], [12]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.7),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0),
              SamplingParams(repetition_penalty=0.5),
              SamplingParams()]  # row 3 uses nothing: it must stay untouched
    rows = [0, 1, 2]
    pen = PenaltyMetadata.build(rows, [prompts[i] for i in rows], [outputs[i] for i in rows],
                                [params[i] for i in rows], torch.device("cpu"))
    got = logits.clone()
    apply_penalties(got, pen)
    for i in rows:
        expected = reference_penalties(logits[i], prompts[i], outputs[i], params[i])
        torch.testing.assert_close(got[i], expected)
    torch.testing.assert_close(got[3], logits[3])


def test_logit_bias_and_penalties_steer_greedy_sampling():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 4.0  # the argmax of both rows
    meta = SamplingMetadata(temperature=torch.zeros(2))
    meta.logit_bias = (torch.tensor([0]), torch.tensor([17]), torch.tensor([10.0]))
    meta.penalties = PenaltyMetadata.build([1], [[]], [[5]],
                                           [SamplingParams(presence_penalty=2.0,
                                                           frequency_penalty=2.0)],
                                           torch.device("cpu"))
    logits[1, 6] = 1.0  # second best of row 1: wins once token 5 is penalized 4 -> 0
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.sampled.tolist() == [17, 6]


@pytest.mark.parametrize("kwargs,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
])
def test_invalid_penalties_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_logit_bias_keys_become_ints_and_uses_penalties():
    p = SamplingParams(logit_bias={"7": -100, 8: 2})
    assert p.logit_bias == {7: -100.0, 8: 2.0}
    assert not p.uses_penalties and SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("kwargs,field", [({"logit_bias": {VOCAB: 1}}, "logit_bias"),
                                          ({"stop_token_ids": [-1]}, "stop_token_ids")])
def test_token_ids_outside_the_vocabulary_are_refused(kwargs, field):
    processor = InputProcessor(None, max_model_len=64, vocab_size=VOCAB, eos_token_id=0)
    with pytest.raises(ValueError, match=f"{field} has token id"):
        processor.make_requests("r", [1, 2], SamplingParams(**kwargs))


# ---- the engine against transformers ----------------------------------------------------------
PENALTY_CASES = [{"repetition_penalty": 1.8}, {"presence_penalty": 1.5},
                 {"frequency_penalty": 1.2}, {"repetition_penalty": 0.7, "frequency_penalty": -0.5},
                 {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3,
                  "logit_bias": {40: 2.0}},
                 {}]
STEPS = 24
MARGIN = 1e-3  # smallest top-1 lead over the runner-up the reference accepts


def _greedy_reference(hf_model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy tokens over transformers' logits, step by step: logit_bias, then the
    penalties by ``reference_penalties`` over the prompt and the tokens generated so far."""
    out: list[int] = []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].float()
        for token, bias in (p.logit_bias or {}).items():
            logits[token] += bias
        logits = reference_penalties(logits, prompt, out, p)
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, (p, out)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("config", [
    {},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 6},  # cached prefix, chunks
    {"num_kv_blocks": 14, "max_num_batched_tokens": 8},  # preempted and recomputed
    {"num_kv_blocks": 14, "max_num_batched_tokens": 8, "async_scheduling": True},
], ids=["batch", "prefix_cache_chunks", "preemption", "async_preemption"])
def test_greedy_penalties_match_transformers_in_one_batch(tiny_llama, config, assert_no_leaks):
    """Requests with different penalties in one batch (per-request values must not leak
    across rows), 24 tokens each, against transformers step by step; with a prefix-cache hit
    and chunked prefill, and with preemption (recomputed requests count the tokens they
    generated before)."""
    config = {"num_kv_blocks": 64, "block_size": 4, **config}
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", **config)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(2, tiny_llama.vocab_size, (9,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, tiny_llama.vocab_size, (n,), generator=gen).tolist()
               for n in (1, 5, 3, 7, 2, 4)]
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **fields)
              for fields in PENALTY_CASES]
    llm.generate([prompts[0]], params[0], use_tqdm=False)  # the shared prefix is cached
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == _greedy_reference(tiny_llama.hf_model, prompt, p)
    if "prefix" in str(config):
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert (llm.engine.core.scheduler.num_preemptions > 0) == (config["num_kv_blocks"] == 14)
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    from kvflow import LLM
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
               block_size=4)


def test_extreme_repetition_penalty_is_its_limit(tiny_llm, tiny_llama, assert_no_leaks):
    """repetition_penalty=1e-300 is 0 in float32, so a seen token's positive logit became
    inf and the row NaN: the sample was token 0 (the EOS) at once. Its limit: a token seen
    in the prompt or output with a positive logit outweighs every other token. Checked
    against the transformers model's own logits at each step. 1e308 (inf in float32, where
    a logit of exactly 0 times inf would be NaN) samples what 1e30 (finite) does."""
    prompt = [5, 17, 33, 100, 200, 7, 9, 42, 3, 11]
    params = SamplingParams(repetition_penalty=1e-300, seed=7, max_tokens=8, ignore_eos=True)
    (out,) = tiny_llm.generate([prompt], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 8
    checked = 0
    for i, token in enumerate(tokens):
        seen = set(prompt) | set(tokens[:i])
        with torch.no_grad():
            logits = tiny_llama.hf_model(torch.tensor([prompt + tokens[:i]])).logits[0, -1]
        if any(logits[t] > 0 for t in seen):
            assert token in seen and logits[token] > 0, (i, token)
            checked += 1
    assert checked >= 4  # the oracle applied to most steps
    outs = [tiny_llm.generate([prompt], SamplingParams(repetition_penalty=r, seed=7,
                                                       max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids for r in (1e308, 1e30)]
    assert outs[0] == outs[1]  # both: seen positive logits ~0, seen negative ones ~-inf
    assert_no_leaks(tiny_llm)


def test_infinite_repetition_penalty_is_refused():
    """inf was accepted offline (the server refuses it: a JSON number must be finite)."""
    with pytest.raises(ValueError, match=r"SamplingParams\.repetition_penalty=inf"):
        SamplingParams(repetition_penalty=float("inf"))
