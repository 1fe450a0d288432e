"""What a prompt is: the forms ``LLM`` and the server accept (:data:`PromptType`), a dict
prompt's parsing, its token ids, its ``cache_salt`` check, and the :class:`ProcessedPrompt`
ready to queue. The model's limits are checked later, by
:class:`kvflow.inputs.processor.InputProcessor`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvflow.inputs import PromptType
from kvflow.inputs.embeds import PromptEmbeds
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.inputs.tokenization import TokenizationOptions
from kvflow.multimodal.video import video_list

# PromptType (kvflow/inputs/__init__.py, vLLM's vllm.inputs): a text prompt, a token-id prompt, or a
# dict: {"prompt": str} or {"prompt_token_ids": [...]} (its text may come beside the ids, as
# "prompt": not tokenized, the output's prompt), with "multi_modal_data": {"image": PIL
# image or list of them, "video": a video (uint8 array (T, H, W, 3) or list of PIL frames) or
# list of them} for a vision-language model and "cache_salt": a non-empty string salting its
# prefix-cache blocks (vLLM's); or {"prompt_embeds": float tensor [num_tokens, hidden_size]}
# (enable_prompt_embeds), with or without "cache_salt" and its "prompt" text.
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt",
                          "mm_processor_kwargs"})


def check_cache_salt(salt: object) -> str | None:
    """``salt`` itself when it is None or a non-empty string (vLLM's ``cache_salt``: mixed
    into the hash of the prompt's first KV block, so only requests with the same salt share
    prefix-cache blocks).

    Raises:
        ValueError: naming ``cache_salt`` for an empty string or a value of another type.
    """
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string (or None), got {salt!r}")
    return salt


@dataclasses.dataclass
class ProcessedPrompt:
    """A prompt ready to queue: its text (None for token ids), its token ids (image
    placeholders expanded; one placeholder 0 per row of a prompt given as embeddings), its
    images' features (None: text only), its embedding rows (None: token ids) and its
    prefix-cache salt (a dict prompt's ``cache_salt``; None: unsalted)."""

    text: str | None
    token_ids: list[int]
    mm_features: list[MultiModalFeature] | None = None
    cache_salt: str | None = None
    prompt_embeds: PromptEmbeds | None = None


def unpack_prompt(prompt: Mapping[str, Any]) -> tuple[str | list[int], list[Any], list[Any]]:
    """(text or token ids, images, videos) of a dict prompt (``{"prompt": str}`` or
    ``{"prompt_token_ids": [...]}``, whose ids win over a ``prompt`` text beside them, vLLM's
    ``TokensPrompt``: :func:`prompt_text` reads that; optionally ``multi_modal_data``,
    ``cache_salt`` and ``mm_processor_kwargs``; the salt is checked by
    :func:`check_cache_salt`, the kwargs by the model's processor).

    Raises:
        ValueError: for a ``prompt_embeds`` prompt (generation only, not read here), unknown
            or missing keys, a malformed ``multi_modal_data`` or a value of the wrong type.
    """
    if "prompt_embeds" in prompt:
        raise ValueError("a prompt_embeds prompt is for text generation only "
                         "(LLM.generate, /v1/completions)")
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown or not ({"prompt", "prompt_token_ids"} & set(prompt)):
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids' (and "
                         f"optionally 'multi_modal_data', 'mm_processor_kwargs', "
                         f"'cache_salt'); got keys {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, Mapping) or set(data) - {"image", "video"}:
        raise ValueError("multi_modal_data must be a dict with 'image' (a PIL image or a "
                         "list of them) and/or 'video' (a uint8 array (frames, height, "
                         "width, 3) or a list of PIL frames, or a list of videos) entries")
    images = data.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    videos = video_list(data["video"]) if data.get("video") is not None else []
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise ValueError(f"a dict prompt's 'prompt' must be a string, got "
                         f"{type(prompt['prompt']).__name__}")
    ids = prompt.get("prompt_token_ids")
    if "prompt_token_ids" in prompt and not isinstance(ids, (list, tuple)):
        raise ValueError(f"a dict prompt's 'prompt_token_ids' must be a list of integer "
                         f"token ids, got {type(ids).__name__}")
    return (prompt["prompt"] if ids is None else ids), images, videos


def prompt_text(prompt: PromptType) -> str | None:
    """The text a dict prompt gives beside its token ids or embeddings (vLLM's
    ``TokensPrompt`` / ``EmbedsPrompt`` ``prompt``: what ``RequestOutput.prompt`` shows), or
    None.

    Raises:
        ValueError: if that ``prompt`` is not a string.
    """
    if not isinstance(prompt, Mapping) or "prompt" not in prompt or not (
            {"prompt_token_ids", "prompt_embeds"} & set(prompt)):
        return None
    if not isinstance(prompt["prompt"], str):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"a dict prompt's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
    return prompt["prompt"]


def tokenize_prompt(tokenizer: Any, prompt: PromptType,
                    options: TokenizationOptions | None = None) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a prompt: text is encoded by ``tokenizer`` (a
    transformers tokenizer, special tokens added; None: token-id prompts only); a dict
    prompt's images are not looked at (``InputProcessor.process`` attaches them).
    ``options`` (a call's ``tokenization_kwargs``) change how text is encoded and cut or pad
    text and token ids alike; the text returned is the prompt as given.

    Raises:
        ValueError: for text without a tokenizer or not valid Unicode, a token-id list
            holding a non-integer, a malformed dict prompt, or another type; padding
            without a pad token.
    """
    if isinstance(prompt, Mapping):
        prompt = unpack_prompt(prompt)[0]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text: {e}") from None
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer (skip_tokenizer_init is set)")
        if options is not None:
            return prompt, options.encode(tokenizer, prompt)
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, (list, tuple)):
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"a token-id prompt must hold only integers, got {bad[0]!r}")
        if options is not None and options.reshapes:
            return None, options.reshape(tokenizer, list(prompt))
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict prompt "
                     f"({{'prompt': ...}}, {{'prompt_token_ids': [...]}} or "
                     f"{{'prompt_embeds': tensor}}), got {type(prompt).__name__}")
