"""The start-up line that says speculative decoding is on, and how (method, model, K), as
vLLM's engine config line shows its SpeculativeConfig: nothing said it before, so a
newcomer could not tell whether --spec-method / --speculative-config took."""

from __future__ import annotations

import logging

from kvflow import LLM
from kvflow.config import SpeculativeConfig


def test_summary_names_method_model_and_k():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).summary() == \
        "method ngram, model none, num_speculative_tokens 3, adaptive true, n-gram sizes 4..2"
    assert SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=2,
                             adaptive=False).summary() == \
        "method draft_model, model m, num_speculative_tokens 2, adaptive false"
    assert SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=1).summary() == \
        "method deepseek_mtp, model the target's, num_speculative_tokens 1, adaptive true"


def test_engine_logs_it_once_at_start(tiny_llama, caplog):
    kw = {"model": tiny_llama.path, "dtype": "float32", "block_size": 4, "num_kv_blocks": 64}
    with caplog.at_level(logging.INFO, logger="kvflow"):
        LLM(**kw, spec_method="ngram", spec_tokens=3,
            speculative_config={"prompt_lookup_max": 3, "prompt_lookup_min": 1})
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("speculative decoding")]
    assert lines == [("speculative decoding: method ngram, model none, "
                      "num_speculative_tokens 3, adaptive true, n-gram sizes 3..1")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvflow"):
        LLM(**kw)
    assert not [r for r in caplog.records if "speculative decoding" in r.getMessage()]
