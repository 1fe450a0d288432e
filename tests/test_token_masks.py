"""vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` in SamplingParams.

Oracles: ``bad_words``' tokenization against token ids written from the tiny tokenizer's own
pieces (``convert_tokens_to_ids``); the per-row bans of a speculative verification step
against hand-computed ones; ``apply_allowed_token_ids`` against a per-row loop; greedy
engine output (batched decode, native CPU kernels on and off, n-gram speculative decoding)
against a plain torch loop over transformers' logits with the same masks, whose top-1 margin
is asserted at every step (no near-tie that another CPU could flip); truncation against
generating from the explicitly cut prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.inputs.processor import InputProcessor
from kvflow.layers.sampler import apply_allowed_token_ids
from kvflow.sampling.token_masks import bad_words_token_ids
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.request_state import RequestState
from kvflow.worker.sampling_inputs import SamplingInputs
from tests.test_input_batch import FULL

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
STEPS = 8
MARGIN = 1e-3  # smallest top-1 lead over the runner-up the reference accepts


# ---- bad_words tokenization -------------------------------------------------------------------
@pytest.mark.parametrize("word,pieces", [
    ("a", [["a"], ["Ġa"]]),  # one token, and its prefix-space variant
    (" re", [["re"], ["Ġre"]]),  # leading spaces are stripped first
    ("ab", [["a", "b"], ["Ġa", "b"]]),  # two tokens; the variant has as many
    ("the", [["t", "h", "e"]]),  # " the" is one token: a variant of another length is dropped
    ("(ict", [["(", "ict"]]),  # " (ict" is Ġ ( ict: longer, dropped
])
def test_bad_words_tokenize_as_vllm_does(tiny_tokenizer, word, pieces):
    expected = [tiny_tokenizer.convert_tokens_to_ids(p) for p in pieces]
    assert bad_words_token_ids(tiny_tokenizer, [word], len(tiny_tokenizer)) == expected


def test_bad_words_outside_the_vocabulary_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"bad_words: the word 'ab' encodes to token id 66 "):
        bad_words_token_ids(tiny_tokenizer, ["ab"], 66)


# ---- masks per sampling row -------------------------------------------------------------------
def test_bans_follow_the_drafts_at_every_verification_position():
    """Generated [9, 66]; drafts [12, 66, 30] in place. Bad words [12] (always), [66, 12]
    and [9, 66, 30]; min_tokens=3 bans the EOS (2) at the first position only (2 generated,
    + 0 drafts). Position j counts the first j drafts as generated."""
    batch = InputBatch(2, [FULL])
    params = SamplingParams(min_tokens=3, allowed_token_ids=[12, 30, 40])
    params.bad_words_token_ids = [[12], [66, 12], [9, 66, 30]]
    batch.add_request(RequestState("a", [5, 6], params, 2), [9, 66], ([1],), 4)
    batch.write_draft_tokens(0, [12, 66, 30])
    inputs = SamplingInputs(torch.device("cpu"))
    meta = inputs.build(batch, np.zeros(4, np.int64), num_extra=np.arange(4))
    assert {i: sorted(b) for i, b in meta.banned_token_ids.items()} == \
        {0: [2, 12, 12, 30], 1: [12], 2: [12, 12], 3: [12]}
    assert batch.min_tokens_banned == {"a": [2]}  # its list is not extended in place
    rows, positions, ids = meta.allowed_token_ids
    assert rows.tolist() == [0, 1, 2, 3]
    assert sorted(zip(positions.tolist(), ids.tolist())) == \
        [(p, t) for p in range(4) for t in (12, 30, 40)]
    plain = inputs.build(batch, np.array([0]))  # a plain step: position 0's bans
    assert sorted(plain.banned_token_ids[0]) == [2, 12, 12, 30]


def test_allowed_token_ids_tensors_follow_the_batch_rows():
    """The per-step tensors are reused while the rows stay (same objects) and rebuilt when
    a request leaves or joins; each time they list exactly each row's allowed ids."""
    def pairs(meta):
        rows, positions, ids = meta.allowed_token_ids
        return sorted((rows[p].item(), t) for p, t in zip(positions.tolist(), ids.tolist()))

    batch = InputBatch(3, [FULL])
    for rid, allowed in (("a", [4, 9]), ("b", None), ("c", [7])):
        params = SamplingParams(allowed_token_ids=allowed)
        batch.add_request(RequestState(rid, [5, 6], params, 2), [], ([1],), 2)
    inputs = SamplingInputs(torch.device("cpu"))
    first = inputs.build(batch, np.arange(3))
    assert pairs(first) == [(0, 4), (0, 9), (2, 7)]
    again = inputs.build(batch, np.arange(3))
    assert all(x is y for x, y in zip(again.allowed_token_ids, first.allowed_token_ids))
    batch.remove_request("a")  # "c" moves to row 0
    params = SamplingParams(allowed_token_ids=[3, 8, 11])
    batch.add_request(RequestState("d", [5], params, 2), [], ([2],), 1)
    assert batch.req_ids == ["c", "b", "d"]
    assert pairs(inputs.build(batch, np.arange(3))) == [(0, 7), (2, 3), (2, 8), (2, 11)]
    assert pairs(inputs.build(batch, np.array([1, 2]))) == [(1, 3), (1, 8), (1, 11)]


