r"""The compile budget on a character class's count right before a character it also matches
(``.{1,300}\d``, ``[a-z0-9-]{1,300}[a-z0-9]``, ``.{1,300}@``), measured against the
vocabulary it compiles for.

xgrammar (0.2.9) compiles a class's count cheaply only when a string literal beginning
outside the class follows it (``repeat_counts``, ``utf8_grammar._inline_pattern_roots``);
followed by a class or literal the counted class overlaps, it expands the count: up to 128,
the ``m`` required repetitions unrolled in a sequence and the ``n - m`` optional ones as
nested rules (``r_k ::= "" | c r_(k+1)``); past 128, a repeat of one rule then the last 128
repetitions unrolled, and for ``m`` below 128 also ``{m,127}`` as above, as an alternative
(the printing of its compiled grammar shows them). It fills each nested rule's and each
unrolled position's mask for the whole vocabulary at compile time, every token that begins
with a character of the class parsed through them: a nested rule's about twice an unrolled
position's (:func:`expansion_weight`). Its compile time follows that weight times the number
of tokens that begin with a character of the counted class, within 1.3x over
``.{1,128}\d``, ``.{120,128}\d``, ``.{150}\d``, ``.{200,300}\d``, ``.{1,300}\d`` and
schemas of 5-6 such counts (0.52-0.69 s per million half-weighted checks, SmolLM2's 49k
vocabulary, the shared 2-core box at load 6-7; ``min(count, 128)``, charged before, spread
3x: ``.{120,128}\d`` took half of ``.{1,128}\d``, ``.{1,300}\d`` 1.5x;
``benchmarks/pattern_counts.py --budget-sums``, ``docs/benchmarks.md``).

No rewrite into xgrammar's cheap form holds the same strings. That form ends a count at the
first character outside its class; within ``X{m,n} Y`` (``Y`` meeting ``X``) a character
of ``Y`` may end the count or be counted (``.{1,300}\d`` takes ``a1`` and ``a1b1``: the
``1`` is the last character in one and counted in the other), so a count ending that way
must reach the string's closing quote, and the count then cannot say that its last
character is in ``Y``. What was tried instead compiles as slowly or fills masks far
slower (``docs/benchmarks.md``: 3-12 s, or masks of 5-540 ms a token). So the cost is
bounded here: :class:`OverlapBudget` sums each such count's weight times its class's tokens
over the grammar and refuses a grammar past :data:`MAX_OVERLAP_COST` before it compiles.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from kvflow.structured.ebnf_reading import (
    COUNT,
    NAME,
    class_ranges,
    class_rules,
    code_point,
    string_end,
)

NESTED_COUNTS = 128  # the repetitions xgrammar (0.2.9) writes as nested rules, at most
# token checks (nested rules, and unrolled repetitions at half, times the tokens that enter
# them) a grammar's overlapping counts may cost in all: about what the default 30 s compile
# timeout (--structured-output-compile-timeout) allows on the shared 2-core box (0.5-0.7 us
# a check at load 6-7, about 1.3 us at load 16: .{1,300}\d, 9.3 million, took 5.5 s and
# 12 s; six .{200,300}\d-like counts, 19 million, 11 s at load 7). So a grammar refused here
# would most likely be abandoned by that timeout anyway, after waiting for it; one count of
# any class (``{1,300}``: 191.5 checks a token) is taken on a vocabulary of up to ~100k
# tokens, and any number of counts that stay within 20 million.
MAX_OVERLAP_COST = 20_000_000


class OverlapBudget:
    """The budget for one vocabulary, ``vocab``: each token's text as UTF-8 bytes
    (xgrammar's ``TokenizerInfo.decoded_vocab``; a token that is not whole UTF-8 text counts
    by the characters it decodes to, an empty one not at all)."""

    def __init__(self, vocab: Sequence[bytes]) -> None:
        texts = (token.decode("utf-8", "ignore") for token in vocab)
        self._first_chars = sorted(ord(text[0]) for text in texts if text)

    def tokens_in(self, ranges: Sequence[tuple[int, int]]) -> int:
        """How many tokens begin with a character of ``ranges`` (inclusive code point
        ranges, disjoint)."""
        chars = self._first_chars
        return sum(bisect_right(chars, high) - bisect_left(chars, low) for low, high in ranges)

    def cost(self, ebnf: str) -> tuple[int, int]:
        """(token checks, largest count) of the overlapping counts of xgrammar's printing
        ``ebnf`` (``overlapping_class_counts``): the sum of each count's
        :func:`expansion_weight` times the tokens that begin with a character of the
        counted class; (0, 0) with none."""
        counts = overlapping_class_counts(ebnf)
        total = sum(expansion_weight(low, high) * self.tokens_in(ranges) // 2
                    for ranges, low, high in counts)
        return total, max((high if high != -1 else low for _, low, high in counts), default=0)

    def refusal(self, ebnf: str) -> str | None:
        """Why the grammar printed ``ebnf`` is refused for its overlapping counts (the
        module docstring), None when within :data:`MAX_OVERLAP_COST`."""
        cost, largest = self.cost(ebnf)
        if cost <= MAX_OVERLAP_COST:
            return None
        return (f"the constraint counts a character class (up to {largest} times) right before "
                "a character that class also matches (such as .{1,300}\\d): the grammar "
                "engine then checks every token of the model that begins with a character of "
                "the class at each repetition it writes out (up to 255 for one count) when it "
                "compiles, "
                f"{cost:,} checks here, more than the {MAX_OVERLAP_COST:,} kvflow allows "
                "(several seconds); lower the count, or follow it with a character the class "
                "leaves out ([^0-9]{1,300}\\d compiles at once)")


def expansion_weight(low: int, high: int) -> int:
    """Twice the compile cost per token of xgrammar's (0.2.9) expansion of a class's count
    ``{low, high}`` (``high`` -1 for none) in whole-vocabulary checks: each optional
    repetition it nests as a rule (``r_k ::= "" | c r_(k+1)``) counts 1, each one it
    unrolls in a sequence (``c c c ...``) 1/2 (measured: a nested rule's mask took about
    twice an unrolled position's, ``docs/benchmarks.md``). Up to 128 it writes ``low``
    unrolled and ``high - low`` nested; past 128 the count's last 128 repetitions are
    unrolled after a repeat of one rule (one check), and a ``low`` below 128 adds
    ``{low, 127}`` as above, as an alternative; ``{low,}`` is ``low`` (at most 128)
    unrolled and a star (one check)."""
    if high == -1:
        return 2 + min(low, NESTED_COUNTS)
    if high <= NESTED_COUNTS:
        return 2 * (high - low) + low
    past = 2 + NESTED_COUNTS  # the repeat's rule, then 128 unrolled
    return past if low >= NESTED_COUNTS else past + 2 * (NESTED_COUNTS - 1 - low) + low


def overlapping_class_counts(ebnf: str) -> list[tuple[list[tuple[int, int]], int, int]]:
    """Each count of one character class in xgrammar's printing ``ebnf`` (a one-class rule's,
    ``name{m, n}``, or a class written in place, ``[a-z]{m, n}``) followed right away by a
    class, a one-class rule or a string literal whose first character the counted class
    matches (``.{1,300}\\d``, ``.{1,300}"@"``): (the counted class's code point ranges,
    ``m``, ``n``; ``n`` is -1 for no bound). xgrammar (0.2.9) writes such a count as up to
    128 nested rules, each one's mask filled for the whole vocabulary when the grammar
    compiles (``count_budget``). A count followed by anything else (a literal the class
    leaves out: xgrammar's cheap case; a group, a rule's end) is not listed, nor one in a
    rule that ``root`` does not reach (xgrammar drops those before it compiles)."""
    classes, found = class_rules(ebnf), []
    for body in _reachable_bodies(ebnf):
        i = 0
        while i < len(body):
            char, name = body[i], NAME.match(body, i)
            if char == '"':
                i = string_end(body, i)
                continue
            if char == "[":
                ranges, end = class_ranges(body, i)
            elif name is not None:
                ranges, end = classes.get(name.group()), name.end()
            else:
                i += 1
                continue
            count = COUNT.match(body, end)
            i = end if count is None else count.end()
            if count is None or ranges is None:
                continue
            follower = _first_characters(body, i + 1, classes) \
                if body.startswith(" ", i) else None
            if follower and _overlap(ranges, follower):
                found.append((ranges, int(count.group(1)), int(count.group(2))))
    return found


def _reachable_bodies(ebnf: str) -> list[str]:
    """The bodies of the rules of xgrammar's printing ``ebnf`` that ``root`` reaches (every
    rule's when there is no ``root``)."""
    rules = {}
    for line in ebnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep:
            rules[name] = body
    if "root" not in rules:
        return list(rules.values())
    seen, todo = set(), ["root"]
    while todo:
        name = todo.pop()
        if name not in seen and name in rules:
            seen.add(name)
            todo += _rule_names(rules[name])
    return [body for name, body in rules.items() if name in seen]


def _rule_names(body: str) -> list[str]:
    """The names a rule body refers to (outside its string literals and classes)."""
    names, i = [], 0
    while i < len(body):
        name = NAME.match(body, i)
        if body[i] == '"':
            i = string_end(body, i)
        elif body[i] == "[":
            i = class_ranges(body, i)[1]
        elif name is not None:
            names.append(name.group())
            i = name.end()
        else:
            i += 1
    return names


def _first_characters(ebnf: str, start: int, classes: dict[str, list[tuple[int, int]]]
                      ) -> list[tuple[int, int]] | None:
    """The code point ranges of the first character of the element at ``ebnf[start]``: a
    class, a one-class rule or a non-empty string literal; None for anything else."""
    if ebnf.startswith("[", start):
        return class_ranges(ebnf, start)[0]
    if ebnf.startswith('"', start) and not ebnf.startswith('""', start):
        code = code_point(ebnf, start + 1)[0]
        return [(code, code)]
    name = NAME.match(ebnf, start)
    return None if name is None else classes.get(name.group())


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(max(low, other_low) <= min(high, other_high)
               for low, high in a for other_low, other_high in b)
