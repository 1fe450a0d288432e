"""Reasoning parsers (``--reasoning-parser``): split a reply into reasoning and content.

Each is a pure function of the text so far, ``split(text, final)``: an opening marker at the
start of the reply (after whitespace), the reasoning, a closing marker, the content. While
streaming, a possible start of a marker is held back; reasoning and content only ever grow, so
the streamed pieces join to what the whole text gives. A rendered prompt that ends with an
opening marker (``note_prompt``: a template that opens the block itself, as Qwen3's 2507
thinking models do) starts the reply inside the block, for every parser; under a grammar
applied from the first token (structured outputs or a forced tool call with
``--structured-outputs-config '{"enable_in_reasoning": true}'``, or a parser that names no
markers) only a reply that writes the opening marker has reasoning, for every parser too (by
default the grammar starts after the reasoning: ``kvflow/structured/reasoning_gate.py``).

- ``think``: ``<think>reasoning</think>content``; a reply that does not open with ``<think>``
  is all content; a block that never closes (cut by ``max_tokens``) is all reasoning.
- ``qwen3``: the same (Qwen3 writes the pair itself); under the chat template variable
  ``enable_thinking: false`` there is no reasoning at all (the template closed it).
- ``deepseek_r1``: the opening ``<think>`` is optional (DeepSeek-R1's and QwQ's templates
  put it in the prompt): text before ``</think>`` is reasoning; without ``</think>``, all of
  it is (as vLLM reads it).
- ``granite``: ``Here is my thought process:`` ... ``Here is my response:`` (or ``Here's``),
  IBM Granite 3.2's format under ``thinking: true``.
- ``glm45``: ``qwen3``'s reading under its name for GLM-4.5 / 4.6 (``enable_thinking: false``
  too: GLM's template then closes the block itself).
- ``mistral``: ``[THINK]reasoning[/THINK]content`` (Magistral); a reply that does not open
  with ``[THINK]`` is all content. The markers are special tokens: the reply is decoded with
  them.
- ``seed_oss``: ``<seed:think>`` ... ``</seed:think>``, the opening optional (read as
  ``deepseek_r1``); special tokens, as Mistral's.
- ``step3``: no opening marker: text before ``</think>`` is reasoning, all of it without one
  (a ``<think>`` the model writes stays in the reasoning, as vLLM's parser leaves it).
- ``ernie45``: ``deepseek_r1``'s reading, and content written as ``<response>...</response>``
  is the text inside the tags (ERNIE-4.5 thinking models).
- ``hunyuan_a13b``: ``<think>\nreasoning\n</think>\n<answer>\ncontent\n</answer>``
  (Hunyuan-A13B): the newlines next to the tags and the ``<answer>`` tags are dropped; a
  reply without a think block is content (its ``<answer>`` tags dropped too).
- ``deepseek_v3``: ``deepseek_r1`` when the chat template variable ``thinking`` is true
  (DeepSeek-V3.1's switch), else no reasoning at all (vLLM 0.11's reading).
"""

from __future__ import annotations

from typing import Any

from kvflow.config.reasoning import marker_strings
from kvflow.entrypoints.tool_parsers.base import held_back
from kvflow.thinking_budget import ReasoningTokenIds