def test_allowed_token_ids_mask_matches_a_row_loop():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    allowed = {0: [1, 5], 2: [7]}
    expected = logits.clone()
    for row, ids in allowed.items():
        for t in range(20):
            if t not in ids:
                expected[row, t] = float("-inf")
    rows = torch.tensor(list(allowed))
    positions = torch.tensor([0, 0, 1])
    apply_allowed_token_ids(logits, rows, positions, torch.tensor([1, 5, 7]))
    assert torch.equal(logits, expected)


# ---- the engine against transformers ----------------------------------------------------------
def _reference(hf_model, prompt: list[int], allowed: list[int] | None = None,
               bad: list[list[int]] = ()) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's log-softmax over the masked logits (plain torch)."""
    out, logprobs = [], []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].clone()
        if allowed is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[allowed] = True
            logits[~keep] = float("-inf")
        for word in bad:
            if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, (prompt, out, top)
        out.append(int(logits.argmax()))
        logprobs.append(torch.log_softmax(logits, dim=-1))
    return out, logprobs


P1, P3, P4 = "the quick brown fox", "kvflow pages keys and values", "prefix caching reuses them"
ALLOWED = list(range(20, 60))
CASES = [  # (prompt, SamplingParams fields, the bad words' ids as the tokenizer test checks)
    (P1, {"allowed_token_ids": ALLOWED, "logprobs": 2}, []),
    (P1, {"bad_words": ["nke"]}, [[311]]),  # one token: banned at every step
    (P4, {"bad_words": ["(ict", "a+"]}, [[9, 304], [66, 12], [266, 12]]),  # after "(" only
    # "+" only right after a generated "+" (the prompt's do not count); under n-gram
    # speculation the drafts repeat "+", so a ban falls on a draft position (num_extra > 0)
    (P3 + "++++", {"bad_words": ["++"]}, [[12, 12]]),
]


@pytest.fixture(scope="module")
def references(tiny_llama, tiny_tokenizer):
    """Per case: (prompt ids, reference tokens, reference logprobs); each case's masks change
    the unconstrained greedy output (the oracle bites)."""
    out = []
    for prompt, fields, bad in CASES:
        ids = tiny_tokenizer.encode(prompt)
        tokens, logprobs = _reference(tiny_llama.hf_model, ids, fields.get("allowed_token_ids"),
                                      bad)
        assert tokens != _reference(tiny_llama.hf_model, ids)[0], prompt
        out.append((ids, tokens, logprobs))
    return out


def _check(llm: LLM, references) -> list:
    params = [SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **fields)
              for _, fields, _ in CASES]
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in references], params,
                        use_tqdm=False)
    for out, (_, tokens, logprobs), (_, fields, _) in zip(outs, references, CASES):
        assert out.outputs[0].token_ids == tokens
        if fields.get("logprobs"):  # processed_logprobs: after the mask, others are -inf
            for step, ref in zip(out.outputs[0].logprobs, logprobs):
                assert all(t in ALLOWED for t in step)
                for t, lp in step.items():
                    assert lp.logprob == pytest.approx(ref[t].item(), abs=1e-4)
    return outs


def test_greedy_masks_match_transformers(tiny_llama, references, cpu_kernels, assert_no_leaks):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, logprobs_mode="processed_logprobs")
    _check(llm, references)
    assert_no_leaks(llm)


def test_speculative_decoding_keeps_the_masks(tiny_llama, references, assert_no_leaks):
    llm = LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=96,
              block_size=4, speculative_config=NGRAM, logprobs_mode="processed_logprobs")
    outs = _check(llm, references)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert_no_leaks(llm)


# ---- truncate_prompt_tokens and bad values ----------------------------------------------------
@pytest.fixture(scope="module")
def small_llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
               block_size=4, max_model_len=64)


def test_truncation_keeps_the_last_tokens(small_llm, tiny_tokenizer):
    ids = tiny_tokenizer.encode("prefix caching reuses them, chunked prefill splits long")
    assert len(ids) > 6
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut, whole, explicit, minus_one = small_llm.generate(
        [ids, ids, ids[-6:], ids],
        [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        truncate_prompt_tokens=6), greedy, greedy,
         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        truncate_prompt_tokens=-1)], use_tqdm=False)
    assert cut.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert cut.outputs[0].token_ids != whole.outputs[0].token_ids
    assert minus_one.prompt_token_ids == ids  # -1: max_model_len (64), nothing to cut
    assert minus_one.outputs[0].token_ids == whole.outputs[0].token_ids


