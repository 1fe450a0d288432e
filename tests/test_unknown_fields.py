"""Request-body fields kvflow does not declare (kvflow/entrypoints/unknown_fields.py), checked
in-process on the parsed bodies of every endpoint: by default each is a 400 naming every
unknown field (code ``unknown_parameter``, ``param`` the first in sorted order), as the OpenAI
API answers; ``UNSUPPORTED`` names keep their own message and code; with
``--ignore-unknown-fields`` (a ``kvflow serve`` flag and config-file key) they are ignored
and each name is logged once for the whole server. The served checks (reply lengths, KV
blocks) are in tests/e2e/test_unknown_fields_served.py."""

from __future__ import annotations

import itertools
import logging

import pytest

from kvflow.config import ServerConfig
from kvflow.entrypoints import protocol
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.config_file import expand_config_file
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol.responses_api import ResponsesRequest
from kvflow.entrypoints.unknown_fields import UnknownFields

HI = [{"role": "user", "content": "hi"}]
# every model that is a whole request body, with a minimal valid body
BODIES = {"/v1/completions": (protocol.CompletionRequest, {"prompt": "hi"}),
          "/v1/chat/completions": (protocol.ChatCompletionRequest, {"messages": HI}),
          "/v1/responses": (ResponsesRequest, {"input": "hi"}),
          "/v1/embeddings": (protocol.EmbeddingRequest, {"input": "hi"}),
          "/pooling": (protocol.PoolingRequest, {"input": "hi"}),
          "/v1/score": (protocol.ScoreRequest, {"text_1": "hi", "text_2": "yo"}),
          "/v1/rerank": (protocol.RerankRequest, {"query": "hi", "documents": ["yo"]}),
          "/classify": (protocol.ClassificationRequest, {"input": "hi"}),
          "/tokenize": (protocol.TokenizeRequest, {"prompt": "hi"}),
          "/detokenize": (protocol.DetokenizeRequest, {"tokens": [1]}),
          "/v1/load_lora_adapter": (protocol.LoadLoRAAdapterRequest,
                                    {"lora_name": "a", "lora_path": "/p"}),
          "/v1/unload_lora_adapter": (protocol.UnloadLoRAAdapterRequest, {"lora_name": "a"})}


def _parsed(endpoint: str, extra: dict) -> protocol.RequestBody:
    model, body = BODIES[endpoint]
    return model.model_validate({**body, **extra})


def _refusal(endpoint: str, extra: dict, ignore: bool = False) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        UnknownFields(ignore).check(_parsed(endpoint, extra), endpoint)
    return e.value


def test_every_request_body_model_is_covered():
    """A new body model (a subclass of RequestBody) must be added to BODIES."""
    def subclasses(cls: type) -> set[type]:
        return {s for c in cls.__subclasses__() for s in {c} | subclasses(c)}

    models = {m for m in subclasses(protocol.RequestBody) if m is not protocol.SamplingRequest}
    assert models == {model for model, _ in BODIES.values()}


@pytest.mark.parametrize("endpoint", BODIES)
def test_an_unknown_field_is_a_400_naming_it(endpoint):
    error = _refusal(endpoint, {"max_token": 5})
    assert (error.status, error.type, error.param, error.code) == \
        (400, "invalid_request_error", "max_token", "unknown_parameter")
    assert str(error).startswith("Unrecognized request argument supplied: max_token (")
    assert "--ignore-unknown-fields" in str(error)


def test_every_unknown_field_is_named_and_param_is_the_first_sorted():
    error = _refusal("/v1/chat/completions", {"temprature": 0.5, "max_token": 5})
    assert error.param == "max_token"
    assert "max_token, temprature" in str(error)


def test_null_is_no_excuse_for_an_unknown_field():
    """``"max_token": null`` is still a misspelled field (OpenAI refuses it too)."""
    assert _refusal("/v1/completions", {"max_token": None}).param == "max_token"


