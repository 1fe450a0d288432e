"""/tokenize and /detokenize (vLLM's endpoints): a prompt or a chat conversation to token ids,
and token ids back to text. ``api_server.build_app`` adds them to the app; they need the API key
when one is set.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from kvflow.entrypoints.chat_options import ChatOptions
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import off_loop
from kvflow.entrypoints.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvflow.entrypoints.serving_base import body_size
from kvflow.entrypoints.serving_chat import OpenAIServingChat
from kvflow.entrypoints.serving_checks import check_token_ids
from kvflow.entrypoints.structured_requests import (
    RequestFieldError,
    check_tools_off_loop,
    tool_choice_mode,
)


def add_token_routes(app: FastAPI) -> None:
    """/tokenize and /detokenize."""
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, raw: Request) -> TokenizeResponse:
        """Token ids of a prompt or of a chat conversation (rendered with the chat template).

        Raises:
            OpenAIError: 404 if ``model`` names another model; 400 unless exactly one of
                ``prompt`` and ``messages`` is given, when the chat template cannot render
                the messages, or for an image that cannot be used (a vision-language model's
                image placeholders are expanded, so ``count`` is what generation would use),
                or a field kvflow does not declare (``UnknownFields.check``).
        """
        raw.app.state.unknown_fields.check(req, "/tokenize")
        chat = raw.app.state.chat
        chat.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt",
                              code="missing_required_parameter" if req.messages is None
                              else "invalid_value")
        ids = await _tokenize_ids(chat, req, raw)
        strs = chat.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=chat.engine.max_model_len,
                                tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
        """The text of a list of token ids.

        Raises:
            OpenAIError: 404 if ``model`` names another model; 400 for a token id outside
                ``[0, vocab_size)`` (``param`` ``tokens.N``, N its index) or a field kvflow
                does not declare.
        """
        raw.app.state.unknown_fields.check(req, "/detokenize")
        chat = raw.app.state.chat
        chat.check_model(req.model)
        check_token_ids(req.tokens, chat.engine.vocab_size, "tokens")
        tokenizer = chat.tokenizer
        return DetokenizeResponse(prompt=await off_loop(len(req.tokens), tokenizer.decode,
                                                        req.tokens))


async def _tokenize_ids(chat: OpenAIServingChat, req: TokenizeRequest,
                        raw: Request) -> list[int]:
    """/tokenize's token ids: the chat conversation rendered with the chat template (image
    placeholders expanded), else the prompt encoded (off the event loop when long); for an
    embedding model, the prompt as /v1/embeddings tokenizes it (after the model's default
    sentence-transformers prompt, lower-cased when its config says ``do_lower_case``)."""
    if req.messages is not None:
        try:
            mode = tool_choice_mode(req)
            await check_tools_off_loop(req.tools, compile_schemas=mode in ("required",
                                                                           "named"))  # as chat
            tools = chat.template_tools(req, mode)  # as chat renders them
        except RequestFieldError as e:
            raise OpenAIError(str(e), param=e.param, code="invalid_value") from None
        text, ids = await chat.render(req.messages, ChatOptions.of(req), tools,
                                      check_length=False, size=body_size(raw),
                                      tool_instructions=mode is not None)
        return (await chat.attach_images(req.messages, text, ids)).token_ids  # expanded
    _refuse_chat_options(req)
    special = req.add_special_tokens is not False
    tokenizer = chat.tokenizer
    # an embedding model's text as /v1/embeddings feeds it (default prompt, lower-casing)
    text = chat.engine.processor.pooling_text(req.prompt)
    return await off_loop(len(text), lambda: tokenizer.encode(text, add_special_tokens=special))


# /tokenize's fields that only a conversation uses (the chat template renders them)
CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "tools", "tool_choice", "documents")


def _refuse_chat_options(req: TokenizeRequest) -> None:
    """A /tokenize ``prompt`` is encoded as it is, with no chat template: a chat option set to
    anything but its default would be ignored, so it is refused.

    Raises:
        OpenAIError: 400 naming the first such field (code ``invalid_value``).
    """
    for name in CHAT_ONLY_FIELDS:
        if getattr(req, name) != TokenizeRequest.model_fields[name].default:
            raise OpenAIError(f"{name} applies to messages only: a prompt is tokenized as "
                              "it is, with no chat template", param=name,
                              code="invalid_value")
