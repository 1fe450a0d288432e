"""Conversations -> prompt text through the model's (or the caller's) chat template.

Shared by ``LLM.chat``, ``/v1/chat/completions`` and ``/tokenize``, so a conversation renders
the same everywhere. Messages are normalized as OpenAI clients send them and as vLLM renders
them ("string" content format):

* ``content`` must be sent, except on an assistant turn that calls tools, and a tool turn
  needs ``tool_call_id`` (OpenAI's rules, ``check_message_fields``); null (an assistant turn that only calls tools, or any empty
  turn) becomes ``""``;
* a list of content parts becomes the ``"\\n"``-joined text of its ``text`` parts (``refusal``
  parts of assistant turns count as text); ``image_url`` parts, for a model that takes images
  (the caller passes its ``image_placeholder``), become that placeholder text, one line per
  image before the text (``detail`` other than ``"auto"`` is refused); any other part is
  refused. A template that loops over a message's
  content itself (Qwen2-VL's; found in its Jinja syntax tree, as vLLM does) gets the parts
  instead, images as ``{"type": "image"}``, so it places them as the model was trained;
  ``image_urls`` lists the images in prompt order either way;
* an assistant's ``tool_calls[].function.arguments`` given as JSON text (OpenAI's form) is
  parsed into an object, as templates that write ``arguments | tojson`` expect.

Options are honoured or refused, never dropped: ``continue_final_message`` (the reply continues
the last, assistant, message; exclusive with ``add_generation_prompt``), ``chat_template`` (a
Jinja template replacing the model's; rendered in transformers' sandbox), ``documents``,
``tools`` and an assistant's ``tool_calls`` (refused when the template never reads them;
callers that can inject them as text do so first), ``chat_template_kwargs`` (extra template
variables; names of ``apply_chat_template``'s own parameters are refused).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.text_checks import find_lone_surrogate

__all__ = ["ChatTemplateError", "NoChatTemplateError", "check_message_fields", "image_urls",
           "normalize_conversation", "render_chat", "syntax_error_message"]

# A message's keys in OpenAI's API and vLLM's (passed to the template whether it reads them
# or not, as vLLM does: clients send them routinely); any other key must be read by the
# template, or it is refused (``_check_other_keys_read``).
_MESSAGE_KEYS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio",
    "function_call", "annotations", "reasoning_content", "reasoning"})
_MAX_OTHER_KEYS = 8  # distinct other keys a conversation may use (one extra render each)
_TEXT_PARTS = {"text", "refusal"}
_IMAGE_PARTS = {"image_url"}
# apply_chat_template's own parameters: never template variables.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


class ChatTemplateError(ValueError):
    """A conversation or option that cannot be rendered; ``param`` names the field at fault
    (``messages.2.content``, ``continue_final_message``, ...), ``code`` the OpenAI error code
    the server answers with."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template and the caller gave none."""


def normalize_conversation(messages: Sequence[Any], image_placeholder: str | None = None,
                           content_parts: bool = False) -> list[dict[str, Any]]:
    """Messages as the template sees them (see the module docstring); inputs are not changed.

    Args:
        messages: OpenAI-style message dicts.
        image_placeholder: the text standing for one image (None: images are refused).
        content_parts: keep list content as parts (for templates that loop over them).

    Raises:
        ChatTemplateError: for an empty list, a message that is not a dict with a string
            ``role``, an unsupported content part (any image when ``image_placeholder`` is
            None), or text with a lone surrogate.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("a conversation must be a non-empty list of messages",
                                "messages")
    found = find_lone_surrogate(list(messages), "messages")
    if found is not None:
        raise ChatTemplateError(f"{found[0]} {found[1]}", found[0])
    return [_normalize_message(m, i, image_placeholder, content_parts)
            for i, m in enumerate(messages)]


def image_urls(messages: Sequence[Any]) -> list[tuple[str, Any]]:
    """``(field path, url)`` of every ``image_url`` part, in prompt order (messages in
    order, parts in order). Call after ``normalize_conversation`` accepted the messages."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                out.append((f"messages.{i}.content.{j}.image_url", url))
    return out


