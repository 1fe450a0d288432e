"""vLLM 0.32's ``thinking_token_budget`` in the engine (``kvflow/thinking_budget.py``, the
runner's forced rows in ``worker/sampling_inputs.py``).

Oracles: the rule on hand-written token lists (vLLM model runner V2's reading: the last
start marker after the last natural end, think tokens counted from the marker, the prompt's
included, the end marker's next token after the longest proper prefix already written); the
engine's greedy output on the tiny random Llama against a plain transformers greedy loop: the
reference run without a budget cut at ``N`` think tokens, the end marker (several tokens with
the tiny tokenizer), then the reference continuation of that prefix. With n-gram speculative
decoding, preemption, prefix caching and ``n`` > 1 the output is the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.sched_output import GrammarBitmask
from kvflow.thinking_budget import ReasoningTokenIds, ThinkingBudgetScan
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.request_state import RequestState
from kvflow.worker.sampling_inputs import SamplingInputs
from tests.test_input_batch import FULL

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
MARGIN = 1e-3  # smallest top-1 lead over the runner-up the reference accepts
IDS = ReasoningTokenIds([7], [8, 9])  # start 7, end 8 9 (natural end 8 9)


def _forced(scan: ThinkingBudgetScan, tokens: list[int], num_known: int | None = None):
    arr = np.array(tokens, np.int64)
    known = len(tokens) if num_known is None else num_known
    scan.commit(arr[:known])
    return scan.forced_token(arr, known)


# ---- the rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,budget,expected", [
    ([1, 7, 3], 2, None),  # one think token: under the budget
    ([1, 7, 3, 4], 2, 8),  # two: the end marker's first token
    ([1, 7, 3, 4, 8], 2, 9),  # its first token written: the second
    ([1, 7, 3, 4, 8, 9], 2, None),  # the natural end follows the start: out of the block
    ([1, 7, 3, 4, 8, 9, 5, 7, 6], 1, 8),  # a later block: counted from its own start
    ([1, 7], 0, 8),  # budget 0: ended at once
    ([1, 2, 3], 0, None),  # no start marker
    ([7, 8, 9, 1], 0, None),  # the block closed in the prompt
    ([1, 7, 3, 8, 4], 1, 8),  # a lone 8 the model wrote earlier is not a prefix at the end
])
def test_forced_token_follows_vllms_rule(tokens, budget, expected):
    assert _forced(ThinkingBudgetScan(budget, IDS), tokens) == expected


def test_drafts_count_and_commits_read_only_new_tokens():
    """Draft tokens before a position count (num_known < len); a commit that sees the same or
    more tokens keeps the markers found before; one that sees fewer reads them again."""
    scan = ThinkingBudgetScan(3, IDS)
    assert _forced(scan, [1, 7, 2], num_known=2) is None  # one think token (a draft)
    assert _forced(scan, [1, 7, 2, 3, 4], num_known=2) == 8  # three, two of them drafts
    assert _forced(scan, [1, 7, 2, 3, 4, 8], num_known=2) == 9
    assert _forced(scan, [1, 7, 2, 3, 4, 8, 9], num_known=2) is None  # the drafts close it
    assert (scan.last_start, scan.last_end) == (1, -1)  # drafts are not committed
    assert _forced(scan, [1, 7, 2, 3, 4, 8, 9]) is None  # committed now
    assert (scan.last_start, scan.last_end) == (1, 5)
    assert _forced(scan, [1, 7, 2, 3, 4]) == 8  # fewer tokens than read: read again
    transition = ReasoningTokenIds([7], [5, 8, 9], [8, 9])  # a phrase before the natural end
    assert [_forced(ThinkingBudgetScan(0, transition), [7] + t) for t in
            ([], [5], [5, 8], [5, 8, 9])] == [5, 8, 9, None]


def test_first_leaves_the_prompts_markers_uncounted():
    scan = ThinkingBudgetScan(0, IDS, first=2)  # a 2-token prompt [1, 7]
    assert _forced(scan, [1, 7]) is None
    assert _forced(scan, [1, 7, 3, 7]) == 8


def test_budget_values_are_checked_as_vllm_checks_them():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for bad in (-2, True, 1.5, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget=.* must be a non-negative "
                                             "integer, or -1"):
            SamplingParams(thinking_token_budget=bad)
    with pytest.raises(ValueError, match=r"reasoning_token_ids.reasoning_end_token_ids=\[\] "):
        SamplingParams(reasoning_token_ids={"reasoning_start_token_ids": [1],
                                            "reasoning_end_token_ids": []})
    params = SamplingParams(reasoning_token_ids={"reasoning_start_token_ids": [1],
                                                 "reasoning_end_token_ids": [2, 3]})
    assert params.reasoning_token_ids == ReasoningTokenIds([1], [2, 3], [2, 3])


# ---- sampling rows ----------------------------------------------------------------------------
def _bitmask(allowed_per_row: list[list[int]], vocab: int = 64) -> torch.Tensor:
    words = np.zeros((len(allowed_per_row), (vocab + 31) // 32), np.int64)
    for r, allowed in enumerate(allowed_per_row):
        for t in allowed:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def test_verification_rows_force_at_their_own_positions():
    """Prompt [5, 7] (start 7), generated [3]; drafts [4, 8, 6]: budget 2 is reached at the
    position after draft 4 (8 forced), then 9 after the draft 8; the position after draft 6
    is past an 8 that is not the end's prefix at the end: 8 again. Another request has no
    budget: no forced rows."""
    batch = InputBatch(2, [FULL])
    params = SamplingParams(thinking_token_budget=2, reasoning_token_ids=IDS)
    batch.add_request(RequestState("a", [5, 7], params, 2), [3], ([1],), 3)
    batch.add_request(RequestState("b", [5, 7], SamplingParams(), 2), [3], ([2],), 3)
    batch.write_draft_tokens(0, [4, 8, 6])
    inputs = SamplingInputs(torch.device("cpu"))
    meta = inputs.build(batch, np.array([0, 0, 0, 0, 1]), num_extra=np.array([0, 1, 2, 3, 0]))
    assert meta.forced_token_ids == {1: 8, 2: 9, 3: 8}
    plain = inputs.build(batch, np.array([0, 1]))
    assert plain.forced_token_ids == {}  # one think token known
    # a grammar that does not allow 9 at the second row leaves it to the grammar
    grammar = GrammarBitmask(["a"] * 4, _bitmask([[1], [8], [1], [8]]))
    meta = inputs.build(batch, np.array([0, 0, 0, 0, 1]), grammar,
                        num_extra=np.array([0, 1, 2, 3, 0]))
    assert meta.forced_token_ids == {1: 8, 3: 8}


def test_a_forced_row_is_a_point_mass():
    from kvflow.layers.sampler import Sampler
    from kvflow.layers.sampling_metadata import SamplingMetadata
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    meta = SamplingMetadata(temperature=torch.tensor([0.0, 1.0]),
                            banned_token_ids={1: [4]}, forced_token_ids={0: 3, 1: 4})
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.sampled.tolist() == [3, 4]  # the forced token wins over a ban too (vLLM's)


# ---- the engine against transformers ----------------------------------------------------------
def _greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy loop over transformers' logits, asserting a top-1 lead at every step."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1]
        top = logits.topk(2).values
        assert top[0] - top[1] > MARGIN, (prompt, out, top)
        out.append(int(logits.argmax()))
    return out


def _markers(tokenizer) -> ReasoningTokenIds:
    return ReasoningTokenIds(tokenizer.encode("<think>", add_special_tokens=False),
                             tokenizer.encode("</think>", add_special_tokens=False))


PROMPTS = ["the quick brown fox", "kvflow pages keys and values", "a b a b a b a b"]
MAX_TOKENS = 20


def _expected(hf_model, prompt: list[int], budget: int, end: list[int]) -> list[int]:
    """The reference: ``budget`` tokens of the unbudgeted greedy reply, the end marker, then
    the greedy continuation of that prefix, ``MAX_TOKENS`` in all."""
    think = _greedy(hf_model, prompt, budget)
    assert not any(think[len(think) - k:] == end[:k] for k in range(1, len(end))), \
        "a reply ending with a prefix of the marker would be forced its next token"
    head = think + end
    return head + _greedy(hf_model, prompt + head, MAX_TOKENS - len(head))


@pytest.fixture(scope="module")
def cases(tiny_llama, tiny_tokenizer):
    """(prompt ids ending with the start marker, budget, expected tokens) per case."""
    ids = _markers(tiny_tokenizer)
    assert len(ids.reasoning_end_token_ids) > 1  # the multi-token marker case
    out = []
    for prompt, budget in zip(PROMPTS, (0, 3, 9)):
        tokens = tiny_tokenizer.encode(prompt) + ids.reasoning_start_token_ids
        out.append((tokens, budget, _expected(tiny_llama.hf_model, tokens, budget,
                                              ids.reasoning_end_token_ids)))
    return ids, out


def _outputs(llm: LLM, ids: ReasoningTokenIds, cases, **fields) -> list:
    prompts = [{"prompt_token_ids": tokens} for tokens, _, _ in cases]
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **fields}
    params = [SamplingParams(thinking_token_budget=budget, reasoning_token_ids=ids, **fields)
              for _, budget, _ in cases]
    return llm.generate(prompts, params, use_tqdm=False)


def _run(llm: LLM, ids: ReasoningTokenIds, cases, **fields) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs]
            for o in _outputs(llm, ids, cases, **fields)]


def _engine(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


def test_greedy_output_is_cut_at_the_budget(tiny_llama, cases, assert_no_leaks):
    ids, cases_ = cases
    llm = _engine(tiny_llama.path)
    assert _run(llm, ids, cases_) == [[expected] for _, _, expected in cases_]
    assert _run(llm, ids, cases_, n=2) == [[expected] * 2 for _, _, expected in cases_]
    assert_no_leaks(llm)


def test_ngram_speculation_gives_the_same_tokens(tiny_llama, cases, assert_no_leaks):
    ids, cases_ = cases
    llm = _engine(tiny_llama.path, NGRAM)
    outs = _outputs(llm, ids, cases_)
    assert [[list(o.outputs[0].token_ids)] for o in outs] == \
        [[expected] for _, _, expected in cases_]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted  # drafts taken and drafts rejected
    assert_no_leaks(llm)


def test_preemption_and_prefix_caching_keep_the_count(tiny_llama, cases, assert_no_leaks):
    """A pool too small for every request at once: requests are preempted and recomputed
    (their think tokens read again from their prompt and output), with and without drafts;
    a prompt sent again hits the prefix cache."""
    ids, cases_ = cases
    many = cases_ * 3
    for spec in (None, NGRAM):
        llm = _engine(tiny_llama.path, spec, num_kv_blocks=16, max_num_seqs=9)
        assert _run(llm, ids, many) == [[expected] for _, _, expected in many]
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(llm)
        last = cases_[-1:]  # its prompt from the prefix cache
        assert _run(llm, ids, last) == [[last[0][2]]]
        assert llm.engine.core.kv_cache_manager.num_hits > 0


def test_sampled_samples_take_the_marker_at_the_budget(tiny_llama, cases):
    """Random sampling (n=3, seeded): each sample's tokens ``budget .. budget + len(end)``
    are the end marker, whatever was sampled before."""
    ids, cases_ = cases
    end = ids.reasoning_end_token_ids
    llm = _engine(tiny_llama.path)
    for (_, budget, _), samples in zip(cases_, _run(llm, ids, cases_, n=3, temperature=1.0,
                                                   seed=5)):
        for tokens in samples:
            cut = tokens[:budget]
            if any(cut[len(cut) - k:] == end[:k] for k in range(1, len(end))):
                continue  # a sample that wrote a prefix of the marker itself
            assert tokens[budget:budget + len(end)] == end


def test_a_budget_without_markers_is_refused(tiny_llama):
    llm = _engine(tiny_llama.path)
    with pytest.raises(ValueError, match=r"SamplingParams.thinking_token_budget needs the "
                                         r"model's reasoning markers"):
        llm.generate("the quick", SamplingParams(thinking_token_budget=4), use_tqdm=False)
    bad = ReasoningTokenIds([1], [10**6])
    with pytest.raises(ValueError, match=r"reasoning_end_token_ids has token id 1000000 "
                                         r"outside the vocabulary"):
        llm.generate("the quick", SamplingParams(thinking_token_budget=4,
                                                 reasoning_token_ids=bad), use_tqdm=False)


def test_a_grammar_starts_after_the_forced_marker(tiny_llama, cases):
    """Under a grammar the markers hand over to it (``tests/test_grammar_after_reasoning.py``):
    the prompt's opening marker counts, budget 0 forces the end marker at once, and the
    grammar reads the reply after it: the tokens a prompt already holding the marker gives
    (the grammar from its first token there, as vLLM reads such a prompt)."""
    import re

    from kvflow.structured import StructuredOutputsParams
    ids, cases_ = cases
    end = ids.reasoning_end_token_ids
    llm = _engine(tiny_llama.path)
    regex = "[a-z ]{1,15}"
    fields = {"structured_outputs": StructuredOutputsParams(regex=regex), "max_tokens": 16,
              "temperature": 0, "reasoning_token_ids": ids}
    budgeted = llm.generate([{"prompt_token_ids": cases_[0][0]}], SamplingParams(
        thinking_token_budget=0, **{**fields, "max_tokens": 16 + len(end)}),
        use_tqdm=False)[0].outputs[0]
    closed = llm.generate([{"prompt_token_ids": cases_[0][0] + end}], SamplingParams(
        **fields), use_tqdm=False)[0].outputs[0]
    assert list(budgeted.token_ids) == end + list(closed.token_ids)
    assert budgeted.text.startswith("</think>")
    assert re.fullmatch(regex, budgeted.text[len("</think>"):])