def test_unsupported_fields_keep_their_own_message_in_both_modes():
    for ignore in (False, True):
        error = _refusal("/v1/completions", {"logits_processors": ["x"], "max_token": 5},
                         ignore)
        assert (error.param, error.code) == ("logits_processors", "unsupported_parameter")
        assert "structured_outputs" in str(error)  # what to do instead
        # the generation fields completions and chat declare stay refused elsewhere
        error = _refusal("/v1/embeddings", {"allowed_token_ids": [1]}, ignore)
        assert (error.param, error.code) == ("allowed_token_ids", "unsupported_parameter")
        assert "only /v1/completions and /v1/chat/completions take it" in str(error)
    error = _refusal("/v1/chat/completions", {"verbosity": "low"})
    assert (error.param, error.code) == ("verbosity", "unsupported_parameter")


# the openai client's chat fields kvflow cannot honour, as it sends them
CLIENT_CHAT_FIELDS = {"moderation": {"model": "omni-moderation-latest"},
                      "prompt_cache_retention": "24h",
                      "prompt_cache_options": {"mode": "explicit", "ttl": "30m"}}


@pytest.mark.parametrize("name", CLIENT_CHAT_FIELDS)
def test_openai_client_chat_fields_are_refused_as_on_responses(name):
    """``moderation`` and the prompt-cache options the openai client types for chat are a 400
    naming the field (``unsupported_parameter``, with /v1/responses' reason, which declares
    them), also under ``--ignore-unknown-fields``: they were unknown fields, which that flag
    drops unread (moderation asked for and not run); null passes."""
    from kvflow.entrypoints.protocol.responses_api import unhonoured_fields

    for ignore in (False, True):
        error = _refusal("/v1/chat/completions", {name: CLIENT_CHAT_FIELDS[name]}, ignore)
        assert (error.param, error.code) == (name, "unsupported_parameter")
        assert str(error) == f"{name} is not supported by kvflow: " \
                             f"{unhonoured_fields()[name].instead}"
    UnknownFields().check(_parsed("/v1/chat/completions", {name: None}), "/v1/chat/completions")


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_thinking_token_budget_is_declared_on_both_endpoints(endpoint):
    """vLLM 0.32's ``thinking_token_budget`` is a declared field of completions and chat
    (honoured: tests/e2e/test_thinking_budget_served.py), not an unknown one; elsewhere it is
    refused, saying so, also under ``--ignore-unknown-fields`` (vLLM declares it on those two
    only: its /v1/responses drops it unread, a budget not kept). ``include_reasoning`` is
    declared on chat."""
    for value in (16, -1, None):
        body = _parsed(endpoint, {"thinking_token_budget": value})
        assert body.thinking_token_budget == value and not body.unknown_fields
        UnknownFields().check(body, endpoint)
    for other, ignore in itertools.product(("/v1/embeddings", "/v1/responses"), (False, True)):
        error = _refusal(other, {"thinking_token_budget": 16}, ignore)
        assert (error.param, error.code) == ("thinking_token_budget", "unsupported_parameter")
        assert "vLLM 0.32's /v1/responses does not read it" in str(error)
    UnknownFields().check(_parsed("/v1/responses", {"thinking_token_budget": None}),
                          "/v1/responses")
    assert protocol.ChatCompletionRequest.model_validate(
        {"messages": HI, "include_reasoning": False}).include_reasoning is False


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions",
                                      "/v1/responses"])
def test_vllm_032_fields_kvflow_does_not_take(endpoint):
    """vLLM 0.32's ``watermarking``, ``ec_transfer_params`` and
    ``routed_experts_prompt_start`` would change its reply: a 400 naming each with why
    (also under ``--ignore-unknown-fields``), their defaults passing; the render endpoints'
    ``return_token_offsets`` / ``mm_payload`` / ``return_mm_kwargs`` change nothing on
    vLLM's generation endpoints: unknown fields, whose 400 says why, ignored under the flag
    (``session_id`` is declared: tests/e2e/test_openai_fields.py)."""
    for name, value in (("watermarking", True), ("ec_transfer_params", {"a": 1}),
                        ("routed_experts_prompt_start", 2)):
        for ignore in (False, True):
            error = _refusal(endpoint, {name: value}, ignore)
            assert (error.param, error.code) == (name, "unsupported_parameter")
    UnknownFields().check(_parsed(endpoint, {"watermarking": False,
                                             "routed_experts_prompt_start": 0}), endpoint)
    for name, value, why in (("return_token_offsets", True, "render endpoints"),
                             ("mm_payload", "none", "render endpoints"),
                             ("return_mm_kwargs", False, "render endpoints")):
        error = _refusal(endpoint, {name: value})
        assert (error.param, error.code) == (name, "unknown_parameter")
        assert f"{name}: vLLM 0.32" in str(error) and why in str(error)
        UnknownFields(True).check(_parsed(endpoint, {name: value}), endpoint)


