"""Conversations -> prompt text through the model's (or the caller's) chat template.

Shared by ``LLM.chat``, ``/v1/chat/completions`` and ``/tokenize``, so a conversation renders
the same everywhere. The messages are checked and normalized first (``messages.py``:
``content`` required and null as ``""``, content parts joined, or kept as parts for a template
that loops over a message's content, images as the model's placeholder, tool-call arguments
parsed); ``ChatTemplateError``, defined there, is every error of both. A developer message
is a system message for a template that has no developer role (vLLM's rule,
``chat_messages.developer_as_system``).

Options are honoured or refused, never dropped: ``continue_final_message`` (the reply continues
the last message, whatever its role, as transformers' ``apply_chat_template`` and vLLM
continue it; exclusive with ``add_generation_prompt``), ``chat_template`` (a
Jinja template replacing the model's; rendered in transformers' sandbox), ``documents``,
``tools`` and an assistant's ``tool_calls`` (refused when the template never reads them;
callers that can inject them as text do so first), ``chat_template_kwargs`` (extra template
variables; names of ``apply_chat_template``'s own parameters are refused, and so is a name
the template never reads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.chat.messages import ChatTemplateError, developer_as_system, normalize_conversation
from kvflow.utils.text_checks import find_lone_surrogate

__all__ = ["ChatTemplateError", "NoChatTemplateError", "check_default_template_kwargs",
           "loops_over_content", "render_chat", "syntax_error_message",
           "template_text", "template_variables"]

# A message's keys in OpenAI's API and vLLM's (passed to the template whether it reads them
# or not, as vLLM does: clients send them routinely); any other key must be read by the
# template, or it is refused (``_check_other_keys_read``).
_MESSAGE_KEYS = frozenset({
    "role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio",
    "function_call", "annotations", "reasoning_content", "reasoning"})
_MAX_OTHER_KEYS = 8  # distinct other keys a conversation may use (one extra render each)
# apply_chat_template's own parameters: never template variables.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


# Offline and command-line callers' error (the server words its own: chat_conversation.py)
_NO_TEMPLATE = ("this model has no chat template: give one, as chat_template (the Jinja text) "
                "or --chat-template FILE on the command line (kvflow generate --chat, serve, "
                "run-batch)")


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template and the caller gave none."""


def loops_over_content(template: str) -> bool:
    """Whether a Jinja chat template iterates over a message's ``content`` (then it renders
    content parts itself; vLLM's "openai" content format), directly or through filters
    (``message['content'] | selectattr('type', 'equalto', 'image')``, llava-hf's templates).
    Parsed with transformers' environment (its ``{% generation %}`` tag). False for a
    template that does not parse (rendering reports that)."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _jinja_environment(template).parse(template)
    except jinja2.TemplateError:
        return False
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and \
                it.arg.value == "content":
            return True
    return False


def _jinja_environment(template: str) -> Any:
    """transformers' chat-template Jinja environment (loop controls, ``{% generation %}``);
    a plain one with loop controls when that cannot be built (a syntax error, another
    transformers version)."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        return _compile_jinja_template(template).environment
    except Exception:  # noqa: BLE001 - a syntax error, or another transformers version
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


