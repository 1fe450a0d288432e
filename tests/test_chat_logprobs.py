"""Chat logprobs' ``bytes``: a token's own bytes (OpenAI's meaning), so that a reply's token
bytes join to its UTF-8 text even where a token holds part of a character."""

from __future__ import annotations

from kvflow.entrypoints.chat_logprobs import chat_logprobs, token_bytes
from kvflow.outputs import Logprob


def test_partial_character_tokens_carry_their_own_bytes(tiny_tokenizer):
    """Each token of '東京🙂 ok' (multi-byte characters split across byte-level tokens) decodes
    alone to U+FFFD or text; its bytes were U+FFFD's (EF BF BD) for the partial ones, so the
    joined bytes were not the reply. Expected: the text's UTF-8, joined."""
    text = "東京🙂 ok"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tiny_tokenizer.decode([i]) for i in ids)  # the case under test
    steps = [{i: Logprob(-0.5, 1, tiny_tokenizer.decode([i]))} for i in ids]
    content = chat_logprobs(ids, steps, 1, tiny_tokenizer).content
    assert b"".join(bytes(t.bytes) for t in content) == text.encode("utf-8")
    assert b"".join(bytes(t.top_logprobs[0].bytes) for t in content) == text.encode("utf-8")
    assert [t.token for t in content] == [tiny_tokenizer.decode([i]) for i in ids]


def test_own_bytes_with_the_logprob_texts_the_engine_writes(tiny_tokenizer):
    """The engine's logprob texts (kvflow.engine.logprob_tokens, vLLM's rule) are "" for a token
    holding part of a character and the whole character for the one completing it; each
    token's bytes are still its own (they were [] and the whole character's 4 bytes), and
    joined they are the text's UTF-8."""
    from kvflow.engine.logprob_tokens import LogprobTokenTexts

    text = "東京🙂 ok"
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    texts = [LogprobTokenTexts(tiny_tokenizer).texts([i], ids[max(0, k - 4):k])[0]
             for k, i in enumerate(ids)]
    assert "" in texts and "".join(texts) == text
    steps = [{i: Logprob(-0.5, 1, t)} for i, t in zip(ids, texts)]
    content = chat_logprobs(ids, steps, 1, tiny_tokenizer).content
    own = [list(tiny_tokenizer.convert_tokens_to_string([p]).encode("utf-8", "surrogateescape"))
           if "\ufffd" not in tiny_tokenizer.decode([i]) else None
           for i, p in zip(ids, tiny_tokenizer.convert_ids_to_tokens(ids))]
    assert all(bytes(t.bytes) for t in content)  # none empty
    assert [t.token for t in content] == texts
    assert b"".join(bytes(t.bytes) for t in content) == text.encode("utf-8")
    assert [t.bytes for t, o in zip(content, own) if o is not None] == \
        [o for o in own if o is not None]


class _ByteFallbackTokenizer:
    """A sentencepiece-style vocabulary: partial characters are ``<0xNN>`` pieces."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return {7: "<0xE6>", 8: "▁ok"}[token_id]


def test_byte_fallback_piece_and_whole_text():
    assert token_bytes(_ByteFallbackTokenizer(), 7, "\ufffd") == [0xE6]
    assert token_bytes(_ByteFallbackTokenizer(), 8, " ok") == [32, 111, 107]
    assert token_bytes(None, 7, "\ufffd") == [0xEF, 0xBF, 0xBD]  # no tokenizer: the text's


def test_a_skipped_special_token_keeps_its_vocabulary_bytes(tiny_tokenizer):
    """README: joined bytes are the reply's text only where the text holds every token. An
    ``<eos>`` (id 0) generated under ignore_eos is skipped from the text (the default
    skip_special_tokens) but its bytes are its vocabulary string's."""
    ids = [*tiny_tokenizer.encode("ok", add_special_tokens=False), 0]
    steps = [{i: Logprob(-0.5, 1, tiny_tokenizer.decode([i]))} for i in ids]
    content = chat_logprobs(ids, steps, 0, tiny_tokenizer).content
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "ok"
    assert b"".join(bytes(t.bytes) for t in content) == b"ok<eos>"
