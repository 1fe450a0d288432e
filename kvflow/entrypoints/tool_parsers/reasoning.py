"""Reasoning parsers (``--reasoning-parser``): split a reply into reasoning and content.

Each is a pure function of the text so far, ``split(text, final)``: an opening marker at the
start of the reply (after whitespace), the reasoning, a closing marker, the content. While
streaming, a possible start of a marker is held back; reasoning and content only ever grow, so
the streamed pieces join to what the whole text gives.

- ``think``: ``<think>reasoning</think>content``; a reply that does not open with ``<think>``
  is all content; a block that never closes (cut by ``max_tokens``) is all reasoning.
- ``qwen3``: the same (Qwen3 writes the pair itself); under the chat template variable
  ``enable_thinking: false`` there is no reasoning at all (the template closed it).
- ``deepseek_r1``: the opening ``<think>`` is optional (DeepSeek-R1's and QwQ's templates
  put it in the prompt): text before ``</think>`` is reasoning; without ``</think>``, all of
  it is (as vLLM reads it).
- ``granite``: ``Here is my thought process:`` ... ``Here is my response:`` (or ``Here's``),
  IBM Granite 3.2's format under ``thinking: true``.
"""

from __future__ import annotations

from typing import Any

from kvflow.entrypoints.tool_parsers.base import held_back


class ReasoningParser:
    """Base: reasoning between one of ``STARTS`` and one of ``ENDS``; subclasses set the
    markers, ``name``, and ``opening_optional`` (text before an end marker is reasoning even
    without an opening one) / ``off_switch`` (a chat template variable that, false, turns
    reasoning off)."""

    name = "base"
    STARTS: tuple[str, ...] = ()
    ENDS: tuple[str, ...] = ()
    opening_optional = False
    off_switch: str | None = None

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning so far, content so far), holding back partial markers unless ``final``."""
        stripped = text.lstrip()
        start = next((s for s in self.STARTS if stripped.startswith(s)), None)
        if start is not None:
            body = stripped[len(start):]
        elif not final and any(s.startswith(stripped) for s in self.STARTS):
            return "", ""  # the opening marker may be coming
        elif self.opening_optional:
            body = text
        else:
            return "", text
        found = [(i, m) for m in self.ENDS if (i := body.find(m)) >= 0]
        if not found:
            hold = 0 if final else max(held_back(body, m) for m in self.ENDS)
            return body[:len(body) - hold], ""
        end, marker = min(found)
        return body[:end], body[end + len(marker):].lstrip()  # as it grows too


class ThinkReasoningParser(ReasoningParser):
    name = "think"
    START, END = "<think>", "</think>"
    STARTS, ENDS = (START,), (END,)


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    off_switch = "enable_thinking"


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    opening_optional = True


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    STARTS = ("Here is my thought process:", "Here's my thought process:")
    ENDS = ("Here is my response:", "Here's my response:")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    ThinkReasoningParser, DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
    GraniteReasoningParser)}


def make_reasoning_parser(name: str | None, template_kwargs: dict[str, Any] | None = None
                          ) -> ReasoningParser | None:
    """The ``--reasoning-parser`` named ``name`` for one request (None: no split), given the
    request's chat template variables (the server's defaults merged under the request's):
    None too when they switch the model's reasoning off (``enable_thinking: false`` for
    ``qwen3``).

    Raises:
        ValueError: for an unknown name, listing the choices.
    """
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{sorted(REASONING_PARSERS)}")
    cls = REASONING_PARSERS[name]
    if cls.off_switch and (template_kwargs or {}).get(cls.off_switch) is False:
        return None
    return cls()
