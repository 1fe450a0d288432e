"""Tensor parallelism (TP=2, worker processes over gloo) and pipeline parallelism (PP=2) of
the Llama-family variants give the greedy tokens of the one-process engine, which tests/models/test_parity.py checks against
HF transformers: OLMo 2's q/k norm over the whole projection sums its mean square over the
ranks (heads split 2+2 / 1+1, or one KV head held by both ranks), Granite's multipliers and
GLM-4's interleaved partial RoPE, post-norms and fused gate/up apply per rank, and Gemma 2's
soft-capped attention runs on each rank's torch backend. Over two pipeline stages the
first holds the (scaled) embedding and layer 0, the second layer 1 and the head (OLMo 2's
post-norm layers hand over the same hidden + residual pair as Llama's).

Each case starts 2 worker processes (about 10-15 s on 2 busy cores); Granite and GLM-4 add no
TP code of their own (nor Granite MoE, Gemma 2) and run in scripts/test_distributed_slow.sh.
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import SLOW, assert_same_greedy, greedy_run


@pytest.mark.parametrize("model", [
    "olmo2", "olmo2_mqa",
    pytest.param("granite", marks=SLOW), pytest.param("granite_moe", marks=SLOW),
    pytest.param("glm4", marks=SLOW), pytest.param("gemma2", marks=SLOW),
])
def test_tp2_greedy_equals_one_process(tiny_model_factory, single_process_greedy, model):
    got, _ = greedy_run(tiny_model_factory(model).path, tensor_parallel_size=2)
    assert_same_greedy(single_process_greedy(model), got)


@pytest.mark.parametrize("model", ["olmo2", pytest.param("granite", marks=SLOW),
                                   pytest.param("glm4", marks=SLOW)])
def test_pp2_greedy_equals_one_process(tiny_model_factory, single_process_greedy, model):
    got, _ = greedy_run(tiny_model_factory(model).path, pipeline_parallel_size=2)
    assert_same_greedy(single_process_greedy(model), got)
