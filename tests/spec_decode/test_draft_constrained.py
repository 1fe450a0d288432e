"""A draft model speculating for constrained requests (structured output, tool-call grammars),
on tiny random models (float32): greedy output is the non-speculative constrained output token
for token (JSON schema, regex, choice, a tool call's grammar), and both are transformers'
greedy decoding with xgrammar's bitmask applied to its logits; the draft model did propose for
them (drafted > 0); logprobs are those of every position masked; a seeded sampled request
gives the same output twice and matches its constraint; an executor that cannot split a step
leaves constrained requests undrafted.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.config import SpeculativeConfig
from kvflow.spec_decode.speculator import Speculator
from kvflow.structured import StructuredOutputsParams
from tests.spec_decode.test_draft_model_engine import _count_draft_passes
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "array", "maxItems": 6,
                                                 "items": {"enum": ["ab", "ab ab"]}}},
          "required": ["a"]}
REGEX = "(ab ){2,12}(the|a) fox"


def _engine(path: str, draft: str | None = None, **kw) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": 3, "adaptive": False,
                                       "quantization": "none"}
    kw.setdefault("num_kv_blocks", 96)
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return _engine(tiny_llama.path)


@pytest.fixture(scope="module")
def self_draft(tiny_llama):
    """The target as its own draft: its unconstrained proposals are right wherever the
    grammar allows the target's unconstrained choice, rejected (by the masked target) where
    it does not."""
    return _engine(tiny_llama.path, tiny_llama.path)


def _generate(llm: LLM, params, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def _tool_call_constraint() -> StructuredOutputsParams:
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.structured_requests import tool_constraint

    tools = [{"type": "function", "function": {"name": f, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"]}}} for f in ("get_a", "get_b")]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                tool_choice="required", parallel_tool_calls=False)
    return tool_constraint(req, "required")


def _reference(hf, tokenizer, prompt: list[int], regex: str, max_tokens: int) -> list[int]:
    """Greedy decoding of ``hf`` (transformers) with every step's logits masked by xgrammar's
    bitmask for ``regex`` (unpacked here with plain torch bit operations)."""
    import xgrammar as xgr

    vocab = hf.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                              stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt), []
    while len(out) < max_tokens and not matcher.is_terminated():
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        logits[~bits.bool().flatten()[:vocab]] = float("-inf")
        token = int(logits.argmax())
        assert matcher.accept_token(token)
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "tool_call"])
def test_greedy_equals_plain_constrained_decoding(plain, self_draft, assert_no_leaks, kind):
    """Every verified position is masked by the grammar (rows filled after the proposed
    drafts), so the output is plain constrained greedy output; the draft model proposed for
    every request (its drafts are rejected where the grammar forbids them)."""
    constraint = {"json": lambda: StructuredOutputsParams(json=SCHEMA),
                  "regex": lambda: StructuredOutputsParams(regex=REGEX),
                  "choice": lambda: StructuredOutputsParams(choice=["ab ab ab the", "fox"]),
                  "tool_call": _tool_call_constraint}[kind]()
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
    passes = _count_draft_passes(self_draft)
    ref, got = _generate(plain, params), _generate(self_draft, params)
    _same_outputs(ref, got)
    for out in got:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        if kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "json":
            assert isinstance(json.loads(text)["a"], list), text
        elif kind == "tool_call":
            assert [k for k, _ in json.loads(text, object_pairs_hook=list)[0]] == \
                ["name", "arguments"], text
    drafted, accepted = _drafted(got)
    assert drafted > 0 and passes and 0 <= accepted <= drafted
    assert_no_leaks(self_draft)


def test_mixed_batch_with_a_bad_draft_and_preemption(tiny_llama, tiny_model_factory, plain,
                                                     assert_no_leaks):
    """Constrained and free requests in one batch, a different random model drafting (rarely
    right), a 30-block pool forcing preemptions: each request's output is its plain output,
    the free ones' untouched by the grammar rows of the others."""
    spec = _engine(tiny_llama.path, tiny_model_factory("llama_mqa").path, num_kv_blocks=30,
                   max_num_seqs=8)
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex=REGEX)
                             if i % 2 else None) for i in range(8)]
    ref, got = _generate(plain, params, prompts), _generate(spec, params, prompts)
    _same_outputs(ref, got)
    assert spec.engine.core.scheduler.num_preemptions > 0
    assert all(_drafted([o])[0] > 0 for o in got)
    assert_no_leaks(spec)