def _normalize_message(message: Any, i: int, image_placeholder: str | None,
                       content_parts: bool) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"message {i} must be a dict with a string 'role'",
                                f"messages.{i}")
    check_message_fields(message, i)
    out = dict(message)
    content = message.get("content")
    if content_parts and isinstance(content, list):
        out["content"] = _content_parts(content, i, image_placeholder)
    else:
        out["content"] = _content_text(content, i, image_placeholder)
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_parsed_arguments(_without_index(c, i, j))
                             for j, c in enumerate(message["tool_calls"])]
    return out


def check_message_fields(message: Mapping[str, Any], i: int) -> None:
    """OpenAI's per-role rules for message ``i``'s fields, the same for ``LLM.chat`` and the
    server (which passes the fields its client sent): ``content`` is sent on every message
    (null counts: it renders as empty text) except an assistant message calling tools
    (``tool_calls``, or the older ``function_call``); a tool message has ``tool_call_id`` (the
    call its result answers); ``tool_calls`` is on assistant messages only and
    ``tool_call_id`` on tool messages only (a template reads them nowhere else).

    Args:
        message: the message's keys as sent (a None value counts as sent for ``content``,
            as unset for the others), ``role`` a string.
        i: the message's position in the conversation.

    Raises:
        ChatTemplateError: naming ``messages.<i>.content`` or ``messages.<i>.tool_call_id``
            when missing (code ``missing_required_parameter``), or ``messages.<i>.tool_calls``
            / ``messages.<i>.tool_call_id`` on another role (code ``invalid_value``).
    """
    role = message.get("role")
    calls = bool(message.get("tool_calls")) or message.get("function_call") is not None
    if "content" not in message and not (role == "assistant" and calls):
        need = "assistant messages without tool_calls" if role == "assistant" else \
            f"{role} messages"
        raise ChatTemplateError(f"messages.{i}.content: a required field for {need} (null "
                                "for no text), not sent", f"messages.{i}.content",
                                "missing_required_parameter")
    if role == "tool" and message.get("tool_call_id") is None:
        raise ChatTemplateError(f"messages.{i}.tool_call_id: a required field for tool "
                                "messages (the id of the call this result answers), not sent",
                                f"messages.{i}.tool_call_id", "missing_required_parameter")
    for name, owner in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
        if message.get(name) is not None and role != owner:
            raise ChatTemplateError(f"messages.{i}.{name} is for {owner} messages only (this "
                                    f"is a {role} message)", f"messages.{i}.{name}")


def _without_index(call: Any, i: int, j: int) -> Any:
    """Tool call ``j`` of message ``i`` without its ``index`` key (see
    :func:`check_call_index`).

    Raises:
        ChatTemplateError: if ``index`` is given and is not ``j``.
    """
    if not isinstance(call, dict) or "index" not in call:
        return call
    check_call_index(call["index"], i, j)
    return {k: v for k, v in call.items() if k != "index"}


def check_call_index(index: Any, i: int, j: int) -> None:
    """A tool call's ``index``, the position a streamed delta gave the call (clients echo it
    back), must be ``j``, its position in message ``i``'s ``tool_calls`` (or absent: None).

    Raises:
        ChatTemplateError: naming ``messages.i.tool_calls.j.index`` otherwise.
    """
    if index is not None and index != j:
        raise ChatTemplateError(f"message {i}: tool call {j} has index {index}; a call's "
                                "index is its position in tool_calls",
                                f"messages.{i}.tool_calls.{j}.index")


def _content_text(content: Any, i: int, image_placeholder: str | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"message {i}: content must be a string, a list of content "
                                "parts or null", f"messages.{i}.content")
    images, texts = [], []
    for j, part in enumerate(content):
        kind, text = _part(part, i, j, image_placeholder)
        (images if kind in _IMAGE_PARTS else texts).append(text)
    return "\n".join(images + texts)


def _content_parts(content: list, i: int, image_placeholder: str | None) -> list[dict]:
    parts = []
    for j, part in enumerate(content):
        kind, text = _part(part, i, j, image_placeholder)
        parts.append({"type": "image"} if kind in _IMAGE_PARTS else
                     {"type": "text", "text": text})
    return parts


