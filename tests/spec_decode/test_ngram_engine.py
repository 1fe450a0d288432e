"""Speculative decoding with n-gram drafts through the whole engine, on the tiny random Llama
(float32): greedy output equals greedy output without speculation token for token (with
logprobs, penalties, min_tokens, stop strings, max_tokens boundaries, structured output, prefix
caching, preemption); sampled output keeps the target's distribution (a chi-square test
against transformers' probabilities); no KV block leaks.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
# repetitive prompts: the tiny model falls into loops the n-gram proposer then predicts
PROMPTS = ["the quick brown fox jumps over the lazy dog the quick brown fox jumps",
           "kvflow pages keys and values through blocks of tokens; kvflow pages keys",
           "a b a b a b a b a",
           "prefix caching reuses them, chunked prefill splits long prompts, prefix"]


def _engine(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return _engine(tiny_llama.path), _engine(tiny_llama.path, NGRAM)


def _generate(llm: LLM, params, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def _same_outputs(base, spec) -> None:
    for b, s in zip(base, spec):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids
        assert s.outputs[0].text == b.outputs[0].text
        assert (s.outputs[0].finish_reason, s.outputs[0].stop_reason) == \
            (b.outputs[0].finish_reason, b.outputs[0].stop_reason)


def _drafted(outputs) -> tuple[int, int]:
    return (sum(o.metrics.num_draft_tokens for o in outputs),
            sum(o.metrics.num_accepted_tokens for o in outputs))


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 40])
def test_greedy_equals_plain_greedy(engines, assert_no_leaks, max_tokens):
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in got)
    if max_tokens == 40:  # long enough for loops: drafts accepted and rejected
        drafted, accepted = _drafted(got)
        assert 0 < accepted < drafted
        m = got[0].metrics
        assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
        assert m.mean_acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts
    assert_no_leaks(spec)


def test_logprobs_penalties_and_min_tokens_match(engines):
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3, repetition_penalty=1.3,
                            frequency_penalty=0.2, presence_penalty=0.1, min_tokens=12)
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    for b, s in zip(ref, got):
        for lb, ls in zip(b.outputs[0].logprobs, s.outputs[0].logprobs):
            assert lb.keys() == ls.keys()
            for token, entry in lb.items():
                assert ls[token].rank == entry.rank
                assert abs(ls[token].logprob - entry.logprob) < 1e-4
    assert _drafted(got)[0] > 0


def test_logprob_token_ids_and_repetition_detection_match(engines):
    """vLLM 0.32's logprob_token_ids: every verified position reports the listed ids'
    logprobs, as the plain engine's; repetition_detection cuts the output at the same token
    when a step verifies several (each accepted token is checked in turn)."""
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=0, ignore_eos=True,
                            logprob_token_ids=[66, 200, 7])
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    for b, s in zip(ref, got):
        for lb, ls in zip(b.outputs[0].logprobs, s.outputs[0].logprobs):
            assert list(lb) == list(ls)
            assert all(abs(ls[t].logprob - lb[t].logprob) < 1e-4 for t in lb)
    assert _drafted(got)[0] > 0
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            repetition_detection={"max_pattern_size": 6, "min_count": 2})
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    assert {o.outputs[0].finish_reason for o in got} == {"repetition"}


def test_logit_bias_applies_at_every_verified_position(engines):
    """logit_bias shifts every row a step verifies, not only the one after the last draft
    (it did only that one: drafts were checked against unbiased logits, so the output
    wandered off the biased greedy text). A moderate bias that changes the text, and one
    that bans a token."""
    base, spec = engines
    plain = _generate(base, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    banned = plain[0].outputs[0].token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            logit_bias={109: 2.5, 12: -2.0, banned: -100})
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    assert [o.outputs[0].token_ids for o in ref] != [o.outputs[0].token_ids for o in plain]
    assert all(banned not in o.outputs[0].token_ids for o in got)
    drafted, accepted = _drafted(got)
    assert 0 < accepted < drafted


def test_stop_strings_cut_where_plain_decoding_stops(engines):
    """A stop string taken from the middle of the plain output: the speculative run stops at
    the same token even when that token was an accepted draft with more after it."""
    base, spec = engines
    free = _generate(base, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stops = []
    for out in free:
        text = out.outputs[0].text
        stops.append(text[len(text) // 2:len(text) // 2 + 3] or "zz")
    for i, stop in enumerate(stops):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        ref, got = _generate(base, params, [PROMPTS[i]]), _generate(spec, params, [PROMPTS[i]])
        _same_outputs(ref, got)
        assert got[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_structured_output_checks_drafted_tokens(engines, assert_no_leaks, kind):
    """Constrained greedy decoding: the grammar vets the drafts (the JSON schema rejects most
    of what the n-gram proposes; the regex's repetitions are accepted) and masks every verified
    position; the output equals plain constrained decoding and matches the constraint. On the
    module's two engines (the same settings; the earlier tests' prompts are in their prefix
    caches, which changes no output)."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "maxItems": 6,
                                                     "items": {"enum": ["ab", "ab ab"]}}},
              "required": ["a"]}
    constraint = StructuredOutputsParams(json=schema) if kind == "json" else \
        StructuredOutputsParams(regex="(ab ){2,12}(the|a) fox")
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
    base, spec = engines
    ref, got = _generate(base, params), _generate(spec, params)
    _same_outputs(ref, got)
    for out in got:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if kind == "json":
            assert isinstance(json.loads(text)["a"], list)
        else:
            assert re.fullmatch("(ab ){2,12}(the|a) fox", text)
    if kind == "regex":
        drafted, accepted = _drafted(got)
        assert 0 < accepted <= drafted
    assert_no_leaks(spec)


