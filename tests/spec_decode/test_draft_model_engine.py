"""Speculative decoding with a draft model through the whole engine, on tiny random models
(float32): greedy output equals greedy output without speculation token for token; the
draft's paged KV cache lives in the target's block pool (one block's bytes count both
models); with the target itself as the draft nearly every draft is accepted (so the draft's
K/V is right after rejections, preemptions and prefix-cache hits); a different random model as
a deliberately bad draft still leaves the target's sampling distribution exact (chi-square
against transformers); no KV block leaks.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.core.kv_cache_utils import kv_bytes_per_token
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs


def _engine(path: str, draft: str | None = None, k: int = 3, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 96)
    # the draft as loaded: the CPU default (INT8 weights) would make a self-draft differ from
    # the target, and these tests count on a self-draft being nearly always right
    spec = None if draft is None else {"method": "draft_model", "model": draft,
                                       "num_speculative_tokens": k, "adaptive": False,
                                       "quantization": "none"}
    return LLM(model=path, dtype="float32", block_size=4, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def base(tiny_llama):
    return _engine(tiny_llama.path)


@pytest.fixture(scope="module")
def self_draft(tiny_llama):
    return _engine(tiny_llama.path, tiny_llama.path)


def _generate(llm: LLM, params, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def test_draft_cache_shares_the_block_pool(base, self_draft):
    """The self-draft's layers are the target's again: every block id holds twice the bytes,
    so the same --kv-cache-memory would hold half the blocks."""
    plain, spec = base.engine.core.kv_cache_config, self_draft.engine.core.kv_cache_config
    assert spec.draft_group is not None and plain.draft_group is None
    assert len(spec.draft_group.layer_names) == len(plain.kv_cache_groups[0].layer_names)
    assert spec.page_size_bytes == 2 * plain.page_size_bytes
    assert kv_bytes_per_token(spec) == 2 * kv_bytes_per_token(plain)


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 40])
def test_greedy_with_the_target_as_draft(base, self_draft, assert_no_leaks, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref, got = _generate(base, params), _generate(self_draft, params)
    _same_outputs(ref, got)
    drafted, accepted = _drafted(got)
    if max_tokens >= 7:
        # the same model drafts: only near-ties between a 1-token and a k-token pass differ
        assert drafted > 0 and accepted >= 0.95 * drafted
    assert_no_leaks(self_draft)


def test_bad_draft_greedy_preemption_and_prefix_cache(tiny_llama, tiny_model_factory, base,
                                                      assert_no_leaks):
    """A different random model drafts (rarely right); a 24-block pool forces preemptions;
    the shared prompts hit the prefix cache. Output is still plain greedy output."""
    other = tiny_model_factory("llama_mqa")
    prompts = [PROMPTS[i % 4] + " " + "ab" * (i % 3) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = _generate(base, params, prompts)
    for draft in (other.path, tiny_llama.path):
        spec = _engine(tiny_llama.path, draft, num_kv_blocks=30, max_num_seqs=8)
        got = _generate(spec, params, prompts)
        _same_outputs(ref, got)
        assert spec.engine.core.scheduler.num_preemptions > 0
        assert_no_leaks(spec)
        again = _generate(spec, params, prompts[-1:])
        _same_outputs(ref[-1:], again)
        assert spec.engine.core.kv_cache_manager.num_hits > 0
        assert_no_leaks(spec)
        drafted, accepted = _drafted(got + again)
        assert drafted > 0
        if draft == tiny_llama.path:  # the draft's K/V survived preemption and cache hits
            assert accepted >= 0.9 * drafted


def second_token_marginal(hf, prompt: list[int], top_k: int, temperature: float) -> torch.Tensor:
    """The target's marginal of the second generated token, [vocab] float64:
    sum_t1 p(t1) p(t2 | t1), with p the top-k, temperature softmax of ``hf``'s logits."""

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        keep = logits.topk(top_k).indices
        p = torch.zeros_like(logits)
        p[keep] = torch.softmax(logits[keep] / temperature, 0)
        return p

    p1 = probs(prompt)
    return sum(p1[t1] * probs(prompt + [t1]) for t1 in p1.nonzero().flatten().tolist())


