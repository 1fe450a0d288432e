"""Logprob token texts (``Logprob.decoded_token``) as vLLM 0.32 writes them
(``convert_ids_list_to_tokens`` plus ``LogprobsProcessor._verify_tokens``): a SentencePiece
piece keeps the leading space its ``▁`` stands for, and a token holding part of a multi-byte
character reads ``""`` until the token that completes the character, which reads the whole
character (it decoded to U+FFFD alone). Oracles: hand-written strings (the pieces are read
back with ``convert_ids_to_tokens`` to show what each id is)."""

from __future__ import annotations

import pytest

from kvflow.engine.logprob_tokens import LogprobTokenTexts, leading_space_marker
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine_outputs import EngineCoreOutput
from kvflow.inputs.processor import InputProcessor
from kvflow.sampling_params import SamplingParams
from tests import test_detokenizer as tokenizers_here
from tests.test_detokenizer import _byte_level_char, token_ids

# The tokenizers trained in test_detokenizer (fixtures).
byte_bpe = tokenizers_here.byte_bpe
metaspace = tokenizers_here.metaspace
llama_style = tokenizers_here.llama_style


def _generate(tokenizer, ids: list[int], alternatives: list[list[int]],
              prompt: list[int] | None = None) -> tuple[list[dict], list]:
    """Feed ``ids`` one per step with logprobs (``alternatives[k]``: position k's top-k ids);
    returns the sampled logprobs and the prompt logprobs (every prompt position after the
    first with the prompt token and ``[prompt token]`` as top-1)."""
    prompt = prompt or [1, 2]
    params = SamplingParams(logprobs=1, prompt_logprobs=1, max_tokens=len(ids))
    requests = InputProcessor(tokenizer, 128, len(tokenizer), tokenizer.eos_token_id) \
        .make_requests("r", prompt, params)
    out_proc = OutputProcessor(tokenizer)
    out_proc.add_request(None, requests)
    prompt_entries = [None] + [([t], [-1.0], -1.0, 1) for t in prompt[1:]]
    last = None
    for step, (tid, alts) in enumerate(zip(ids, alternatives)):
        eco = EngineCoreOutput(
            "r-0" if "r-0" in out_proc._parent_of else "r", [tid],
            [(alts, [-1.0] * len(alts), -0.5, 1)],
            "length" if step == len(ids) - 1 else None,
            prompt_logprobs=prompt_entries if step == 0 else None)
        outs, _ = out_proc.process([eco])
        last = outs[-1]
    return last.outputs[0].logprobs, last.prompt_logprobs


def _texts(entries) -> list[list[str]]:
    return [[lp.decoded_token for lp in step.values()] for step in entries if step]


def test_sentencepiece_pieces_keep_their_leading_space(metaspace):
    ids = metaspace.encode("The quick brown fox", add_special_tokens=False)
    fox = token_ids(metaspace, "▁fox")[0]
    assert metaspace.convert_ids_to_tokens(ids)[-1] == "▁fox"
    assert metaspace.decode([fox]) == "fox"  # a lone decode drops the space
    assert leading_space_marker(metaspace) == "▁"
    logprobs, prompt_logprobs = _generate(metaspace, ids, [[fox]] * len(ids), prompt=ids)
    words = [" The", " quick", " brown", " fox"]
    assert [metaspace.convert_ids_to_tokens(i) for i in ids] == [w.replace(" ", "▁")
                                                                  for w in words]
    assert _texts(logprobs) == [[w, " fox"] if w != " fox" else [w] for w in words]
    assert _texts(prompt_logprobs) == [[w] for w in words[1:]]


def test_byte_level_pieces_unchanged(byte_bpe):
    ids = byte_bpe.encode(" alpha beta", add_special_tokens=False)
    assert leading_space_marker(byte_bpe) is None
    assert LogprobTokenTexts(byte_bpe).texts(ids, []) == [byte_bpe.decode([i]) for i in ids]
    assert "".join(LogprobTokenTexts(byte_bpe).texts(ids, [])) == " alpha beta"


def test_split_character_reads_whole_on_its_last_token(byte_bpe):
    """🙂 (F0 9F 99 82) as four byte tokens; the top-1 alternative at each position is the
    same id, read with the same context."""
    emoji = token_ids(byte_bpe, *(_byte_level_char(b) for b in "🙂".encode()))
    head = byte_bpe.encode("alpha", add_special_tokens=False)
    ids = head + emoji + head
    assert [byte_bpe.decode([i]) for i in emoji] == ["\ufffd"] * 4
    logprobs, _ = _generate(byte_bpe, ids, [[i] for i in ids])
    assert [t[0] for t in _texts(logprobs)] == ["alpha", "", "", "", "🙂", "alpha"]
    # An alternative is read after the sampled tokens before it: "é" is C3 A9.
    e_lead, e_cont = token_ids(byte_bpe, *(_byte_level_char(b) for b in "é".encode()))
    texts = LogprobTokenTexts(byte_bpe).texts([emoji[0], e_cont, e_lead], [*head, e_lead])
    assert texts == ["", "é", ""]


@pytest.mark.parametrize("prompt_side", [False, True])
def test_byte_fallback_character_in_prompt_and_output(llama_style, prompt_side):
    ids = token_ids(llama_style, "▁fox", "<0xE4>", "<0xB8>", "<0xAD>", "▁fox")
    assert llama_style.decode(ids) == "fox中 fox"
    expected = [" fox", "", "", "中", " fox"]
    logprobs, prompt_logprobs = _generate(llama_style, ids, [[i] for i in ids], prompt=ids)
    if prompt_side:  # the first prompt token has no entry
        assert [t[0] for t in _texts(prompt_logprobs)] == expected[1:]
    else:
        assert [t[0] for t in _texts(logprobs)] == expected
