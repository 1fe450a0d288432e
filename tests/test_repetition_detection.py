"""vLLM 0.32's ``repetition_detection``: a request whose generated tokens end with an n-gram
repeated ``min_count`` times in a row finishes with reason ``repetition`` (stop reason
``repetition_detected``). The rule is checked on hand-made sequences and against a
brute-force oracle (string matching over every cut of random sequences); the engine against
the same request run without it, cut where the oracle first finds a repetition."""

from __future__ import annotations

import random

import pytest

from kvflow.sampling.repetition_detection import RepetitionDetectionParams, ends_with_repetition
from kvflow.sampling_params import SamplingParams


def _oracle(tokens: list[int], lo: int, hi: int, count: int) -> bool:
    """Brute force, as strings: the last n*count tokens are the last n, count times."""
    text = [f"<{t}>" for t in tokens]
    return any(len(tokens) >= n * count and
               "".join(text[len(text) - n * count:]) == "".join(text[len(text) - n:]) * count
               for n in range(max(lo, 1), hi + 1))


@pytest.mark.parametrize("tokens,params,expected", [
    ([1, 2, 3, 3, 3], (1, 1, 3), True),  # "3" three times
    ([1, 2, 3, 3, 3], (1, 1, 4), False),
    ([7, 1, 2, 1, 2], (2, 2, 2), True),  # "1 2" twice
    ([7, 1, 2, 1, 2], (3, 3, 2), False),  # only pattern size 3 looked for
    ([7, 1, 2, 1, 2], (3, 0, 2), True),  # 0: sizes from 1, so 2 is found
    ([1, 2, 1, 2, 1], (2, 2, 2), True),  # "2 1" twice
    ([1, 2, 1, 2, 3], (2, 1, 2), False),  # "1 2" twice, then 3
    ([5, 5], (0, 0, 0), False),  # off
])
def test_hand_made(tokens, params, expected):
    hi, lo, count = params
    detection = RepetitionDetectionParams(max_pattern_size=hi, min_pattern_size=lo,
                                          min_count=count)
    assert ends_with_repetition(tokens, detection) is expected


def test_random_sequences_match_the_oracle():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        hi = rng.randrange(1, 5)
        lo, count = rng.randrange(0, hi + 1), rng.randrange(2, 4)
        detection = RepetitionDetectionParams(hi, lo, count)
        expected = _oracle(tokens, lo, hi, count)
        assert ends_with_repetition(tokens, detection) is expected, (tokens, hi, lo, count)
        found += expected
    assert 300 < found < 2700  # both answers are exercised


@pytest.mark.parametrize("fields,match", [
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
     "min_pattern_size=3 is invalid: it must be <= max_pattern_size"),
    ({"max_pattern_size": 2, "min_count": 1}, "min_count=1 is invalid"),
    ({"max_pattern_size": -1}, "max_pattern_size=-1 is invalid"),
    ({"max_pattern_size": 2.0, "min_count": 2}, "max_pattern_size=2.0 is invalid"),
    ({"max_pattern_size": 2, "min_count": 2, "size": 1}, "repetition_detection.size is not"),
])
def test_bad_values_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(repetition_detection=fields)


def test_a_dict_is_taken():
    params = SamplingParams(repetition_detection={"max_pattern_size": 3, "min_count": 2})
    assert params.repetition_detection == RepetitionDetectionParams(3, 0, 2)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from kvflow import LLM
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64,
               block_size=4)


def _first_repetition(tokens: list[int], lo: int, hi: int, count: int, start: int) -> int:
    """How many of ``tokens`` the request keeps: the first length >= ``start`` (min_tokens)
    whose tokens end with the repetition (the oracle); all of them when none does."""
    return next((k for k in range(max(start, 1), len(tokens) + 1)
                 if _oracle(tokens[:k], lo, hi, count)), len(tokens))


@pytest.mark.parametrize("hi,lo,count,min_tokens", [(1, 1, 2, 0), (4, 2, 2, 0),
                                                    (3, 0, 3, 0), (2, 0, 2, 12)])
def test_engine_cuts_the_output_where_the_oracle_finds_it(llm, assert_no_leaks, hi, lo,
                                                          count, min_tokens):
    """Greedy, the tiny model loops; with detection the output is the plain output's first
    tokens, up to where they first end with the pattern, finish reason ``repetition``."""
    prompt = {"prompt_token_ids": [5, 17, 33, 100, 200, 7, 9, 42]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48,
                                                ignore_eos=True))[0].outputs[0]
    kept = _first_repetition(plain.token_ids, lo, hi, count, min_tokens)
    assert kept < len(plain.token_ids)  # the model does loop, so the case shows something
    detection = {"max_pattern_size": hi, "min_pattern_size": lo, "min_count": count}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                              min_tokens=min_tokens,
                                              repetition_detection=detection))[0].outputs[0]
    assert out.token_ids == plain.token_ids[:kept]
    assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    assert_no_leaks(llm)


def test_length_wins_on_the_same_token(llm):
    """max_tokens reached by the token that completes the pattern: ``length`` (vLLM's
    order); off (max_pattern_size 0): the plain output."""
    prompt = {"prompt_token_ids": [5, 17, 33, 100, 200, 7, 9, 42]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48,
                                                ignore_eos=True))[0].outputs[0]
    kept = _first_repetition(plain.token_ids, 1, 4, 2, 0)
    detection = {"max_pattern_size": 4, "min_count": 2}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=kept, ignore_eos=True,
                                              repetition_detection=detection))[0].outputs[0]
    assert out.token_ids == plain.token_ids[:kept] and out.finish_reason == "length"
    off = llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True,
        repetition_detection={"max_pattern_size": 0}))[0].outputs[0]
    assert off.token_ids == plain.token_ids and off.finish_reason == "length"