def test_preemption_prefix_caching_and_aborts_leak_nothing(tiny_llama, assert_no_leaks):
    """A pool of 24 blocks of 4 tokens for 8 requests of up to ~70 tokens: preemptions while
    drafts are verified; shared prompt prefixes hit the cache; an abort mid-run."""
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = _engine(tiny_llama.path, num_kv_blocks=200)
    ref = _generate(base, params, prompts)
    spec = _engine(tiny_llama.path, NGRAM, num_kv_blocks=24, max_num_seqs=8)
    got = _generate(spec, params, prompts)
    _same_outputs(ref, got)
    assert spec.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(spec)
    _same_outputs(ref[-1:], _generate(spec, params, prompts[-1:]))  # from the prefix cache
    assert spec.engine.core.kv_cache_manager.num_hits > 0
    assert_no_leaks(spec)
    engine = spec.engine
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    for _ in range(6):
        engine.step()
    engine.abort_request(ids[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(spec)


def test_swap_preemption(tiny_llama, assert_no_leaks, monkeypatch):
    """--preemption-mode swap with n-gram drafts (the README said it was refused): victims
    copied out to the host pool and back while drafts are verified give plain greedy
    decoding's tokens, and no block leaks. Every victim is swapped (``always_swap``): the
    engine's own choice between swap and recompute follows measured step times, so on a busy
    machine it may recompute them all (seen: no swap, the assertion failed)."""
    from tests.core.swap_checks import always_swap

    always_swap(monkeypatch)
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = _generate(_engine(tiny_llama.path, num_kv_blocks=300), params, prompts)
    spec = _engine(tiny_llama.path, NGRAM, num_kv_blocks=30, max_num_seqs=8,
                   preemption_mode="swap", swap_space="16MiB")
    _same_outputs(ref, _generate(spec, params, prompts))
    assert spec.engine.core.scheduler.swap.num_swapped_out > 0
    assert _drafted(_generate(spec, params, prompts[:1]))[1] > 0
    assert_no_leaks(spec)


def test_seeded_sampling_is_reproducible(engines):
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True)
    first = _generate(spec, params)
    second = _generate(spec, [params] * len(PROMPTS), list(reversed(PROMPTS)))[::-1]
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_tokens_do_not_depend_on_the_batch(engines):
    """A seeded request alone, and batched with requests that verify more drafts than it
    does: the same tokens (its generator drew one uniform per draft of the batch's longest
    draft list, so its draws, and then its text, followed its neighbours)."""
    _, spec = engines
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = _generate(spec, seeded, PROMPTS[:1])[0].outputs[0].token_ids
    for other in PROMPTS[1:]:
        mixed = _generate(spec, [seeded, greedy], [PROMPTS[0], other])
        assert mixed[0].outputs[0].token_ids == alone
        assert _drafted(mixed)[0] > 0


def test_sampled_tokens_keep_the_target_distribution(tiny_llama):
    """Temperature 0.6 with top_k=4. The prompt starts with "c d" and its first token t1 is c
    with probability > 0.5, so the n-gram draft for t2 is then d: the target's third most
    likely token after the prompt and c (accepted sometimes, rejected mostly); other t1 get
    whatever the n-gram finds, or no draft. The marginal of t2 over
    3,000 requests must match sum_t1 p(t1) p(t2 | t1) from transformers (chi-square,
    p > 0.001)."""
    hf = tiny_llama.hf_model
    top_k, temperature = 4, 0.6

    def logits_after(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].double()

    def probs(ids: list[int]) -> torch.Tensor:
        logits = logits_after(ids)
        keep = logits.topk(top_k).indices
        p = torch.zeros_like(logits)
        p[keep] = torch.softmax(logits[keep] / temperature, 0)
        return p

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):  # a prompt "c d head" after which c is (nearly) certain
        head = torch.randint(2, tiny_llama.vocab_size, (6,), generator=gen).tolist()
        c = int(probs(head).argmax())
        d = int(logits_after(head + [c]).topk(3).indices[2])
        prompt = [c, d] + head
        p1 = probs(prompt)
        if c != d and c not in head and p1[c] > 0.5 and probs(prompt + [c])[d] > 0.05:
            break
    else:
        pytest.fail("no prompt with a likely first token")
    support = p1.nonzero().flatten().tolist()
    marginal = sum(p1[t1] * probs(prompt + [t1]) for t1 in support)
    spec = _engine(tiny_llama.path, {**NGRAM, "num_speculative_tokens": 1},
                   num_kv_blocks=4000, max_num_seqs=256)
    n = 3000
    outs = _generate(spec, SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                                          ignore_eos=True), [prompt] * n)
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    assert_sampled_token_follows(outs, 1, marginal)
    drafted, accepted = _drafted(outs)
    assert drafted > n // 3 and 0 < accepted < drafted // 2


