"""A draft model speculating for constrained requests (structured output, tool-call grammars),
on tiny random models (float32): greedy output is the non-speculative constrained output token
for token (JSON schema, regex, choice, a tool call's grammar), and both are transformers'
greedy decoding with xgrammar's bitmask applied to its logits; the draft model did propose for
them (drafted > 0); logprobs are those of every position masked; sampled tokens follow the
masked target's distribution (chi-square against transformers + xgrammar); a seeded request
gives the same output twice and matches its constraint; an executor that cannot split a step
leaves constrained requests undrafted. The TP=2 case (two worker processes) runs in
scripts/test_distributed_slow.sh: speculation over two ranks runs by default in
tests/spec_decode/test_eagle_tp.py, the draft model's constrained steps here in one process.
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
from tests.distributed.conftest import slow
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


@pytest.fixture(scope="module")
def mp_self_draft(tiny_llama):
    """The self-draft engine with its worker in a process of its own (the mp executor: the
    split step crosses the worker's message surface)."""
    llm = _engine(tiny_llama.path, tiny_llama.path, distributed_executor_backend="mp")
    yield llm
    llm.engine.core.executor.shutdown()


@pytest.fixture(params=["uni", "mp"])
def self_drafts(request):
    """The self-draft engine under each executor that splits steps."""
    return request.getfixturevalue({"uni": "self_draft", "mp": "mp_self_draft"}[request.param])


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
    the requests, each draft within the grammar's row after the drafts before it, so the
    self-draft's drafts are the target's choices and accepted (but for drafts after the
    end)."""
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
    # every draft is chosen within its grammar row: the self-draft's are the target's choices
    # (regex: 0 of 174 accepted without any mask, 29 of 87 with draft 1's only, 45 of 48
    # with every draft's; json 25 of 75 -> 36 of 42, tool_call 85 of 249 -> 128 of 132)
    assert drafted > 0 and passes and 0.8 * drafted <= accepted <= drafted
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


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_restricted_draft_vocabulary(tiny_llama, plain, assert_no_leaks, temperature):
    """A draft whose head is cut to 48 ids (FR-Spec): draft 1's grammar row is read through
    the cut columns (a row with no allowed column stays unmasked), so greedy drafts 1 are
    accepted where the target's choice is among the columns; greedy output is plain
    constrained output, seeded sampling repeats itself and matches the regex."""
    spec = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=96,
               speculative_config={"method": "draft_model", "model": tiny_llama.path,
                                   "num_speculative_tokens": 3, "adaptive": False,
                                   "quantization": "none", "draft_vocab_size": 48})
    assert spec.engine.core.executor.runner.drafter.vocab is not None
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=REGEX))
              for s in range(4)]
    got = _generate(spec, params)
    if temperature == 0:
        _same_outputs(_generate(plain, params), got)
    else:
        again = _generate(spec, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in again]
    for out in got:
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
    drafted, accepted = _drafted(got)
    assert drafted > 0
    if temperature == 0:  # 26 of 102 here; 0 of 174 without the first draft's mask
        assert accepted >= 0.15 * drafted
    assert_no_leaks(spec)


def test_a_split_step_that_fails_aborts_its_requests_and_the_engine_recovers(
        plain, self_draft, monkeypatch, assert_no_leaks):
    """A failure between the draft's proposal and the sampling (the forward pass launched)
    aborts the step's requests; the engine then serves the same requests as before."""
    params = SamplingParams(temperature=0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    runner = self_draft.engine.core.executor.runner
    real, failed = runner.launch_sampling, []

    def broken(*args, **kwargs):
        if not runner.proposed_drafts():  # the prefill step
            return real(*args, **kwargs)
        failed.append(True)
        raise RuntimeError("simulated failure while sampling")

    with monkeypatch.context() as patch:
        patch.setattr(runner, "launch_sampling", broken)
        with pytest.raises(RuntimeError, match="simulated"):
            _generate(self_draft, params, PROMPTS[:2])
    assert failed == [True]
    assert_no_leaks(self_draft)
    _same_outputs(_generate(plain, params, PROMPTS[:2]), _generate(self_draft, params,
                                                                    PROMPTS[:2]))
    assert_no_leaks(self_draft)


def test_matches_transformers_with_xgrammar_mask(tiny_llama, tiny_tokenizer, self_drafts):
    """The oracle: transformers' greedy decoding, logits masked with xgrammar's bitmask (the
    split step in process and through the mp worker's propose / verify messages)."""
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=(
        StructuredOutputsParams(regex=REGEX)))
    got = _generate(self_drafts, params, PROMPTS[:2])
    for out in got:
        expected = _reference(tiny_llama.hf_model, tiny_tokenizer, out.prompt_token_ids,
                              REGEX, 30)
        assert list(out.outputs[0].token_ids) == expected
    drafted, accepted = _drafted(got)  # undrafted under mp before it split steps
    assert drafted > 0 and accepted >= 0.8 * drafted  # every draft within its grammar row


def test_later_drafts_rows_are_xgrammar_rows_after_the_drafts(tiny_llama, tiny_tokenizer,
                                                             self_drafts, monkeypatch):
    """The rows the draft model gets for drafts 2..k (``StructuredOutputManager.draft_rows``,
    asked through the executor) are xgrammar's bitmask after the request's output and its
    drafts so far, from a matcher of its own; the drafts proposed within them are tokens the
    grammar accepts."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer, vocab_size=tiny_llama.vocab_size,
                                              stop_token_ids=[tiny_tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    so = self_drafts.engine.core.structured_output
    real, seen = so.draft_rows, []

    def checked(requests, drafts):
        rows = real(requests, drafts)
        for rid, row in zip(rows.request_ids, rows.bitmask, strict=True):
            matcher = xgr.GrammarMatcher(compiled)
            expected = xgr.allocate_token_bitmask(1, tiny_llama.vocab_size)[0]
            if all(matcher.accept_token(t) for t in
                   [*requests[rid].output_token_ids, *drafts[rid]]) and \
                    not matcher.is_terminated():
                matcher.fill_next_token_bitmask(expected.unsqueeze(0))
            else:  # after a draft the grammar rejects, or after its end: nothing
                expected.zero_()
            assert torch.equal(row, expected[:row.shape[0]])
            seen.append(len(drafts[rid]))
        return rows

    monkeypatch.setattr(so, "draft_rows", checked)
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    got = _generate(self_drafts, params, PROMPTS[:2])
    assert sorted(set(seen)) == [1, 2]  # k = 3: the rows of drafts 2 and 3
    for out in got:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text


def test_split_steps_count_in_the_worker_step_statistics(self_drafts, monkeypatch):
    """Every engine step (one ``update_from_output`` each), split or whole, is one step of
    the worker's ``step_stats``, with its seconds; drafts were proposed (split steps)."""
    core = self_drafts.engine.core
    real, steps = core.scheduler.update_from_output, []

    def counted(*args, **kwargs):
        steps.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(core.scheduler, "update_from_output", counted)
    before = core.executor.collective_rpc("step_stats")[0]
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(regex=REGEX)))
    got = _generate(self_drafts, params, PROMPTS[:2])
    after = core.executor.collective_rpc("step_stats")[0]
    assert _drafted(got)[0] > 0 and len(steps) >= 3
    assert after["steps"] - before["steps"] == len(steps)
    assert after["step_s"] - before["step_s"] >= after["forward_s"] - before["forward_s"] > 0