def template_variables(template: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads from its context (``messages``,
    ``enable_thinking``, ...), found statically; None when it does not parse."""
    return _template_variables(template)


@functools.lru_cache(maxsize=16)
def _template_variables(template: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads from its context (``messages``,
    ``add_generation_prompt``, ``enable_thinking``, ...), found statically (as vLLM finds
    which ``chat_template_kwargs`` to pass); None when the template does not parse
    (rendering reports the syntax error). Parsed with transformers' environment, which knows
    its ``{% generation %}`` tag."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(
            _jinja_environment(template).parse(template)))
    except jinja2.TemplateError:
        return None


def render_chat(tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                documents: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None,
                image_placeholder: str | None = None,
                default_template: str | None = None,
                on_unread_kwargs: Callable[[list[str]], None] | None = None,
                default_kwargs: dict[str, Any] | None = None,
                content_format: str = "auto",
                video_placeholder: str | None = None) -> str:
    """Render a conversation to prompt text.

    Args:
        tokenizer: a transformers tokenizer (its ``chat_template`` unless ``chat_template``).
        messages: OpenAI-style message dicts (normalized here).
        add_generation_prompt: end with the header of a new assistant turn.
        continue_final_message: leave the last message (of any role) open for the reply.
        chat_template: a Jinja template to use instead of the model's.
        tools / documents: the template's ``tools`` / ``documents`` variables.
        template_kwargs: further template variables.
        image_placeholder: the text standing for one image, for a model that takes images
            (None: ``image_url`` parts are refused).
        default_template: a Jinja template replacing the model's, below ``chat_template``
            (a server's ``--chat-template``, checked when it started): its errors are the
            conversation's (param ``messages``), as the model's are.
        on_unread_kwargs: None: a ``template_kwargs`` key the template never reads is a
            ChatTemplateError; else such keys are dropped and this is called with their
            names, sorted (a server started with ``--ignore-unknown-fields`` logs them).
        default_kwargs: template variables under ``template_kwargs`` (a server's
            ``--default-chat-template-kwargs``): a key ``template_kwargs`` sets wins, and a
            key the template never reads is left out (it is no request's mistake).
        content_format: how a message's content reaches the template: ``auto`` (as a list
            of parts for a template that loops over a message's content, else as one
            string), ``string`` (always one string) or ``openai`` (always a list of parts);
            vLLM's ``--chat-template-content-format``.
        video_placeholder: the text standing for one video, for a model that takes videos
            (None: ``video_url`` parts are refused).

    Raises:
        NoChatTemplateError: when neither the model nor the caller has a template.
        ChatTemplateError: for a bad message or option (see the module docstring), one the
            template fails on, or a template with a Jinja syntax error (naming the line, and
            whether it is the model's template, the default or the caller's).
    """
    source, template = _pick_template(tokenizer, chat_template, default_template, tools)
    conversation = normalize_conversation(
        messages, image_placeholder,
        content_parts={"string": False, "openai": True}.get(
            content_format, isinstance(template, str) and loops_over_content(template)),
        video_placeholder=video_placeholder)
    if not template:
        raise NoChatTemplateError(_NO_TEMPLATE, "messages")
    kwargs = _template_kwargs(conversation, template, add_generation_prompt,
                              continue_final_message, tools, documents, template_kwargs,
                              on_unread_kwargs)
    kwargs = {**_read_defaults(template, default_kwargs, kwargs), **kwargs}
    # the checks above and below name messages by their index as sent; the template gets
    # developers as systems
    text = _apply_template(tokenizer, developer_as_system(conversation, template), template,
                           source, kwargs)
    _check_other_keys_read(tokenizer, conversation, template, kwargs, text)
    return text


def template_text(tokenizer: Any, chat_template: str | None = None,
                  default_template: str | None = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The Jinja text :func:`render_chat` renders with for these arguments (one of a
    tokenizer's named templates picked as it picks them), for callers that look into it
    first (which variables it mentions: ``chat_tools_text.tools_as_text``); ``""`` for none,
    or for a caller's template ``render_chat`` refuses (it reports that)."""
    try:
        template = _pick_template(tokenizer, chat_template, default_template, tools)[1]
    except ChatTemplateError:
        return ""
    return template if isinstance(template, str) else ""


def _pick_template(tokenizer: Any, chat_template: str | None,
                   default_template: str | None,
                   tools: list | None = None) -> tuple[str, Any]:
    """``(source, template)``: the caller's ``chat_template`` (checked), else the server's
    ``default_template``, else the tokenizer's own (possibly None); ``source`` is
    ``"caller"``, ``"default"`` or ``"model"``. A tokenizer holding named templates (a dict:
    a tokenizer_config.json list, a GGUF's ``tokenizer.chat_template.<name>``) gives the one
    transformers' ``get_chat_template`` picks: ``tool_use`` when ``tools`` are given and it
    has one, else ``default``; a caller's ``chat_template`` that is one of their names
    picks that one (transformers' and vLLM's rule: ``chat_template="tool_use"``). Raises
    ChatTemplateError for a caller's template that is not Jinja text, or named templates
    without a ``default`` (naming them)."""
    named = getattr(tokenizer, "chat_template", None)
    if isinstance(named, dict) and isinstance(chat_template, str) and chat_template in named:
        return "model", named[chat_template]
    if chat_template is not None:
        _check_caller_template(chat_template)
    source = "caller" if chat_template is not None else \
        "default" if default_template is not None else "model"
    template = {"caller": chat_template, "default": default_template,
                "model": getattr(tokenizer, "chat_template", None)}[source]
    if isinstance(template, dict):
        name = "tool_use" if tools is not None and "tool_use" in template else "default"
        if name not in template:
            raise ChatTemplateError(f"this model has named chat templates {sorted(template)} "
                                    "and no 'default' one; pass chat_template", "chat_template")
        template = template[name]
    return source, template


def _apply_template(tokenizer: Any, conversation: list[dict[str, Any]], template: str,
                    source: str, kwargs: dict[str, Any]) -> str:
    """The prompt text ``tokenizer.apply_chat_template`` renders; any error it raises is a
    ChatTemplateError blaming the caller's template (param ``chat_template``) or, for the
    model's and the default template, the messages."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template,
                                             tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja and transformers errors: bad input
        param = "chat_template" if source == "caller" else "messages"
        if isinstance(e, jinja2.TemplateSyntaxError):  # the template is broken, not the messages
            raise ChatTemplateError(syntax_error_message(e, source), param) from None
        raise ChatTemplateError(f"the chat template cannot render these messages: "
                                f"{type(e).__name__}: {e}", param) from None


def _check_caller_template(chat_template: Any) -> None:
    """Raises ChatTemplateError (param ``chat_template``) unless ``chat_template`` is Jinja
    text holding markup: text without any renders the same prompt for every conversation,
    most likely a file's name passed where its text belongs (``LLM.chat(chat_template=
    "chat.jinja")``, as ``--chat-template`` takes it)."""
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise ChatTemplateError("chat_template must be a non-empty Jinja template string",
                                "chat_template")
    if not any(marker in chat_template for marker in ("{%", "{{", "{#")):
        shown = chat_template if len(chat_template) <= 80 else chat_template[:77] + "..."
        raise ChatTemplateError(
            f"chat_template must be the Jinja template's text, holding {{%, {{{{ or {{#; got "
            f"text without any ({shown!r}), which would render the same prompt for every "
            "conversation (for a template file, pass its text: "
            "kvflow.chat_template_source.load_chat_template(path) reads and checks it)",
            "chat_template")


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
        without = developer_as_system(
            [{k: v for k, v in m.items() if k != key} for m in conversation], template)
        try:
            same = tokenizer.apply_chat_template(without, chat_template=template,
                                                 tokenize=False, **kwargs) == text
        except Exception:  # noqa: BLE001 - it fails without the key: it reads it
            same = False
        if same:
            raise ChatTemplateError(f"Unrecognized request argument supplied: {param} (not "
                                    "an OpenAI message field, and this chat template does "
                                    "not read it)", param, "unknown_parameter")


def check_default_template_kwargs(defaults: dict[str, Any] | None) -> None:
    """Check a server's ``--default-chat-template-kwargs`` (template variables of every
    conversation) at start-up.

    Raises:
        ValueError: for a name of ``apply_chat_template``'s own parameters (``tools``,
            ``tokenize``, ...), which a template variable cannot be.
    """
    reserved = sorted(_RESERVED_KWARGS & set(defaults or {}))
    if reserved:
        raise ValueError(f"--default-chat-template-kwargs may not set {reserved}: they are "
                         "parameters of the renderer, not template variables")


def _read_defaults(template: Any, defaults: dict[str, Any] | None,
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``defaults`` that ``kwargs`` (the request's) does not set and the
    template reads (every key when the template does not parse)."""
    if not defaults:
        return {}
    read = _template_variables(template) if isinstance(template, str) else None
    return {k: v for k, v in defaults.items()
            if k not in kwargs and (read is None or k in read)}


