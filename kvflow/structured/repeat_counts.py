r"""Large counted repetitions of a JSON-schema pattern's rules, written so that xgrammar
compiles them in time that does not grow with the count.

xgrammar (0.2.9) compiles a repetition ``x{m,n}`` of its own in time growing with the count
(``.{1,300}``: 5-9 s for a 49k vocabulary, and 25-30 ms a token to fill a mask; its
JSON-string regex, which kvflow used past a count of 32 before, wrote a pattern's quotes raw
and let overlong UTF-8 through). Past :data:`INLINE_COUNT`, :func:`compact_repeat` writes
``x{m,n}`` as rules shared by every count: a block ``b ::= x{K}`` (``K`` = :data:`BLOCK`),
the rest of ``m`` as ``x{m mod K}``, and the ``n - m`` optional repetitions as a chain
``t_i ::= "" | x t_(i-1)`` (``i < K``) after at most ``(n - m) div K`` optional blocks,
``q_j ::= t_(K-1) | b q_(j-1)``, ``q_0 ::= t_s``: each count is matched one way only, and the
grammar holds about ``2 K`` character positions whatever the count. ``x{m,}`` is ``x{m}``
then ``x*``. A token that runs past a block's or chain's end is checked when the mask is
filled (xgrammar cannot tell from the rule alone what follows it), so up to
:data:`INLINE_COUNT` xgrammar's own repetition is kept: it fills masks faster there
(``benchmarks/pattern_counts.py``). A repetition of one character class is never written
here (``utf8_grammar._pattern_rules``): ``json_pattern`` writes the class negated, which
xgrammar repeats cheaply at any count (``.{1,3000}`` right before the closing quote: 0.02 s
to compile, 0.1 ms a mask, against 2-3 s and 5-15 ms as blocks and chains). A class's count
followed by a class it does not overlap is written as literal alternatives
(:func:`literal_followers`: ``[a-z]{1,300}\d`` 6-12 s -> 0.1 s).
"""

from __future__ import annotations

import json

INLINE_COUNT = 128  # counts up to this stay xgrammar's own repetition (cheaper masks)
BLOCK = 64  # the repetitions one shared block holds (32: half the compile time, twice the
# tokens checked at fill time; benchmarks/pattern_counts.py)


def compact_repeat(atom: str, low: int, high: int, rules: dict[str, str]) -> str:
    """The EBNF expression for ``atom{low,high}`` (``atom`` a rule name; ``high`` -1 for no
    bound) when a count passes :data:`INLINE_COUNT`, else xgrammar's own ``atom{low, high}``.
    The rules it refers to are added to ``rules`` (name -> definition; names start with
    ``atom``, so rules shared by two repetitions of one atom are defined once).

    Raises:
        ValueError: for ``low`` below 0, or ``high`` below ``low`` (and not -1).
    """
    if low < 0 or (high != -1 and high < low):
        raise ValueError(f"bad repetition count {{{low},{high}}} of {atom}")
    if max(low, high) <= INLINE_COUNT:
        return f"{atom}{{{low}, {high}}}"
    blocks, rest = divmod(low, BLOCK)
    parts = []
    if blocks:
        parts.append(f"{_block(atom, rules)}{{{blocks}, {blocks}}}")
    if rest:
        parts.append(f"{atom}{{{rest}, {rest}}}")
    if high == -1:
        parts.append(f"{atom}*")
    elif high > low:
        parts.append(_optional(atom, high - low, rules))
    return "(" + " ".join(parts) + ")" if parts else '""'


def _block(atom: str, rules: dict[str, str]) -> str:
    name = f"{atom}_block"
    rules[name] = f"{atom}{{{BLOCK}, {BLOCK}}}"
    return name


def _optional(atom: str, count: int, rules: dict[str, str]) -> str:
    """A rule name for ``atom{0,count}`` (``count`` >= 1), its rules added to ``rules``."""
    if count < BLOCK:
        return _chain(atom, count, rules)
    blocks, rest = divmod(count, BLOCK)
    block, full = _block(atom, rules), _chain(atom, BLOCK - 1, rules)
    name = f"{atom}_opt{rest}_0"
    rules[name] = _chain(atom, rest, rules) if rest else '""'
    for j in range(1, blocks + 1):
        previous, name = name, f"{atom}_opt{rest}_{j}"
        rules[name] = f"{full} | ({block} {previous})"
    return name


def _chain(atom: str, count: int, rules: dict[str, str]) -> str:
    """``t_count`` of the module docstring: ``atom{0,count}`` matched one way only."""
    for i in range(1, count + 1):
        rest = f" {atom}_upto{i - 1}" if i > 1 else ""
        rules[f"{atom}_upto{i}"] = f'"" | ({atom}{rest})'
    return f"{atom}_upto{count}"


# a class that follows a class's count is written as its characters when it holds this many
# at most: each one is an alternative the matcher follows, and past this they cost more than
# they save where few tokens are made of the repeated class ("[0-9]{1,300}[a-zA-Z]": 0.03 s
# to compile and 0.05 ms a mask as xgrammar's, 0.5 s and 0.17 ms as 52 literals;
# benchmarks/pattern_counts.py)
MAX_FOLLOWER_CHARS = 16
FOLLOWED_COUNT = 8  # counts past this are written so (below: xgrammar's few rules are cheap)


def literal_followers(repeat: str, high: int, repeated: list[tuple[int, int]],
                      follower: list[tuple[int, int]]) -> str | None:
    r"""``repeat`` (xgrammar's ``name{m, n}`` of a one-class rule) followed by a class, as
    one alternative a character of that class, each a string literal: ``(r "0") | (r "1") |
    ...`` for ``r [0-9]``; None where that does not hold the same strings or does not pay.

    xgrammar (0.2.9) compiles a class's count cheaply only when a string literal that begins
    outside the class follows it (``[^0-9]{1,300} "0"``: 0.02 s for a 49k vocabulary), and
    writes one followed by a class as up to 128 nested optional rules, each filled for the
    whole vocabulary (``[^0-9]{1,300} [0-9]``: 6-12 s, 1 ms a mask; written as ten literal
    alternatives, 0.3 s and 0.1 ms). So each of the follower's characters (``follower``:
    sorted inclusive code point ranges) becomes a literal when it holds at most
    :data:`MAX_FOLLOWER_CHARS`, none of them in ``repeated`` (what the repeated class
    matches: then each string is matched one way only, as before), and the count ``high``
    passes :data:`FOLLOWED_COUNT`. A follower the repeated class overlaps (``.{1,300}\d``)
    stays as it is: a literal beginning inside the class is not xgrammar's cheap case.
    """
    chars = [code for low, high_ in follower for code in range(low, high_ + 1)
             if high_ - low < MAX_FOLLOWER_CHARS]
    count = sum(high_ - low + 1 for low, high_ in follower)
    if high <= FOLLOWED_COUNT or not 0 < count <= MAX_FOLLOWER_CHARS or len(chars) != count:
        return None
    if any(low <= code <= high_ for code in chars for low, high_ in repeated):
        return None
    return "(" + " | ".join(f"({repeat} {json.dumps(chr(code), ensure_ascii=False)})"
                            for code in chars) + ")"
