"""Prompts given as embeddings (``LLM(enable_prompt_embeds=True)``), on the tiny random Llama
(and Granite, whose embedding multiplier applies to them).

Oracles: HF ``generate(inputs_embeds=...)`` greedy tokens (a divergence is allowed only at a
near-tie of HF's top-2 logits, after which the continuations may differ); and kvflow's own
output for the equivalent token ids when the embeddings are the model's embedding rows. The
engine runs a small token budget (chunked prefill: every prompt spans several steps), batches
mixing embedding and token prompts, prefix caching, and a KV cache small enough to preempt.
Every bad input is a ValueError naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.beam_search import BeamSearchParams
from kvflow.config import EngineConfig
from kvflow.inputs.embeds import PromptEmbeds, check_prompt_embeds
from kvflow.request import Request

MAX_TOKENS = 8
TIE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _embeds(seed: int, num_tokens: int, hidden: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(num_tokens, hidden, generator=gen)


def _hf_greedy(tiny, embeds: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens from ``inputs_embeds`` [T, hidden] and its per-step logits."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=0,
                           eos_token_id=None, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
    with torch.no_grad():
        out = tiny.hf_model.generate(inputs_embeds=embeds.float()[None],
                                     attention_mask=torch.ones(1, embeds.shape[0],
                                                               dtype=torch.long),
                                     generation_config=cfg)
    return out.sequences[0, -MAX_TOKENS:].tolist(), torch.stack([s[0] for s in out.logits])


def _assert_matches_hf(tiny, embeds: torch.Tensor, tokens: list[int]) -> None:
    ref, logits = _hf_greedy(tiny, embeds)
    assert len(tokens) == MAX_TOKENS
    for step, (ours, theirs) in enumerate(zip(tokens, ref)):
        if ours != theirs:
            top2 = logits[step].float().topk(2).values
            assert float(top2[0] - top2[1]) <= TIE, \
                f"token {step}: kvflow {tokens}, HF {ref} (no near-tie)"
            return
    assert tokens == ref


@pytest.fixture(scope="module")
def llm(tiny_llama):
    """Chunked prefill (8-token steps), prefix caching on."""
    return LLM(model=tiny_llama.path, dtype="float32", enable_prompt_embeds=True,
               max_num_batched_tokens=8, block_size=4, enable_prefix_caching=True,
               max_model_len=64, num_kv_blocks=128)


def test_greedy_matches_hf_inputs_embeds_in_a_mixed_chunked_batch(tiny_llama, llm,
                                                                   assert_no_leaks):
    embeds = [_embeds(1, 13), _embeds(2, 5), _embeds(3, 21)]
    token_prompt = [5, 17, 42, 9, 100, 3, 77]
    prompts = [{"prompt_embeds": embeds[0]}, token_prompt, {"prompt_embeds": embeds[1]},
               {"prompt_embeds": embeds[2][None]}]  # a leading batch dim of 1 is squeezed
    outs = llm.generate(prompts, GREEDY)
    for out, e in zip([outs[0], outs[2], outs[3]], embeds):
        _assert_matches_hf(tiny_llama, e, out.outputs[0].token_ids)
        assert len(out.prompt_token_ids) == e.shape[0]
    # the token prompt in the same batch: HF from its own embedding rows
    rows = tiny_llama.hf_model.model.embed_tokens.weight[token_prompt].detach()
    _assert_matches_hf(tiny_llama, rows, outs[1].outputs[0].token_ids)
    assert_no_leaks(llm)


def test_granite_scales_prompt_embeds_as_transformers(tiny_model_factory, assert_no_leaks):
    """Granite multiplies prompt embeddings by ``embedding_multiplier`` (3.0 here) as it does
    the token embeddings, as transformers' ``inputs_embeds`` path (and vLLM) do."""
    tiny = tiny_model_factory("granite")
    llm = LLM(model=tiny.path, dtype="float32", enable_prompt_embeds=True,
              max_num_batched_tokens=8, block_size=4, max_model_len=64, num_kv_blocks=64)
    embeds = [_embeds(4, 11), _embeds(5, 6)]
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY)
    for out, e in zip(outs, embeds):
        _assert_matches_hf(tiny, e, out.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_own_embedding_rows_equal_token_ids(tiny_llama, llm, assert_no_leaks):
    ids = [[7, 8, 9, 200, 31, 64, 5, 5, 12, 90, 1], [44, 3, 250]]
    table = tiny_llama.hf_model.model.embed_tokens.weight.detach()
    prompts = [{"prompt_embeds": table[i]} for i in ids] + ids
    outs = llm.generate(prompts, GREEDY)
    for k in range(len(ids)):
        assert outs[k].outputs[0].token_ids == outs[k + len(ids)].outputs[0].token_ids
    assert_no_leaks(llm)


def test_prefix_cache_is_keyed_by_the_embedding_bytes(tiny_llama, llm, assert_no_leaks):
    first, other = _embeds(10, 17), _embeds(11, 17)  # equal placeholders, different rows
    out_a = llm.generate({"prompt_embeds": first}, GREEDY)[0]
    out_b = llm.generate({"prompt_embeds": other}, GREEDY)[0]
    again = llm.generate({"prompt_embeds": first.clone()}, GREEDY)[0]
    assert out_b.metrics.num_cached_tokens == 0  # never another prompt's blocks
    assert again.metrics.num_cached_tokens >= 16  # the very same rows: a hit
    _assert_matches_hf(tiny_llama, other, out_b.outputs[0].token_ids)
    assert again.outputs[0].token_ids == out_a.outputs[0].token_ids
    assert_no_leaks(llm)


def test_samples_share_the_rows(tiny_llama, llm, assert_no_leaks):
    e = _embeds(15, 10)
    out = llm.generate({"prompt_embeds": e}, SamplingParams(
        n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    assert out.prompt is None and len(out.outputs) == 2
    for sample in out.outputs:
        _assert_matches_hf(tiny_llama, e, sample.token_ids)
    assert_no_leaks(llm)


def test_truncation_keeps_the_last_rows(tiny_llama, llm, assert_no_leaks):
    """truncate_prompt_tokens=k keeps the last k rows (vLLM's rule for prompt_embeds):
    the same tokens as the explicitly cut rows, HF's greedy on those rows, and the cut
    rows' prefix-cache key (a request with the cut rows hits the truncated one's blocks)."""
    e = _embeds(33, 14)
    cut = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                         truncate_prompt_tokens=9)
    truncated = llm.generate({"prompt_embeds": e}, cut)[0]
    assert len(truncated.prompt_token_ids) == 9
    _assert_matches_hf(tiny_llama, e[-9:], truncated.outputs[0].token_ids)
    explicit = llm.generate({"prompt_embeds": e[-9:].clone()}, GREEDY)[0]
    assert explicit.outputs[0].token_ids == truncated.outputs[0].token_ids
    assert explicit.metrics.num_cached_tokens >= 8  # keyed by the kept rows' digest
    longer = llm.generate({"prompt_embeds": torch.cat([_embeds(34, 60), e])}, cut)[0]
    assert longer.outputs[0].token_ids == truncated.outputs[0].token_ids  # 74 rows > 64: cut
    llm.engine.add_request({"prompt_embeds": torch.cat([_embeds(35, 60), e])}, cut,
                           request_id="engine-cut")  # LLMEngine's own path cuts them too
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in finished] == [truncated.outputs[0].token_ids]
    whole = llm.generate({"prompt_embeds": e}, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, truncate_prompt_tokens=-1))[0]
    assert len(whole.prompt_token_ids) == 14  # -1: max_model_len (64), nothing cut
    _assert_matches_hf(tiny_llama, e, whole.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_dtypes_are_cast_to_the_model_dtype(tiny_llama, llm):
    e = _embeds(20, 9)
    ref = llm.generate({"prompt_embeds": e}, GREEDY)[0].outputs[0].token_ids
    assert llm.generate({"prompt_embeds": e.double()}, GREEDY)[0].outputs[0].token_ids == ref
    half = llm.generate({"prompt_embeds": e.bfloat16()}, GREEDY)[0].outputs[0].token_ids
    _assert_matches_hf(tiny_llama, e.bfloat16().float(), half)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_requests_recompute_from_their_embeddings(tiny_llama, assert_no_leaks,
                                                            async_scheduling):
    llm = LLM(model=tiny_llama.path, dtype="float32", enable_prompt_embeds=True,
              block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, max_model_len=52,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    embeds = [_embeds(30 + i, 14) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for out, e in zip(outs, embeds):
        _assert_matches_hf(tiny_llama, e, out.outputs[0].token_ids)
    assert_no_leaks(llm)


@pytest.mark.parametrize(("embeds", "match"), [
    ("not a tensor", "must be a torch.Tensor"),
    (torch.ones(4, 64, dtype=torch.int64), "floating-point"),
    (torch.ones(64), r"shape \[num_tokens, hidden_size\]"),
    (torch.ones(2, 4, 64), r"shape \[num_tokens, hidden_size\]"),
    (torch.ones(4, 32), "hidden size 32 but the model's is 64"),
    (torch.ones(0, 64), "no rows"),
    (torch.full((3, 64), float("nan")), "NaN or infinite"),
    (torch.tensor([[float("inf")] * 64]), "NaN or infinite"),
    (torch.ones(64, 64), "64 rows .* max_model_len is 64"),
])
def test_bad_embeddings_are_refused(llm, embeds, match):
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt_embeds": embeds}, GREEDY)
    assert not llm.engine.core.has_unfinished_requests()


def test_an_embeds_prompt_may_carry_its_text(llm):
    """vLLM's EmbedsPrompt ``prompt`` (was refused: "takes no other keys"): the rows are what
    the model reads (the same tokens as without it), the text is the output's ``prompt``."""
    e = _embeds(41, 5)
    plain, with_text = llm.generate([{"prompt_embeds": e},
                                     {"prompt_embeds": e, "prompt": "five rows"}], GREEDY)
    assert (plain.prompt, with_text.prompt) == (None, "five rows")
    assert with_text.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="'prompt' must be a string, got int"):
        llm.generate({"prompt_embeds": e, "prompt": 5}, GREEDY)


def test_refused_combinations(llm):
    e = _embeds(40, 4)
    with pytest.raises(ValueError, match="prompt_logprobs cannot be computed"):
        llm.generate({"prompt_embeds": e}, SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(ValueError, match="takes no other keys than cache_salt and prompt"):
        llm.generate({"prompt_embeds": e, "prompt_token_ids": [1, 2, 3, 4]}, GREEDY)
    with pytest.raises(ValueError, match="beam search takes no prompt_embeds"):
        llm.beam_search({"prompt_embeds": e}, BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.engine.core.has_unfinished_requests()
    with pytest.raises(ValueError, match="speculative decoding .* enable_prompt_embeds"):
        EngineConfig.from_kwargs(model="x", enable_prompt_embeds=True,
                                 speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2})


def test_refused_where_nothing_reads_the_rows(tiny_model_factory, tiny_llama):
    with pytest.raises(ValueError, match="enable_prompt_embeds=True: Gemma3ForCausalLM is a "
                                         "model that takes no prompt embeddings"):
        LLM(model=tiny_model_factory("gemma3").path, dtype="float32", max_model_len=64,
            enable_prompt_embeds=True, num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True is for text generation; "
                                         "this engine runs task='embed'"):
        LLM(model=tiny_llama.path, dtype="float32", max_model_len=64, task="embed",
            enable_prompt_embeds=True)


def test_refused_without_the_flag(tiny_llama):
    plain = LLM(model=tiny_llama.path, dtype="float32", max_model_len=64,
                max_num_batched_tokens=16, block_size=4, num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        plain.generate({"prompt_embeds": _embeds(50, 4)}, GREEDY)
    # the engine core refuses one that got past a front end
    request = Request("r", [0] * 4, GREEDY, prompt_embeds=check_prompt_embeds(
        _embeds(50, 4), 64, 64))
    with pytest.raises(ValueError, match="started without enable_prompt_embeds"):
        plain.engine.core.add_request(request)
    assert not plain.engine.core.has_unfinished_requests()


def _packed(dtype: str, shape: tuple[int, int], nbytes: int) -> PromptEmbeds:
    return PromptEmbeds(dtype, shape, b"\0" * nbytes, "not-checked")


@pytest.mark.parametrize(("packed", "match"), [
    (_packed("float32", (4, 32), 4 * 32 * 4), "hidden size 32 but the model's is 64"),
    (_packed("float32", (4, 64), 10), r"data holds 10 bytes, but \[4, 64\] rows .* 1024"),
    (_packed("int8", (4, 64), 4 * 64), "dtype 'int8'"),
    (_packed("float16", (4, 0), 0), "positive sizes"),
])
def test_packed_rows_the_model_cannot_take_are_refused_before_they_run(tiny_llama, llm, packed,
                                                                       match):
    """A ``PromptEmbeds`` handed over packed (``AsyncLLM.add_request``, a ``ProcessedPrompt``,
    the core's queue) is checked like a tensor: was accepted, and its step raised in the
    model (``index_copy_``), aborting every request in it."""
    from kvflow.core.request_errors import PROMPT_EMBEDS, RequestError
    from kvflow.inputs.prompts import ProcessedPrompt

    engine = llm.engine
    with pytest.raises(ValueError, match=match):
        engine.add_request(ProcessedPrompt(None, [0] * 4, prompt_embeds=packed), GREEDY,
                           "pe-packed")
    assert not engine.has_unfinished_requests()
    with pytest.raises(RequestError, match=match) as refused:  # one past a front end
        engine.core.add_request(Request("pe-core", [0] * 4, GREEDY, prompt_embeds=packed))
    assert refused.value.field == PROMPT_EMBEDS
    assert not engine.core.has_unfinished_requests()
    good = _embeds(60, 5)  # the engine serves on
    _assert_matches_hf(tiny_llama, good,
                       llm.generate({"prompt_embeds": good}, GREEDY)[0].outputs[0].token_ids)
