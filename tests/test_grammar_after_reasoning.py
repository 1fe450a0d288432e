"""A grammar starts after the reasoning when the request's reasoning markers are known
(``SamplingParams.reasoning_token_ids``; vLLM 0.32's ``reasoning_ended`` rule:
``kvflow/structured/reasoning_gate.py``).

Oracle: the tiny random Llama's plain transformers greedy loop for the think tokens (free:
not constrained), and for the answer the same engine run from a prompt that already holds the
think block and its end marker (vLLM's prompt rule: the grammar applies from the first
token); the answer must parse as JSON and validate against the schema (``jsonschema``). With
the old code the grammar read the think tokens too.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from kvflow.structured.reasoning_gate import ReasoningGate, prompt_ends_reasoning
from kvflow.thinking_budget import ReasoningTokenIds
from tests.test_thinking_budget import NGRAM, _greedy, _markers

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
MAX_TOKENS = 40  # the answer's (room for the whole JSON object)
IDS = ReasoningTokenIds([7], [8, 9])


# ---- the rule, hand-computed ------------------------------------------------------------------
@pytest.mark.parametrize("prompt,ended", [
    ([], False),  # no marker: reasoning until the reply writes the end marker (vLLM's)
    ([1, 7], False),  # the template opened the block
    ([1, 7, 3, 8, 9], True),  # ... and closed it (thinking disabled)
    ([8, 9, 7, 2], False),  # a block opened after an earlier one closed
    ([1, 8, 9], True),
    ([1, 7, 8], False),  # half an end marker
])
def test_the_prompt_decides_as_vllms_is_reasoning_end(prompt, ended):
    assert prompt_ends_reasoning(prompt, IDS) is ended
    assert ReasoningGate(IDS, prompt).ended is ended


def test_the_gate_finds_the_end_marker_across_tokens_and_drafts():
    gate = ReasoningGate(IDS, [1, 7])
    assert gate.ended_after([2, 8]) is None  # half the marker
    assert gate.ended_after([8, 9, 4]) == 2  # drafts crossing the marker
    assert gate.append(8) is False and gate.ended_after([9, 5]) == 1  # straddling
    assert gate.ended_after([3]) is None  # 8 then 3: no marker
    assert gate.append(9) is True and gate.ended
    assert gate.ended_after([1, 2]) == 0
    single = ReasoningGate(ReasoningTokenIds([7], [8]), [7])
    assert single.ended_after([1, 8, 2]) == 2 and single.append(1) is False


class _OnlyFive:
    """A grammar backend whose matcher takes token 5 only (up to three of them), and
    records what it was fed."""

    def compile(self, params):
        return "five"

    def new_matcher(self, compiled):
        class Matcher:
            def __init__(self):
                self.fed: list[int] = []

            def accept_tokens(self, tokens):
                if tokens != [5] or len(self.fed) == 3:
                    return False
                self.fed = self.fed + tokens
                return True

            def rollback(self, num):
                self.fed = self.fed[:len(self.fed) - num]

            def fill_bitmask(self, bitmask, row):
                bitmask[row].zero_()
                if len(self.fed) < 3:
                    bitmask[row, 0] = 1 << 5

            def is_terminated(self):
                return False

        return Matcher()


def test_rows_drafts_and_tokens_before_the_end_marker_are_free():
    """The engine core's side: bitmask rows (one per draft prefix) allow every token up to
    the end marker and the grammar's tokens after it; draft checks and accepted tokens
    likewise; the matcher is fed only what follows the marker (hand-computed)."""
    import time

    from kvflow.request import Request
    from kvflow.structured.manager import StructuredOutputManager

    manager = StructuredOutputManager(_OnlyFive, vocab_size=64, max_num_seqs=4)
    state = manager.request_state(StructuredOutputsParams(grammar="five"), "r",
                                  reasoning=ReasoningGate(IDS, [1, 7]))
    while not state.is_compiled:
        time.sleep(0.002)
    assert manager.take_failed() == [] and state.is_ready
    request = Request("r", [1, 7], SamplingParams())
    request.structured_output = state
    drafts = [2, 8, 9, 5, 6]
    rows = manager.grammar_bitmask(["r"], {"r": request}, {"r": drafts}).bitmask
    free, five = [-1, -1], [1 << 5, 0]
    assert rows.tolist() == [free, free, free, five, five, [0, 0]]
    assert state.matcher.fed == []  # rolled back
    assert state.num_valid_drafts(drafts) == 4 and state.num_valid_drafts([2, 8]) == 2
    assert [state.accept_token(t) for t in (2, 8, 9)] == [True] * 3
    assert state.matcher.fed == [] and not state.in_reasoning
    assert state.accept_token(5) and not state.accept_token(6)
    assert state.matcher.fed == [5]
    rows = manager.grammar_bitmask(["r"], {"r": request}, {"r": [5, 5]}).bitmask
    assert rows.tolist() == [five, five, [0, 0]]  # the grammar's own rows now
    manager.shutdown()


# ---- the engine -------------------------------------------------------------------------------
def _engine(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


def _params(ids: ReasoningTokenIds | None, **kw) -> SamplingParams:
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return SamplingParams(reasoning_token_ids=ids,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


def _answer_is_valid(tokenizer, answer: list[int]) -> None:
    value = json.loads(tokenizer.decode(answer, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)


def _generate(llm: LLM, prompts: list[list[int]], params) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


PROMPTS = ["the quick brown fox", "a b a b a b a b"]


@pytest.fixture(scope="module")
def budget_cases(tiny_llama, tiny_tokenizer):
    """(prompt ending with ``<think>``, budget, free think tokens, end marker) per case: the
    budget's forced ``</think>`` (several tokens) hands over to the grammar."""
    ids = _markers(tiny_tokenizer)
    out = []
    for text, budget in zip(PROMPTS, (3, 6)):
        prompt = tiny_tokenizer.encode(text) + ids.reasoning_start_token_ids
        out.append((prompt, budget, _greedy(tiny_llama.hf_model, prompt, budget)))
    return ids, out


