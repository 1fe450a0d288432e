"""The prompt forms ``LLM`` and ``AsyncLLM`` take, at vLLM's path (``vllm.inputs``): a string,
a list of token ids, or a dict, named here as vLLM names the dicts: :class:`TextPrompt`
(``{"prompt": str}``), :class:`TokensPrompt` (``{"prompt_token_ids": [...]}``) and
:class:`EmbedsPrompt` (``{"prompt_embeds": tensor}``, with ``enable_prompt_embeds``). They are
TypedDicts: ``TokensPrompt(prompt_token_ids=[1, 2])`` is the plain dict kvflow parses
(``kvflow/inputs/prompts.py``), so they only name the keys. Typing only, no kvflow imports.

As in vLLM, a ``TokensPrompt`` and an ``EmbedsPrompt`` may carry the ``prompt`` text they stand
for: the model reads the ids (embeddings), and the text is the ``RequestOutput.prompt``. Unlike
vLLM's, an ``EmbedsPrompt`` takes no ``prompt_token_ids`` / ``prompt_is_token_ids`` (vLLM's
mixed token and embedding chat prompts).

The package holds what a prompt goes through before the engine: ``prompts`` (the forms parsed,
their token ids), ``processor`` (``InputProcessor``: prompts -> engine requests) and its halves
``pooling`` and ``media``, ``sampling_checks`` (SamplingParams against the model),
``tokenization`` (``tokenization_kwargs``), ``truncation`` (``truncate_prompt_tokens``), ``score``
(cross-encoder pairs), and the pure data that crosses processes: ``embeds`` (prompt
embeddings) and ``multimodal`` (one preprocessed image or video).
"""

# no ``from __future__ import annotations``: a TypedDict reads its keys' requiredness when the
# class is made, from the ``total`` of the class that declares each key
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import torch

__all__ = ["EmbedsPrompt", "PromptType", "TextPrompt", "TokensPrompt"]


class _CacheSalt(TypedDict, total=False):
    """What every dict prompt may add."""

    cache_salt: str  # a non-empty string mixed into the first KV block's hash (vLLM's)


class _PromptOptions(_CacheSalt, total=False):
    """What a text or token-id dict prompt may add."""

    # {"image": a PIL image or a list of them, "video": a uint8 array (frames, height, width,
    # 3), a list of PIL frames, or a list of videos} for a vision-language model
    multi_modal_data: Mapping[str, Any]
    mm_processor_kwargs: dict[str, Any]  # the model's processor's arguments for this prompt


class TextPrompt(_PromptOptions):
    """A text prompt as a dict (vLLM's ``TextPrompt``): ``prompt`` is encoded by the model's
    tokenizer."""

    prompt: str


class _PromptText(TypedDict, total=False):
    """The text a token-id or embedding prompt stands for: returned as
    ``RequestOutput.prompt``, not tokenized (vLLM's)."""

    prompt: str


class TokensPrompt(_PromptOptions, _PromptText):
    """A token-id prompt as a dict (vLLM's ``TokensPrompt``), with the text the ids stand
    for as ``prompt`` if the caller has it."""

    prompt_token_ids: list[int]


class EmbedsPrompt(_CacheSalt, _PromptText):
    """A prompt given as its input embeddings (vLLM's ``EmbedsPrompt``): a float tensor
    [num_tokens, hidden_size]; the engine needs ``enable_prompt_embeds``. ``prompt``: the
    text the rows stand for, if the caller has it."""

    prompt_embeds: "torch.Tensor"


# What LLM.generate and the other entry points take for one prompt: text, token ids, or one
# of the dicts above (any mapping with those keys)
PromptType = str | list[int] | Mapping[str, Any]
