"""Options of ``kvflow serve`` beyond the engine's (``ServerConfig``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from kvflow.config.options import add_field_arg, check_choices, opt, parse_bytes


@dataclass
class ServerConfig:
    """Options of ``kvflow serve`` beyond the engine's (flags are generated from these fields).

    Raises:
        ValueError: from the constructor for an out-of-range value.
    """

    host: str = opt("127.0.0.1", "address the HTTP server listens on")
    port: int = opt(8000, "TCP port the HTTP server listens on")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on every route but "
                               "/health, /metrics and /version; unset: $KVFLOW_API_KEY, if set")
    served_model_name: str | None = opt(None, "model name clients send; unset: the model "
                                         "argument")
    max_waiting_requests: int | None = opt(None, "accepted requests that have not produced a "
                                            "token yet beyond which new requests get 503; "
                                            "unset: unlimited")
    max_n: int = opt(16, "largest n (samples per prompt) one request may ask for")
    max_logprobs: int = opt(20, "largest logprobs / top_logprobs one request may ask for")
    max_request_body_size: str | int = opt("32MiB", "largest request body the server reads, "
                                            "e.g. 16MiB, 100MB or a byte count; a bigger one "
                                            "gets 413 (code request_too_large) before any of "
                                            "it is parsed or tokenized (the default leaves "
                                            "room for one image of the default "
                                            "--max-image-bytes, base64-encoded)")
    responses_store_size: int = opt(1000, "replies of /v1/responses (store true, OpenAI's "
                                    "default) kept in memory for GET /v1/responses/{id}, "
                                    "input_items and previous_response_id, least recently "
                                    "used dropped first; 0 keeps none: a reply then echoes "
                                    "store false, and a request sending store true gets 400")
    uvicorn_log_level: str = opt("info", "HTTP server log level",
                                  choices=["critical", "error", "warning", "info", "debug"])
    engine_start_timeout: float = opt(600.0, "seconds to wait for the engine process to load "
                                       "the model")
    timeout_keep_alive: float = opt(20.0, "seconds an idle HTTP keep-alive connection stays "
                                     "open; longer than clients' own idle expiry (httpx 5 s, "
                                     "aiohttp 15 s) so a client never sends on a connection "
                                     "the server is closing")
    engine_failure: str = opt("exit", "when the engine-core process dies: open streams end "
                               "with an error event and new requests get 503, then the "
                               "server exits with status 1 ('exit') or starts a new engine "
                               "('restart')", choices=["exit", "restart"])
    tool_call_parser: str = opt("hermes", "how tool calls are read from the output under "
                                 "tool_choice=auto", choices=["hermes", "llama3_json"])
    exclude_tools_when_tool_choice_none: bool = opt(
        False, "leave a request's tools out of the chat template's prompt under "
        "tool_choice=none (default: the model still sees them and calls none, as with "
        "OpenAI; vLLM's flag of the same name)")
    reasoning_parser: str | None = opt(None, "split <think>...</think> reasoning into "
                                        "reasoning_content", choices=[None, "think"])
    chat_template: str | None = opt(None, "the Jinja chat template of every conversation "
                                    "(/v1/chat/completions, /tokenize messages), replacing "
                                    "the model's: a file, or the template itself (a value "
                                    "that names no file and holds {%%, {{ or {#); read and "
                                    "compiled at start-up, before the model loads; a "
                                    "request's own chat_template (under "
                                    "--trust-request-chat-template) still wins; unset: the "
                                    "model's (vLLM's flag of the same name)",
                                    metavar="FILE_OR_TEMPLATE")
    trust_request_chat_template: bool = opt(False, "accept a Jinja chat_template sent in a "
                                            "request (/v1/chat/completions, /tokenize); off: "
                                            "such a request gets 400, since a template runs "
                                            "code of the client's choosing on the server "
                                            "(vLLM's flag of the same name)")
    ignore_unknown_fields: bool = opt(False, "ignore top-level request-body fields kvflow "
                                      "does not know and log each name once, as vLLM "
                                      "does; off: such a request gets a 400 naming them "
                                      "(code unknown_parameter), as the OpenAI API "
                                      "answers, so that a misspelled field (max_token) is "
                                      "never silently dropped (an unknown key inside a "
                                      "nested object is a 400 either way)")
    enable_prompt_tokens_details: bool = opt(False, "add usage.prompt_tokens_details."
                                             "cached_tokens (the prompt tokens found in the "
                                             "prefix cache) to /v1/chat/completions and "
                                             "/v1/completions replies, streamed ones' usage "
                                             "chunks included; off: usage has no details "
                                             "(vLLM's flag of the same name)")
    lora_modules: tuple[str, ...] | None = opt(None, "LoRA adapters served from start-up, each "
                                                "NAME=PATH (a PEFT folder); requests pick one "
                                                "by model=NAME (needs --enable-lora)",
                                                nargs="+")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.lora_modules is not None:
            self.lora_modules = tuple(self.lora_modules)
        checks = [(0 <= self.port <= 65535, "port", "must be in [0, 65535]"),
                  (self.max_n >= 1, "max_n", "must be >= 1"),
                  (self.max_logprobs >= 0, "max_logprobs", "must be >= 0"),
                  (self.responses_store_size >= 0, "responses_store_size", "must be >= 0"),
                  (self.max_waiting_requests is None or self.max_waiting_requests >= 1,
                   "max_waiting_requests", "must be >= 1 (0 would refuse every request)"),
                  (self.api_key is None or self.api_key.strip() != "", "api_key",
                   "must not be empty (an empty key would leave the server open)"),
                  (self.served_model_name is None or self.served_model_name.strip() != "",
                   "served_model_name", "must not be empty"),
                  (self.chat_template is None or self.chat_template.strip() != "",
                   "chat_template", "must not be empty (leave it unset for the model's)"),
                  (self.engine_start_timeout > 0, "engine_start_timeout", "must be > 0"),
                  (self.timeout_keep_alive > 0, "timeout_keep_alive", "must be > 0"),
                  (all(m.partition("=")[0] and m.partition("=")[2]
                       for m in self.lora_modules or []), "lora_modules",
                   "must be NAME=PATH pairs"),
                  (len({m.partition("=")[0] for m in self.lora_modules or []})
                   == len(self.lora_modules or []), "lora_modules", "names an adapter twice")]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it {why}")
        try:
            parse_bytes(self.max_request_body_size)
        except ValueError as e:
            raise ValueError(f"max_request_body_size={self.max_request_body_size!r} is "
                             f"invalid: {e}") from None

    @property
    def max_request_body_bytes(self) -> int:
        """``max_request_body_size`` in bytes."""
        return parse_bytes(self.max_request_body_size)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("ServerConfig")
        for f in fields(ServerConfig):
            add_field_arg(group, f)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      env: dict[str, str] | None = None) -> ServerConfig:
        """Build from parsed flags; ``--api-key`` falls back to ``KVFLOW_API_KEY`` in ``env``
        (default: the process environment).

        Raises:
            ValueError: for a bad flag value, or a ``KVFLOW_API_KEY`` that is set but empty
                or blank (it would leave the server open, as an empty ``--api-key`` would;
                unset it to serve without a key).
        """
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("api_key") is None:
            key = (os.environ if env is None else env).get("KVFLOW_API_KEY")
            if key is not None and not key.strip():
                raise ValueError(f"KVFLOW_API_KEY={key!r} is empty: an empty key would leave "
                                 "the server open; give a key, or unset the variable to "
                                 "serve without one")
            values["api_key"] = key
        return cls(**values)
