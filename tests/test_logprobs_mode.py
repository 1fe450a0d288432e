"""vLLM's ``logprobs_mode`` (``--logprobs-mode``): what a sampled token's logprobs, its top-k
and the prompt logprobs report.

Oracle: plain torch over transformers' logits of the tiny Llama, recomputed per step from the
tokens the engine produced: logit_bias added, then the repetition / frequency / presence
penalties by their formulas, then (sampled rows) the division by the temperature and the top-k
and top-p masks written out with a sort (vLLM's order: the logits processors that may change
the argmax, penalties, temperature, top-k / top-p). Raw values use none of that.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.beam_search import BeamSearchParams

PROMPT = [5, 17, 33, 100, 200, 7, 9, 33]
STEPS = 5
BIAS = {40: 3.0, 41: -2.0, 33: 1.5}
GREEDY = {"temperature": 0.0, "repetition_penalty": 1.4, "frequency_penalty": 0.5,
          "presence_penalty": 0.3, "logit_bias": BIAS}
SAMPLED = {"temperature": 0.7, "top_k": 12, "top_p": 0.8, "repetition_penalty": 1.3,
           "frequency_penalty": 0.4, "presence_penalty": 0.2, "logit_bias": BIAS, "seed": 3}
K = 6  # top logprobs per step


def _llm(path: str, mode: str, **kwargs) -> LLM:
    return LLM(model=path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
               logprobs_mode=mode, **kwargs)


def _processed(logits: torch.Tensor, prompt: list[int], out: list[int],
               fields: dict) -> torch.Tensor:
    """The logits a row samples from (float32 [V]), by hand."""
    x = logits.clone()
    for tid, b in fields["logit_bias"].items():
        x[tid] += b
    rep = fields["repetition_penalty"]
    for tid in set(prompt) | set(out):
        x[tid] = x[tid] / rep if x[tid] > 0 else x[tid] * rep
    for tid in set(out):
        x[tid] -= fields["frequency_penalty"] * out.count(tid) + fields["presence_penalty"]
    if fields["temperature"] == 0:
        return x
    x = x / fields["temperature"]
    order = x.argsort(descending=True)
    drop = torch.zeros_like(x, dtype=torch.bool)
    drop[order[fields["top_k"]:]] = True
    kept = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(kept, dim=-1)[order]
    mass = 0.0
    for rank, tid in enumerate(order.tolist()):  # the smallest top set reaching top_p
        if mass >= fields["top_p"]:
            drop[tid] = True
        mass += float(probs[rank])
    return x.masked_fill(drop, float("-inf"))


def _expected(hf_model, prompt: list[int], out: list[int], fields: dict,
              mode: str) -> list[torch.Tensor]:
    """Per generated token: the [V] values ``mode`` reports for its step."""
    rows = []
    for t in range(len(out)):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out[:t]])).logits[0, -1].float()
        x = logits if mode.startswith("raw") else _processed(logits, prompt, out[:t], fields)
        rows.append(torch.log_softmax(x, dim=-1) if mode.endswith("logprobs") else x)
    return rows


def _assert_step(step: dict, token: int, ref: torch.Tensor, k: int = K) -> None:
    """One step's {token id: Logprob} (k top entries + the sampled token) against ``ref``."""
    assert step[token].logprob == pytest.approx(float(ref[token]), abs=2e-4)
    assert step[token].rank == int((ref > ref[token]).sum()) + 1
    top = ref.topk(k)
    for tid, value in zip(top.indices.tolist(), top.values.tolist()):
        if math.isfinite(value):
            assert tid in step and step[tid].logprob == pytest.approx(value, abs=2e-4)
    assert sum(math.isinf(lp.logprob) for t, lp in step.items() if t != token) == \
        int(top.values.isinf().sum()) - int(token in top.indices.tolist() and
                                            math.isinf(float(ref[token])))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_logprobs_mode_matches_torch_reference(tiny_llama, mode):
    """A greedy and a sampled request in one batch (the sampled path handles both rows), each
    with logit_bias and all three penalties: every step's sampled token value, rank and top-K
    against the hand-computed values; prompt logprobs are raw (logits in *_logits modes)."""
    llm = _llm(tiny_llama.path, mode)
    params = [SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=K, **GREEDY),
              SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=K,
                             prompt_logprobs=2, **SAMPLED)]
    outs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    for out, fields in zip(outs, (GREEDY, SAMPLED)):
        c = out.outputs[0]
        refs = _expected(tiny_llama.hf_model, PROMPT, list(c.token_ids), fields, mode)
        for token, step, ref in zip(c.token_ids, c.logprobs, refs):
            _assert_step(step, token, ref)
            if mode.startswith("processed"):  # sampled from the processed distribution
                assert math.isfinite(step[token].logprob)
    with torch.no_grad():
        logits = tiny_llama.hf_model(torch.tensor([PROMPT])).logits[0, :-1].float()
    ref = logits if mode.endswith("logits") else torch.log_softmax(logits, dim=-1)
    prompt_lps = outs[1].prompt_logprobs
    assert prompt_lps[0] is None
    for p in range(1, len(PROMPT)):
        step, token = prompt_lps[p], PROMPT[p]
        assert step[token].logprob == pytest.approx(float(ref[p - 1][token]), abs=2e-4)
        assert step[token].rank == int((ref[p - 1] > ref[p - 1][token]).sum()) + 1