def _expected_budgeted(llm: LLM, ids: ReasoningTokenIds, cases) -> list[list[int]]:
    """Think tokens (transformers' greedy), the end marker, then the answer the engine gives
    from a prompt holding both (grammar from the first token there: the prompt closed the
    block), each answer checked to be valid."""
    end = ids.reasoning_end_token_ids
    heads = [think + end for _, _, think in cases]
    answers = _generate(llm, [p + h for (p, _, _), h in zip(cases, heads)], _params(ids))
    return [h + a[0] for h, a in zip(heads, answers)]


def _budgeted(ids: ReasoningTokenIds, budget: int, **kw) -> SamplingParams:
    """A budgeted request with room for ``MAX_TOKENS`` after the think block."""
    return _params(ids, thinking_token_budget=budget,
                   max_tokens=budget + len(ids.reasoning_end_token_ids) + MAX_TOKENS, **kw)


def test_the_budget_hands_over_to_the_grammar(tiny_llama, tiny_tokenizer, budget_cases,
                                              assert_no_leaks):
    ids, cases = budget_cases
    llm = _engine(tiny_llama.path)
    expected = _expected_budgeted(llm, ids, cases)
    got = _generate(llm, [p for p, _, _ in cases],
                    [_budgeted(ids, b, n=2) for _, b, _ in cases])
    assert got == [[e, e] for e in expected]
    end = ids.reasoning_end_token_ids
    for (_, budget, think), tokens in zip(cases, expected):
        assert tokens[:budget] == think  # free: transformers' own greedy tokens
        assert tokens[-1] == tiny_tokenizer.eos_token_id  # the grammar ended the reply
        _answer_is_valid(tiny_tokenizer, tokens[budget + len(end):])
    assert_no_leaks(llm)


def test_drafts_and_preemption_give_the_same_tokens(tiny_llama, budget_cases,
                                                    assert_no_leaks):
    """n-gram drafts (crossing the end marker: the repeated prompt drafts it) and a pool
    too small for every request at once (preempted and recomputed)."""
    ids, cases = budget_cases
    expected = _expected_budgeted(_engine(tiny_llama.path), ids, cases)
    many = cases * 3
    for spec, blocks in ((NGRAM, 128), (None, 20), (NGRAM, 20)):
        llm = _engine(tiny_llama.path, spec, num_kv_blocks=blocks, max_num_seqs=6)
        outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in many],
                            [_budgeted(ids, b) for _, b, _ in many],
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected * 3, (spec, blocks)
        if spec is not None:
            assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
        if blocks == 20:
            assert llm.engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(llm)


@pytest.fixture(scope="module")
def natural_case(tiny_llama, tiny_tokenizer):
    """A prompt ending with a one-token start marker, and an end marker the model writes
    itself: the first token from the fifth on of its greedy reply that it has not written before."""
    prompt = tiny_tokenizer.encode("one two three")
    greedy = _greedy(tiny_llama.hf_model, prompt, 8)
    k = next(i for i in range(4, 8) if greedy[i] not in greedy[:i] and greedy[i] != prompt[-1])
    return ReasoningTokenIds([prompt[-1]], [greedy[k]]), prompt, greedy[:k + 1]


def test_the_models_own_end_marker_hands_over(tiny_llama, tiny_tokenizer, natural_case):
    ids, prompt, think = natural_case
    llm = _engine(tiny_llama.path)
    [[answer]] = _generate(llm, [prompt + think], _params(ids))
    assert answer[-1] == tiny_tokenizer.eos_token_id
    for spec in (None, NGRAM):
        llm = _engine(tiny_llama.path, spec)
        long = _params(ids, max_tokens=len(think) + MAX_TOKENS)
        assert _generate(llm, [prompt], long) == [[think + answer]]
    _answer_is_valid(tiny_tokenizer, answer)


def test_without_markers_the_grammar_reads_every_token(tiny_llama, tiny_tokenizer,
                                                       natural_case):
    """As before: no reasoning_token_ids, the grammar from the first token; and a prompt
    that closed the block gives what no markers give."""
    ids, prompt, think = natural_case
    llm = _engine(tiny_llama.path)
    [[plain]] = _generate(llm, [prompt], _params(None))
    _answer_is_valid(tiny_tokenizer, plain)
    assert plain[:len(think)] != think
    assert _generate(llm, [prompt + think], _params(None)) == \
        _generate(llm, [prompt + think], _params(ids))


def test_a_reply_that_never_ends_reasoning_is_free(tiny_llama, tiny_tokenizer, budget_cases):
    """vLLM's rule: a prompt without markers starts inside the reasoning; a reply that never
    writes the end marker is never constrained (transformers' greedy, untouched)."""
    ids = budget_cases[0]
    prompt = tiny_tokenizer.encode(PROMPTS[0])
    free = _greedy(tiny_llama.hf_model, prompt, 10)
    end = ids.reasoning_end_token_ids
    assert not any(free[i:i + len(end)] == end for i in range(len(free)))
    llm = _engine(tiny_llama.path)
    assert _generate(llm, [prompt], _params(ids, max_tokens=10, ignore_eos=True)) == [[free]]
