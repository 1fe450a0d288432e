"""The xgrammar implementation of the grammar backend (https://github.com/mlc-ai/xgrammar).

xgrammar compiles JSON schemas, regexes and EBNF into a pushdown automaton with per-state token
masks precomputed for the tokenizer (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"), so filling one request's bitmask is
microseconds for most states. Its parts: ``xgrammar_convert`` (a constraint as xgrammar's
grammar), ``xgrammar_validate`` (the check without a tokenizer), ``xgrammar_errors`` (its
error messages in the user's terms).
"""

from __future__ import annotations

from typing import Any

import torch
import xgrammar as xgr

from kvflow.structured.backend import StructuredOutputBackend, StructuredOutputGrammar
from kvflow.structured.count_budget import OverlapBudget
from kvflow.structured.params import StructuredOutputsParams
from kvflow.structured.text_tokens import special_token_ids, text_tokenizer_info
from kvflow.structured.utf8_grammar import printed_ebnf, regex_grammar, utf8_grammar
from kvflow.structured.xgrammar_convert import (
    NEEDS_TOKENIZER,
    grammar_text,
    json_only_strings,
    json_schema_grammar,
    structural_tag_grammar,
    structural_tag_text,
)
from kvflow.structured.xgrammar_errors import clean_error
from kvflow.structured.xgrammar_validate import validate


class XgrammarGrammar(StructuredOutputGrammar):
    """A ``xgr.GrammarMatcher`` behind the backend interface."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self._num_accepted = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                return False
            self._num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        self._num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # stop token taken (the scheduler ends such a
            bitmask[row].zero_()  # request with ``stop``): nothing more is allowed
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted


class XgrammarBackend(StructuredOutputBackend):
    """Compiles for one HF tokenizer.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's size; the extra ids
            are never allowed).
        eos_token_id: the engine's EOS id: the only token that may end a complete grammar.
        max_threads: compiler threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        stop = [eos_token_id] if eos_token_id is not None else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop)
        # text grammars: special tokens spell no text (``text_tokens``); structural tags
        # keep xgrammar's reading (their token formats name special tokens). No xgrammar
        # cache: it keys a grammar by its printing and compiles that text, which xgrammar
        # (0.2.9) misreads (``utf8_grammar.printed_ebnf``: the enum "Ünïcödé" became "Ün"
        # U+0EFC U+0F6D "é"); the manager caches compiled grammars by constraint.
        text_info = text_tokenizer_info(info, special_token_ids(tokenizer))
        self._compiler = xgr.GrammarCompiler(text_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._tag_compiler = xgr.GrammarCompiler(info, max_threads=max_threads,
                                                 cache_enabled=False)
        self._text_info = text_info
        self._budget: OverlapBudget | None = None  # built at the first compile (0.3 s at 49k)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """``params``' constraint compiled for the model's vocabulary.

        Raises:
            ValueError: for a constraint ``validate`` refuses, one whose class counts before
                a character the class matches cost more than ``count_budget`` allows for
                this vocabulary, or a structural tag xgrammar cannot compile (a token name
                or id the vocabulary lacks).
        """
        validate(params)
        kind, spec = grammar_text(params)
        if kind == "json":
            # Compact separators (", " and ": "): tiny or weak models otherwise wander off in
            # whitespace until max_tokens.
            return self._compile(json_schema_grammar(spec))
        if kind == "json_object":
            # Any object: additional properties allowed (strict mode would forbid them all).
            return self._compile(utf8_grammar(json_only_strings(
                xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False))))
        if kind == "regex":
            return self._compile(regex_grammar(xgr.Grammar.from_regex(spec)))
        if kind == "structural_tag":  # what validate could not check: token names and ids
            try:
                return self._compile_structural_tag(structural_tag_text(spec))
            except RuntimeError as e:
                raise ValueError(f"invalid structural tag in structured_outputs: {clean_error(e)}"
                                 ) from None
        return self._compile(utf8_grammar(xgr.Grammar.from_ebnf(spec)))

    def _compile(self, grammar: xgr.Grammar, tags: bool = False) -> xgr.CompiledGrammar:
        """``grammar`` compiled (by the structural tags' compiler with ``tags``) once within
        ``count_budget``'s budget.

        Raises:
            ValueError: past it (the message says why and what to change).
        """
        if self._budget is None:
            self._budget = OverlapBudget(self._text_info.decoded_vocab)
        problem = self._budget.refusal(printed_ebnf(grammar))
        if problem is not None:
            raise ValueError(problem)
        return (self._tag_compiler if tags else self._compiler).compile_grammar(grammar)

    def _compile_structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """A structural tag (xgrammar's ``format`` JSON text) compiled as UTF-8 text, its
        JSON-schema patterns converted by kvflow (``structural_tag_grammar``), over xgrammar's
        own reading of the vocabulary (special tokens
        spell their text: a trigger may be one). A tag that names tokens converts only with
        the tokenizer: it is compiled as written (its grammars may hold surrogates).

        Raises:
            RuntimeError: from xgrammar, for a tag it cannot compile.
            ValueError: for a JSON-schema pattern in it that does not convert.
        """
        try:
            grammar = structural_tag_grammar(text)
        except RuntimeError as e:
            if NEEDS_TOKENIZER not in str(e):
                raise
            return self._tag_compiler.compile_structural_tag(text)
        return self._compile(grammar, tags=True)

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))
