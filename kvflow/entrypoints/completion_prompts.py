"""A /v1/completions request's ``prompt`` field read: its prompts listed (one text, one list
of token ids, or a list of either) with an empty one refused by its place, and a
vision-language model's placeholder tokens refused in them (images go in chat's parts).
"""

from __future__ import annotations

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.inputs.processor import InputProcessor


def prompt_items(prompt: str | list[int] | list[str] | list[list[int]]
                 ) -> list[str | list[int]]:
    """The prompts of a ``prompt`` field, in order: a text or a list of token ids is one
    prompt, a list of texts or of token-id lists is one each.

    Raises:
        OpenAIError: 400 for an empty prompt (param ``prompt``, code ``empty_string`` or
            ``empty_array``) or an empty item of a list (param ``prompt.<i>``).
    """
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    elif not prompt:
        raise OpenAIError("the prompt is empty", param="prompt", code="empty_array")
    else:
        items = list(prompt)
    for i, item in enumerate(items):
        if len(item) == 0:  # in a list of prompts, name the empty one
            listed = items[0] is not prompt
            raise OpenAIError(f"prompt {i} of the list is empty" if listed
                              else "the prompt is empty",
                              param=f"prompt.{i}" if listed else "prompt",
                              code="empty_string" if isinstance(item, str)
                              else "empty_array")
    return items


def refuse_placeholders(processor: InputProcessor, text: str | None, ids: list[int]) -> None:
    """A vision-language model's completion prompt carries no images or videos: a
    placeholder token in it would stand for nothing (they go in /v1/chat/completions
    image_url / video_url parts).

    Raises:
        OpenAIError: 400 naming ``prompt`` (code ``invalid_value``) for a placeholder token
            in ``ids`` (``processor.attach_images`` with no images refuses it).
    """
    try:
        processor.attach_images(text, ids, [])
    except ValueError as e:
        raise OpenAIError(f"{e} (images and videos go in /v1/chat/completions image_url "
                          "and video_url parts)", param="prompt",
                          code="invalid_value") from None
