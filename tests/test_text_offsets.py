"""``TokenTextOffsets`` (legacy-completions ``text_offset``) on the tiny byte-level BPE
tokenizer, against an oracle computed from the tokens' UTF-8 bytes."""

from __future__ import annotations

import codecs

from kvflow.entrypoints.text_offsets import TokenTextOffsets


def stable_offsets(tokenizer, ids, start=0):
    """The oracle: a token's offset is ``start`` plus the characters that the UTF-8 bytes of
    the tokens before it decode to, an incomplete trailing character not counted (Python's
    incremental UTF-8 decoder); a byte-level token is one byte per alphabet character and
    special tokens add no text."""
    # GPT-2's byte -> alphabet character map (printable bytes map to themselves, the rest
    # to chr(256 + k) in byte order)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    to_byte = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}
    special = set(tokenizer.all_special_ids)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    count, out = 0, []
    for token_id, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        out.append(start + count)
        if token_id not in special:
            count += len(decoder.decode(bytes(to_byte[ch] for ch in piece), final=False))
    return out


def test_offsets_count_whole_characters_across_split_tokens(tiny_tokenizer):
    """Per-token decodes summed (the old way) count each piece of a split character as one
    U+FFFD and run past the text; these offsets index ``start + text``, fed in two pieces as a
    stream is, and a stop-string cut caps them at the text's end."""
    text = "the café 你 fox"
    ids = tiny_tokenizer.encode(text)
    want = stable_offsets(tiny_tokenizer, ids, 14)
    assert len(set(want)) < len(ids) and want[-1] < 14 + len(text)
    offsets = TokenTextOffsets(tiny_tokenizer, 14, skip_special_tokens=True)
    got = offsets.next_offsets(ids[:7]) + offsets.next_offsets(ids[7:])
    assert got == want
    cut = TokenTextOffsets(tiny_tokenizer, 0, skip_special_tokens=True).next_offsets(ids, 5)
    assert cut == [min(o - 14, 5) for o in want]
    assert TokenTextOffsets(None, 3, skip_special_tokens=True).next_offsets(ids[:2]) == [3, 3]
