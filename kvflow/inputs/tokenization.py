"""``tokenization_kwargs`` of the offline API (``LLM.generate``, vLLM's "overrides for
``tokenizer.encode``"): the keys vLLM's renderer reads (``TokenizeParams.with_kwargs``),
parsed once per call into :class:`TokenizationOptions` and applied to each text or token-id
prompt. vLLM logs and ignores any other key; kvflow refuses it, naming it.

Keys read (vLLM's meanings):

* ``add_special_tokens`` (bool, default True): passed to the tokenizer.
* ``do_lower_case`` (bool): the text is lower-cased before it is tokenized.
* ``max_length`` (int >= 1, default ``max_model_len``): the length ``truncation`` and
  ``padding="max_length"`` use.
* ``truncation``: True / ``"longest_first"`` keeps ``max_length`` tokens; False /
  ``"do_not_truncate"`` none.
* ``truncate_prompt_tokens`` (int >= 1, or -1 for ``max_model_len``; ``max_model_len - 1``
  for a generation prompt, which must leave a position for its first generated token):
  keep that many tokens.
* ``truncation_side`` (``"left"``: keep the last tokens, ``"right"``: keep the first): when
  given, the whole text is tokenized and cut on that side (special tokens cut too); when
  not, the side is vLLM's default for the call's runner (vLLM loads the tokenizer with
  ``truncation_side="left"`` for generation, ``LLM.generate`` and ``LLM.chat``, and
  ``"right"`` for pooling, ``embed`` / ``encode`` / ``classify``, whatever the
  tokenizer's own config says), and a text is cut as the tokenizer cuts it on that side
  (its special tokens kept: ``tokenizer(text, truncation=True, max_length=k)``); a token-id
  prompt is cut on that side.
* ``padding``: ``"max_length"`` appends the tokenizer's pad token up to ``max_length``
  tokens (after any cut); False / ``"do_not_pad"`` nothing. ``pad_prompt_tokens`` (int >= 1,
  or -1 for ``max_model_len``) pads to that length.
* ``needs_detokenization`` (bool): read and ignored (kvflow always keeps the prompt's text).

Cutting or padding a prompt with images or videos, or one given as embeddings, is refused
(their placeholders or rows are not tokens to cut).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.inputs.truncation import truncation_length

__all__ = ["GENERATION_SIDE", "POOLING_SIDE", "TokenizationOptions", "cut_generation_prompt",
           "parse_tokenization_kwargs", "pooling_cut"]

# vLLM 0.32 loads the tokenizer with these truncation sides, whatever its config says
# (tokenizers/registry.py): a generation runner keeps a prompt's last tokens, a pooling
# runner (embed, encode, classify, score) its first
GENERATION_SIDE = "left"
POOLING_SIDE = "right"

_FIELD = "tokenization_kwargs"
_KEYS = ("add_special_tokens", "do_lower_case", "max_length", "truncation",
         "truncate_prompt_tokens", "truncation_side", "padding", "pad_prompt_tokens",
         "needs_detokenization")


@dataclass(frozen=True)
class TokenizationOptions:
    """How one call's prompts are tokenized, cut and padded (see the module docstring).

    Attributes:
        add_special_tokens: passed to the tokenizer for text prompts.
        do_lower_case: lower-case a text prompt before tokenizing it.
        keep: tokens kept (None: no cut).
        side: the side cut, ``"left"`` (keep the last tokens) or ``"right"`` (the first).
        side_given: whether the caller named ``side`` (``truncation_side``): then a text's
            whole tokenization is cut, special tokens too; else the tokenizer's way.
        pad_to: pad to this many tokens (None: no padding).
    """

    add_special_tokens: bool = True
    do_lower_case: bool = False
    keep: int | None = None
    side: str = "left"
    side_given: bool = False
    pad_to: int | None = None

    @property
    def reshapes(self) -> bool:
        """Whether a prompt's tokens are cut or padded."""
        return self.keep is not None or self.pad_to is not None

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """``text``'s token ids under these options, cut and padded.

        Raises:
            ValueError: for padding without a pad token in the tokenizer.
        """
        if self.do_lower_case:
            text = text.lower()
        ids = list(tokenizer.encode(text, add_special_tokens=self.add_special_tokens))
        return self.cut_encoded(tokenizer, text, ids)

    def cut_encoded(self, tokenizer: Any, text: str, ids: list[int]) -> list[int]:
        """``ids`` (``text`` already encoded under these options) cut and padded as
        :meth:`encode` cuts and pads them.

        Raises:
            ValueError: for padding without a pad token in the tokenizer.
        """
        if self.keep is not None and not self.side_given and self.add_special_tokens:
            ids = self._cut_around_special_tokens(tokenizer, text, ids)
        return self.reshape(tokenizer, ids)

    def _cut_around_special_tokens(self, tokenizer: Any, text: str,
                                   ids: list[int]) -> list[int]:
        """``ids`` (``text`` tokenized with its special tokens) cut as an HF tokenizer with
        ``truncation_side=side`` cuts them for ``truncation=True, max_length=keep``: the
        text's own tokens cut so that they and the special tokens around them fit in
        ``keep``. ``ids`` unchanged when they fit, when the special tokens alone take more
        than ``keep`` (HF then cuts nothing; ``reshape`` cuts the whole), or when the text's
        tokens are not one run inside ``ids``."""
        if len(ids) <= self.keep:
            return ids
        body = list(tokenizer.encode(text, add_special_tokens=False))
        num_special = len(ids) - len(body)
        budget = self.keep - num_special
        start = next((p for p in range(max(num_special, 0) + 1)
                      if ids[p:p + len(body)] == body), None)
        if start is None or budget < 0:
            return ids
        kept = _cut(body, budget, self.side)
        return ids[:start] + kept + ids[start + len(body):]

    def reshape(self, tokenizer: Any, token_ids: list[int]) -> list[int]:
        """``token_ids`` cut to ``keep`` on ``side``, then padded to ``pad_to``.

        Raises:
            ValueError: for padding without a pad token in the tokenizer.
        """
        if self.keep is not None:
            token_ids = _cut(token_ids, self.keep, self.side)
        if self.pad_to is not None and len(token_ids) < self.pad_to:
            pad = getattr(tokenizer, "pad_token_id", None)
            if pad is None:
                raise ValueError(f"{_FIELD} padding needs a pad token, and this model's "
                                 "tokenizer has none")
            token_ids = token_ids + [pad] * (self.pad_to - len(token_ids))
        return token_ids


