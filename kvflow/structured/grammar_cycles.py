"""Rules that are defined only as themselves, found before xgrammar compiles them.

xgrammar 0.2.9 crashes the process (a segmentation fault, not an exception) compiling a
grammar with a rule whose whole definition is a counted repetition of itself, directly or
through other rules that are each one reference: ``b ::= b{1,2}``, ``b ::= c{2}`` with
``c ::= b``, ``b ::= c`` with ``c ::= b{0,1}``, even when ``root`` never uses the rule. Such
a "unit cycle" derives nothing but itself, so a grammar holding one is refused with a
ValueError before it reaches the compiler (all of them, with or without a repetition: none
is a useful rule). Found by fuzzing random Lark grammars against Lark (session 30). A
lookahead after the reference (``b ::= b{9} (= "a")``, ``b ::= c (= [a-z])`` with
``c ::= b{2}``) changes nothing: the same segfault, found by
``benchmarks/xgrammar_crash_fuzz.py`` (session 31).
"""

from __future__ import annotations

import re

# A rule of xgrammar's printed (normalized) grammar whose body is exactly one rule reference,
# optionally repeated, optionally followed by a lookahead: ``name ::= ((other))``,
# ``name ::= ((other{m, n}))``, ``name ::= ((other{m, n})) (=("a"))``.
_UNIT_RULE = re.compile(
    r"^(\S+) ::= \(\(([A-Za-z_][\w.-]*)(\{\d+, -?\d+\})?\)\)(?: \(=.*\))?$")


def unit_edges(normalized: str) -> dict[str, str]:
    """Rule -> the one rule its whole definition refers to, for the rules of ``normalized``
    (``str(xgr.Grammar)``: one ``name ::= body`` line per rule) defined as a single
    reference, repeated or not."""
    edges = {}
    for line in normalized.splitlines():
        match = _UNIT_RULE.match(line)
        if match:
            edges[match.group(1)] = match.group(2)
    return edges


def unit_cycle(normalized: str) -> list[str] | None:
    """The first rule cycle ``[a, b, ..., a]`` of ``normalized`` (``str(xgr.Grammar)``) in
    which every rule is defined as only the next one (see the module docstring); None when
    there is none. Linear in the number of rules."""
    edges = unit_edges(normalized)
    done: set[str] = set()
    for start in edges:
        path: list[str] = []
        on_path: set[str] = set()
        rule = start
        while rule in edges and rule not in done and rule not in on_path:
            path.append(rule)
            on_path.add(rule)
            rule = edges[rule]
        if rule in on_path:
            return path[path.index(rule):] + [rule]
        done.update(path)
    return None


def unit_cycle_problem(normalized: str) -> str | None:
    """A sentence naming a unit cycle of ``normalized`` and why it is refused; None when
    there is none."""
    cycle = unit_cycle(normalized)
    if cycle is None:
        return None
    return (f"rule {cycle[0]!r} is defined only as itself ({' -> '.join(cycle)}), so it "
            "matches no text; give it an alternative that does, or remove it")
