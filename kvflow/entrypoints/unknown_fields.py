"""Request-body fields kvflow does not declare. By default each is a 400 naming it (code
``unknown_parameter``), as the OpenAI API answers "Unrecognized request argument supplied", so
that a misspelled field (``max_token``) is never silently dropped; the OpenAI and vLLM fields
that would change the reply (``UNSUPPORTED``) get a 400 of their own saying what to do instead
(code ``unsupported_parameter``; null and the ``HARMLESS`` values pass). With
``--ignore-unknown-fields`` the other unknown fields are ignored, as vLLM ignores them, and
logged once per field name for the whole server, whichever endpoint they come to
(``UnknownFieldLog``, which remembers the last ``MAX_REMEMBERED_NAMES`` names: bounded). A field kvflow declares is honoured or rejected with a 400 naming it
(see ``protocol``); ``UnknownFields`` is the one object every endpoint asks."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import RequestBody

logger = logging.getLogger(__name__)

# OpenAI (chat) and vLLM (both endpoints) request fields kvflow does not implement and that
# change what the reply holds: field -> what to do instead.
UNSUPPORTED = {
    "early_stopping": "kvflow's beam search, as vLLM's, runs every beam to EOS or "
                      "max_tokens (send false or leave it out)",
    # vLLM v1 refuses it too: its processors are loaded per engine, not per request
    "logits_processors": "load custom logits processors when the server starts "
                         "(--logits-processors module.path:ClassName) and pass a request's "
                         "arguments to them in vllm_xargs, or use logit_bias or "
                         "structured_outputs",
    "guided_whitespace_pattern": "structured output uses xgrammar's default whitespace",
    "guided_decoding_backend": "structured output runs on xgrammar (send xgrammar or auto, "
                               "or leave it out)",
    "prompt_embeds": "send text or token ids (/v1/completions takes prompt_embeds when the "
                     "server runs with --enable-prompt-embeds)",
    "mm_processor_kwargs": "only /v1/chat/completions takes it (images and videos come in "
                           "its image_url and video_url parts)",
    "media_io_kwargs": "images are decoded as RGB with the server's limits; a video file's "
                       "frame count is the server's --media-io-kwargs",
    # declared (and honoured) on completions, chat and responses; refused elsewhere, even
    # under --ignore-unknown-fields, as a salt ignored would share the prefix cache
    "cache_salt": "only /v1/completions, /v1/chat/completions and /v1/responses take it",
    "functions": "send tools (the deprecated functions field is not read)",
    "function_call": "send tool_choice (the deprecated function_call field is not read)",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "modalities": "the reply is text only",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "only /v1/chat/completions takes it (elsewhere pass the model's "
                        "own switch in chat_template_kwargs, e.g. enable_thinking)",
    # vLLM's /v1/embeddings extensions; normalize and add_special_tokens are declared (and
    # honoured) there, these entries refuse them on the endpoints that do not take them
    "normalize": "only /v1/embeddings and /pooling take it (scores and classes use the "
                 "model's own pooling)",
    "add_special_tokens": "only /v1/completions, /v1/chat/completions, /v1/embeddings, "
                          "/pooling and /tokenize take it (other inputs are tokenized with the "
                          "tokenizer's special tokens)",
    "embed_dtype": "only /v1/embeddings and /pooling take it (with encoding_format base64 "
                   "or bytes)",
    "endianness": "only /v1/embeddings and /pooling take it (with encoding_format base64 "
                  "or bytes)",
    "priority": "only /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, "
                "/pooling, /classify, /v1/score and /v1/rerank take a priority (other requests are "
                "queued at priority 0, by client under --policy fair)",
    # vLLM 0.32's pooling requests declare it (and kvflow's honour it)
    "padding": "only /v1/embeddings, /pooling, /classify, /v1/score and /v1/rerank take it "
               "(send do_not_pad or leave it out)",
    "target_ttft_ms": "only generation requests take one (embedding requests take the "
                      "server's --target-ttft-ms)",
    "target_tpot_ms": "only generation requests generate tokens",
    # vLLM sampling fields /v1/completions and /v1/chat/completions declare (and honour):
    # refused where they are not declared rather than ignored under --ignore-unknown-fields
    "allowed_token_ids": "only /v1/completions and /v1/chat/completions take it",
    "bad_words": "only /v1/completions and /v1/chat/completions take it",
    "return_tokens_as_token_ids": "only /v1/completions and /v1/chat/completions take it",
    "truncate_prompt_tokens": "only /v1/completions, /v1/chat/completions, /v1/embeddings, "
                              "/pooling, /v1/score, /v1/rerank and /classify (/v1/classify) "
                              "take it",
    "spaces_between_special_tokens": "only /v1/completions and /v1/chat/completions take "
                                     "it",
    # vLLM 0.32 declares it on these two only: its /v1/responses drops it unread (its
    # ResponsesRequest has no such field), which here would be a budget silently not kept
    "thinking_token_budget": "only /v1/completions and /v1/chat/completions take it (vLLM "
                             "0.32's /v1/responses does not read it either): send the "
                             "conversation to /v1/chat/completions for a think-token budget",
    # vLLM's pooling and generation requests declare it; kvflow's pooling ones honour it
    "truncation_side": "only /v1/embeddings, /pooling, /classify (/v1/classify), /v1/score "
                       "and /v1/rerank take it (a generation prompt cut by "
                       "truncate_prompt_tokens keeps its last tokens: send left or leave it "
                       "out)",
    # OpenAI fields of its own models
    "verbosity": "the reply's length follows the model and max_tokens",
    # OpenAI chat fields the openai client sends (/v1/responses declares them, refusing
    # every value but null the same way: protocol/responses_api.py)
    "moderation": "kvflow runs no moderation",
    "prompt_cache_retention": "the prefix cache keeps blocks while memory allows",
    "prompt_cache_options": "every request shares the prefix cache",
    # OpenAI's chat platform fields (kvflow/entrypoints/platform_fields.py decides them on
    # chat, where they are declared): elsewhere too a value that asks for what kvflow cannot
    # do is refused, not ignored under --ignore-unknown-fields
    "store": "completions are never stored (send false or leave it out)",
    "service_tier": "every request is served on one tier (send auto or default, or leave it "
                    "out)",
    # vLLM 0.32's: they change its replies; refused (their defaults pass: HARMLESS)
    "watermarking": "kvflow does not watermark outputs (vLLM's needs a server watermark "
                    "config: send false or leave it out)",
    "ec_transfer_params": "encoder-cache disaggregation (vLLM's ECConnector) is not "
                          "supported: kvflow encodes a request's images itself",
    "routed_experts_prompt_start": "kvflow does not return the routed experts (vLLM's "
                                   "--enable-return-routed-experts): send 0 or leave it out",
}


# vLLM 0.32's fields above: the values that ask for nothing (its defaults)
_VLLM_032_HARMLESS = {"watermarking": [False], "routed_experts_prompt_start": [0]}

# vLLM 0.32 fields that change nothing in its replies on the endpoints kvflow serves: unknown
# fields still (a 400 naming them, ignored under --ignore-unknown-fields as vLLM ignores them
# there), the 400 saying why kvflow does not take them
UNREAD = {
    **{name: "vLLM 0.32 reads it on its /v1/completions/render and "
             "/v1/chat/completions/render endpoints only (its generation endpoints ignore "
             "it), and kvflow has no render endpoints (/tokenize gives a prompt's token ids)"
       for name in ("return_token_offsets", "mm_payload", "return_mm_kwargs")},
}

# Values of an UNSUPPORTED field that ask for nothing kvflow does not do.
HARMLESS = {**_VLLM_032_HARMLESS,
            "modalities": [["text"]], "bad_words": [[]], "early_stopping": [False],
            "guided_decoding_backend": ["xgrammar", "auto"],
            "spaces_between_special_tokens": [True], "store": [False],
            "truncation_side": ["left"], "padding": ["do_not_pad"],
            "service_tier": ["auto", "default"]}


def refuse_unsupported(unknown: Mapping[str, Any]) -> None:
    """Raises OpenAIError 400 (code ``unsupported_parameter``) naming the first of a body's
    ``unknown`` fields (name -> value sent) that would change the reply (``UNSUPPORTED``);
    null, and the values in ``HARMLESS`` (``"modalities": ["text"]``), ask for nothing and
    pass."""
    for name, value in unknown.items():
        if name in UNSUPPORTED and value is not None and value not in HARMLESS.get(name, []):
            raise OpenAIError(f"{name} is not supported by kvflow: {UNSUPPORTED[name]}",
                              param=name, code="unsupported_parameter")


def refuse_unknown(names: Iterable[str]) -> None:
    """Raises OpenAIError 400 (code ``unknown_parameter``, ``param`` the first name in sorted
    order) naming every one of a body's undeclared field ``names``, except the
    ``UNSUPPORTED`` ones that ``refuse_unsupported`` let pass (null, ``HARMLESS``); an
    ``UNREAD`` name's reason is added."""
    unknown = [name for name in sorted(names) if name not in UNSUPPORTED]
    if unknown:
        why = "".join(f"; {name}: {UNREAD[name]}" for name in unknown if name in UNREAD)
        raise OpenAIError(f"Unrecognized request argument supplied: {', '.join(unknown)} "
                          "(kvflow does not know it, so it is refused rather than ignored: "
                          "check the spelling, or start the server with "
                          "--ignore-unknown-fields to ignore such top-level fields as vLLM "
                          f"does{why})", param=unknown[0], code="unknown_parameter")