def _part(part: Any, i: int, j: int, image_placeholder: str | None) -> tuple[str, str]:
    """(type, text) of one content part; an image's text is the placeholder. A part holds
    ``type`` and its type's payload only (another non-null key would go unread: a
    ChatTemplateError naming it, as the HTTP schema refuses it)."""
    kind = part.get("type") if isinstance(part, dict) else None
    other = next((k for k, v in part.items() if k not in ("type", kind) and v is not None),
                 None) if isinstance(kind, str) else None
    if other is not None and kind in _TEXT_PARTS | _IMAGE_PARTS:
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} carries "
                                f"{kind} only, not {other!r}",
                                f"messages.{i}.content.{j}.{other}", "unknown_parameter")
    if kind in _IMAGE_PARTS and image_placeholder is not None:
        image = part.get("image_url")
        if not isinstance(image.get("url") if isinstance(image, dict) else image, str):
            raise ChatTemplateError(f"message {i}: content part {j} needs image_url.url",
                                    f"messages.{i}.content.{j}.image_url")
        detail = image.get("detail") if isinstance(image, dict) else None
        if detail not in (None, "auto"):  # honoured or refused, never ignored
            raise ChatTemplateError(f"image_url.detail={detail!r} is not supported: the "
                                    "model's image processor chooses the resolution (use "
                                    "'auto' or leave it out)",
                                    f"messages.{i}.content.{j}.image_url.detail",
                                    "unsupported_value")
        return kind, image_placeholder
    text = part.get(kind) if kind in _TEXT_PARTS else None
    if kind in _TEXT_PARTS and not isinstance(text, str):
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} needs "
                                f"{kind} (a string)", f"messages.{i}.content.{j}.{kind}")
    if not isinstance(text, str):
        what = "text and image_url" if image_placeholder is not None else \
            "text only: this model does not take images"
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} is not "
                                f"supported ({what})", f"messages.{i}.content.{j}")
    return kind, text