def _cut(token_ids: list[int], keep: int, side: str) -> list[int]:
    """``token_ids`` cut to ``keep`` (>= 0) tokens: the last ones for ``side="left"``, the
    first for ``"right"``; unchanged when there are no more."""
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[len(token_ids) - keep:] if side == "left" else token_ids[:keep]


def cut_generation_prompt(tokenizer: Any, text: str | None, token_ids: list[int], keep: int,
                          add_special_tokens: bool) -> list[int]:
    """A generation prompt's ``token_ids`` cut to ``keep`` (>= 0) tokens as vLLM 0.32's
    /v1/completions and /v1/chat/completions cut one for ``truncate_prompt_tokens`` without
    ``truncation_side``: a text encoded with its special tokens (``add_special_tokens``) is
    cut as the tokenizer cuts it with the generation runner's ``truncation_side="left"``
    (``tokenizer(text, truncation=True, max_length=keep)``): the text's own tokens keep their
    last ones and the special tokens the tokenizer adds around them (a BOS) stay. Token ids
    given as such (``text`` None) and a text encoded without special tokens keep their last
    ``keep``.

    Args:
        tokenizer: the transformers tokenizer ``text`` was encoded with (None for token ids).
        text: the prompt's text, or None for a token-id prompt.
        token_ids: ``text`` encoded (``add_special_tokens`` as given), or the prompt's ids.
        keep: tokens kept.
        add_special_tokens: whether ``token_ids`` hold the tokenizer's special tokens.
    """
    if text is None or not add_special_tokens:
        return _cut(token_ids, keep, GENERATION_SIDE)
    return TokenizationOptions(keep=keep).cut_encoded(tokenizer, text, token_ids)


def pooling_cut(keep: int | None, side: str | None = None,
                add_special_tokens: bool = True) -> TokenizationOptions:
    """A pooling input's ``truncate_prompt_tokens`` cut (``keep`` tokens, from
    :func:`~kvflow.inputs.truncation.truncation_length`; None: no cut) as vLLM's pooling
    requests cut it: ``side`` their ``truncation_side`` (``"left"``: keep the last tokens,
    ``"right"``: the first); None: ``POOLING_SIDE``, a text cut as the tokenizer cuts it
    there (its special tokens kept) and token ids to their first ``keep``. Apply it with
    ``encode`` (a text) or ``reshape`` (token ids).

    Raises:
        ValueError: for a ``side`` other than None, ``"left"`` or ``"right"``.
    """
    if side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    return TokenizationOptions(add_special_tokens=add_special_tokens, keep=keep,
                               side=side or POOLING_SIDE, side_given=side is not None)


