"""A chat request's conversation before the template renders it: the fields of its
messages checked (the tools and tool calls written as text for a template that cannot read
them: ``kvflow.chat.tools_text``, shared with ``LLM.chat``); and the 400 for a model without a
template."""

from __future__ import annotations

from kvflow.chat.messages import ChatTemplateError, check_call_index, check_message_fields
from kvflow.chat.tool_calls import check_tool_call_ids
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatMessage


def check_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's per-role rules (``content`` sent unless an assistant turn calls tools,
    ``tool_call_id`` on every tool turn and only there, ``tool_calls`` only on assistant
    turns: ``chat_messages.check_message_fields``, the check ``LLM.chat`` runs, here on the
    fields the client sent) and each call's ``index`` its position (checked here too, before
    calls a template cannot read become text), and each tool turn's ``tool_call_id`` the id
    of an earlier assistant turn's call (``chat_tool_calls.check_tool_call_ids``, as
    ``LLM.chat``), and ``parsed`` only on assistant turns. Raises OpenAIError 400 naming the
    field otherwise."""
    try:
        for i, message in enumerate(messages):
            check_message_fields({k: getattr(message, k) for k in message.model_fields_set}, i)
            if message.parsed is not None and message.role != "assistant":
                raise ChatTemplateError(f"messages.{i}.parsed is for assistant messages only "
                                        f"(the openai client's reading of a reply; this is a "
                                        f"{message.role} message)", f"messages.{i}.parsed")
            for j, call in enumerate(message.tool_calls or []):
                check_call_index(call.index, i, j)
        check_tool_call_ids((m.role, [c.id for c in m.tool_calls or ()], m.tool_call_id)
                            for m in messages)
    except ChatTemplateError as e:
        raise OpenAIError(str(e), param=e.param, code=e.code) from None


def no_template_error(task: str, request_templates: bool,
                      command: str = "kvflow serve") -> OpenAIError:
    """The 400 (param ``messages``, code ``no_chat_template``) for a conversation on a model
    without a chat template, saying what this server takes instead: a request's
    ``chat_template`` when it trusts them (``request_templates``), else ``--chat-template``
    of ``command`` (the one that runs it: ``kvflow serve`` or ``kvflow run-batch``),
    or the plain-text routes of the server's ``task`` (a pooling server's inputs, else
    /v1/completions)."""
    plain = {"generate": "use /v1/completions with a plain prompt",
             "embed": "send the text as /tokenize's prompt or /v1/embeddings' (/pooling's) "
                      "input"}.get(task, "send the text as /tokenize's prompt or /pooling's "
                                         "input")
    how = "send one in the request's chat_template field" if request_templates else \
        f"the server needs one ({command} --chat-template FILE)"
    return OpenAIError(f"this model has no chat template: {how}, or {plain}",
                       param="messages", code="no_chat_template")