def test_processed_logprobs_hold_the_masks(tiny_llama):
    """processed_logprobs of a top_k=3 request: exactly 3 finite entries per step, summing to
    probability 1 (what the sampler draws from); raw ones are finite everywhere."""
    llm = _llm(tiny_llama.path, "processed_logprobs")
    params = SamplingParams(temperature=1.0, top_k=3, seed=1, max_tokens=4, ignore_eos=True,
                            logprobs=5)
    c = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    for step in c.logprobs:
        finite = [lp.logprob for lp in step.values() if math.isfinite(lp.logprob)]
        assert len(finite) == 3
        assert sum(math.exp(v) for v in finite) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs"])
def test_logprobs_mode_with_ngram_speculation_matches_without(tiny_llama, mode):
    """n-gram speculative decoding reports the same values as plain decoding (greedy, with
    penalties and a bias, so processed differs from raw)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "adaptive": False}
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, **GREEDY)
    plain = _llm(tiny_llama.path, mode).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    specd = _llm(tiny_llama.path, mode, speculative_config=spec).generate(
        [prompt], params, use_tqdm=False)[0].outputs[0]
    assert specd.token_ids == plain.token_ids
    refs = _expected(tiny_llama.hf_model, prompt, list(plain.token_ids), GREEDY, mode)
    for token, a, b, ref in zip(plain.token_ids, plain.logprobs, specd.logprobs, refs):
        _assert_step(b, token, ref, k=3)
        assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
            {t: lp.logprob for t, lp in b.items()}, abs=2e-4)


def test_beam_search_refuses_logits_modes(tiny_llama):
    llm = _llm(tiny_llama.path, "raw_logits")
    with pytest.raises(ValueError, match=r"--logprobs-mode raw_logits"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=3))


def test_unknown_logprobs_mode_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="logprobs_mode"):
        _llm(tiny_llama.path, "logits")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_logprobs_mode_flag(command):
    from kvflow.config import EngineConfig
    from kvflow.entrypoints.cli import build_parser

    def parse(*argv: str) -> EngineConfig:
        return EngineConfig.from_cli_args(build_parser().parse_args([command, *argv]))

    assert parse().model_config.logprobs_mode == "raw_logprobs"  # vLLM's default
    assert parse("--logprobs-mode", "processed_logits").model_config.logprobs_mode == \
        "processed_logits"
    with pytest.raises(SystemExit):  # argparse's choices
        parse("--logprobs-mode", "logits")
