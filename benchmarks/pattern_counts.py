"""Compile time and mask time of JSON-schema string patterns with counted repetitions, three
ways in one run: xgrammar's own JSON-schema conversion (its JSON-string regex, what kvflow
used for a count past 32 before ``repeat_counts``), xgrammar's repetition as rules
(``x{m,n}`` of its regex converter on ``json_pattern``'s text, in a rule of its own between
the quotes) and kvflow's conversion (``xgrammar_convert.json_schema_grammar``:
``json_pattern``'s negated classes, ``repeat_counts`` past 128 for what is not one class, the
pattern's root written between the quotes by ``utf8_grammar``); where kvflow writes a class
after a class's count as literal alternatives (``repeat_counts.literal_followers``), also
``kvflow-0``, its conversion without them (what it was before), and the two's ratios.

Mask time: the mean (and worst) ``fill_next_token_bitmask`` over a random walk of up to 60
tokens through the string. Usage::

    python benchmarks/pattern_counts.py [--tokenizer out/smollm2-hf] [PATTERN ...]

``--skip-rules-over N`` leaves out xgrammar's repetition as rules past a count of N (it
compiles in time growing with the count). ``--grid`` instead times kvflow's way alone over
``GRID``: each atom (a class, ``.``, a literal, a group) counted ``{1,n}`` for each ``n`` at
the pattern's end, before a literal and before a class; ``convert s`` is what runs in the API
server's event loop (``json_schema_grammar`` with the repetition budget lifted), ``cost``
what ``schema_patterns.pattern_repeat_cost`` says of the pattern. ``--regex`` instead times
each pattern (default ``REGEX_PATTERNS``) as a ``regex`` constraint: ``regex-0`` as kvflow
wrote it before (``regex_dialect.xgrammar_regex``, its classes as written), ``regex`` as it
does now (``xgrammar_convert.regex_text``: classes written negated by ``regex_classes``),
both through ``utf8_grammar.regex_grammar``; ``json`` the same pattern (``^...$``) as a
JSON-schema string's; and ``regex-0 / regex`` ratios. ``--budget`` instead times, for each
pattern (default ``BUDGET_PATTERNS``: a class counted right before a character it also
matches, and a few cheap ones), ``count_budget``'s check on kvflow's grammar (its cost in
token checks, refused or not, and how long the check took: what a refused request now
waits) against compiling that grammar (what it waited before, and still waits within the
budget). ``--budget-sums`` instead compiles each group of ``BUDGET_SUMS`` (its patterns the
properties of one object schema) and prints ``count_budget``'s cost, what ``min(count,
128)`` charged before, and the compile seconds per million of each: a cost that follows the
compile time keeps that ratio across the rows. ``--trailing`` instead times each ``regex`` constraint (default
``TRAILING_PATTERNS``: a class's count past 128 at the end) as kvflow writes it now
(``regex``: ``repeat_counts``' blocks and chains, ``utf8_grammar.regex_grammar``) and before
(``regex-0``: xgrammar's own expansion), and the ``regex-0 / regex`` ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from unittest import mock

import xgrammar as xgr

from kvflow.structured import utf8_grammar
from kvflow.structured.count_budget import (
    MAX_OVERLAP_COST,
    OverlapBudget,
    overlapping_class_counts,
)
from kvflow.structured.json_pattern import json_pattern
from kvflow.structured.regex_dialect import xgrammar_regex
from kvflow.structured.schema_patterns import pattern_repeat_cost
from kvflow.structured.utf8_grammar import printed_ebnf, regex_grammar
from kvflow.structured.xgrammar_convert import json_schema_grammar, regex_text

PATTERNS = ["^[a-z]{30}$", "^.{1,30}$", "^[a-z\u00e9]{40,60}$", "^\\d{100}$", "^.{1,100}$",
            "^.{1,300}$", "^.{1,3000}$", "^.{1,300}\\d$", "^(ab|c){1,300}$", "^[a-z]{1,300}\\d$",
            "^[^0-9]{2,40}[0-9]$", "^[0-9]{1,300}[a-zA-Z]$"]

REGEX_PATTERNS = ["[a-z]{30}", "[a-z]{1,300}", "[a-z\u00e9]{40,60}", "\\d{100}", ".{1,300}",
                  "[a-z]{1,300}\\d", "[0-9]{1,300}[a-zA-Z]", "[^0-9]{2,40}[0-9]",
                  "\\w{1,100}@[a-z]{1,50}\\.com"]


BUDGET_PATTERNS = ["^.{1,300}\\d$", "^.{1,300}@$", "^.{1,100}\\.$", "^[a-zA-Z ]{1,300}[a-z]$",
                   "^.{1,64}\\d$", "^.{1,20}\\d$", "^\\w{1,300}\\d$", "^[a-z]{1,300}[aeiou]$",
                   "^[a-zA-Z0-9][a-zA-Z0-9-]{0,61}[a-zA-Z0-9]$", "^[0-9]{1,300}[0-9]$"]

TRAILING_PATTERNS = [".{1,300}", "[a-z]{0,500}", "x.{1,200}", "\\w{0,1000}", ".{1,100}"]

BUDGET_SUMS = [["^.{1,128}\\d$"], ["^.{120,128}\\d$"], ["^.{150}\\d$"], ["^.{200,300}\\d$"],
               ["^.{1,300}\\d$"], [f"^.{{{200 + i},{300 + i}}}\\d$" for i in range(6)],
               [f"^.{{{115 + i},128}}\\d$" for i in range(5)]]

GRID_ATOMS = ["[a-z]", ".", "a", "(ab)"]
GRID_COUNTS = [10, 100, 1000, 10000]
GRID_ENDS = ["$", "@$", "\\d$"]


def grid() -> list[str]:
    """The patterns ``--grid`` times: every atom, count and ending of ``GRID_*``."""
    return [f"^{atom}{{1,{n}}}{end}" for end in GRID_ENDS for atom in GRID_ATOMS
            for n in GRID_COUNTS]


def mask_times(compiled: xgr.CompiledGrammar, vocab_size: int, steps: int = 60,
               seed: int = 0) -> tuple[float, float]:
    """(mean, worst) milliseconds of one ``fill_next_token_bitmask`` along a random walk."""
    rng, matcher = random.Random(seed), xgr.GrammarMatcher(compiled)
    bitmask, times = xgr.allocate_token_bitmask(1, vocab_size), []
    for _ in range(steps):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - start)
        rejected = set(xgr.testing._get_masked_tokens_from_bitmask(bitmask, vocab_size))
        allowed = [i for i in range(vocab_size) if i not in rejected]
        if not allowed or not matcher.accept_token(rng.choice(allowed)) or \
                matcher.is_terminated():
            break
    return sum(times) / len(times) * 1000, max(times) * 1000


def grammars(pattern: str, skip_rules_over: int) -> dict[str, xgr.Grammar]:
    schema = {"type": "string", "pattern": pattern}
    out = {"xgrammar": xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)}
    if pattern_repeat_cost(pattern)[1] <= skip_rules_over:
        rules = printed_ebnf(xgr.Grammar.from_regex(json_pattern(pattern)))
        out["rules"] = xgr.Grammar.from_ebnf(rules.replace("root", "pattern") +
                                             '\nroot ::= "\\"" pattern "\\""')
    with mock.patch.object(utf8_grammar, "literal_followers", lambda *args: None):
        before = json_schema_grammar(json.dumps(schema))
    out["kvflow"] = json_schema_grammar(json.dumps(schema))
    if str(before) != str(out["kvflow"]):  # the class after a count written as literals
        out["kvflow-0"] = before
    return out


def trailing_grammars(pattern: str) -> dict[str, xgr.Grammar]:
    """``pattern`` as a ``regex`` constraint before (``regex-0``: a class's count at the end
    left to xgrammar) and now (``regex``)."""
    def own(atom: str, low: int, high: int, rules: dict[str, str]) -> str:
        return f"{atom}{{{low}, {high}}}"
    grammar = xgr.Grammar.from_regex(regex_text(pattern))
    with mock.patch.object(utf8_grammar, "compact_repeat", own):
        before = regex_grammar(grammar)
    return {"regex-0": before, "regex": regex_grammar(grammar)}


def regex_grammars(pattern: str) -> dict[str, xgr.Grammar]:
    """``pattern`` as a ``regex`` constraint before (``regex-0``) and now (``regex``), and
    as a JSON-schema string's ``pattern`` (``json``)."""
    schema = {"type": "string", "pattern": f"^{pattern}$"}
    return {"regex-0": regex_grammar(xgr.Grammar.from_regex(xgrammar_regex(pattern))),
            "regex": regex_grammar(xgr.Grammar.from_regex(regex_text(pattern))),
            "json": json_schema_grammar(json.dumps(schema))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patterns", nargs="*")
    parser.add_argument("--tokenizer", default="out/smollm2-hf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-rules-over", type=int, default=300)
    parser.add_argument("--grid", action="store_true")
    parser.add_argument("--regex", action="store_true")
    parser.add_argument("--budget", action="store_true")
    parser.add_argument("--trailing", action="store_true")
    parser.add_argument("--budget-sums", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(args.tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
    if args.grid:
        return grid_times(compiler, info.vocab_size)
    if args.budget:
        return budget_times(compiler, info, args.patterns or BUDGET_PATTERNS)
    if args.budget_sums:
        return budget_sums(compiler, info)
    print(f"{'pattern':24s} {'way':9s} {'compile s':>9s} {'mask ms':>8s} {'worst':>8s}")
    patterns = args.patterns or (REGEX_PATTERNS if args.regex else
                                 TRAILING_PATTERNS if args.trailing else PATTERNS)
    for pattern in patterns:
        timed = {}
        ways = regex_grammars(pattern) if args.regex else trailing_grammars(pattern) \
            if args.trailing else grammars(pattern, args.skip_rules_over)
        for way, grammar in ways.items():
            start = time.perf_counter()
            compiled = compiler.compile_grammar(grammar)
            seconds = time.perf_counter() - start
            mean, worst = mask_times(compiled, info.vocab_size)
            timed[way] = seconds, mean
            print(f"{pattern:24s} {way:9s} {seconds:9.2f} {mean:8.2f} {worst:8.2f}", flush=True)
        if "kvflow-0" in timed:
            (after_s, after_ms), (before_s, before_ms) = timed["kvflow"], timed["kvflow-0"]
            print(f"{pattern:24s} kvflow-0 / kvflow: compile {before_s / after_s:.0f}x, "
                  f"mask {before_ms / after_ms:.1f}x", flush=True)
        if "regex-0" in timed:
            (after_s, after_ms), (before_s, before_ms) = timed["regex"], timed["regex-0"]
            print(f"{pattern:24s} regex-0 / regex: compile {before_s / after_s:.1f}x, "
                  f"mask {before_ms / after_ms:.1f}x", flush=True)


def budget_times(compiler: xgr.GrammarCompiler, info: xgr.TokenizerInfo,
                 patterns: list[str]) -> None:
    """Prints, for each JSON-schema ``pattern`` as kvflow converts it, ``count_budget``'s
    cost and verdict and the check's ms, then the grammar's compile s and mean / worst mask
    ms (the compile the budget saves when it refuses)."""
    start = time.perf_counter()
    budget = OverlapBudget(info.decoded_vocab)
    print(f"budget built in {time.perf_counter() - start:.2f} s; limit {MAX_OVERLAP_COST:,}")
    print(f"{'pattern':44s} {'cost':>10s} {'verdict':>8s} {'check ms':>8s} {'compile s':>9s} "
          f"{'mask ms':>8s} {'worst':>8s}")
    for pattern in patterns:
        grammar = json_schema_grammar(json.dumps({"type": "string", "pattern": pattern}))
        start = time.perf_counter()
        cost, _ = budget.cost(printed_ebnf(grammar))
        refused = budget.refusal(printed_ebnf(grammar)) is not None
        checked = (time.perf_counter() - start) * 1000
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        seconds = time.perf_counter() - start
        mean, worst = mask_times(compiled, info.vocab_size, steps=30)
        print(f"{pattern:44s} {cost:10,d} {'refused' if refused else 'taken':>8s} "
              f"{checked:8.2f} {seconds:9.2f} {mean:8.2f} {worst:8.2f}", flush=True)


def budget_sums(compiler: xgr.GrammarCompiler, info: xgr.TokenizerInfo) -> None:
    """Prints, for each group of ``BUDGET_SUMS`` in one object schema, ``count_budget``'s
    cost, the ``min(count, 128)`` cost it replaced, the compile seconds and the seconds per
    million of each cost."""
    budget = OverlapBudget(info.decoded_vocab)
    print(f"{'patterns':30s} {'cost':>11s} {'min(n,128)':>11s} {'compile s':>9s} "
          f"{'s/M cost':>8s} {'s/M old':>8s}")
    for group in BUDGET_SUMS:
        schema = {"type": "object", "required": [f"p{i}" for i in range(len(group))],
                  "properties": {f"p{i}": {"type": "string", "pattern": p}
                                 for i, p in enumerate(group)}}
        grammar = json_schema_grammar(json.dumps(schema))
        ebnf = printed_ebnf(grammar)
        cost = budget.cost(ebnf)[0]
        old = sum(min(high if high != -1 else low, 128) * budget.tokens_in(ranges)
                  for ranges, low, high in overlapping_class_counts(ebnf))
        start = time.perf_counter()
        compiler.compile_grammar(grammar)
        seconds = time.perf_counter() - start
        name = group[0] if len(group) == 1 else f"{len(group)} x {group[0]}.."
        print(f"{name:30s} {cost:11,d} {old:11,d} {seconds:9.2f} {seconds / cost * 1e6:8.2f} "
              f"{seconds / old * 1e6:8.2f}", flush=True)


def grid_times(compiler: xgr.GrammarCompiler, vocab_size: int) -> None:
    """Prints convert and compile seconds and mean / worst mask ms of each ``grid()``
    pattern as kvflow converts it, the repetition budget lifted."""
    import kvflow.structured.xgrammar_convert as convert

    print(f"{'pattern':22s} {'cost':>12s} {'convert s':>9s} {'compile s':>9s} {'mask ms':>8s} "
          f"{'worst':>8s}")
    for pattern in grid():
        text = json.dumps({"type": "string", "pattern": pattern})
        with mock.patch.object(convert, "costly_pattern", lambda schema: None):
            start = time.perf_counter()
            grammar = json_schema_grammar(text)
            converted = time.perf_counter() - start
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        seconds = time.perf_counter() - start
        mean, worst = mask_times(compiled, vocab_size, steps=30)
        print(f"{pattern:22s} {pattern_repeat_cost(pattern)[0]:12,d} {converted:9.2f} "
              f"{seconds:9.2f} {mean:8.2f} {worst:8.2f}", flush=True)


if __name__ == "__main__":
    main()
