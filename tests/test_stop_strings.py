"""Stop strings against a brute-force reference, on real outputs of the packaged SmolLM2.

The reference knows nothing of tokens arriving one at a time: it searches the whole decoded
text for the stop occurrence that ends first (ties: the one that starts first) and cuts the
text there. The incremental detokenizer must give exactly that for every chunking of the ids,
and the engine must stop on the token where that occurrence completes, with
``finish_reason="stop"`` even when it is the last token ``max_tokens`` allows. ``min_tokens``:
an occurrence counts only if it ends beyond the text of the first ``min_tokens`` tokens.
"""

from __future__ import annotations

import random

import pytest

from kvflow.engine.detokenizer import IncrementalDetokenizer

PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "Once upon a time, in a small village,",
           "def fibonacci(n):"]

pytestmark = pytest.mark.slow


def reference(text: str, stops: list[str], include: bool, boundary: int = 0
              ) -> tuple[str, str | None]:
    """(output text, matched stop) by brute force over the whole text: the occurrence ending
    first after ``boundary`` characters wins (on a tie, the one starting first)."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, boundary - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    if best is None:
        return text, None
    end, start, stop = best
    return text[:end if include else start], stop


def random_stops(rng: random.Random, text: str) -> list[str]:
    """1-3 stop strings: substrings of ``text`` (often spanning tokens), sometimes altered so
    that they never match but their prefixes do."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 20)]
        if rng.random() < 0.3:
            stop += "\x00"
        stops.append(stop)
    return stops


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    """The session's SmolLM2 engine (tests/conftest.py; also tests/models/test_gguf_loader.py's
    oracle comparison): one load of the GGUF for both."""
    return smollm2_llm


@pytest.fixture(scope="module")
def real_outputs(llm) -> list[list[int]]:
    """Greedy token ids of SmolLM2 for a few prompts (48 tokens each)."""
    from kvflow import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_detokenizer(tokenizer, ids, stops, include, min_tokens, rng) -> tuple[str, str | None]:
    detok = IncrementalDetokenizer(tokenizer, [1], stop=stops,
                                   include_stop_str_in_output=include, min_tokens=min_tokens)
    pieces, pos, stop_str = [], 0, None
    while pos < len(ids) and stop_str is None:
        new = ids[pos:pos + rng.randint(1, 4)]
        pos += len(new)
        delta = detok.update(new, finished=pos >= len(ids))
        pieces.append(delta.text)
        stop_str = delta.stop_str
    assert "".join(pieces) == detok.output_text
    return "".join(pieces), stop_str


def test_detokenizer_matches_brute_force(llm, real_outputs):
    tokenizer, rng = llm.get_tokenizer(), random.Random(0)
    for ids in real_outputs:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(150):
            stops = random_stops(rng, text)
            include, min_tokens = rng.random() < 0.3, rng.choice([0, 0, 3, 10])
            boundary = len(tokenizer.decode(ids[:min_tokens], skip_special_tokens=True))
            expected = reference(text, stops, include, boundary)
            got = run_detokenizer(tokenizer, ids, stops, include, min_tokens, rng)
            assert got == expected, (text, stops, include, min_tokens)


def test_issue_stop_spanning_tokens(llm):
    """The reported input: "quick brown bear" spans three tokens of the greedy output."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12)
    plain = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    assert plain.text.startswith(" with a quick brown bear.")
    for max_tokens in (12, 5):  # 5: the stop completes on the last allowed token
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=["quick brown bear"])
        out = llm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == \
            (" with a ", "stop", "quick brown bear")
        assert out.token_ids == plain.token_ids[:5]


def test_issue_min_tokens_holds_stop_strings(llm):
    """No stop string ends a request before ``min_tokens`` tokens (vLLM's rule)."""
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, stop=[","])
    out = llm.generate("1, 2, 3, 4,", params, use_tqdm=False)[0].outputs[0]
    plain = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20),
                         use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    boundary = len(tokenizer.decode(plain.token_ids[:10]))
    assert (out.text, out.finish_reason) == \
        (reference(plain.text, [","], False, boundary)[0], "stop")
    assert len(out.token_ids) > 10 and out.token_ids == plain.token_ids[:len(out.token_ids)]


def test_engine_stops_where_the_reference_does(llm, real_outputs):
    """A batch of requests with random stops, ``max_tokens`` and ``min_tokens``: each output
    is the reference cut of its own tokens' text, and the stop completed on its last token
    (no token generated past it)."""
    from kvflow import SamplingParams

    tokenizer, rng = llm.get_tokenizer(), random.Random(1)
    cases = []
    for prompt, ids in zip(PROMPTS, real_outputs):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for _ in range(6):
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 40),
                                    min_tokens=rng.choice([0, 0, 4]),
                                    stop=random_stops(rng, text),
                                    include_stop_str_in_output=rng.random() < 0.3)
            cases.append((prompt, params))
    outs = llm.generate([p for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)
    num_stopped = 0
    for (_, params), out in zip(cases, outs):
        c = out.outputs[0]
        full = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        boundary = len(tokenizer.decode(c.token_ids[:params.min_tokens],
                                        skip_special_tokens=True))
        text, stop = reference(full, params.stop, params.include_stop_str_in_output, boundary)
        assert (c.text, c.stop_reason if stop else None) == (text, stop), params
        if stop is not None:
            num_stopped += 1
            assert c.finish_reason == "stop"
            before_last = tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
            assert reference(before_last, params.stop, False, boundary)[1] is None
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == params.max_tokens or \
                c.token_ids[-1] == tokenizer.eos_token_id
    assert num_stopped >= len(cases) // 2  # the stops were drawn from these very outputs
