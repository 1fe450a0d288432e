"""Incremental detokenization and stop-string handling.

This module turns the stream of token ids produced for one request into text deltas, for the
offline ``LLM.generate`` path and for streaming (SSE) responses alike.

Contract
--------
* The concatenation of every ``DetokenizerDelta.text`` returned for a request equals the
  generated ids' decode in the prompt's context (next item; ``tokenizer.decode(generated_ids,
  skip_special_tokens=...)`` without one) when no stop string matched.
  With ``spaces_between_special_tokens=False`` (and special tokens kept), an added token
  (special or not) that follows another added token is written as its content alone: the ids
  are decoded in runs split before each such token, so no text a decoder puts between them
  (WordPiece's space: ``[SEP] [SEP]``) survives (vLLM's fast detokenizer's rule; byte-level
  and SentencePiece decoders put nothing there, so their text does not change).
  The prompt's text never appears in the output.
* The first generated token is decoded in the prompt's context, as vLLM (its fast
  detokenizer primes tokenizers' ``DecodeStream`` with the prompt's last tokens) and
  text-generation-inference do: with ``tail`` = :func:`prompt_context` (the prompt's last 4
  to 23 ids, the fewest whose decode has no U+FFFD; the whole prompt when it has at most 4
  ids), the output text is ``decode(tail + generated)`` minus ``decode(tail)``. A
  SentencePiece / Metaspace tokenizer (Llama-2, Mistral) therefore keeps the first token's
  leading space: prompt "The quick brown" + ``[▁fox, ▁jumps]`` gives " fox jumps", so
  prompt + completion reads "The quick brown fox jumps". Byte-level BPE text is the
  generated ids' own decode either way. Without a prompt (no prompt ids, e.g. prompt
  embeddings only), for a WordPiece decoder (which would put a space before every token
  that does not continue a word; kept as the ids' own decode) and when ``decode(tail)``
  holds a U+FFFD, there is no context: the text is ``decode(generated)``.
* A partial UTF-8 character (a byte-level BPE or byte-fallback token that splits a multi-byte
  character decodes to U+FFFD) is never emitted while the request runs; it is held back until
  it completes. At ``finished=True`` everything is flushed exactly as the full decode gives it,
  but for a byte-fallback run of ``<0xNN>`` tokens that ends inside a character: the full
  decode writes the whole run as U+FFFD, while its complete characters were already
  emitted; the incomplete character's ids are then written as they decode alone.
* With stop strings, a suffix that may be the start of a stop string is held back until it is
  resolved (unless ``include_stop_str_in_output``, where nothing can be lost by emitting it).
  When a stop string completes, the output is cut right before it (or right after it with
  ``include_stop_str_in_output``) and the delta carries the matched string in ``stop_str``.

Algorithm
---------
Token -> text uses the prefix/read offset technique of Hugging Face text-generation-inference
(``decode_token``) and vLLM (``detokenize_incrementally``): rather than decoding every generated
id at each step, decode a short window that starts a few tokens before the new ones and emit
the part of the window's text that goes beyond what was already emitted. Starting the window a
few tokens back gives decoders whose output depends on position (SentencePiece/Metaspace strip
the leading space of the first token; WordPiece glues ``##`` pieces) the context they need.
This implementation tracks, per window, the window text that has already been released and
checks every step that the window's decode still starts with it; when a window decode disagrees
(a tokenizer whose decode of a window differs from its full decode) it falls back once to a full
decode and then narrows the window again. A window is only narrowed after the narrower decode
is verified to reproduce the tail of the released text. Each update therefore decodes O(1)
tokens (at most ``2 * _CONTEXT_TOKENS`` plus the new ones, plus one verification decode every
``_CONTEXT_TOKENS`` steps); only the fallback is O(length).

Text that a later token may still change is held back: a trailing run of U+FFFD (at most
``_MAX_PENDING_REPLACEMENTS`` characters: an incomplete UTF-8 sequence has at most 3 bytes;
when a byte-fallback decoder turns a whole run of ``<0xNN>`` tokens into U+FFFD because it ends
in an incomplete character, the text is taken from the decode without the last 1 to 3 ids) and,
for tokenizers with ``clean_up_tokenization_spaces`` enabled, a trailing proper prefix of one of
the patterns that ``transformers``' ``clean_up_tokenization`` rewrites (``" ."``, ``" n't"``, ...).

Stop strings are searched only in the newly decoded text plus the previous
``max(len(stop)) - 1`` characters. Among several stop strings the occurrence that completes
first wins (smallest end offset; on a tie, the one that starts first). This makes the result
independent of how the text happens to be split into tokens: a stop string is acted on as soon
as it is complete, which is what one-token-at-a-time generation observes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvflow.engine.detokenizer_stops import earliest_stop, longest_suffix_prefix, normalize_stops
from kvflow.engine.detokenizer_tokens import added_token_ids, id_decoder, prompt_context

__all__ = ["DetokenizerDelta", "IncrementalDetokenizer", "prompt_context"]

# Tokens kept in the decode window before the newest ones (context for position-dependent
# decoders). The window is narrowed back to this many tokens once it exceeds twice as many.
_CONTEXT_TOKENS = 4
# Longest run of trailing U+FFFD that a later token may still turn into a real character.
_MAX_PENDING_REPLACEMENTS = 3
_REPLACEMENT_CHAR = "\ufffd"
# Patterns rewritten by transformers' PreTrainedTokenizerBase.clean_up_tokenization.
_CLEANUP_PATTERNS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
_MAX_CLEANUP_HOLD = max(len(p) for p in _CLEANUP_PATTERNS) - 1


@dataclass(frozen=True, slots=True)
class DetokenizerDelta:
    """Result of one :meth:`IncrementalDetokenizer.update` call.

    Attributes:
        text: New text to emit now (possibly empty). Units: Python ``str`` characters.
        stop_str: The stop string that matched during this update, else ``None``. When set, the
            request must be finished with ``finish_reason="stop"`` and ``stop_reason=stop_str``.
    """

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, applying stop strings.

    Args:
        tokenizer: A ``transformers`` tokenizer (fast or slow); only ``decode`` and the
            ``clean_up_tokenization_spaces`` attribute are used.
        prompt_token_ids: The request's prompt ids. Their last few (:func:`prompt_context`)
            open the decode window, so that the first generated token is decoded in the
            prompt's context (see the module docstring); their text is never emitted. Their
            number is kept as :attr:`num_prompt_tokens` for callers' bookkeeping.
        skip_special_tokens: Passed to ``tokenizer.decode``.
        spaces_between_special_tokens: False: nothing between two adjacent added tokens
            (see the module docstring); read only with ``skip_special_tokens=False``, as
            vLLM reads it.
        stop: Stop strings (a single ``str`` is accepted as a one-element list).
        include_stop_str_in_output: Keep the matched stop string at the end of the output.
        min_tokens: A stop string counts only when it completes in a token after the first
            ``min_tokens`` (vLLM's rule): text of the first ``min_tokens`` tokens is never
            searched, though a stop string may start in it.

    Raises:
        ValueError: If a stop string is empty or ``min_tokens`` is negative.

    After a stop string matched or an update with ``finished=True``, further updates are
    ignored and return an empty delta.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._decode_ids = id_decoder(tokenizer, skip_special_tokens)
        # Ids of the added tokens glued to an added token before them (empty: none glued).
        self._glued = frozenset() if skip_special_tokens or spaces_between_special_tokens \
            else added_token_ids(tokenizer)
        self._cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.num_prompt_tokens = len(prompt_token_ids)
        self._stops = normalize_stops(stop)
        self._include_stop = include_stop_str_in_output
        self._stop_window = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        # Token -> text stage: the ids (prompt context first), window start and the released
        # prefix of the window's decode (the context's own text counts as released).
        self._ids: list[int] = prompt_context(tokenizer, prompt_token_ids)
        self._start = 0
        self._released = self._decode(0) if self._ids else ""
        if _REPLACEMENT_CHAR in self._released:  # a tail that splits a character: none
            self._ids, self._released = [], ""
        self._num_context = len(self._ids)
        self._context_text = self._released
        # Stop stage: emitted chunks, held-back text, last `_stop_window` decoded characters.
        self._chunks: list[str] = []
        self._held = ""
        self._tail = ""
        self._done = False

    @property
    def output_text(self) -> str:
        """The concatenation of all emitted deltas (after any stop-string cut)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def has_stop_strings(self) -> bool:
        """Whether any stop string is being searched for."""
        return bool(self._stops)

    @property
    def is_finished(self) -> bool:
        """True after a stop string matched or an update with ``finished=True``."""
        return self._done

    def update(self, new_token_ids: Sequence[int], finished: bool,
               stop_terminated: bool = False) -> DetokenizerDelta:
        """Consume newly generated ids and return the text that may be emitted now.

        Args:
            new_token_ids: Ids generated since the previous call (may be empty).
            finished: True when the request ends with these ids (EOS, length, abort): all
                held-back text is flushed.
            stop_terminated: the last of ``new_token_ids`` is a stop token (the EOS or one
                of ``stop_token_ids``) that ended the request: its text is left out unless
                ``include_stop_str_in_output`` (vLLM v1's rule: a stop token ends the text,
                it is not part of it; its id stays in the output's token ids).

        Returns:
            The delta; ``stop_str`` is set when a stop string completed.
        """
        if self._done:
            return DetokenizerDelta("")
        if stop_terminated and not self._include_stop and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        before_min = self._min_tokens - (len(self._ids) - self._num_context)
        if 0 < before_min < len(new_token_ids):  # stops start counting inside these ids
            first = self._update(new_token_ids[:before_min], finished=False)
            rest = self._update(new_token_ids[before_min:], finished)
            return DetokenizerDelta(first.text + rest.text, rest.stop_str)
        return self._update(new_token_ids, finished)

    def _update(self, new_token_ids: Sequence[int], finished: bool) -> DetokenizerDelta:
        decoded = self._decode_step(new_token_ids, finished)
        if self._stops:
            search = len(self._ids) - self._num_context > self._min_tokens
            text, stop_str = self._apply_stops(decoded, finished, search)
        else:
            text, stop_str = decoded, None
        if text:
            self._chunks.append(text)
        self._done = finished or stop_str is not None
        return DetokenizerDelta(text, stop_str)

    @property
    def _num_generated(self) -> int:
        """Generated ids consumed so far (the prompt context not counted)."""
        return len(self._ids) - self._num_context

    # ---- token ids -> text -------------------------------------------------------------

    def _decode(self, start: int, end: int | None = None) -> str:
        """Decode ``self._ids[start:end]`` (``end`` None: to the last id)."""
        ids = self._ids[:end] if end is not None else self._ids
        if self._glued:  # decode in runs, each glued added token starting one
            cuts = [i for i in range(start + 1, len(ids))
                    if ids[i] in self._glued and ids[i - 1] in self._glued]
            if cuts:
                bounds = [start, *cuts, len(ids)]
                return "".join(self._decode_ids(ids[a:b]) for a, b in pairwise(bounds))
        return self._decode_ids(ids[start:])

    def _decode_step(self, new_token_ids: Sequence[int], flush: bool) -> str:
        """Append ids, return the newly stable text (all remaining text when ``flush``)."""
        ids = self._ids
        ids.extend(new_token_ids)
        text = self._decode_ids(ids[self._start:]) if not self._glued else \
            self._decode(self._start)
        released = self._released
        if not self._cleanup and text.startswith(released) and \
                not text.endswith(_REPLACEMENT_CHAR):
            # The common step, in one call: nothing held back (no split character, no
            # clean-up pattern), so all of the window's text past the released part goes.
            self._released = text
            if not flush and len(ids) - self._start > 2 * _CONTEXT_TOKENS:
                self._narrow_window(text)
            return text[len(released):]
        split = self._before_split_character(text, flush)
        if split is not None:
            before, num_split = split
            if not flush:  # release what precedes the split character
                return self._release(before, flush=False)
            # The output ends in it: its ids are written as they decode alone.
            text = before + self._decode(len(self._ids) - num_split)
        if not text.startswith(self._released):
            text = self._resync()
        delta = self._release(text, flush)
        if not flush:
            self._narrow_window(text)
        return delta

    def _release(self, text: str, flush: bool) -> str:
        """Release the stable part of the window decode ``text`` beyond what was released;
        return it (all of it when ``flush``)."""
        end = len(text) if flush else len(text) - self._unstable_suffix_len(text)
        if end <= len(self._released):
            return ""
        delta = text[len(self._released) : end]
        self._released = text[:end]
        return delta

    def _before_split_character(self, text: str, flush: bool) -> tuple[str, int] | None:
        """The window decode without the last 1 to 3 ids and their number, when ``text``
        ends in U+FFFD because those ids hold an incomplete character: the first such decode
        that starts with the released text and does not end in U+FFFD; else None.

        A byte-fallback decoder (``<0xNN>`` tokens) writes a run of byte tokens as one
        group: while the run ends in an incomplete character, every token of the run reads
        U+FFFD, the complete characters before it too (``中`` and the first byte of ``🙂``
        read ``\ufffd`` * 4), so neither the window decode nor a count of trailing U+FFFD
        tells what is stable until the character completes. While the request runs, text
        with at most 3 trailing U+FFFD that extends the released text is held back as it is
        (None); at ``flush`` every trailing U+FFFD is looked at.
        """
        if not text.endswith(_REPLACEMENT_CHAR):
            return None
        if not flush and text.startswith(self._released) and \
                _trailing_replacements(text, _MAX_PENDING_REPLACEMENTS + 1) <= \
                _MAX_PENDING_REPLACEMENTS:
            return None  # at most one split character's worth: held back as it is
        n = len(self._ids)
        most = min(_MAX_PENDING_REPLACEMENTS, n - self._start - 1, self._num_generated)
        for k in range(1, most + 1):
            shorter = self._decode(self._start, n - k)
            if shorter.startswith(self._released) and \
                    not shorter.endswith(_REPLACEMENT_CHAR):
                return shorter, k
        return None

    def _unstable_suffix_len(self, text: str) -> int:
        """Characters at the end of ``text`` that a later token may still change."""
        replacements = _trailing_replacements(text)
        if replacements or not self._cleanup:
            return replacements
        return longest_suffix_prefix(text, _CLEANUP_PATTERNS, _MAX_CLEANUP_HOLD)

    def _resync(self) -> str:
        """Fallback when a window decode disagrees with released text: decode everything.

        Costs O(generated length) once; the window is narrowed again on the next steps. If even
        the full decode does not extend what was released (a decoder that is not prefix-stable),
        the text after the released length is emitted as a best effort.
        """
        released_total = self._context_text + self.output_text + self._held
        text = self._decode(0)
        self._start = 0
        if text.startswith(released_total):
            self._released = released_total
        else:
            self._released = text[: len(released_total)]
        return text

    def _narrow_window(self, text: str) -> None:
        """Move the window start forward once the window exceeds ``2 * _CONTEXT_TOKENS``.

        A candidate start is accepted only if its decode ends with the not-yet-released text and
        the rest is a non-empty suffix of the released text, so that position-dependent effects
        at the window start (stripped leading space, ``##`` pieces, a split character) fall in
        already-released text. The candidates are the ``_CONTEXT_TOKENS`` starts from
        ``_CONTEXT_TOKENS`` ids back, so that one of them is a character boundary inside a run
        of byte tokens (a character has at most 4 bytes; a byte-fallback decode from the
        middle of a character reads U+FFFD for the whole run and is refused).
        """
        n = len(self._ids)
        if n - self._start <= 2 * _CONTEXT_TOKENS:
            return
        pending = text[len(self._released) :]
        for start in range(n - _CONTEXT_TOKENS, n - 2 * _CONTEXT_TOKENS, -1):
            window_text = self._decode(start)
            if not window_text.endswith(pending):
                continue
            released = window_text[: len(window_text) - len(pending)]
            if released and self._released.endswith(released):
                self._start, self._released = start, released
                return

    # ---- stop strings --------------------------------------------------------------------

    def _apply_stops(self, decoded: str, flush: bool, search: bool) -> tuple[str, str | None]:
        """Apply stop strings to newly decoded text; return (text to emit, matched stop).

        ``search``: look for stop strings completing in ``decoded`` (False while ``min_tokens``
        holds them back; a possible stop prefix is still held, as the stop may complete later).
        """
        if not self._stops:
            return decoded, None
        if not decoded and not (flush and self._held):
            return "", None
        region = self._tail + decoded
        emitted_upto = len(self._tail) - len(self._held)
        hit = earliest_stop(region, self._stops, len(self._tail)) if search else None
        if hit is not None:
            start, stop_str = hit
            cut = start + len(stop_str) if self._include_stop else start
            self._held = ""
            return region[emitted_upto:cut] if cut > emitted_upto else "", stop_str
        hold = 0
        if not (flush or self._include_stop):
            hold = longest_suffix_prefix(region, self._stops, len(region) - emitted_upto)
        keep = len(region) - hold
        self._held = region[keep:]
        self._tail = region[max(0, len(region) - self._stop_window):]
        return region[emitted_upto:keep], None


def _trailing_replacements(text: str, cap: int = _MAX_PENDING_REPLACEMENTS) -> int:
    """Length of the trailing U+FFFD run of ``text``, capped at ``cap``."""
    n = 0
    while n < min(len(text), cap) and text[-1 - n] == _REPLACEMENT_CHAR:
        n += 1
    return n