def test_matches_transformers_with_xgrammar_mask(tiny_llama, tiny_tokenizer, self_draft):
    """The oracle: transformers' greedy decoding, logits masked with xgrammar's bitmask."""
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(regex=REGEX)))
    for out in _generate(self_draft, params, PROMPTS[:2]):
        expected = _reference(tiny_llama.hf_model, tiny_tokenizer, out.prompt_token_ids,
                              REGEX, 30)
        assert list(out.outputs[0].token_ids) == expected


@pytest.fixture(scope="module")
def own_text(plain) -> tuple[list[str], StructuredOutputsParams]:
    """(prompt, a choice holding the target's own unconstrained greedy text there): the
    self-draft's unconstrained proposals are then what the grammar allows."""
    prompt = PROMPTS[1:2]  # the tiny model's greedy text here is printable (whole characters)
    free = _generate(plain, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                     prompt)[0].outputs[0].text
    assert len(free) >= 8 and free.isprintable()
    return prompt, StructuredOutputsParams(choice=[free, "fox"])


def test_drafts_the_grammar_allows_are_accepted(plain, self_draft, own_text, assert_no_leaks):
    """Nearly all drafts are accepted where the grammar allows them, and the output is the
    chosen text (as without speculation)."""
    prompt, constraint = own_text
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs=constraint)
    ref, got = _generate(plain, params, prompt), _generate(self_draft, params, prompt)
    _same_outputs(ref, got)
    assert got[0].outputs[0].text == constraint.choice[0]
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted >= 0.7 * drafted
    assert_no_leaks(self_draft)


@pytest.mark.parametrize("case", ["own_text", "regex"])
def test_logprobs_are_those_of_masked_positions(plain, self_draft, own_text, case):
    """Each emitted token's logprobs come from its position's masked (renormalized)
    distribution, as without speculation: at accepted drafts' positions (own_text: most
    tokens) and where drafts are rejected (regex)."""
    prompt, constraint = own_text if case == "own_text" else \
        (PROMPTS[:2], StructuredOutputsParams(regex=REGEX))
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                            structured_outputs=constraint)
    ref, got = _generate(plain, params, prompt), _generate(self_draft, params, prompt)
    _same_outputs(ref, got)
    if case == "own_text":
        assert _drafted(got)[1] >= 8
    for r, g in zip(ref, got):
        assert len(g.outputs[0].logprobs) == len(r.outputs[0].token_ids)
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lr.keys() == lg.keys()
            for t in lr:
                assert lg[t].logprob == pytest.approx(lr[t].logprob, abs=1e-4)


def test_seeded_sampling_is_reproducible_and_constrained(self_draft):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=REGEX))
              for s in range(4)]
    first, second = _generate(self_draft, params), _generate(self_draft, params)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.outputs[0].finish_reason == "stop":
            assert re.fullmatch(REGEX, a.outputs[0].text), a.outputs[0].text
    assert _drafted(first)[0] > 0


@pytest.mark.parametrize("splits", [True, False])
def test_constrained_requests_drafted_only_where_the_step_splits(splits):
    """The speculator gives a constrained request draft-model placeholders only when the
    executor can fill its grammar rows after the proposal; unconstrained ones always."""
    spec = Speculator(SpeculativeConfig(method="draft_model", model="m",
                                        num_speculative_tokens=3, adaptive=False),
                      4000, constrained_draft_model=splits)
    params = SimpleNamespace(max_tokens=100)
    requests = [SimpleNamespace(request_id=rid, all_token_ids=[5, 6, 7], num_computed_tokens=2,
                                prompt_token_ids=[5, 6], sampling_params=params,
                                structured_output=so)
                for rid, so in (("free", None), ("constrained", object()))]
    drafts = spec.propose(requests, 2)
    assert drafts["free"] == [-1, -1, -1]
    assert drafts.get("constrained") == ([-1, -1, -1] if splits else None)
    assert np.array_equal(spec.num_accepted_per_pos, [0, 0, 0])
