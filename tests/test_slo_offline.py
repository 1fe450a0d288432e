"""Service-level and fairness options through the offline API (``LLM``) and SamplingParams.

Oracles: the deficit-round-robin order computed by hand; validation messages naming the field.
"""

from __future__ import annotations

import math

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig


@pytest.mark.parametrize("field", ["target_ttft_ms", "target_tpot_ms"])
@pytest.mark.parametrize("value", [0, -5.0, math.inf, math.nan, True, "100"])
def test_bad_targets_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_targets_are_kept_as_floats():
    params = SamplingParams(target_ttft_ms=500, target_tpot_ms=40.5)
    assert (params.target_ttft_ms, params.target_tpot_ms) == (500.0, 40.5)


def test_admission_control_is_a_server_option():
    with pytest.raises(ValueError, match="admission_control is a server option"):
        LLM(model="unused", admission_control=True)
    # from an EngineConfig too (kvflow generate and kvflow bench build the LLM this way)
    config = EngineConfig.from_kwargs(model="unused", admission_control=True)
    with pytest.raises(ValueError, match="admission_control is a server option"):
        LLM.from_engine_config(config)


def test_generate_fair_alternates_clients(tiny_llama, assert_no_leaks):
    """One running slot, 200-token prompts, 256-token quanta: by DRR, A0 (credit 256 - 200),
    then B0 (B's first visit), A1, B1, then A2; A sent all of its prompts first."""
    llm = LLM(model=tiny_llama.path, num_kv_blocks=128, block_size=4, policy="fair",
              max_num_seqs=1)
    prompts = [[5 + i] + [7] * 199 for i in range(5)]
    users = ["A", "A", "A", "B", "B"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                        user=users)
    order = sorted(range(5), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [0, 3, 1, 4, 2]
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match="user"):
        llm.generate(prompts[:2], user=["A"])
