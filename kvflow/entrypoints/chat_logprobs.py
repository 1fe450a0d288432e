"""Chat-format logprobs (``choices[].logprobs.content``): per token its text, logprob, UTF-8
``bytes`` and the best alternatives.

``bytes`` are the token's own bytes, as OpenAI's are: a token holding part of a multi-byte
character decodes alone to U+FFFD (its logprob text is ``""``, or the whole character for the
token completing it), which says nothing of its own bytes, so such a token's bytes come from
the vocabulary (byte-level BPE pieces, ``<0xNN>`` byte-fallback
pieces); joined, a reply's token bytes are its UTF-8 text where that text holds every token
whole (a special token skipped from the text, ``<eos>`` under ``ignore_eos``, keeps its
vocabulary string's bytes; a token that completed a stop string keeps all of its bytes).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from kvflow.entrypoints.protocol import ChatLogprobs, ChatLogprobToken, TopLogprob
from kvflow.entrypoints.serving_base import MIN_LOGPROB
from kvflow.outputs import Logprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes of token ``token_id`` whose logprob ``text`` is given: ``text``'s own
    unless the token holds part of a character (``text`` or the token decoded alone holds
    U+FFFD: a logprob's text is ``""`` for such a token, the whole character for the one
    completing it), then the vocabulary piece's bytes when the piece is byte-level or
    ``<0xNN>`` (else ``text``'s, the best there is)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None or "\ufffd" not in text and not _splits_a_character(tokenizer, token_id):
        return list(text.encode("utf-8"))
    piece = convert(token_id)
    if isinstance(piece, str):
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        table = _byte_level_table()
        if piece and all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
    return list(text.encode("utf-8"))


def _splits_a_character(tokenizer: Any, token_id: int) -> bool:
    """Whether ``token_id`` decoded alone holds U+FFFD (False without ``decode``)."""
    decode = getattr(tokenizer, "decode", None)
    return decode is not None and "\ufffd" in (decode([token_id]) or "")


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top_k: int,
                  tokenizer: Any = None, as_token_ids: bool = False,
                  listed: bool = False) -> ChatLogprobs:
    """Chat-format logprobs: per token its logprob, bytes and the ``top_k`` best
    (``tokenizer`` gives partial characters' bytes; None: the decoded text's); ``listed``
    (vLLM's ``logprob_token_ids``): every entry of each token's dict instead, the chosen
    token then the listed ones, in order, as vLLM writes them.

    ``as_token_ids`` (vLLM's ``return_tokens_as_token_ids``): every ``token``, the chosen
    one's and the alternatives', is ``"token_id:{id}"``; as vLLM writes them, the chosen
    token's ``bytes`` stay its text's and an alternative's are those of its
    ``"token_id:{id}"`` string."""
    content = []
    for token_id, step in zip(token_ids, logprobs):
        top = list(step.items()) if listed else \
            sorted(((tid, lp) for tid, lp in step.items() if lp.rank <= top_k),
                   key=lambda item: item[1].rank)
        chosen = _entry(tokenizer, token_id, step[token_id])
        alternatives = [_entry(tokenizer, tid, lp) for tid, lp in
                        (top if listed else top[:top_k])]
        if as_token_ids:
            chosen["token"] = f"token_id:{token_id}"
            for (tid, _), entry in zip(top, alternatives):
                entry["token"] = f"token_id:{tid}"
                entry["bytes"] = list(entry["token"].encode("utf-8"))
        content.append(ChatLogprobToken(
            **chosen, top_logprobs=[TopLogprob(**entry) for entry in alternatives]))
    return ChatLogprobs(content=content)


def _entry(tokenizer: Any, token_id: int, lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": max(lp.logprob, MIN_LOGPROB),
            "bytes": token_bytes(tokenizer, token_id, token)}