@slow
def test_tensor_parallel_split_steps_equal_plain_decoding(tiny_llama, plain, self_draft,
                                                          monkeypatch, assert_no_leaks):
    """TP=2 (mp, gloo): every rank holds the whole draft and both verify TP rank 0's
    proposal. Greedy constrained and free requests in one batch give plain decoding's
    tokens and logprobs; seeded sampled constrained requests give the one-rank self-draft's
    tokens (its draws, with ``q`` broadcast from rank 0); both ranks count every engine step
    in ``step_stats``."""
    tp = _engine(tiny_llama.path, tiny_llama.path, tensor_parallel_size=2)
    try:
        core, steps = tp.engine.core, []
        real = core.scheduler.update_from_output
        monkeypatch.setattr(core.scheduler, "update_from_output",
                            lambda *a, **k: steps.append(1) or real(*a, **k))
        regex = StructuredOutputsParams(regex=REGEX)
        greedy = [SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=i == 1,
                                 structured_outputs=None if i == 1 else regex)
                  for i in range(3)]
        ref, got = _generate(plain, greedy, PROMPTS[:3]), _generate(tp, greedy, PROMPTS[:3])
        _same_outputs(ref, got)
        for r, g in zip(ref, got):
            for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert lr.keys() == lg.keys()
                for t in lr:
                    assert lg[t].logprob == pytest.approx(lr[t].logprob, abs=1e-4)
        assert all(_drafted([o])[0] > 0 for o in got)
        assert _drafted(got[::2])[1] >= 0.8 * _drafted(got[::2])[0]  # rows asked by rank 0
        assert [s["steps"] for s in core.executor.collective_rpc("step_stats")] == \
            [len(steps)] * 2
        sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=24,
                                  structured_outputs=regex) for s in range(3)]
        one_rank = _generate(self_draft, sampled, PROMPTS[:3])
        two_ranks = _generate(tp, sampled, PROMPTS[:3])
        assert [o.outputs[0].token_ids for o in two_ranks] == \
            [o.outputs[0].token_ids for o in one_rank]
        assert _drafted(two_ranks)[0] > 0
        assert_no_leaks(tp)
    finally:
        tp.engine.core.executor.shutdown()