def _template_kwargs(conversation: list[dict[str, Any]], template: Any,
                     add_generation_prompt: bool, continue_final_message: bool,
                     tools: list | None, documents: list | None,
                     extra: dict[str, Any] | None,
                     on_unread: Callable[[list[str]], None] | None) -> dict[str, Any]:
    """apply_chat_template's keyword arguments (``on_unread``: see ``render_chat``'s
    ``on_unread_kwargs``). Raises ChatTemplateError for a bad option."""
    for name, flag in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):  # "no" would read as true
            raise ChatTemplateError(f"{name} must be true or false, got {flag!r:.40}", name)
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both "
                                "be true; add_generation_prompt defaults to true, so send it "
                                "as false with continue_final_message",
                                "continue_final_message")
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
    read = _template_variables(template) if isinstance(template, str) else None
    unread = [] if read is None else sorted(set(extra) - read)
    if unread and on_unread is None:
        raise ChatTemplateError(f"this chat template does not use chat_template_kwargs."
                                f"{unread[0]} (it reads no variable of that name): leave it "
                                "out for this model (a server started with "
                                "--ignore-unknown-fields drops such keys, as vLLM does)",
                                f"chat_template_kwargs.{unread[0]}")
    if unread:
        on_unread(unread)
        extra = {k: v for k, v in extra.items() if k not in unread}
    return {**extra, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "tools": tools or None,
            "documents": documents or None}