# Unknown field names remembered (as logged already) per server: the names are the clients'
# own, so a set of every name ever sent would grow with each new one (a client sending fresh
# names in every body grows the server's memory without end). Past this many the longest
# unseen is forgotten, and logged again if it comes back.
MAX_REMEMBERED_NAMES = 1024


class UnknownFieldLog:
    """The unknown field names logged so far; one per server, shared by every endpoint.
    At most ``capacity`` names are remembered (least recently sent forgotten first): a name
    forgotten is logged again when it is sent again.

    Raises:
        ValueError: from the constructor for a ``capacity`` below 1.
    """

    def __init__(self, capacity: int = MAX_REMEMBERED_NAMES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._logged: OrderedDict[str, None] = OrderedDict()

    def note(self, req: RequestBody, endpoint: str) -> list[str]:
        """Log the names among ``req.unknown_fields`` that no request has sent before (with
        the endpoint of the first one to send them); returns those names, sorted."""
        return self.note_names(req.unknown_fields, endpoint)

    def note_names(self, names: Iterable[str], endpoint: str,
                   what: str = "request fields kvflow does not know") -> list[str]:
        """Log the ``names`` (``what`` says what they are) that no request has sent before
        (or not among the last ``capacity`` names remembered); returns those names, sorted."""
        names = set(names)
        new = sorted(names - self._logged.keys())
        for name in names:
            self._logged[name] = None
            self._logged.move_to_end(name)
        while len(self._logged) > self.capacity:
            self._logged.popitem(last=False)
        if new:
            logger.warning("ignoring %s: %s (first sent to %s; each name is logged once)",
                           what, ", ".join(new), endpoint)
        return new


class UnknownFields:
    """What the server does with the body fields kvflow does not declare; one per server,
    shared by every endpoint.

    Args:
        ignore: ignore them and log each name once (``--ignore-unknown-fields``, vLLM's
            behaviour) instead of refusing them.
    """

    def __init__(self, ignore: bool = False) -> None:
        self.ignore = ignore
        self.log = UnknownFieldLog()

    def check(self, req: RequestBody, endpoint: str) -> None:
        """Refuse ``req``'s ``UNSUPPORTED`` fields (``refuse_unsupported``), then its other
        unknown fields (``refuse_unknown``) unless ``ignore``, which logs them instead
        (``endpoint`` names where a name was first sent).

        Raises:
            OpenAIError: 400 naming the field (``unsupported_parameter``) or every unknown
                field (``unknown_parameter``).
        """
        self.check_values(req.unknown_values, endpoint)

    def check_values(self, unknown: Mapping[str, Any], endpoint: str) -> None:
        """``check`` for a body's undeclared fields given as name -> value sent (a body the
        schema refused has no model to ask).

        Raises:
            OpenAIError: as ``check``.
        """
        refuse_unsupported(unknown)
        if self.ignore:
            self.log.note_names(unknown, endpoint)
        else:
            refuse_unknown(unknown)
