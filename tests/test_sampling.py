"""Sampling semantics, end to end on a tiny Llama and on the Sampler directly.

Seeded sampling is reproducible and does not depend on the batch; n, top-k, top-p, min_tokens,
stop_token_ids, max_tokens and logprobs behave as in vLLM; ``apply_top_k_top_p_min_p`` is
checked against hand-computed sets; and temperature-1 sampling matches softmax probabilities
(chi-square).
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.sampler import Sampler, apply_top_k_top_p_min_p
from kvflow.layers.sampling_metadata import SamplingMetadata

PROMPTS = [[5, 17, 33, 100, 200, 7, 9], [42, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("block_size", 4)
    return LLM(model=path, dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    """One engine on the tiny Llama, shared by the tests of this module."""
    return _llm(tiny_llama.path)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _greedy_tokens(llm: LLM, prompt: list[int], max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def hot(seed: int | None = None, max_tokens: int = 12, temperature: float = 1.5,
        **kwargs) -> SamplingParams:
    """Random sampling at a temperature that spreads tokens out, EOS ignored."""
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kwargs)


# ---- seeds ---------------------------------------------------------------------------------------
def test_seed_is_reproducible(llm, tiny_llama, assert_no_leaks):
    a = _tokens(llm.generate([PROMPTS[0]], hot(seed=1234), use_tqdm=False))
    b = _tokens(llm.generate([PROMPTS[0]], hot(seed=1234), use_tqdm=False))
    c = _tokens(_llm(tiny_llama.path).generate([PROMPTS[0]], hot(seed=1234), use_tqdm=False))
    other = _tokens(llm.generate([PROMPTS[0]], hot(seed=4321), use_tqdm=False))
    assert a == b == c
    assert other != a  # 12 tokens at temperature 1.5 over 320 ids: a collision is ~impossible
    assert_no_leaks(llm)


def test_seed_is_independent_of_batch(tiny_llama, assert_no_leaks):
    """The same seeded request alone, and amid unseeded and other seeded requests of other
    lengths under a small token budget (so chunks and decodes mix) and a KV cache small enough
    to force preemption and recomputation, gives identical tokens."""
    target = hot(seed=77, max_tokens=16)
    alone = _tokens(_llm(tiny_llama.path).generate([PROMPTS[0]], target, use_tqdm=False))
    llm = _llm(tiny_llama.path, max_num_batched_tokens=8, num_kv_blocks=13)
    neighbours = [hot(), hot(seed=5, max_tokens=7), hot(max_tokens=20, top_k=5),
                  SamplingParams(temperature=0.0, max_tokens=9)]
    prompts = [PROMPTS[1], PROMPTS[2] * 2, PROMPTS[2], PROMPTS[0], PROMPTS[0]]
    params = neighbours + [target]  # the newest request: the first to be preempted
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs)[4] == alone[0]
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_n_gives_n_samples(llm, assert_no_leaks):
    (out,) = llm.generate([PROMPTS[0]], hot(seed=3, n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    (again,) = llm.generate([PROMPTS[0]], hot(seed=3, n=3), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leaks(llm)


def test_seed_minus_one_is_unseeded_as_in_vllm(llm, assert_no_leaks):
    """``seed=-1`` is vLLM's "no seed" (its SamplingParams sets None): kvflow took it as an
    ordinary seed, so every call gave the same sample. A sample ``i`` of a request seeded
    ``s`` is still seeded ``s + i`` where that is -1 (seed -2, n=2): reproducible, also
    through msgspec (the engine-core process's copy)."""
    import msgspec

    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0
    draws = {tuple(_tokens(llm.generate([PROMPTS[0]], hot(seed=-1, temperature=3.0),
                                        use_tqdm=False))[0]) for _ in range(3)}
    assert len(draws) == 3  # 12 tokens at temperature 3 over 320 ids: no repeats
    (first,) = llm.generate([PROMPTS[0]], hot(seed=-2, n=2), use_tqdm=False)
    (again,) = llm.generate([PROMPTS[0]], hot(seed=-2, n=2), use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    child = llm.engine.processor.make_requests("r", PROMPTS[0], hot(seed=-2, n=2), 0.0)[1]
    assert child.sampling_params.seed == -1
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(child.sampling_params),
                                  type=SamplingParams)
    assert copy.seed == -1
    assert_no_leaks(llm)


def test_logprobs_minus_one_is_the_whole_vocabulary(llm, tiny_llama):
    """``logprobs=-1`` / ``prompt_logprobs=-1`` are vLLM's "every token": each position's
    entry holds all ``vocab_size`` tokens with transformers' log-softmax (was a ValueError);
    -2 is still refused, naming the field."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1,
                            prompt_logprobs=-1)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    ids = PROMPTS[0] + out.outputs[0].token_ids
    with torch.no_grad():
        want = torch.log_softmax(tiny_llama.hf_model(torch.tensor([ids])).logits[0].double(), -1)
    vocab = tiny_llama.vocab_size
    rows = [(len(PROMPTS[0]) - 1 + j, entry) for j, entry in enumerate(out.outputs[0].logprobs)]
    rows += [(j - 1, entry) for j, entry in enumerate(out.prompt_logprobs) if entry is not None]
    assert len(rows) == 3 + len(PROMPTS[0]) - 1
    for row, entry in rows:
        assert sorted(entry) == list(range(vocab))
        got = torch.tensor([entry[t].logprob for t in range(vocab)], dtype=torch.float64)
        assert torch.allclose(got, want[row], atol=1e-4)
    with pytest.raises(ValueError, match=r"SamplingParams.logprobs=-2 is invalid: it must be "
                       r">= 0, or -1 \(the whole vocabulary\)"):
        SamplingParams(logprobs=-2)


def test_detokenize_false_returns_ids_without_text(llm, tiny_llama):
    """vLLM's ``detokenize=False``: the same token ids (and logprobs) as with text, but
    ``text`` "" and every ``decoded_token`` None; with True the text is the tokenizer's
    decoding of the ids. Stop strings need text: refused, naming ``detokenize`` (the field
    was a TypeError)."""
    from transformers import AutoTokenizer

    def run(detokenize: bool):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2,
                                prompt_logprobs=1, detokenize=detokenize)
        return llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]

    text, ids_only = run(True), run(False)
    sample = ids_only.outputs[0]
    assert sample.token_ids == text.outputs[0].token_ids and sample.text == ""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    assert text.outputs[0].text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    entries = [*sample.logprobs, *ids_only.prompt_logprobs[1:]]
    assert entries and all(lp.decoded_token is None for e in entries for lp in e.values())
    for a, b in zip(sample.logprobs, text.outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}
    assert all(lp.decoded_token is not None for e in text.outputs[0].logprobs
               for lp in e.values())
    with pytest.raises(ValueError, match=r"SamplingParams.detokenize=False is invalid: it must "
                       r"be True with stop strings"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match=r"SamplingParams.detokenize=0 is invalid"):
        SamplingParams(detokenize=0)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["pc_on", "pc_off"])
def test_n_samples_share_prompt_blocks(tiny_llama, prefix_caching, assert_no_leaks):
    """The n samples of a request share their prompt's KV blocks (also with prefix caching
    off); that sharing changes no token, under preemption too, and greedy samples agree."""
    prompt = PROMPTS[2] * 2  # 22 tokens: 5 full blocks to share
    alone = [_tokens(_llm(tiny_llama.path).generate([prompt], hot(seed=9 + i), use_tqdm=False))[0]
             for i in range(3)]
    # 13 usable blocks: 3 samples need 5 shared + 3 x 4 own blocks, so one gets preempted.
    llm = _llm(tiny_llama.path, enable_prefix_caching=prefix_caching, num_kv_blocks=14)
    (out,) = llm.generate([prompt], hot(seed=9, n=3), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == alone  # sample i is seeded with seed + i
    assert llm.engine.core.scheduler.num_preemptions > 0
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    (out,) = llm.generate([prompt], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == _greedy_tokens(llm, prompt)
    assert_no_leaks(llm)


# ---- filters that reduce to greedy ---------------------------------------------------------------
@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0},
                                     {"top_p": 1e-300}, {"temperature": 1e-45}],
                         ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_p=1e-300",
                              "temperature=1e-45"])
def test_filter_to_one_token_equals_greedy(llm, filters, assert_no_leaks):
    """top_p=1e-300 is 0 in float32 and masked every token; temperature=1e-45 (float32's
    smallest subnormal) sent the logits to inf: both sampled a NaN row, whose "sample" was
    token 0 (the EOS) at the first step. Each is the greedy limit."""
    greedy = [_greedy_tokens(llm, p) for p in PROMPTS]
    outs = llm.generate(PROMPTS, hot(**filters), use_tqdm=False)
    assert _tokens(outs) == greedy
    assert_no_leaks(llm)


# ---- stopping ------------------------------------------------------------------------------------
def test_max_tokens_finishes_with_length(llm):
    (out,) = llm.generate([PROMPTS[1]], hot(max_tokens=5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].stop_reason is None
    assert out.finished


def test_stop_token_ids(llm, assert_no_leaks):
    greedy = _greedy_tokens(llm, PROMPTS[0], 12)
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy[k]])
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == greedy[:k + 1]  # the stop token is kept in token_ids
    assert c.finish_reason == "stop"
    assert c.stop_reason == greedy[k]
    assert_no_leaks(llm)


def test_stop_string(llm, assert_no_leaks):
    """A stop string ends the request early (its blocks are freed at once), the text is cut
    before it, and stop_reason is the string."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    text = full.text
    k = next(i for i in range(1, len(text) - 1)
             if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    stop = text[k:k + 2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    c = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[:text.find(stop)]
    assert c.token_ids == full.token_ids[:len(c.token_ids)] and len(c.token_ids) < 16
    assert_no_leaks(llm)


def test_min_tokens_masks_stop_token_ids(llm):
    greedy = _greedy_tokens(llm, PROMPTS[0], 12)
    first = greedy[0]
    stop_now = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
    assert llm.generate([PROMPTS[0]], stop_now, use_tqdm=False)[0].outputs[0].token_ids == [first]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4, stop_token_ids=[first])
    c = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 4 and first not in c.token_ids[:4]
    assert c.token_ids[0] != first
    if len(c.token_ids) < 12:
        assert (c.token_ids[-1], c.finish_reason, c.stop_reason) == (first, "stop", first)


@pytest.fixture(scope="module")
def eos_is_greedy_model(tiny_llama, tmp_path_factory):
    """The tiny Llama's weights with a config whose ``eos_token_id`` is the first greedy token of
    PROMPTS[0] (no tokenizer: the engine then takes EOS from the config). Returns (path, eos)."""
    probe = _llm(tiny_llama.path, skip_tokenizer_init=True)
    eos = _greedy_tokens(probe, PROMPTS[0], 1)[0]
    folder = tmp_path_factory.mktemp("eos_is_greedy")
    with open(os.path.join(tiny_llama.path, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = eos
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    os.symlink(os.path.join(tiny_llama.path, "model.safetensors"), folder / "model.safetensors")
    return str(folder), eos


def test_eos_and_min_tokens(eos_is_greedy_model, assert_no_leaks):
    path, eos = eos_is_greedy_model
    llm = _llm(path, skip_tokenizer_init=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    c = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == ([eos], "stop", None)
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3)
    c = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 3 and eos not in c.token_ids[:3]
    if len(c.token_ids) < 10:
        assert (c.token_ids[-1], c.finish_reason) == (eos, "stop")
    ignore = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    c = llm.generate([PROMPTS[0]], ignore, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 10 and c.token_ids[0] == eos and c.finish_reason == "length"
    assert_no_leaks(llm)


# ---- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3])
def test_logprobs_greedy(llm, tiny_llama, k):
    """Greedy: k entries (the sampled token is the top one) ranked 1..k, matching HF's top-k."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=k)
    c = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 4
    for token, step in zip(c.token_ids, c.logprobs):
        assert len(step) == max(k, 1)
        assert step[token].rank == 1
        ranked = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == list(range(1, max(k, 1) + 1))
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(ranked))
    assert c.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs)))
    with torch.no_grad():
        logits = tiny_llama.hf_model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    top = torch.log_softmax(logits.float(), -1).topk(max(k, 1))
    first = c.logprobs[0]
    assert sorted(first, key=lambda t: first[t].rank) == top.indices.tolist()
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert first[tid].logprob == pytest.approx(lp, abs=1e-4)


def test_logprobs_sampled_outside_top_k(llm):
    """Random sampling: k entries plus the sampled token when it is outside the top k, whose
    rank is then > k; ranks are consistent with the logprob order."""
    params = hot(seed=11, max_tokens=24, logprobs=2, temperature=3.0)
    c = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    outside = 0
    for token, step in zip(c.token_ids, c.logprobs):
        assert token in step
        top = [t for t in step if step[t].rank <= 2]
        assert len(top) == 2
        if token in top:
            assert len(step) == 2
        else:
            outside += 1
            assert len(step) == 3 and step[token].rank > 2
            assert step[token].logprob <= min(step[t].logprob for t in top)
    assert outside > 0  # temperature 3 over 320 ids leaves the top 2 often


# ---- the filter function -------------------------------------------------------------------------
def test_apply_top_k_top_p_min_p_hand_computed():
    probs = torch.tensor([0.15, 0.05, 0.5, 0.1, 0.2])  # sorted: idx 2, 4, 0, 3, 1
    logits = probs.log().repeat(6, 1)
    top_k = torch.tensor([2, 0, 0, 0, 3, 100])
    top_p = torch.tensor([1.0, 0.55, 0.45, 1.0, 0.8, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.25, 0.0, 0.0])
    out = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    expected_kept = [
        {2, 4},  # top-k 2
        {2, 4},  # top-p 0.55: 0.5 (mass before 0), 0.2 (before 0.5); 0.15 has 0.7 before it
        {2},  # top-p 0.45: 0.5 already reaches it
        {2, 4, 0},  # min-p 0.25: p >= 0.125
        {2, 4},  # top-k 3 renormalizes to .588 .235 .176; top-p 0.8 then drops the third
        {0, 1, 2, 3, 4},  # top-k beyond the vocabulary: no filter
    ]
    for row, kept in enumerate(expected_kept):
        finite = set(torch.isfinite(out[row]).nonzero().flatten().tolist())
        assert finite == kept, f"row {row}: kept {sorted(finite)}, expected {sorted(kept)}"
        assert torch.equal(out[row, sorted(kept)], logits[row, sorted(kept)])
    assert torch.equal(logits, probs.log().repeat(6, 1))  # the input is not modified
    only_k = apply_top_k_top_p_min_p(logits[:1], torch.tensor([2]), None, None)
    assert set(torch.isfinite(only_k[0]).nonzero().flatten().tolist()) == {2, 4}
    assert apply_top_k_top_p_min_p(logits, None, None, None) is logits


# ---- the Sampler's distribution ------------------------------------------------------------------
def test_top_k_keeps_the_tokens_tied_with_the_kth_as_transformers_does():
    """Tokens whose logit equals the k-th largest all stay (HF's TopKLogitsWarper, vLLM's
    ``logits < kth`` mask); bf16 logits tie often. The cut at exactly k kept only the tied
    token the sort put first: in row 0 token 2 could never be sampled."""
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0],
                           [1.0, 3.0, 3.0, 3.0, 0.5],  # a three-way tie at the top, k = 1
                           [0.5, 0.5, 0.5, 0.5, 0.5],
                           [4.0, 2.0, 2.0, 2.0, 1.0]])
    top_k = [2, 1, 3, 3]
    out = apply_top_k_top_p_min_p(logits, torch.tensor(top_k), None, None)
    for row, k in enumerate(top_k):
        expected = TopKLogitsWarper(k)(None, logits[row:row + 1].clone())[0]
        assert torch.equal(out[row], expected), (row, out[row], expected)
    # then top-p over the tied set: row 0 keeps 2, 1, 1 (mass before the third: 0.79 < 0.9)
    out = apply_top_k_top_p_min_p(logits[:1], torch.tensor([2]), torch.tensor([0.9]), None)
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False, False]


def test_top_p_matches_transformers_and_leaves_a_top_p_1_row_whole():
    """top-p over a 49,152-token vocabulary of peaked logits: the kept sets equal HF's
    TopPLogitsWarper's, and a row with top_p 1 (off) batched with rows that use top-p keeps
    every token. Summed from the top (``cumsum - probs``), the mass before a tail token
    reached 1.0 in float32: that row lost ~46,000 tokens, its neighbours' setting leaking
    into it (and its processed logprobs were -inf there)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 8
    top_p = [1.0, 0.5, 0.9, 0.99]
    out = apply_top_k_top_p_min_p(logits, None, torch.tensor(top_p), None)
    assert torch.isfinite(out[0]).all()
    for row, p in enumerate(top_p[1:], start=1):
        expected = TopPLogitsWarper(p)(None, logits[row:row + 1].clone())[0]
        assert torch.equal(torch.isfinite(out[row]), torch.isfinite(expected)), row


def test_top_k_samples_tied_tokens_by_their_probability():
    """Sampling with top_k 2 over [2, 1, 1, 0]: tokens 1 and 2 tie and are drawn equally
    often (chi-square against softmax over the three kept tokens)."""
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    draws = 6000
    meta = SamplingMetadata(temperature=torch.ones(draws),
                            top_k=torch.full((draws,), 2))
    sampled = Sampler(torch.Generator().manual_seed(5))(logits.repeat(draws, 1), meta).sampled
    probs = torch.softmax(logits, -1)
    probs[3] = 0
    assert _chi_square(sampled, probs / probs.sum()) < _CHI2_9999[2]


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 0.9999 quantiles of chi-square: a correct sampler fails one run in 10^4.
_CHI2_9999 = {2: 18.42, 7: 29.88}
# by the number of tokens kept (degrees of freedom + 1)
_CHI2_9999_BY_KEPT = {2: 15.14, 3: 18.42, 4: 21.11, 5: 23.51, 6: 25.74}


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_sampler_matches_softmax(temperature, top_k):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    draws = 6000
    sampler = Sampler(torch.Generator().manual_seed(123))
    meta = SamplingMetadata(temperature=torch.full((draws,), temperature),
                            top_k=torch.full((draws,), top_k) if top_k else None)
    sampled = sampler(logits.repeat(draws, 1), meta).sampled
    probs = torch.softmax(logits / temperature, -1)
    if top_k:
        probs[probs < probs.topk(top_k).values[-1]] = 0
        probs /= probs.sum()
    dof = (top_k or logits.numel()) - 1
    assert _chi_square(sampled, probs) < _CHI2_9999[dof]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 0.8, 0.0), (0.7, 5, 0.9, 0.0), (1.3, 0, 1.0, 0.1), (1.0, 6, 0.7, 0.05)])
def test_sampler_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    """Sampling frequencies against transformers' warpers applied in vLLM's order
    (temperature, min-p, top-k, top-p): chi-square over the tokens they keep, none of the
    others ever drawn. The rows are sampled in one batch with rows of other settings."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2
    x = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if min_p:
        x = MinPLogitsWarper(min_p)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    probs = torch.softmax(x[0], -1)
    draws, others = 6000, 3  # rows 0..2: greedy, no filter, top_k 2 / top_p 0.5 / min_p 0.5
    n = draws + others
    meta = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0, 1.0] + [temperature] * draws),
        top_k=torch.tensor([0, 0, 2] + [top_k] * draws),
        top_p=torch.tensor([1.0, 1.0, 0.5] + [top_p] * draws),
        min_p=torch.tensor([0.0, 0.0, 0.5] + [min_p] * draws))
    sampled = Sampler(torch.Generator().manual_seed(7))(logits.repeat(n, 1), meta).sampled
    kept = int((probs > 0).sum())
    assert kept in _CHI2_9999_BY_KEPT
    assert _chi_square(sampled[others:], probs) < _CHI2_9999_BY_KEPT[kept]


def test_sampler_seeded_rows_and_greedy_rows():
    """Greedy rows take the argmax in a mixed batch; a seeded row's draw depends only on its
    seed and output position, not on the row it sits in or on its neighbours."""
    gen_logits = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen_logits)
    sampler = Sampler(torch.Generator().manual_seed(1))

    def draw(rows: torch.Tensor, seeded_row: int) -> tuple[int, list[int]]:
        meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0, 1.0, 0.0]),
                                seeded={seeded_row: (99, 4)})
        out = sampler(rows.clone(), meta).sampled.tolist()
        return out[seeded_row], out

    seeded_a, out_a = draw(logits, 1)
    swapped = logits[[0, 2, 1, 3]]
    seeded_b, _ = draw(swapped, 2)
    assert seeded_a == seeded_b
    assert out_a[0] == int(logits[0].argmax()) and out_a[3] == int(logits[3].argmax())


def test_sampler_vanishing_temperature_and_top_p_take_the_argmax():
    """The Sampler itself (all rows random): temperature 1e-45 and top_p 0 (float32's
    1e-300) each reduce to the argmax; they sampled token 0 from a NaN row."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    sampler = Sampler(torch.Generator().manual_seed(4))
    tiny = SamplingMetadata(temperature=torch.full((6,), 1e-45))
    nucleus = SamplingMetadata(temperature=torch.ones(6), top_p=torch.zeros(6))
    for meta in (tiny, nucleus):
        assert sampler(logits.clone(), meta).sampled.tolist() == logits.argmax(-1).tolist()


def test_huge_temperature_keeps_the_masks(llm, assert_no_leaks):
    """temperature=1e308 (accepted over HTTP too) is inf in float32, and -inf / inf is NaN:
    a row with any masked token went NaN and its "sample" was token 0, the tiny Llama's EOS.
    A choice constraint then ended at once with no token ("length"), and min_tokens let the
    EOS it bans through. At that temperature the sample is uniform, but only over what the
    masks allow."""
    choice = SamplingParams(temperature=1e308, seed=3, max_tokens=5,
                            structured_outputs={"choice": ["yes", "no"]})
    for out in llm.generate(PROMPTS, choice, use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"
    banned = SamplingParams(temperature=1e308, seed=3, max_tokens=6, min_tokens=4)
    for out in llm.generate(PROMPTS, banned, use_tqdm=False):
        assert 0 not in out.outputs[0].token_ids[:4]  # 0 is the EOS, banned for 4 tokens
    assert_no_leaks(llm)
