"""FR-Spec: a draft model whose LM head covers only frequent tokens (``draft_vocab_size``).

The restricted head's logits are the full head's at the kept rows (against a plain fp32
product, unquantized and INT8); through the engine (tiny random models, float32) greedy output
equals plain greedy output and every draft token lies in the subset (the lowest ids, the end
token, the context's tokens); sampled output keeps the target's distribution although the
draft's ``q`` is zero on most of the vocabulary (chi-square against transformers); no KV block
leaks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.layers.embedding import ParallelLMHead
from kvflow.quant.int8 import Int8EmbeddingMethod
from kvflow.spec_decode.draft_vocab import DraftVocab, frequent_token_ids, restrict_lm_head
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs

SUBSET = 48  # of the tiny tokenizer's 320 ids


def test_frequent_token_ids_are_the_lowest_ids_and_the_end_tokens():
    assert frequent_token_ids(10, 4, [9, 2]).tolist() == [0, 1, 2, 3, 9]
    assert frequent_token_ids(10, 40).tolist() == list(range(10))
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        frequent_token_ids(10, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequent_token_ids(10, 4, [10])


@pytest.mark.parametrize("int8", [False, True])
def test_restricted_head_gives_the_full_heads_logits_at_its_rows(int8):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(100, 32, generator=gen)
    head = ParallelLMHead(100, 32, quant_method=Int8EmbeddingMethod() if int8 else None)
    head.weight.data.copy_(table)
    head.quant_method.process_weights_after_loading(head)
    keep = torch.tensor([0, 3, 7, 42, 99])
    sub = restrict_lm_head(head, keep)
    hidden = torch.randn(3, 32, generator=gen)
    if int8:  # the oracle: the dequantized int8 rows, in fp32
        table = head.weight.float() * head.weight_scale[:, None]
    expected = hidden @ table[keep].T
    got = sub.compute_logits(hidden)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert sub.weight.data_ptr() != head.weight.data_ptr()  # a copy: packing sub leaves head
    assert head.compute_logits(hidden).shape == (3, 100)


class _CappedModel(torch.nn.Module):
    """A model's logits interface (``compute_logits(hidden, head=None)``, soft-capped at 5 as
    Gemma's) that fails if its ``lm_head`` is replaced once ``frozen``."""

    def __init__(self, head: ParallelLMHead) -> None:
        super().__init__()
        self.lm_head = head

    def __setattr__(self, name, value):
        if name == "lm_head" and getattr(self, "frozen", False):
            raise AssertionError("the model's lm_head was replaced")
        super().__setattr__(name, value)

    def compute_logits(self, hidden, head=None):
        return torch.tanh((head or self.lm_head).compute_logits(hidden) / 5) * 5


