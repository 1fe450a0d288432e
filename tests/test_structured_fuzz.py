"""Structured-output fuzz: for each grammar kind of ``tests/structured_fuzz_cases.py``, random
outputs of the tiny random model at a high temperature (half of them with the byte tokens of a
UTF-16 surrogate's spelling ``ED B1 xx`` favoured). Each output must be UTF-8 (strict decoding
of its tokens' bytes: no surrogate, no broken sequence; a finished text without U+FFFD), a
finished one must pass the kind's oracle, a cut one (``length``) must be a prefix of an accepted
text where an oracle can say so, and every request must end within max_tokens.

``KVFLOW_FUZZ_SAMPLES=200`` (per kind) turns the test into a soak; the default keeps it to a
few seconds a kind."""

from __future__ import annotations

import codecs
import os

import pytest

from kvflow import LLM, SamplingParams
from kvflow.structured import StructuredOutputsParams
from tests.structured_fuzz_cases import CASES, FuzzCase

SAMPLES = int(os.environ.get("KVFLOW_FUZZ_SAMPLES", "8"))
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, num_kv_blocks=256, block_size=16)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the byte each token character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


def _params(llm, case: FuzzCase) -> list[SamplingParams]:
    tok = llm.get_tokenizer()
    lead, cont = tok.convert_tokens_to_ids(["í", "±"])  # the byte tokens of ED and B1
    return [SamplingParams(temperature=1.5, seed=seed, max_tokens=MAX_TOKENS,
                           logit_bias={lead: 6.0, cont: 12.0} if seed % 2 else None,
                           structured_outputs=StructuredOutputsParams(**case.constraint))
            for seed in range(SAMPLES)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_outputs_are_utf8_and_match(llm, case):
    tok = llm.get_tokenizer()
    byte_of = _byte_of_char()
    params = _params(llm, case)
    outs = [o.outputs[0] for o in llm.generate(["a b a b"] * len(params), params,
                                                use_tqdm=False)]
    for out in outs:
        assert out.finish_reason in ("stop", "length"), out
        assert len(out.token_ids) <= MAX_TOKENS
        raw = bytes(byte_of[ch] for t in out.token_ids if t != tok.eos_token_id
                    for ch in tok.convert_ids_to_tokens(t))
        finished = out.finish_reason == "stop"
        # strict UTF-8 (a surrogate raises); a cut output may end inside a character
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=finished)
        if finished:
            assert out.text == text and "\ufffd" not in text, (raw, out.text)
            case.check(out.text)
        elif case.is_prefix is not None:
            assert case.is_prefix(text), (text, case.constraint)
    if not case.open_ended and SAMPLES >= 4:
        assert any(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