def test_sampled_tokens_keep_the_processed_distribution(tiny_llama):
    """As above with the sampler's other settings: temperature 0.8, min_p 0.05, presence
    penalty 1.0 and a logit_bias that raises the draft d and lowers another token. The
    target the rejection sampler must keep is then plain decoding's processed distribution:
    t2's probabilities after the bias and the penalty on t1 (an output token), scaled by
    the temperature and cut by min-p, computed here from transformers' logits. 3,000
    requests, chi-square p > 0.001 on t2's marginal, and d's frequency after c (where it
    was drafted) within 4.5 standard deviations of its probability."""
    hf = tiny_llama.hf_model
    temperature, min_p, presence = 0.8, 0.05, 1.0

    def last_logits(batch: torch.Tensor) -> torch.Tensor:
        """[rows, positions] token ids -> [rows, vocab] float64 logits after each row."""
        with torch.no_grad():
            return hf(batch).logits[:, -1].double()

    def logits_after(ids: list[int]) -> torch.Tensor:
        return last_logits(torch.tensor([ids]))[0]

    def processed(logits: torch.Tensor, output: list[int],
                  bias: dict[int, float]) -> torch.Tensor:
        logits = logits.clone()
        for token, value in bias.items():
            logits[token] += value
        for token in set(output):
            logits[token] -= presence
        p = torch.softmax(logits / temperature, 0)
        p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
        return p / p.sum()

    def probs(prompt: list[int], output: list[int], bias: dict[int, float]) -> torch.Tensor:
        return processed(logits_after(prompt + output), output, bias)

    # a prompt "c d head" after which c is likely, and d after c: 2,000 random heads, each
    # forward pass run for all of them at once (one at a time it was ~7,500 passes, most of
    # the test's time); c is the argmax of the head's processed distribution (no bias, no
    # output: the logits' argmax)
    gen = torch.Generator().manual_seed(1)
    heads = torch.randint(2, tiny_llama.vocab_size, (2000, 6), generator=gen)
    cs = last_logits(heads).argmax(1, keepdim=True)
    ds = last_logits(torch.cat([heads, cs], 1)).topk(2).indices[:, 1:]
    prompts = torch.cat([cs, ds, heads], 1)
    after_prompt, after_c = last_logits(prompts), last_logits(torch.cat([prompts, cs], 1))
    for i, row in enumerate(prompts.tolist()):
        c, d, head = row[0], row[1], row[2:]
        bias = {d: 1.0, int(after_prompt[i].topk(2).indices[1]): -0.5}
        if c != d and c not in head and processed(after_prompt[i], [], bias)[c] > 0.3 \
                and 0.1 < processed(after_c[i], [c], bias)[d] < 0.6:
            prompt = row
            break
    else:
        pytest.fail("no prompt with a likely first token")
    p1, p2 = probs(prompt, [], bias), probs(prompt, [c], bias)  # the oracle: one row a pass
    support = p1.nonzero().flatten().tolist()
    marginal = sum(p1[t1] * probs(prompt, [t1], bias) for t1 in support)
    spec = _engine(tiny_llama.path, {**NGRAM, "num_speculative_tokens": 1},
                   num_kv_blocks=4000, max_num_seqs=256)
    n = 3000
    params = SamplingParams(temperature=temperature, min_p=min_p, presence_penalty=presence,
                            logit_bias=bias, max_tokens=3, ignore_eos=True)
    outs = _generate(spec, params, [prompt] * n)
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    assert_sampled_token_follows(outs, 1, marginal)
    # the drafted case alone (t1 = c, so d was drafted): d's frequency is p2[d], within 4.5
    # standard deviations (a sampler accepting d 1.5x too often moves it by ~7)
    after_c = [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == c]
    share, want = sum(t == d for t in after_c) / len(after_c), float(p2[d])
    assert abs(share - want) < 4.5 * (want * (1 - want) / len(after_c)) ** 0.5, (share, want)
    drafted, accepted = _drafted(outs)
    assert drafted > n // 6 and 0 < accepted < drafted