def test_logits_cover_the_subset_and_the_context_without_touching_the_model():
    """Head of 100 ids cut to 8 (ids 0-6 and the end token 99); the context adds 40 and 77.
    The logits' columns are tokens [0..6, 99, 40, 77], each the soft-capped fp32 product with
    that row of the full table, and the model's lm_head stays the cut head throughout."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(100, 16, generator=gen)
    head = ParallelLMHead(100, 16)
    head.weight.data.copy_(table)
    model = _CappedModel(head)
    vocab = DraftVocab(model, 7, always=[99])
    cut = model.lm_head
    model.frozen = True
    vocab.update(np.array([[3, 40, 77, 5]]), np.array([4]), np.array([0]))
    assert vocab.token_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 99, 40, 77]
    hidden = torch.randn(2, 16, generator=gen)
    expected = torch.tanh(hidden @ table[vocab.token_ids].T / 5) * 5
    torch.testing.assert_close(vocab.logits(hidden), expected, rtol=1e-5, atol=1e-5)
    assert model.lm_head is cut


def _engine(path: str, draft: str | None = None, k: int = 3, subset: int = SUBSET,
            **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": k, "adaptive": False,
                                       "draft_vocab_size": subset, "quantization": "none"}
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


def _spy_drafts(llm: LLM) -> list[int]:
    """Every draft token the draft model proposes, in a list."""
    drafter, seen = llm.engine.core.executor.runner.drafter, []
    original = drafter._propose

    def spy(*args, **kwargs):
        proposal = original(*args, **kwargs)
        for tokens in proposal.token_ids.values():
            seen.extend(tokens)
        return proposal

    drafter._propose = spy
    return seen


def test_greedy_with_a_restricted_self_draft(tiny_llama, assert_no_leaks):
    """The target drafts for itself with its head cut to 48 ids: output is plain greedy; each
    draft token is in the subset (ids < 48, the end token 0, the request's context); the
    drafts are often accepted (the same model; when the target's argmax is outside the
    subset the draft cannot be right: about half were here)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base, spec = _engine(tiny_llama.path), _engine(tiny_llama.path, tiny_llama.path)
    drafter = spec.engine.core.executor.runner.drafter
    assert drafter.vocab is not None and len(drafter.vocab.fixed_ids) == SUBSET
    assert drafter.model.lm_head.weight.shape[0] == SUBSET or \
        drafter.model.lm_head.packed_weight is not None
    drafts = _spy_drafts(spec)
    ref, got = base.generate(PROMPTS, params, use_tqdm=False), \
        spec.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    context = set()
    tokenizer = spec.get_tokenizer()
    for prompt, out in zip(PROMPTS, ref):
        context |= set(tokenizer(prompt)["input_ids"]) | set(out.outputs[0].token_ids)
    assert drafts and all(t < SUBSET or t in context for t in drafts)
    assert any(t >= SUBSET for t in drafts)  # context tokens outside the fixed ids drafted
    drafted, accepted = _drafted(got)
    assert drafted == len(drafts) and accepted >= 0.4 * drafted
    assert_no_leaks(spec)


def test_sampling_with_a_restricted_bad_draft_keeps_the_target_distribution(
        tiny_llama, assert_no_leaks):
    """Temperature 0.3, top_k=5 on the target; the target drafts for itself from its softmax
    (no top-k) over ids < 200 plus the context's, so q differs from p inside the subset and is
    zero on over half of the target's mass, which the residual max(0, p - q) = p carries
    there. The second token's marginal over 2,000 requests must match
    sum_t1 p(t1) p(t2 | t1) from transformers (chi-square, p > 0.001); a q handed to the
    sampler at half its value fails it (p = 1.5e-20)."""
    from tests.spec_decode.test_draft_model_engine import second_token_marginal
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    hf, top_k, temperature = tiny_llama.hf_model, 5, 0.3

    prompt, subset = [5, 17, 42, 99, 7, 23], 200
    marginal = second_token_marginal(hf, prompt, top_k, temperature)
    outside = marginal.clone()
    outside[:subset] = 0
    outside[prompt] = 0
    assert 0.4 < outside.sum() < 0.8  # 0.59: the draft cannot say half of what p says
    spec = _engine(tiny_llama.path, tiny_llama.path, k=2, subset=subset,
                   num_kv_blocks=4000, max_num_seqs=256)
    drafts = _spy_drafts(spec)
    n = 2000
    outs = spec.generate([prompt] * n, SamplingParams(temperature=temperature, top_k=top_k,
                                                      max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
    assert_sampled_token_follows(outs, 1, marginal)
    drafted, accepted = _drafted(outs)
    assert drafted >= n and 0 < accepted < drafted
    tokens = np.array(drafts)
    allowed = set(range(subset)) | {int(t) for o in outs for t in o.outputs[0].token_ids} | \
        set(prompt)
    assert set(tokens.tolist()) <= allowed
    assert_no_leaks(spec)


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_cpu_default_draft_int8_with_a_restricted_head(tiny_model_factory, name,
                                                       assert_no_leaks):
    """The CPU defaults (no ``quantization``: INT8 weights and an INT8 LM head) with the head
    cut to 48 of the 320 ids, tied to the embedding or not: the cut head's per-row scales are
    cut with its rows (float32 [48], contiguous: the INT8 kernel's contract), output is plain
    greedy and the quantized self-draft's drafts are accepted. A tied head once kept the
    embedding's whole [320] scale (its parameter names were not shared with the table's), so
    engine start failed in the INT8 kernel."""
    model = tiny_model_factory(name)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = _engine(model.path)
    spec = LLM(model=model.path, dtype="float32", block_size=4, num_kv_blocks=96,
               speculative_config={"method": "draft_model", "model": model.path,
                                   "num_speculative_tokens": 3, "adaptive": False,
                                   "draft_vocab_size": SUBSET})
    head = spec.engine.core.executor.runner.drafter.model.lm_head
    assert head.weight.dtype == torch.int8 and head.vocab_size == SUBSET
    assert head.weight_scale.dtype == torch.float32 and head.weight_scale.shape == (SUBSET,)
    assert head.weight_scale.is_contiguous()
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(base.generate(PROMPTS, params, use_tqdm=False), got)
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted > 0
    assert_no_leaks(spec)