def test_share_proposal_takes_rank_zeros_tokens_and_q():
    """``share_proposal`` rebuilds the proposal from what the group broadcasts (rank 0's
    tokens, then its ``q`` rows, each in request-id order), whatever this rank proposed."""
    from kvflow.spec_decode.draft_proposal import DraftProposal, share_proposal

    q0 = {"b": torch.rand(2, 5), "c": torch.rand(1, 5)}
    rank0 = [torch.tensor([7, 8, 9, 3, 4, 5]), torch.cat([q0["b"], q0["c"]])]

    class FakeGroup:  # its broadcast hands back rank 0's tensors, in call order
        world_size, device = 2, torch.device("cpu")

        def broadcast(self, x):
            x.copy_(rank0.pop(0))
            return x

    mine = DraftProposal({"c": [1], "a": [2, 2, 2], "b": [6, 6]},
                         {"b": torch.zeros(2, 5), "c": torch.zeros(1, 5)}, 0.1)
    share_proposal(mine, FakeGroup())
    assert mine.token_ids == {"a": [7, 8, 9], "b": [3, 4], "c": [5]}
    torch.testing.assert_close(mine.probs["b"], q0["b"])
    torch.testing.assert_close(mine.probs["c"], q0["c"])
    assert rank0 == []


@pytest.mark.parametrize("where", ["draft_rows", "launch_sampling"])
def test_split_step_that_fails_is_discarded_and_the_engine_recovers(
        plain, self_drafts, monkeypatch, assert_no_leaks, where):
    """A failure in the engine core while the draft proposes (answering its grammar rows:
    under mp the worker waits for them) or between the proposal and the verification aborts
    the step's requests and the workers drop the step; the engine then serves the same
    requests as plain constrained decoding (logprobs too)."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    core = self_drafts.engine.core
    owner = core.structured_output if where == "draft_rows" else core.executor
    real, calls = getattr(owner, where), []

    def broken(*args, **kwargs):
        calls.append(True)
        if len(calls) == 2:  # a decode step's (the prefill step proposes nothing)
            raise RuntimeError(f"simulated failure in {where}")
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(owner, where, broken)
        with pytest.raises(RuntimeError, match="simulated"):
            _generate(self_drafts, params, PROMPTS[:2])
    assert len(calls) == 2
    assert_no_leaks(self_drafts)
    ref, got = _generate(plain, params, PROMPTS[:2]), _generate(self_drafts, params,
                                                                PROMPTS[:2])
    _same_outputs(ref, got)
    for r, g in zip(ref, got):
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lr.keys() == lg.keys()
            for t in lr:
                assert lg[t].logprob == pytest.approx(lr[t].logprob, abs=1e-4)
    assert _drafted(got)[0] > 0
    assert_no_leaks(self_drafts)


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


def _masked_probs(hf, matcher, bitmask, ids: list[int], top_k: int,
                  temperature: float) -> torch.Tensor:
    """float64 [vocab]: the target's next-token distribution after ``ids`` as plain
    constrained sampling forms it: logits masked by the grammar (xgrammar's bitmask from
    ``matcher``'s state, unpacked with torch), then top-k, then softmax(logits / T)."""
    vocab = hf.config.vocab_size
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    logits[~bits.bool().flatten()[:vocab]] = float("-inf")
    keep = logits.topk(top_k).indices
    p = torch.zeros_like(logits)
    p[keep] = torch.softmax(logits[keep] / temperature, 0)
    return p


def _third_token_marginal(hf, tokenizer, regex: str, prompt: list[int], top_k: int,
                          temperature: float) -> torch.Tensor:
    """sum over t1, t2 of P(t1) P(t2 | t1) P(t3 | t1 t2), [vocab] float64, each P masked."""
    import xgrammar as xgr

    vocab = hf.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                              stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    total = torch.zeros(vocab, dtype=torch.float64)
    p1 = _masked_probs(hf, matcher, bitmask, prompt, top_k, temperature)
    for t1 in p1.nonzero().flatten().tolist():
        assert matcher.accept_token(t1)
        p2 = _masked_probs(hf, matcher, bitmask, prompt + [t1], top_k, temperature)
        for t2 in p2.nonzero().flatten().tolist():
            assert matcher.accept_token(t2)
            p3 = _masked_probs(hf, matcher, bitmask, prompt + [t1, t2], top_k, temperature)
            total += p1[t1] * p2[t2] * p3
            matcher.rollback(1)
        matcher.rollback(1)
    return total


def _draft_leaning_to(path: str, folder, token_ids: list[int]) -> str:
    """``path``'s model saved in ``folder`` with its LM head's rows of ``token_ids`` scaled
    by 5 and every other row zeroed: its top tokens are mostly ``token_ids`` (those the
    target scores above 0), padded with others when fewer are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, folder)
    weights = load_file(f"{folder}/model.safetensors")
    head = weights["lm_head.weight"]
    lean = torch.zeros_like(head)
    lean[token_ids] = 5 * head[token_ids]
    weights["lm_head.weight"] = lean
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_sampling_keeps_the_masked_target_distribution(tiny_llama, tiny_tokenizer, tmp_path):
    """Temperature 0.8, top_k=5, a regex allowing only tokens of the letters a-h (14 of the
    tiny vocabulary; 12 reach the third token's marginal); the draft leans to those tokens
    but also proposes others (which the masked target rejects), with q far from p. The third token (verified at a draft's position after an accepted draft,
    or first in a later step) over 2,000 requests must follow the masked target's marginal
    from transformers + xgrammar (chi-square, p > 0.001)."""
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    hf, top_k, temperature, regex = tiny_llama.hf_model, 5, 0.8, "[a-h]{12}"
    allowed = [t for t in range(tiny_llama.vocab_size)
               if (text := tiny_tokenizer.decode([t])) and set(text) <= set("abcdefgh")]
    assert len(allowed) >= 3
    prompt = [5, 17, 42, 99, 7, 23]
    marginal = _third_token_marginal(hf, tiny_tokenizer, regex, prompt, top_k, temperature)
    spec = _engine(tiny_llama.path, _draft_leaning_to(tiny_llama.path, tmp_path / "lean",
                                                      allowed),
                   num_kv_blocks=4000, max_num_seqs=256)
    n = 2000
    outs = _generate(spec, SamplingParams(
        temperature=temperature, top_k=top_k, max_tokens=4,
        structured_outputs=StructuredOutputsParams(regex=regex)), [prompt] * n)
    assert_sampled_token_follows(outs, 2, marginal)
    drafted, accepted = _drafted(outs)
    assert drafted >= n and 0.1 * drafted < accepted < 0.9 * drafted


def test_draft_mask_against_plain_torch():
    """``draft_choice.mask_drafts`` against the sampler's plain-torch bitmask
    (``apply_token_bitmask``): full columns, cut columns (a subset of ids, in any order),
    unconstrained rows untouched, a cut row with no allowed column left as it is."""
    from kvflow.layers.sampler import apply_token_bitmask
    from kvflow.sched_output import GrammarBitmask
    from kvflow.spec_decode.draft_choice import mask_drafts

    vocab, gen = 70, torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64
                            ).to(torch.int32)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5  # request "c" allows token 5 only
    grammar = GrammarBitmask(["a", "c"], bitmask)
    batch = SimpleNamespace(req_ids=["a", "b", "c"])
    rows = np.array([0, 1, 2])
    logits = torch.randn(3, vocab, generator=gen)
    expected = logits.clone()
    apply_token_bitmask(expected, [0, 2], bitmask)
    got = logits.clone()
    mask_drafts(batch, rows, got, grammar)
    torch.testing.assert_close(got, expected)
    columns = torch.tensor([9, 3, 64, 0, 41, 17])  # no 5: row "c" has no allowed column
    cut = logits[:, columns].clone()
    mask_drafts(batch, rows, cut, grammar, SimpleNamespace(token_ids=columns))
    torch.testing.assert_close(cut[:2], expected[:2, columns])
    torch.testing.assert_close(cut[2], logits[2, columns])