class ReasoningParser:
    """Base: reasoning between one of ``STARTS`` and one of ``ENDS``; subclasses set the
    markers, ``name``, and ``opening_optional`` (text before an end marker is reasoning even
    without an opening one) / ``off_switch`` (a chat template variable that, false, turns
    reasoning off) / ``on_switch`` (one that must be true for any reasoning) /
    ``CONTENT_TAGS`` (tags around the content, dropped) / ``keeps_special_tokens`` (the
    markers are special tokens: the reply must be decoded with them) /
    ``reasoning_start_str`` and ``reasoning_end_str`` (vLLM's names: the markers a
    ``thinking_token_budget`` is counted from and forces; None for a parser whose vLLM
    namesake names none, where vLLM refuses a budget)."""

    name = "base"
    STARTS: tuple[str, ...] = ()
    ENDS: tuple[str, ...] = ()
    CONTENT_TAGS: tuple[str, str] | None = None
    opening_optional = False
    off_switch: str | None = None
    on_switch: str | None = None
    keeps_special_tokens = False
    reasoning_start_str: str | None = None
    reasoning_end_str: str | None = None

    def __init__(self) -> None:
        #: the reply may start inside the block without writing the opening marker (text
        #: before an end marker is reasoning, all of it without one): ``opening_optional``,
        #: or the prompt opened the block; never under a grammar (``note_prompt``)
        self.inside = self.opening_optional

    def note_prompt(self, prompt: str, grammar: bool = False) -> None:
        """Read the end of the rendered prompt (text): a template that opens the block
        itself, its prompt ending (but for whitespace) with an opening marker (Qwen3's 2507
        thinking models, ``<|im_start|>assistant\n<think>\n``; DeepSeek-R1's), starts the
        reply inside the reasoning: text before the end marker is reasoning though the reply
        writes no opening marker, and all of it without one (``deepseek_r1``'s reading, as
        vLLM's parsers read such replies). Under a ``grammar`` applied from the first token
        (the server passes it only then: ``enable_in_reasoning``, or no markers known), the
        reply is what the grammar forces: reasoning only where it writes the opening marker itself, whatever the prompt
        or ``opening_optional`` say (else forced JSON or calls would read as reasoning)."""
        tail = prompt.rstrip()
        self.inside = not grammar and (self.opening_optional or any(
            tail.endswith(s.strip()) for s in self.STARTS))

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning so far, content so far), holding back partial markers unless ``final``."""
        stripped = text.lstrip()
        start = next((s for s in self.STARTS if stripped.startswith(s)), None)
        if start is not None:
            body = stripped[len(start):]
        elif not final and any(s.startswith(stripped) for s in self.STARTS):
            return "", ""  # the opening marker may be coming
        elif self.inside:
            body = text
        else:
            return "", self.unwrap(text, final)
        found = [(i, m) for m in self.ENDS if (i := body.find(m)) >= 0]
        if not found:
            hold = 0 if final else max(held_back(body, m) for m in self.ENDS)
            return body[:len(body) - hold], ""
        end, marker = min(found)
        return body[:end], self.unwrap(body[end + len(marker):].lstrip(), final)  # as it grows

    def unwrap(self, content: str, final: bool) -> str:
        """``content`` less the ``CONTENT_TAGS`` around it (and the whitespace inside them;
        text after the closing tag is dropped); content that does not open with the tag is
        kept whole. While streaming, a possible start of a tag waits, and so does trailing
        whitespace inside the tags (the content only ever grows)."""
        if self.CONTENT_TAGS is None:
            return content
        start, end = self.CONTENT_TAGS
        stripped = content.lstrip()
        if not stripped.startswith(start):
            return "" if not final and start.startswith(stripped) else content
        inner = stripped[len(start):].lstrip()
        close = inner.find(end)
        if close >= 0:
            return inner[:close].rstrip()
        return inner if final else inner[:len(inner) - held_back(inner, end)].rstrip()


class ThinkReasoningParser(ReasoningParser):
    name = "think"
    START, END = "<think>", "</think>"
    STARTS, ENDS = (START,), (END,)
    reasoning_start_str, reasoning_end_str = START, END


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


class Glm45ReasoningParser(Qwen3ReasoningParser):
    name = "glm45"


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    STARTS, ENDS = ("[THINK]",), ("[/THINK]",)
    reasoning_start_str, reasoning_end_str = "[THINK]", "[/THINK]"
    keeps_special_tokens = True


class SeedOssReasoningParser(ReasoningParser):
    name = "seed_oss"
    STARTS, ENDS = ("<seed:think>",), ("</seed:think>",)
    reasoning_start_str, reasoning_end_str = "<seed:think>", "</seed:think>"
    opening_optional = keeps_special_tokens = True


class Step3ReasoningParser(ReasoningParser):
    name = "step3"
    ENDS = ("</think>",)
    reasoning_start_str, reasoning_end_str = "<think>", "</think>"  # vLLM's step3 names both
    opening_optional = True


class Ernie45ReasoningParser(DeepSeekR1ReasoningParser):
    name = "ernie45"
    CONTENT_TAGS = ("<response>", "</response>")


class HunyuanA13BReasoningParser(ReasoningParser):
    name = "hunyuan_a13b"
    # the longer forms first: the newline next to a tag is the tag's, not the reasoning's
    STARTS, ENDS = ("<think>\n", "<think>"), ("\n</think>", "</think>")
    CONTENT_TAGS = ("<answer>", "</answer>")


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    name = "deepseek_v3"
    on_switch = "thinking"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    ThinkReasoningParser, DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
    GraniteReasoningParser, Glm45ReasoningParser, MistralReasoningParser,
    SeedOssReasoningParser, Step3ReasoningParser, Ernie45ReasoningParser,
    HunyuanA13BReasoningParser, DeepSeekV3ReasoningParser)}


def make_reasoning_parser(name: str | None, template_kwargs: dict[str, Any] | None = None
                          ) -> ReasoningParser | None:
    """The ``--reasoning-parser`` named ``name`` for one request (None: no split), given the
    request's chat template variables (the server's defaults merged under the request's):
    None too when they switch the model's reasoning off (``enable_thinking: false`` for
    ``qwen3`` and ``glm45``; ``thinking`` not true for ``deepseek_v3``).

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
    if cls.on_switch and not (template_kwargs or {}).get(cls.on_switch):
        return None
    return cls()


def reasoning_token_ids(name: str | None, tokenizer: Any,
                        config: dict[str, str] | None = None) -> ReasoningTokenIds | None:
    """The token ids of the ``--reasoning-parser`` named ``name``'s markers
    (``reasoning_start_str`` / ``reasoning_end_str``), or of ``--reasoning-config``'s strings
    (``config``, winning over the parser's), tokenized without special tokens, as
    vLLM's ``ReasoningConfig.initialize_token_ids`` does (the end marker is also the natural
    end), which a request's ``thinking_token_budget`` is counted and ended with; None without
    a tokenizer or markers (``granite``, ``hunyuan_a13b``: vLLM's name none), or when one
    tokenizes to nothing.

    Raises:
        ValueError: for an unknown name, listing the choices.
    """
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{sorted(REASONING_PARSERS)}")
    strings = marker_strings(name, config)
    if strings is None or tokenizer is None:
        return None
    start, end = (tokenizer.encode(s, add_special_tokens=False) for s in strings)
    return ReasoningTokenIds(list(start), list(end)) if start and end else None