def test_truncated_text_prompt_keeps_its_text_as_vllm_does(small_llm, tiny_tokenizer):
    """vLLM's ``RequestOutput.prompt`` is the text as given (its engines hand the caller's
    prompt text to the output processor; truncation cuts only the token ids), so kvflow's is
    too: the whole text, while ``prompt_token_ids`` are the last 6 of its tokenization."""
    text = "prefix caching reuses them, chunked prefill splits long"
    ids = tiny_tokenizer.encode(text)
    (out,) = small_llm.generate(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=6),
                                use_tqdm=False)
    assert out.prompt_token_ids == ids[-6:]
    assert out.prompt == text != tiny_tokenizer.decode(ids[-6:])


def test_truncation_cuts_a_prompt_longer_than_the_context(small_llm, tiny_tokenizer):
    """A prompt of more than max_model_len (64) tokens is cut first, then checked (vLLM's
    order, and the server's): the last 6 tokens answer as that prompt sent alone."""
    ids = tiny_tokenizer.encode("prefix caching reuses them, chunked prefill splits long " * 8)
    assert len(ids) > 64
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut, salted, explicit = small_llm.generate(
        [ids, {"prompt_token_ids": ids, "cache_salt": "s"}, ids[-6:]],
        [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                        truncate_prompt_tokens=6)] * 2 + [greedy], use_tqdm=False)
    assert cut.prompt_token_ids == salted.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == explicit.outputs[0].token_ids
    assert salted.outputs[0].token_ids == explicit.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"the prompt has \d+ tokens but max_model_len is 64"):
        small_llm.generate(ids, greedy, use_tqdm=False)  # not cut: too long


@pytest.mark.parametrize("fields,message", [
    ({"allowed_token_ids": []}, r"SamplingParams.allowed_token_ids=\[\] is invalid"),
    ({"allowed_token_ids": [1, "2"]}, "SamplingParams.allowed_token_ids"),
    ({"bad_words": [" "]}, "SamplingParams.bad_words"),
    ({"bad_words": "a"}, "SamplingParams.bad_words='a' is invalid"),
    ({"truncate_prompt_tokens": 0}, "SamplingParams.truncate_prompt_tokens=0 is invalid"),
    ({"truncate_prompt_tokens": -2}, "SamplingParams.truncate_prompt_tokens=-2 is invalid"),
])
def test_bad_values_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields,message", [
    ({"allowed_token_ids": [3, 50]}, "allowed_token_ids has token id 50 outside the vocabulary"),
    ({"truncate_prompt_tokens": 65},
     r"^SamplingParams.truncate_prompt_tokens=65 is greater than max_model_len \(64\)"),
    ({"bad_words": ["a"]}, "bad_words needs a tokenizer"),
])
def test_values_the_model_cannot_take_are_refused(fields, message):
    processor = InputProcessor(None, max_model_len=64, vocab_size=50, eos_token_id=0)
    with pytest.raises(ValueError, match=message):
        processor.make_requests("r", [1, 2], SamplingParams(**fields))


@pytest.mark.parametrize("fields,message", [
    # both pieces of "a" banned by the word: nothing allowed is left at any step
    ({"allowed_token_ids": ["a", "Ġa"], "bad_words": ["a"]},
     r"SamplingParams.bad_words ban every token allowed_token_ids allows"),
    # only the EOS (2) allowed, which min_tokens bans for the first token
    ({"allowed_token_ids": [2], "min_tokens": 1}, r"SamplingParams.min_tokens=1 bans"),
    ({"allowed_token_ids": [7, "a"], "min_tokens": 2, "stop_token_ids": [7],
      "bad_words": ["a"]}, r"SamplingParams.min_tokens=2 bans"),
])
def test_allowed_token_ids_the_other_bans_empty_are_refused(tiny_tokenizer, fields, message):
    """Each case leaves a step whose logits are all -inf, where the sampler's id 0 would be
    a token the request never allowed: refused before anything runs."""
    fields = dict(fields, allowed_token_ids=[
        tiny_tokenizer.convert_tokens_to_ids(t) if isinstance(t, str) else t
        for t in fields["allowed_token_ids"]])
    processor = InputProcessor(tiny_tokenizer, max_model_len=64,
                               vocab_size=len(tiny_tokenizer), eos_token_id=2)
    with pytest.raises(ValueError, match=message):
        processor.make_requests("r", [1, 2], SamplingParams(**fields))


@pytest.mark.parametrize("fields", [
    {"allowed_token_ids": [2], "min_tokens": 1, "ignore_eos": True},  # EOS not banned then
    {"allowed_token_ids": [2, 9], "min_tokens": 1},  # 9 is left
    {"allowed_token_ids": [12], "bad_words": ["a b"]},  # a two-token word bans only in context
])
def test_allowed_token_ids_with_a_token_left_are_taken(tiny_tokenizer, fields):
    processor = InputProcessor(tiny_tokenizer, max_model_len=64,
                               vocab_size=len(tiny_tokenizer), eos_token_id=2)
    (request,) = processor.make_requests("r", [1, 2], SamplingParams(**fields))
    assert request.sampling_params.allowed_token_ids == fields["allowed_token_ids"]