def _noisy_copy(path: str, folder, scale: float = 0.02) -> str:
    """``path``'s model saved in ``folder`` with N(0, scale) added to every weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, folder)
    gen = torch.Generator().manual_seed(0)
    weights = load_file(f"{folder}/model.safetensors")
    save_file({name: w + scale * torch.randn(w.shape, generator=gen)
               for name, w in sorted(weights.items())}, f"{folder}/model.safetensors",
              metadata={"format": "pt"})
    return str(folder)


def test_sampling_with_a_bad_draft_keeps_the_target_distribution(tiny_llama, tmp_path):
    """Temperature 0.8, top_k=5 on the target; the draft is the target with noisy weights
    sampling from its own top 5 (so q differs from p everywhere, its top 5 overlap p's only
    in part, and the residual max(0, p - q) is drawn often). The second token's marginal over
    2,000 requests must match sum_t1 p(t1) p(t2 | t1) from transformers (chi-square,
    p > 0.001)."""
    from tests.spec_decode.test_rejection_sampler import assert_sampled_token_follows

    hf, top_k, temperature = tiny_llama.hf_model, 5, 0.8

    prompt = [5, 17, 42, 99, 7, 23]
    marginal = second_token_marginal(hf, prompt, top_k, temperature)
    spec = _engine(tiny_llama.path, _noisy_copy(tiny_llama.path, tmp_path / "noisy"), k=2,
                   num_kv_blocks=4000, max_num_seqs=256)
    n = 2000
    outs = _generate(spec, SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3,
                                          ignore_eos=True), [prompt] * n)
    assert_sampled_token_follows(outs, 1, marginal)
    drafted, accepted = _drafted(outs)
    assert drafted >= n and 0 < accepted < drafted


@pytest.mark.parametrize("cut", [{"top_k": 5}, {"top_p": 0.3}, {"min_p": 0.6}])
def test_sampled_drafts_are_cut_like_the_target(self_draft, cut):
    """Sampled drafts come from the draft's softmax within the request's top-k / top-p /
    min-p, as the target's p: with the target as its own draft q = p, and a draft is accepted
    with probability sum min(p, q) = 1 (Leviathan et al. 2023), so every draft is (up to
    float noise between the two passes)."""
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3, **cut)
    drafted, accepted = _drafted(_generate(self_draft, params))
    assert drafted > 0 and accepted >= 0.95 * drafted


def test_vanishing_temperature_drafts_are_the_greedy_limit(base, self_draft):
    """temperature=1e-45 (float32's smallest subnormal) is the greedy limit for the draft's q
    as for the target's p: the plain quotient logits / 1e-45 overflowed to inf and made q NaN,
    so every draft was rejected. With the target as its own draft q = p = the argmax's one-hot,
    so every draft is accepted and the tokens are greedy's."""
    params = SamplingParams(temperature=1e-45, max_tokens=12, ignore_eos=True, seed=3)
    got = _generate(self_draft, params)
    _same_outputs(_generate(base, SamplingParams(temperature=0, max_tokens=12,
                                                 ignore_eos=True)), got)
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted >= 0.95 * drafted


def test_quantized_kv_cache_holds_the_drafts_scales_too(tiny_llama, assert_no_leaks):
    """--kv-cache-dtype int8: the draft's layers get int8 tensors and scales of their own in
    the same pool (twice the bytes per block with a self-draft); greedy output equals the
    plain int8 engine's and the self-draft is still nearly always accepted."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _engine(tiny_llama.path, kv_cache_dtype="int8")
    spec = _engine(tiny_llama.path, tiny_llama.path, kv_cache_dtype="int8")
    ref, got = _generate(plain, params), _generate(spec, params)
    _same_outputs(ref, got)
    config = spec.engine.core.kv_cache_config
    assert config.draft_group.kv_cache_spec.dtype == torch.int8
    assert config.page_size_bytes == 2 * plain.engine.core.kv_cache_config.page_size_bytes
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted >= 0.9 * drafted
    assert_no_leaks(spec)


def test_draft_gemms_take_the_targets_cpu_path(tiny_llama):
    """On CPU the draft's GEMM weights are packed for the chosen kernel like the target's (an
    unpacked bf16 draft ran its passes ~2.5x slower than the packed path on the real Qwen
    pair), and the bf16 draft still drafts what the target accepts (the self-draft)."""
    from kvflow.kernels.gemm import GemmPathMixin

    spec = LLM(model=tiny_llama.path, dtype="bfloat16", block_size=4, num_kv_blocks=64,
               speculative_config={"method": "draft_model", "model": tiny_llama.path,
                                   "num_speculative_tokens": 3, "adaptive": False,
                                   "quantization": "none"})
    runner = spec.engine.core.executor.runner
    if not runner.platform.prepacks_gemm_weights(torch.bfloat16):
        pytest.skip("no packed bf16 GEMM path on this CPU")

    def packed(model) -> list[bool]:
        return [m.packed_weight is not None for m in model.modules()
                if isinstance(m, GemmPathMixin) and isinstance(getattr(m, "weight", None),
                                                               torch.Tensor)]

    target, draft = packed(runner.model), packed(runner.drafter.model)
    assert len(draft) == len(target) > 0 and all(target) and all(draft)
    outs = _generate(spec, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    drafted, accepted = _drafted(outs)
    assert drafted > 0 and accepted >= 0.8 * drafted


def test_cpu_default_draft_is_int8_and_output_stays_exact(tiny_llama, base, assert_no_leaks):
    """No ``quantization`` given: on a CPU the draft's linear layers hold INT8 weights (the
    target's stay float32) and greedy output is still plain greedy output token for token
    (the target verifies every draft); the quantized self-draft is still mostly right."""
    spec = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=96,
               speculative_config={"method": "draft_model", "model": tiny_llama.path,
                                   "num_speculative_tokens": 3, "adaptive": False})
    runner = spec.engine.core.executor.runner
    draft = runner.drafter.model.model.layers[0].mlp.down_proj
    assert draft.weight.dtype == torch.int8
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _same_outputs(_generate(base, params), _generate(spec, params))
    drafted, accepted = _drafted(_generate(spec, params))
    assert drafted > 0 and accepted >= 0.5 * drafted
    assert_no_leaks(spec)


def _count_draft_passes(llm: LLM) -> list[int]:
    """Spy on the draft model's forward passes: the list gets each pass's token count."""
    drafter, seen = llm.engine.core.executor.runner.drafter, []
    original = drafter.run_pass

    def spy(batch, query, *args, **kwargs):
        seen.append(int(query.sum()))
        return original(batch, query, *args, **kwargs)

    drafter.run_pass = spy
    return seen


def test_draft_catches_up_lazily_in_bounded_passes(tiny_llama, assert_no_leaks):
    """The draft computes K/V only for requests that draft: with a 16-token step budget, a
    request's first drafting step catches its ~25-token context up in passes of at most 16
    tokens (then 1-2 tokens per pass); output equals plain greedy with the same budget and the
    self-draft is still nearly always accepted (its K/V is right)."""
    prompts = [PROMPTS[0] + " " + PROMPTS[1], PROMPTS[2] + " " + PROMPTS[3]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _engine(tiny_llama.path, max_num_batched_tokens=16)
    spec = _engine(tiny_llama.path, tiny_llama.path, max_num_batched_tokens=16)
    passes = _count_draft_passes(spec)
    ref, got = _generate(plain, params, prompts), _generate(spec, params, prompts)
    _same_outputs(ref, got)
    assert max(passes) == 16 and min(passes) >= 1
    assert sum(p == 16 for p in passes) >= 2  # each context took more than one catch-up pass
    drafted, accepted = _drafted(got)
    assert drafted > 0 and accepted >= 0.9 * drafted
    assert_no_leaks(spec)


def test_draft_passes_try_each_thread_count_and_keep_greedy_output(base, self_draft):
    """The draft's passes run on the engine's thread count and on one (measured, the faster
    kept): both were tried, the engine's count is back after every step, and the greedy
    output is the plain engine's whatever count a pass ran on."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    _same_outputs(_generate(base, params), _generate(self_draft, params))
    threads = self_draft.engine.core.executor.runner.drafter.threads
    assert torch.get_num_threads() == before
    assert threads.candidates == list(dict.fromkeys([before, 1]))
    assert all(s is not None and s > 0 for s in threads.seconds)


def test_draft_with_a_shorter_context_stops_drafting_before_it(tiny_llama, base, tmp_path,
                                                               assert_no_leaks):
    """A draft covering 32 positions (its max_position_embeddings) for a target of 256: a
    20-token prompt drafts until its sequence would reach position 31, a 40-token prompt
    never drafts, and both decode on to 30 tokens, equal to plain greedy output. The
    draft's passes indexed its rotary table at every position: the first step past 32
    raised ("rotary: positions must lie in [0, 32)"), failing the step's requests."""
    import json
    import shutil

    short = tmp_path / "draft32"
    shutil.copytree(tiny_llama.path, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, tiny_llama.vocab_size, (n,), generator=gen).tolist()
               for n in (20, 40)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = _engine(tiny_llama.path, str(short))
    got = _generate(spec, params, prompts)
    _same_outputs(_generate(base, params, prompts), got)
    # the 20-token prompt drafts from 21 tokens on, at most 3 a step up to 28 tokens, then
    # 2 at 29 and 1 at 30 (position 31 the last a draft reaches): 27 if none were accepted
    assert 0 < got[0].metrics.num_draft_tokens <= 27
    assert got[0].metrics.num_accepted_tokens > 0  # the same weights: its drafts are right
    assert got[1].metrics.num_draft_tokens == 0
    assert spec.engine.core.speculator.draft_len_limit == 32
    assert_no_leaks(spec)
