"""Prompt -> validated engine Requests: tokenization, chat templates, limits, ``n`` fan-out."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvflow.chat_template import render_chat
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

PromptType = str | list[int]


class InputProcessor:
    """Tokenizes and validates prompts against the model's limits.

    Args:
        tokenizer: a transformers tokenizer, or None (token-id prompts only).
        max_model_len: context limit in tokens.
        vocab_size: model vocabulary size (token ids must be below it).
        eos_token_id: id that ends generation unless ``ignore_eos``.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids). Raises ValueError on bad input."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid Unicode text: {e}") from None
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)):
            bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
            if bad:
                raise ValueError(f"a token-id prompt must hold only integers, got {bad[0]!r}")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")

    def validate(self, token_ids: list[int]) -> None:
        """Raises ValueError for an empty prompt, one that leaves no room to generate, or an
        out-of-vocabulary id."""
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: it must be shorter to leave room for "
                             "at least one generated token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """Raises ValueError for a ``logit_bias`` or ``stop_token_ids`` id outside the
        vocabulary, stop strings without a tokenizer, or a malformed structured-output schema / regex / grammar
        (SamplingParams checks everything that does not depend on the model)."""
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to match text "
                             "(skip_tokenizer_init is set); use stop_token_ids")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the vocabulary "
                             f"size ({self.vocab_size})")
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token id {bad[0]} outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            from kvflow.structured import validate

            validate(params.structured_outputs)  # malformed schema / regex / grammar

    def make_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, priority: int = 0) -> list[Request]:
        """One Request per sample (``n``); sample i of a seeded request uses seed + i.

        Raises:
            ValueError: for a bad prompt (see ``validate``) or parameters (``validate_params``).
        """
        self.validate(token_ids)
        self.validate_params(params)
        if params.max_tokens is None:  # as many as the context leaves
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(token_ids))
        requests = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = dataclasses.replace(params, n=1, seed=seed)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            requests.append(Request(rid, token_ids, child, self.eos_token_id, arrival_time,
                                    priority, parent_id=request_id, sample_index=i))
        return requests

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options: Any) -> str:
        """Render a conversation with the model's chat template (or ``chat_template``).

        Args:
            messages: OpenAI-style message dicts (content: text, parts or null).
            add_generation_prompt: end with the header of a new assistant turn.
            **options: ``continue_final_message``, ``chat_template``, ``tools``,
                ``documents``, ``template_kwargs`` (see ``kvflow.chat_template.render_chat``).

        Raises:
            ValueError: without a tokenizer; ``ChatTemplateError`` (a ValueError naming the
                field) for a model without a chat template, a bad message or option.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        return render_chat(self.tokenizer, messages, add_generation_prompt, **options)