def loops_over_content(template: str) -> bool:
    """Whether a Jinja chat template iterates over a message's ``content`` (then it renders
    content parts itself; vLLM's "openai" content format). False for a template that does
    not parse (rendering reports that)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and \
                it.arg.value == "content":
            return True
    return False


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose ``function.arguments`` JSON text is parsed (left alone otherwise)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def render_chat(tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                image_placeholder: str | None = None,
                default_template: str | None = None) -> str:
    """Render a conversation to prompt text.

    Args:
        tokenizer: a transformers tokenizer (its ``chat_template`` unless ``chat_template``).
        messages: OpenAI-style message dicts (normalized here).
        add_generation_prompt: end with the header of a new assistant turn.
        continue_final_message: leave the last (assistant) message open for the reply.
        chat_template: a Jinja template to use instead of the model's.
        tools / documents: the template's ``tools`` / ``documents`` variables.
        template_kwargs: further template variables.
        image_placeholder: the text standing for one image, for a model that takes images
            (None: ``image_url`` parts are refused).
        default_template: a Jinja template replacing the model's, below ``chat_template``
            (a server's ``--chat-template``, checked when it started): its errors are the
            conversation's (param ``messages``), as the model's are.

    Raises:
        NoChatTemplateError: when neither the model nor the caller has a template.
        ChatTemplateError: for a bad message or option (see the module docstring), one the
            template fails on, or a template with a Jinja syntax error (naming the line, and
            whether it is the model's template, the default or the caller's).
    """
    import jinja2

    if chat_template is not None and (not isinstance(chat_template, str)
                                      or not chat_template.strip()):
        raise ChatTemplateError("chat_template must be a non-empty Jinja template string",
                                "chat_template")
    source = "caller" if chat_template is not None else \
        "default" if default_template is not None else "model"
    template = {"caller": chat_template, "default": default_template,
                "model": getattr(tokenizer, "chat_template", None)}[source]
    conversation = normalize_conversation(
        messages, image_placeholder,
        content_parts=isinstance(template, str) and loops_over_content(template))
    if not template:
        raise NoChatTemplateError("this model has no chat template", "messages")
    kwargs = _template_kwargs(conversation, template, add_generation_prompt,
                              continue_final_message, tools, documents, template_kwargs)
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template,
                                             tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja and transformers errors: bad input
        param = "chat_template" if source == "caller" else "messages"
        if isinstance(e, jinja2.TemplateSyntaxError):  # the template is broken, not the messages
            raise ChatTemplateError(syntax_error_message(e, source), param) from None
        raise ChatTemplateError(f"the chat template cannot render these messages: "
                                f"{type(e).__name__}: {e}", param) from None
    _check_other_keys_read(tokenizer, conversation, template, kwargs, text)
    return text


def syntax_error_message(error: Any, source: str) -> str:
    """The error for a template that does not compile (a ``jinja2.TemplateSyntaxError``),
    naming whose template it is (``source``: "model", "default" for a server's
    ``--chat-template``, "caller" for a ``chat_template`` argument) and where it breaks."""
    where = f"(line {error.lineno}: {error.message})"
    if source == "model":
        return (f"the model's chat template is not a valid Jinja template {where}, so no "
                "conversation can be rendered; fix the model's chat_template.jinja (or the "
                "chat_template in its tokenizer_config.json)")
    if source == "default":
        return f"the server's --chat-template is not a valid Jinja template {where}"
    return f"chat_template is not a valid Jinja template {where}"


def _check_other_keys_read(tokenizer: Any, conversation: list[dict[str, Any]], template: str,
                           kwargs: dict[str, Any], text: str) -> None:
    """Refuse a message key outside ``_MESSAGE_KEYS`` (a misspelling such as
    ``tool_call_idd``, or a key of another API) that the template does not read: rendered
    without it in every message, the conversation gives the same ``text``. A template that
    fails without it reads it. At most ``_MAX_OTHER_KEYS`` distinct such keys (one render
    each).

    Raises:
        ChatTemplateError: naming ``messages.<i>.<key>`` of the first message carrying the
            key (code ``unknown_parameter``).
    """
    keys = list(dict.fromkeys(k for m in conversation for k, v in m.items()
                              if k not in _MESSAGE_KEYS and v is not None))
    for n, key in enumerate(keys):
        first = next(i for i, m in enumerate(conversation) if m.get(key) is not None)
        param = f"messages.{first}.{key}"
        if n == _MAX_OTHER_KEYS:
            raise ChatTemplateError(f"{param}: a conversation may use at most "
                                    f"{_MAX_OTHER_KEYS} message keys beyond OpenAI's", param,
                                    "unknown_parameter")
        without = [{k: v for k, v in m.items() if k != key} for m in conversation]
        try:
            same = tokenizer.apply_chat_template(without, chat_template=template,
                                                 tokenize=False, **kwargs) == text
        except Exception:  # noqa: BLE001 - it fails without the key: it reads it
            same = False
        if same:
            raise ChatTemplateError(f"Unrecognized request argument supplied: {param} (not "
                                    "an OpenAI message field, and this chat template does "
                                    "not read it)", param, "unknown_parameter")


def _template_kwargs(conversation: list[dict[str, Any]], template: Any,
                     add_generation_prompt: bool, continue_final_message: bool,
                     tools: list | None, documents: list | None,
                     extra: dict[str, Any] | None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments. Raises ChatTemplateError for a bad option."""
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both "
                                "be true", "continue_final_message")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ChatTemplateError("continue_final_message needs the last message to be an "
                                "assistant message", "continue_final_message")
    for name, value in (("tools", tools), ("documents", documents)):
        if value and name not in str(template):
            raise ChatTemplateError(f"this chat template does not use {name}", name)
    with_calls = [i for i, m in enumerate(conversation) if m.get("tool_calls")]
    if with_calls and "tool_calls" not in str(template):
        raise ChatTemplateError("this chat template does not render an assistant message's "
                                "tool_calls", f"messages.{with_calls[0]}.tool_calls")
    if extra is not None and not isinstance(extra, dict):
        raise ChatTemplateError("chat_template_kwargs must be a dict of template variables, "
                                f"got {type(extra).__name__}", "chat_template_kwargs")
    extra = dict(extra or {})
    reserved = sorted(_RESERVED_KWARGS & set(extra))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}: they are "
                                "parameters of the renderer (use the request fields)",
                                f"chat_template_kwargs.{reserved[0]}")
    found = find_lone_surrogate(extra, "chat_template_kwargs")
    if found is not None:
        raise ChatTemplateError(f"{found[0]} {found[1]}", found[0])
    return {**extra, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "tools": tools or None,
            "documents": documents or None}