def test_null_and_harmless_values_of_unsupported_fields_pass():
    harmless = {"modalities": ["text"], "audio": None, "guided_decoding_backend": "auto",
                "spaces_between_special_tokens": True, "verbosity": None}
    UnknownFields().check(_parsed("/v1/chat/completions", harmless), "/v1/chat/completions")
    harmless.pop("spaces_between_special_tokens")  # declared on chat: not unknown there
    UnknownFields().check(_parsed("/v1/embeddings", {**harmless,
                                                     "spaces_between_special_tokens": True}),
                          "/v1/embeddings")
    error = _refusal("/v1/embeddings", {"spaces_between_special_tokens": False})
    assert error.param == "spaces_between_special_tokens"
    assert "only /v1/completions and /v1/chat/completions take it" in str(error)


def test_ignored_fields_are_logged_once_per_name_for_the_whole_server(caplog):
    fields = UnknownFields(ignore=True)
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.unknown_fields"):
        for endpoint in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            fields.check(_parsed(endpoint, {"max_token": 5}), endpoint)
        fields.check(_parsed("/detokenize", {"max_token": 1, "frobnicate": 2}), "/detokenize")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2, logged
    assert "max_token" in logged[0] and "/v1/completions" in logged[0]
    assert "frobnicate" in logged[1] and "max_token" not in logged[1]


