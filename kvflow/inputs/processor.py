"""Prompt -> validated engine Requests: tokenization, chat templates, limits, ``n`` fan-out."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.chat.template import render_chat
from kvflow.inputs.embeds import (
    PromptEmbeds,
    check_packed_prompt_embeds,
    check_prompt_embeds,
    pack_prompt_embeds,
)
from kvflow.inputs.media import attach_media, chat_media, checked_mm_kwargs
from kvflow.inputs.multimodal import MultiModalFeature, check_mm_features
from kvflow.inputs.pooling import PoolingInputs
from kvflow.inputs.prompts import (
    ProcessedPrompt,
    PromptType,
    check_cache_salt,
    prompt_text,
    tokenize_prompt,
    unpack_prompt,
)
from kvflow.inputs.samples import bad_words_ids_checked, sample_params
from kvflow.inputs.sampling_checks import check_extra_args, check_sampling_params
from kvflow.inputs.tokenization import TokenizationOptions
from kvflow.inputs.truncation import SAMPLING_FIELD, keep_last_tokens, truncation_length
from kvflow.logits_process import LogitsProcessor
from kvflow.lora.request import LoRARequest
from kvflow.models.pooling_config import PoolerConfig
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.structured import CheckedConstraints, StructuredOutputsParams


class InputProcessor(PoolingInputs):
    """Tokenizes and validates prompts against the model's limits.

    Args:
        tokenizer: a transformers tokenizer, or None (token-id prompts only).
        max_model_len: context limit in tokens.
        vocab_size: model vocabulary size (token ids must be below it).
        eos_token_id: id that ends generation unless ``ignore_eos``.
        eos_token_ids: every id the model declares as EOS (generation_config.json); those
            other than ``eos_token_id`` are added to each request's ``stop_token_ids`` unless
            it sets ``ignore_eos`` (as vLLM does), so any of them ends generation.
        pooler: an embedding model's pooling (None: a generation model).
        hidden_size: the model's hidden size (the embedding's length).
        max_model_len_note: appended to a too-long prompt's error after max_model_len (why
            it is lower than asked: the engine core's ``max_model_len_note``).
        enable_prompt_embeds: prompts may come as embedding rows (``prompt_embeds``).
        logits_processors: the engine's custom logits processor classes, whose
            ``validate_params`` check each request's parameters (``extra_args``).
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None, mm_processor: Any = None,
                 eos_token_ids: list[int] | None = None,
                 pooler: PoolerConfig | None = None, hidden_size: int = 0,
                 max_model_len_note: str = "", enable_prompt_embeds: bool = False,
                 logits_processors: Sequence[type[LogitsProcessor]] = ()) -> None:
        self.tokenizer = tokenizer
        self.logits_processors = tuple(logits_processors)
        self.extra_eos_ids = [t for t in eos_token_ids or []
                              if t != eos_token_id and 0 <= t < vocab_size]
        self.max_model_len = max_model_len
        self.max_model_len_note = max_model_len_note
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pooler, self.hidden_size = pooler, hidden_size
        self.enable_prompt_embeds = enable_prompt_embeds
        # kvflow.multimodal.processor.MultiModalProcessor for a vision-language model
        self.mm_processor = mm_processor
        self.checked_constraints = CheckedConstraints()

    @property
    def image_placeholder(self) -> str | None:
        """The text standing for one image in a prompt (None: the model takes no images)."""
        return None if self.mm_processor is None else self.mm_processor.placeholder

    def process(self, prompt: PromptType, keep_last: int | None = None,
                options: TokenizationOptions | None = None,
                mm_kwargs: Mapping[str, Any] | None = None) -> ProcessedPrompt:
        """Tokenize a prompt and, for a vision-language model, preprocess its images and
        expand their placeholders; a dict prompt's ``cache_salt`` is kept, and so is the
        ``prompt`` text beside its token ids or embeddings (vLLM's ``TokensPrompt`` /
        ``EmbedsPrompt``: the ids are what the model reads, the text what
        ``RequestOutput.prompt`` shows). ``keep_last``
        (the request's ``truncate_prompt_tokens`` length) cuts a ``prompt_embeds`` prompt's
        rows before their length check; token prompts are cut by ``make_requests``.
        ``options`` (the call's ``tokenization_kwargs``) tokenize, cut and pad text and
        token-id prompts (:func:`kvflow.inputs.prompts.tokenize_prompt`). ``mm_kwargs`` (the
        call's ``mm_processor_kwargs``) go to the image processor, under a dict prompt's own
        ``mm_processor_kwargs`` (its keys win).

        Raises:
            ValueError: for a malformed prompt, images for a text-only model, a placeholder
                count that differs from the image count, a bad image (``MediaError``), or a
                ``cache_salt`` that is not a non-empty string; ``options`` that cut or pad a
                prompt with images or videos, or one given as embeddings; for
                ``{"prompt_embeds": ...}``, see :meth:`embeds_prompt`.
        """
        images, videos, salt = [], [], None
        given_text = prompt_text(prompt)  # a TokensPrompt's / EmbedsPrompt's text
        if isinstance(prompt, Mapping) and "prompt_embeds" in prompt:
            if not set(prompt) <= {"prompt_embeds", "cache_salt", "prompt"}:
                raise ValueError(f"a prompt_embeds prompt takes no other keys than cache_salt "
                                 f"and prompt; got keys {sorted(prompt)}")
            if options is not None and options.reshapes:
                raise ValueError("tokenization_kwargs cannot cut or pad a prompt_embeds "
                                 "prompt (use SamplingParams.truncate_prompt_tokens)")
            salt = check_cache_salt(prompt.get("cache_salt"))
            return dataclasses.replace(self.embeds_prompt(prompt["prompt_embeds"], keep_last),
                                       text=given_text, cache_salt=salt)
        if isinstance(prompt, Mapping):
            salt = check_cache_salt(prompt.get("cache_salt"))
            own = prompt.get("mm_processor_kwargs")
            if own is not None and not isinstance(own, Mapping):
                raise ValueError(f"a dict prompt's 'mm_processor_kwargs' must be a dict, got "
                                 f"{type(own).__name__}")
            if own:
                mm_kwargs = {**(mm_kwargs or {}), **own}
            prompt, images, videos = unpack_prompt(prompt)
            if (images or videos) and options is not None and options.reshapes:
                raise ValueError("tokenization_kwargs cannot cut or pad a prompt with images "
                                 "or videos (their placeholders are expanded after "
                                 "tokenization)")
        text, token_ids = self.tokenize(prompt, options)
        return dataclasses.replace(self.attach_images(given_text or text, token_ids, images,
                                                      videos, mm_kwargs), cache_salt=salt)

    def embeds_prompt(self, embeds: Any, keep_last: int | None = None) -> ProcessedPrompt:
        """A prompt given as embedding rows: ``embeds`` a float tensor [num_tokens,
        hidden_size] (or [1, num_tokens, hidden_size]), checked and packed
        (``kvflow.inputs.embeds.check_prompt_embeds``; ``keep_last``: keep only the last
        that many rows, a ``truncate_prompt_tokens`` length), with one placeholder id 0 per
        row.

        Raises:
            ValueError: on an engine without ``enable_prompt_embeds``, or for a bad tensor
                (type, dtype, rank, hidden size, no rows, NaN/inf, too long).
        """
        self.require_prompt_embeds()
        packed = check_prompt_embeds(embeds, self.hidden_size, self.max_model_len,
                                     self.max_model_len_note, keep_last)
        return ProcessedPrompt(None, [0] * packed.num_tokens, prompt_embeds=packed)

    def require_prompt_embeds(self) -> None:
        """Raises ValueError (naming the flag) unless this engine takes prompt embeddings."""
        if not self.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs the engine started with "
                             "enable_prompt_embeds=True (--enable-prompt-embeds)")
        if self.mm_processor is not None:
            raise ValueError("prompt_embeds is not supported for vision-language models")

    def attach_images(self, text: str | None, token_ids: list[int],
                      images: list[Any], videos: Sequence[Any] = (),
                      mm_kwargs: Mapping[str, Any] | None = None) -> ProcessedPrompt:
        """``token_ids`` with their images and videos expanded and preprocessed by this
        model's processor (:func:`kvflow.inputs.media.attach_media`).

        Raises:
            ValueError: for media or ``mm_kwargs`` the model does not take (see there).
        """
        return attach_media(self.mm_processor, text, token_ids, images, videos, mm_kwargs)

    def check_mm_kwargs(self, mm_kwargs: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A request's ``mm_processor_kwargs`` checked against the model's image processor
        (:func:`kvflow.inputs.media.checked_mm_kwargs`); None for none.

        Raises:
            ValueError: naming ``mm_processor_kwargs`` (see there).
        """
        return checked_mm_kwargs(self.mm_processor, mm_kwargs)

    def tokenize(self, prompt: PromptType, options: TokenizationOptions | None = None
                 ) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids), tokenized, cut and padded as ``options``
        say (None: as usual); a dict prompt's images are not looked at (see ``process``).
        Raises ValueError on bad input (:func:`tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, prompt, options)

    def validate(self, token_ids: list[int], pooling: bool = False) -> None:
        """Raises ValueError for an empty prompt, one that leaves no room to generate (for an
        embedding, ``pooling``: one longer than max_model_len), or an out-of-vocabulary id."""
        if not token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if pooling and len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}{self.max_model_len_note}")
        if not pooling and len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}{self.max_model_len_note}: it must be "
                             "shorter to leave room for "
                             "at least one generated token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """Raises ValueError for a ``logit_bias``, ``stop_token_ids`` or
        ``allowed_token_ids`` id outside the vocabulary, ``bad_words`` without a tokenizer, a
        ``truncate_prompt_tokens`` above ``max_model_len``, ``logprobs`` / ``prompt_logprobs`` above the vocabulary size, stop
        strings without a tokenizer, a malformed structured-output schema / regex /
        grammar (``check_structured``; SamplingParams checks everything that does not depend
        on the model), or what a custom logits processor's ``validate_params`` refuses."""
        check_sampling_params(params, self.vocab_size, self.max_model_len,
                              has_tokenizer=self.tokenizer is not None)
        if params.structured_outputs is not None:
            self.check_structured(params.structured_outputs)
        check_extra_args(params, self.logits_processors)

    def check_structured(self, constraint: StructuredOutputsParams) -> None:
        """Raises ValueError for a malformed structured-output schema / regex / grammar
        (``kvflow.structured.validate``: converted to a grammar, tens to hundreds of ms for a
        large schema). A constraint that passed before is not converted again
        (``CheckedConstraints``), so the server can check one in a worker thread before it
        queues the request. Thread-safe."""
        self.checked_constraints.check(constraint)

    def make_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, priority: int = 0,
                      mm_features: list[MultiModalFeature] | None = None,
                      client_id: str = "",
                      lora_request: LoRARequest | None = None,
                      cache_salt: str | None = None,
                      prompt_embeds: PromptEmbeds | None = None,
                      session_id: str | None = None) -> list[Request]:
        """One Request per sample (``n``); sample i of a seeded request uses seed + i
        (wrapped into the signed 64-bit range, the same generator seed modulo 2**64). The
        samples share ``mm_features`` (the images of the prompt, already expanded) and
        ``prompt_embeds`` (a prompt given as embeddings, checked by ``embeds_prompt``;
        ``token_ids`` are then its placeholders). ``client_id`` names the sender for the
        fair policy ("" when unknown); every sample runs with ``lora_request`` (None: the
        base model) and ``cache_salt`` (its prefix-cache salt, ``check_cache_salt``; None:
        unsalted). The prompt is first cut to its last ``params.truncate_prompt_tokens``
        tokens (the Requests hold the cut ids) and ``params.bad_words`` are tokenized into
        each sample's ``bad_words_token_ids``.

        Raises:
            ValueError: for a bad prompt (see ``validate``), parameters (``validate_params``,
                ``bad_words_token_ids``, ``check_masks_leave_a_token``: ``allowed_token_ids``
                that ``bad_words`` or ``min_tokens`` leave empty) or ``cache_salt``, a
                truncation that would cut a prompt with images (a prompt given as
                embeddings keeps its last rows, as vLLM does); for ``prompt_embeds`` on an
                engine without ``enable_prompt_embeds``, rows the model cannot take
                (``check_packed_prompt_embeds``: another hidden size, data that does not
                match the shape), or with ``prompt_logprobs`` (a prompt given as
                embeddings has no token ids to score); for ``mm_features`` that do not hold
                what they say (``check_mm_features``).
        """
        check_cache_salt(cache_salt)
        if prompt_embeds is not None:  # rows given packed: the model must take them
            self.require_prompt_embeds()
            check_packed_prompt_embeds(prompt_embeds, self.hidden_size)
        if mm_features:  # images given preprocessed: they must hold what they say
            check_mm_features(mm_features, len(token_ids))
        token_ids, prompt_embeds = self._truncated(token_ids, params, mm_features,
                                                   prompt_embeds)
        self.validate(token_ids)
        self.validate_params(params)
        bad_words_ids = bad_words_ids_checked(self.tokenizer, params, self.vocab_size,
                                              self.eos_token_id, self.extra_eos_ids)
        if prompt_embeds is not None:
            self._check_embeds_request(token_ids, params, prompt_embeds)
        if params.max_tokens is None:  # as many as the context leaves (at least min_tokens:
            # the request then stops at the context's end, as an explicit max_tokens does)
            room = self.max_model_len - len(token_ids)
            params = dataclasses.replace(params, max_tokens=max(room, params.min_tokens))
        requests = []
        for i in range(params.n):
            child = sample_params(params, i, bad_words_ids, self.extra_eos_ids,
                                  self.vocab_size)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            requests.append(Request(rid, token_ids, child, self.eos_token_id, arrival_time,
                                    priority, parent_id=request_id, sample_index=i,
                                    mm_features=mm_features, client_id=client_id,
                                    lora_request=lora_request, cache_salt=cache_salt,
                                    prompt_embeds=prompt_embeds, session_id=session_id))
        return requests

    def _truncated(self, token_ids: list[int], params: SamplingParams,
                   mm_features: list[MultiModalFeature] | None,
                   prompt_embeds: PromptEmbeds | None
                   ) -> tuple[list[int], PromptEmbeds | None]:
        """The prompt cut to its last ``params.truncate_prompt_tokens`` tokens (vLLM's rule;
        a prompt given as embeddings keeps its last rows, packed again so that its
        prefix-cache digest is the kept rows'); unchanged without truncation.

        Raises:
            ValueError: for a bad ``truncate_prompt_tokens``, or one that would cut a prompt
                with images.
        """
        limit = truncation_length(params.truncate_prompt_tokens, self.max_model_len,
                                  SAMPLING_FIELD, generation=True)
        if limit is None or len(token_ids) <= limit:
            return token_ids, prompt_embeds
        if mm_features:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens={limit} would cut a "
                             f"prompt of {len(token_ids)} tokens that holds images: send "
                             "fewer tokens or no truncate_prompt_tokens")
        if prompt_embeds is not None:  # vLLM's rule (serving_engine._load_prompt_embeds)
            prompt_embeds = pack_prompt_embeds(prompt_embeds.tensor()[-limit:])
        return keep_last_tokens(token_ids, limit), prompt_embeds

    def _check_embeds_request(self, token_ids: list[int], params: SamplingParams,
                              prompt_embeds: PromptEmbeds) -> None:
        """Raises ValueError for what a prompt given as embeddings cannot do (see
        ``make_requests``)."""
        self.require_prompt_embeds()
        if len(token_ids) != prompt_embeds.num_tokens:
            raise ValueError(f"{len(token_ids)} placeholder ids for {prompt_embeds.num_tokens} "
                             "prompt_embeds rows")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be computed for prompt_embeds: the prompt "
                             "has no token ids")

    def load_chat_images(self, messages: list[dict]) -> list[Any]:
        """The images of a conversation's ``image_url`` parts (``load_chat_media``'s)."""
        return self.load_chat_media(messages)[0]

    def load_chat_media(self, messages: list[dict]) -> tuple[list[Any], list[Any]]:
        """(images, videos) of a conversation's ``image_url`` and ``video_url`` parts
        (:func:`kvflow.inputs.media.chat_media`).

        Raises:
            MediaError: naming the part, or ``messages`` for a count over its limit.
        """
        return chat_media(self.mm_processor, messages)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options: Any) -> str:
        """Render a conversation with the model's chat template (or ``chat_template``).

        Args:
            messages: OpenAI-style message dicts (content: text, parts or null).
            add_generation_prompt: end with the header of a new assistant turn.
            **options: ``continue_final_message``, ``chat_template``, ``tools``,
                ``documents``, ``template_kwargs`` (see ``kvflow.chat.template.render_chat``).

        Raises:
            ValueError: without a tokenizer; ``ChatTemplateError`` (a ValueError naming the
                field) for a model without a chat template, a bad message or option.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        video = None if self.mm_processor is None else self.mm_processor.video_placeholder
        return render_chat(self.tokenizer, messages, add_generation_prompt,
                           image_placeholder=self.image_placeholder,
                           video_placeholder=video, **options)