def parse_tokenization_kwargs(kwargs: Mapping[str, Any] | None, max_model_len: int,
                              add_special_tokens: bool = True,
                              default_side: str = GENERATION_SIDE,
                              generation: bool = False) -> TokenizationOptions | None:
    """``tokenization_kwargs`` checked and resolved against ``max_model_len`` (tokens); None
    for None or an empty dict (tokenize as usual). ``add_special_tokens``: the default when
    the kwargs do not say (False for a rendered chat, whose template writes them).
    ``default_side``: the side cut when ``truncation_side`` is not given, vLLM's for the
    runner: ``GENERATION_SIDE`` (keep the last tokens) or ``POOLING_SIDE`` (the first).
    ``generation``: the prompts are generation prompts (``truncate_prompt_tokens`` -1 keeps
    ``max_model_len - 1`` tokens: :func:`~kvflow.inputs.truncation.truncation_length`).

    Raises:
        ValueError: naming ``tokenization_kwargs`` and the key, for a key kvflow does not read
            (vLLM ignores it with a warning), a value of the wrong type, or a length out of
            range (0, below -1, above ``max_model_len``).
    """
    if kwargs is None:
        return None
    _check_keys(kwargs)
    if not kwargs:
        return None
    max_length = _length(kwargs, "max_length", max_model_len, allow_minus_one=False)
    max_length = max_model_len if max_length is None else max_length
    keep = _kept_tokens(kwargs, max_model_len, max_length, generation)
    pad_to = _padded_length(kwargs, max_model_len, max_length)
    side = kwargs.get("truncation_side")
    if side not in (None, "left", "right"):
        raise ValueError(f"{_FIELD}['truncation_side'] must be 'left' or 'right', got "
                         f"{side!r}")
    return TokenizationOptions(add_special_tokens=kwargs.get("add_special_tokens",
                                                             add_special_tokens),
                               do_lower_case=kwargs.get("do_lower_case", False),
                               keep=keep, side=side or default_side,
                               side_given=side is not None, pad_to=pad_to)


def _check_keys(kwargs: Any) -> None:
    """``tokenization_kwargs`` is a mapping of keys kvflow reads, its flags bools.

    Raises:
        ValueError: for another type, a key kvflow does not read (named, with the keys it
            reads) or a flag that is not a bool (named).
    """
    if not isinstance(kwargs, Mapping):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"{_FIELD} must be a dict, got {type(kwargs).__name__}")
    unknown = sorted(set(kwargs) - set(_KEYS))
    if unknown:
        raise ValueError(f"{_FIELD} {unknown} are not read by kvflow (vLLM ignores them with a "
                         f"warning); it reads {list(_KEYS)}")
    for name in ("add_special_tokens", "do_lower_case", "needs_detokenization"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ValueError(f"{_FIELD}['{name}'] must be a bool, got {kwargs[name]!r}")


def _kept_tokens(kwargs: Mapping[str, Any], max_model_len: int, max_length: int,
                 generation: bool) -> int | None:
    """The prompt tokens kept (None: no cut): ``truncate_prompt_tokens`` (-1 keeps one less
    than ``max_model_len`` for ``generation``), or ``max_length``
    under ``truncation`` True / ``longest_first``; ``truncation`` False /
    ``do_not_truncate`` turns the cut off.

    Raises:
        ValueError: for a ``truncate_prompt_tokens`` out of range or another ``truncation``
            value (named).
    """
    keep = _length(kwargs, "truncate_prompt_tokens", max_model_len, generation=generation)
    truncation = kwargs.get("truncation")
    if truncation in (True, "longest_first"):
        return max_length
    if truncation not in (None, False, "do_not_truncate"):
        raise ValueError(f"{_FIELD}['truncation']={truncation!r}: kvflow reads True, "
                         "'longest_first', False or 'do_not_truncate' (a single prompt has "
                         "no second sequence to cut)")
    return keep if truncation is None else None


def _padded_length(kwargs: Mapping[str, Any], max_model_len: int,
                   max_length: int) -> int | None:
    """The length a prompt is padded to (None: not padded): ``pad_prompt_tokens``, or
    ``max_length`` under ``padding="max_length"``; ``padding`` False / ``do_not_pad`` turns
    padding off.

    Raises:
        ValueError: for a ``pad_prompt_tokens`` out of range or another ``padding`` value
            (named).
    """
    pad_to = _length(kwargs, "pad_prompt_tokens", max_model_len)
    padding = kwargs.get("padding")
    if padding == "max_length":
        return max_length
    if padding not in (None, False, "do_not_pad"):
        raise ValueError(f"{_FIELD}['padding']={padding!r}: kvflow reads 'max_length', False "
                         "or 'do_not_pad' (one prompt has no longest one to pad to)")
    return pad_to if padding is None else None


def _length(kwargs: Mapping[str, Any], name: str, max_model_len: int,
            allow_minus_one: bool = True, generation: bool = False) -> int | None:
    """``kwargs[name]`` as a token count (-1: ``max_model_len`` where allowed, less one for
    ``generation``); None when absent or None.

    Raises:
        ValueError: naming the key, for a non-integer or a count out of range.
    """
    value = kwargs.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or \
            (value == -1 and not allow_minus_one):
        raise ValueError(f"{_FIELD}['{name}'] must be an integer >= 1"
                         f"{' or -1 (max_model_len)' if allow_minus_one else ''}, got "
                         f"{value!r}")
    return truncation_length(value, max_model_len, f"{_FIELD}['{name}']", generation)
