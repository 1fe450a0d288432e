"""EAGLE, EAGLE-3 and DeepSeek MTP heads with tensor_parallel_size=2 (two CPU worker
processes, gloo): every rank runs the whole head, fed the target's whole features, sharing the
target's vocabulary-parallel embedding / LM head through its collectives, and both ranks
verify TP rank 0's drafts.

Oracles: greedy output equals transformers' greedy continuation token for token (fp32), and
each request's draft / acceptance counters equal those of the one-rank engine with the same
head (whose drafts the other spec_decode tests check against plain-torch heads): the same
drafts were proposed and accepted. Heads built to agree with their target get drafts
accepted, so a head computing something else under TP changes the counters.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from tests.distributed.conftest import slow
from tests.spec_decode import test_eagle3_engine as eagle3
from tests.spec_decode import test_eagle_engine as eagle
from tests.spec_decode.test_deepseek_mtp_engine import _add_mtp_layer
from tests.spec_decode.test_ngram_engine import PROMPTS, _same_outputs


def _counters(outputs) -> list[tuple[int, int]]:
    return [(o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outputs]


def _check_two_ranks(path: str, hf_model, spec: dict, assert_no_leaks,
                     max_tokens: int = 16) -> None:
    """The TP=2 engine's greedy output is transformers' and its counters the TP=1 engine's;
    seeded sampled requests draw the TP=1 engine's tokens (the same drafts and ``q``, TP
    rank 0's, verified by both ranks)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=max_tokens, ignore_eos=True)
               for s in range(len(PROMPTS))]
    kw = {"model": path, "dtype": "float32", "block_size": 4, "num_kv_blocks": 96,
          "speculative_config": spec}
    one_rank = LLM(**kw)
    one = one_rank.generate(PROMPTS, params, use_tqdm=False)
    one_sampled = one_rank.generate(PROMPTS, sampled, use_tqdm=False)
    tp = LLM(**kw, tensor_parallel_size=2)
    try:
        got = tp.generate(PROMPTS, params, use_tqdm=False)
        got_sampled = tp.generate(PROMPTS, sampled, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got_sampled] == \
            [o.outputs[0].token_ids for o in one_sampled]
        assert sum(d for d, _ in _counters(got_sampled)) > 0
        _same_outputs(one, got)
        for o in got:
            prompt = torch.tensor([o.prompt_token_ids])
            hf = hf_model.generate(prompt, max_new_tokens=max_tokens, do_sample=False,
                                   min_new_tokens=max_tokens)
            assert o.outputs[0].token_ids == hf[0, prompt.shape[1]:].tolist()
        assert _counters(got) == _counters(one)
        drafted, accepted = map(sum, zip(*_counters(got)))
        assert drafted > 0 and accepted > 0, (drafted, accepted)
        assert_no_leaks(tp)
    finally:
        tp.engine.core.executor.shutdown()


def _spec(method: str, model: str | None, k: int) -> dict:
    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    return spec if model is None else {**spec, "model": model}


def test_eagle_head_with_two_ranks(tiny_model_factory, tmp_path, assert_no_leaks):
    """EAGLE-1, the near-right head on the one-layer Llama (its own norm, the target's
    embedding and LM head shared: both collectives run in the head's passes)."""
    target = tiny_model_factory("llama_1layer")
    eagle._save_mimic_head(str(tmp_path), target)
    _check_two_ranks(target.path, target.hf_model, _spec("eagle", str(tmp_path), 3),
                     assert_no_leaks)


@slow  # sibling of the EAGLE-1 case (scripts/test_distributed_slow.sh)
def test_eagle3_head_with_two_ranks(tiny_model_factory, tmp_path, assert_no_leaks):
    """EAGLE-3: the taps (the residual stream entering the target's layer) are whole on
    every rank; the head's own LM head over its draft vocabulary, the target's embedding."""
    path = str(tmp_path / "target")
    hf = eagle3._quiet_target(path, tiny_model_factory("llama_1layer"))
    eagle3._save_mimic_head(str(tmp_path / "head"), path, hf)
    _check_two_ranks(path, hf, _spec("eagle3", str(tmp_path / "head"), 3), assert_no_leaks)


@slow  # sibling of the EAGLE-1 case (scripts/test_distributed_slow.sh)
def test_deepseek_mtp_with_two_ranks(tiny_model_factory, tmp_path, assert_no_leaks):
    """DeepSeek MTP: the MLA + MoE layer whole on each rank beside the sharded target."""
    target = tiny_model_factory("deepseek_v3")
    folder = tmp_path / "model"
    _add_mtp_layer(target, folder)
    _check_two_ranks(str(folder), target.hf_model, _spec("deepseek_mtp", None, 2),
                     assert_no_leaks)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "deepseek_mtp"])
def test_heads_take_tensor_parallel(method):
    from kvflow.config import EngineConfig

    config = EngineConfig.from_kwargs(tensor_parallel_size=2, speculative_config={
        "method": method, "model": "some-head"})
    assert config.parallel_config.world_size == 2  # every rank runs the whole head