def test_declared_platform_fields_are_not_unknown():
    """OpenAI's chat fields about the platform rather than the reply are declared."""
    req = _parsed("/v1/chat/completions", {
        "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "prompt_cache_key": "p", "safety_identifier": "s", "parallel_tool_calls": False})
    assert req.unknown_fields == ()
    assert (req.metadata, req.prompt_cache_key, req.safety_identifier) == ({"k": "v"}, "p", "s")


def test_the_flag_and_the_config_file_key(tmp_path):
    parser = build_parser()

    def config(*argv: str) -> ServerConfig:
        return ServerConfig.from_cli_args(parser.parse_args(expand_config_file(
            parser, ["serve", "m", *argv])), env={})

    assert config().ignore_unknown_fields is False
    assert config("--ignore-unknown-fields").ignore_unknown_fields is True
    path = tmp_path / "serve.yaml"
    path.write_text("ignore-unknown-fields: true\n")
    assert config("--config", str(path)).ignore_unknown_fields is True
    path.write_text("ignore_unknown_fields: false\n")
    assert config("--config", str(path)).ignore_unknown_fields is False
    help_text = next(a.help for a in parser._subparsers._group_actions[0].choices["serve"]
                     ._actions if a.dest == "ignore_unknown_fields")
    assert "vLLM" in help_text


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/embeddings"])
@pytest.mark.parametrize("ignore", [False, True], ids=["strict", "ignore_unknown"])
def test_platform_fields_asking_for_what_kvflow_cannot_do_are_refused_everywhere(endpoint,
                                                                                 ignore):
    """``store: true`` is a 400 on chat (declared there); where OpenAI has no such field
    (completions, embeddings) --ignore-unknown-fields used to drop it silently. Now the same
    values are refused on every endpoint in both modes, and the ones chat accepts pass."""
    error = _refusal(endpoint, {"store": True}, ignore)
    assert (error.status, error.param, error.code) == (400, "store", "unsupported_parameter")
    assert str(error) == ("store is not supported by kvflow: completions are never stored "
                          "(send false or leave it out)")
    error = _refusal(endpoint, {"service_tier": "flex"}, ignore)
    assert (error.param, error.code) == ("service_tier", "unsupported_parameter")
    for accepted in ({"store": False}, {"store": None}, {"service_tier": "auto"},
                     {"service_tier": "default"}):
        UnknownFields(ignore).check(_parsed(endpoint, accepted), endpoint)


def test_vllm_fields_pass_where_declared_and_are_refused_elsewhere():
    """``cache_salt`` (completions, chat, responses), ``normalize`` / ``add_special_tokens``
    / ``embed_dtype`` / ``endianness`` / ``priority`` (embeddings, /pooling; ``priority`` on
    /v1/score and /v1/rerank too, as vLLM 0.32) are declared, so honoured, where vLLM takes
    them; sent to another endpoint each is refused as unsupported
    even under ``--ignore-unknown-fields`` (ignored, a salt would share the prefix cache)."""
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        UnknownFields().check(_parsed(endpoint, {"cache_salt": "a"}), endpoint)
    vllm_fields = {"normalize": False, "add_special_tokens": False, "embed_dtype": "float16",
                   "endianness": "big", "priority": 1}
    for endpoint in ("/v1/embeddings", "/pooling"):
        UnknownFields().check(_parsed(endpoint, vllm_fields), endpoint)
    # vLLM 0.32's classification requests take add_special_tokens and messages
    UnknownFields().check(_parsed("/classify", {"add_special_tokens": False, "priority": 1,
                                                "messages": HI}), "/classify")
    for endpoint in ("/v1/score", "/v1/rerank"):
        UnknownFields().check(_parsed(endpoint, {"priority": 1}), endpoint)
    for endpoint, field, value in (("/v1/embeddings", "cache_salt", "a"),
                                   ("/v1/score", "normalize", False),
                                   ("/v1/score", "add_special_tokens", False),
                                   ("/v1/score", "embed_dtype", "float16"),
                                   ("/v1/rerank", "endianness", "big"),
                                   ("/tokenize", "priority", 1)):
        error = _refusal(endpoint, {field: value}, ignore=True)
        assert (error.status, error.param, error.code) == (400, field, "unsupported_parameter")


def test_truncation_side_is_taken_by_the_pooling_endpoints_only():
    """vLLM's ``truncation_side`` is declared on the pooling endpoints ("left" / "right";
    another value refused by the schema, a 400 naming it: tests/e2e); elsewhere "left" (what generation keeps)
    passes as harmless and "right" is refused as unsupported, even under
    ``--ignore-unknown-fields``."""
    from pydantic import ValidationError

    for endpoint in ("/v1/embeddings", "/pooling", "/v1/score", "/v1/rerank", "/classify"):
        for side in ("left", "right", None):
            req = _parsed(endpoint, {"truncation_side": side})
            assert req.truncation_side == side
            UnknownFields().check(req, endpoint)
        model, body = BODIES[endpoint]
        with pytest.raises(ValidationError) as e:
            model.model_validate({**body, "truncation_side": "middle"})
        assert [err["loc"][0] for err in e.value.errors()] == ["truncation_side"]
    for endpoint in ("/v1/completions", "/v1/chat/completions"):
        UnknownFields().check(_parsed(endpoint, {"truncation_side": "left"}), endpoint)
        error = _refusal(endpoint, {"truncation_side": "right"}, ignore=True)
        assert (error.param, error.code) == ("truncation_side", "unsupported_parameter")
        assert "keeps its last tokens" in str(error)


@pytest.mark.parametrize("extra", [{}, {"input": None}])
def test_embeddings_take_messages(extra):
    """vLLM's chat-style embedding body (``messages`` instead of ``input`` on /v1/embeddings)
    is a declared field there, as on /pooling: parsed (not an unknown field), with the chat
    template fields; the handler refuses both or neither (tests/e2e/test_openai_embeddings.py).
    """
    for request_type in (protocol.EmbeddingRequest, protocol.PoolingRequest):
        body = request_type.model_validate({"messages": HI, "add_generation_prompt": True,
                                            **extra})
        assert body.input is None and body.messages[0].content == "hi", request_type
        assert body.add_generation_prompt is True and not body.unknown_fields, request_type
        both = request_type.model_validate({"input": "hi", "messages": HI})
        assert not both.unknown_fields and both.input == "hi", request_type


def _served_error(model: type, body: dict, ignore: bool = False) -> dict:
    """The 400 body the server answers for ``body`` when the schema refuses it."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from kvflow.entrypoints.validation_errors import validation_error

    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    errors = [{**x, "loc": ("body", *x["loc"])} for x in e.value.errors()]
    return validation_error(RequestValidationError(errors), UnknownFields(ignore),
                            "/x").body()["error"]


# the endpoints whose minimal body's first field is required, with that field
REQUIRED = {endpoint: next(iter(body)) for endpoint, (model, body) in BODIES.items()
            if model.model_fields[next(iter(body))].is_required()}


def test_required_fields_cover_the_endpoints_that_have_one():
    """(/v1/completions, /v1/embeddings, /pooling, /classify, /v1/score and /tokenize take
    either of two fields or pairs of fields: a handler says so after the unknown-field
    check.)"""
    assert set(REQUIRED) == set(BODIES) - {"/v1/completions", "/v1/embeddings", "/pooling",
                                           "/classify", "/v1/score", "/tokenize"}


@pytest.mark.parametrize("endpoint", REQUIRED)
def test_a_misspelled_required_field_is_named_with_the_missing_one(endpoint):
    """``{"inptu": "x"}`` on /classify answered only "input: a required field, not
    sent" (the unknown-field check runs on a validated body), never naming the field sent;
    now the unknown field's 400 (param ``inptu``), saying the required field is missing
    too. Under --ignore-unknown-fields the missing field's 400, naming the ignored one."""
    model, body = BODIES[endpoint]
    name = REQUIRED[endpoint]
    sent = {**{k: v for k, v in body.items() if k != name}, name[:-1]: body[name]}
    error = _served_error(model, sent)
    assert (error["param"], error["code"]) == (name[:-1], "unknown_parameter"), error
    assert error["message"].startswith(f"Unrecognized request argument supplied: {name[:-1]} (")
    assert error["message"].endswith(f"; and {name}: a required field, not sent")
    error = _served_error(model, sent, ignore=True)
    assert (error["param"], error["code"]) == (name, "missing_required_parameter"), error
    assert error["message"] == (f"{name}: a required field, not sent (the body's fields "
                                f"kvflow does not know, ignored: {name[:-1]})")


def test_a_missing_field_with_unsupported_or_harmless_fields():
    """An UNSUPPORTED field keeps its own message (then the missing field); a harmless value
    of one (``"store": false``) leaves the missing field's plain 400."""
    error = _served_error(protocol.RerankRequest, {"prompt_embeds": "x", "documents": ["a"]})
    assert (error["param"], error["code"]) == ("prompt_embeds", "unsupported_parameter")
    assert error["message"].endswith("; and query: a required field, not sent")
    for ignore in (False, True):
        error = _served_error(protocol.RerankRequest, {"store": False, "documents": ["a"]},
                              ignore)
        assert error == {"message": "query: a required field, not sent",
                         "type": "invalid_request_error", "param": "query",
                         "code": "missing_required_parameter"}


def test_a_body_validated_again_keeps_its_unknown_fields():
    """``model_validate`` of a parsed body (not a dict) keeps its unknown fields (a first
    version of the missing-field change reset them to none)."""
    body = protocol.CompletionRequest.model_validate({"prompt": "x", "max_token": 1})
    assert protocol.CompletionRequest.model_validate(body).unknown_fields == ("max_token",)
    assert body.unknown_values == {"max_token": 1}


def test_the_names_remembered_are_bounded(caplog):
    """Under --ignore-unknown-fields each new name is remembered so it is logged once; the
    names are the clients' own, so the memory is bounded: 5000 bodies of fresh names keep
    at most ``MAX_REMEMBERED_NAMES`` (was: a set of every name ever sent, growing with each
    body). A name still remembered is not logged again; one forgotten is, once more."""
    from kvflow.entrypoints.unknown_fields import MAX_REMEMBERED_NAMES

    fields = UnknownFields(ignore=True)
    with caplog.at_level(logging.WARNING, logger="kvflow.entrypoints.unknown_fields"):
        fields.check(_parsed("/v1/completions", {"kept": 1}), "/v1/completions")
        for i in range(5000):
            fields.check(_parsed("/v1/completions", {f"name{i}": 1, "kept": 1}),
                         "/v1/completions")
            assert len(fields.log._logged) <= MAX_REMEMBERED_NAMES
        fields.check(_parsed("/v1/completions", {"kept": 1, "name4999": 1}), "/v1/completions")
        fields.check(_parsed("/v1/completions", {"name0": 1}), "/v1/completions")
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 5002
    assert sum("kept" in m for m in logged) == 1  # sent with every body: never forgotten
    assert "name0" in logged[-1]  # forgotten long ago; name4999, sent again, was not logged
