"""Options of ``kvflow serve`` beyond the engine's (``ServerConfig``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from kvflow.config.api_key_env import api_key_from_env
from kvflow.config.options import add_field_arg, check_choices, json_object, opt, parse_bytes
from kvflow.config.profiler import profiler_options
from kvflow.config.reasoning import marker_strings, reasoning_config
from kvflow.config.runtime_lora import runtime_lora_updating
from kvflow.config.server_checks import check_values, check_vllm_flags
from kvflow.config.server_values import (
    LIST_FIELDS,
    check_disable_log_stats,
    lora_module,
    one_or_many,
    structured_outputs_config,
    word_list,
)


@dataclass
class ServerConfig:
    """Options of ``kvflow serve`` beyond the engine's (flags are generated from these fields).

    Raises:
        ValueError: from the constructor for an out-of-range value.
    """

    host: str = opt("127.0.0.1", "address the HTTP server listens on")
    port: int = opt(8000, "TCP port the HTTP server listens on")
    api_key: tuple[str, ...] | None = opt(
        None, "require 'Authorization: Bearer KEY' on every route but /health, /ping, /load, "
        "/metrics and /version; several keys (vLLM's list): any of them is accepted; unset: "
        "$KVFLOW_API_KEY or vLLM's $VLLM_API_KEY, if set", nargs="+")
    served_model_name: tuple[str, ...] | None = opt(
        None, "model name clients send; unset: the model argument. Several names (vLLM's "
        "aliases): each is accepted as a request's model; the first names the metrics' "
        "model_name label and /v1/models' base card (the others follow it)", nargs="+")
    max_waiting_requests: int | None = opt(None, "accepted requests that have not produced a "
                                            "token yet beyond which new requests get 503; "
                                            "unset: unlimited")
    max_num_queued_reqs: int | None = opt(
        None, "sequences in flight (waiting or running; a request of n samples counts n) "
        "beyond which a new request gets 503 (code server_overloaded, Retry-After), counted "
        "across data-parallel replicas (vLLM's flag of the same name; unlike "
        "--max-waiting-requests, running requests count; default: unlimited)")
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
    disable_uvicorn_access_log: bool = opt(False, "write no uvicorn access log line (one per "
                                           "HTTP request, at INFO; vLLM's flag of the same "
                                           "name)")
    disable_access_log_for_endpoints: str | None = opt(
        None, "comma-separated request paths whose uvicorn access log lines are left out, "
        "matched exactly without the query string, e.g. /health,/metrics,/ping; other "
        "paths are still logged (vLLM's flag of the same name; default: none)",
        metavar="PATHS")
    uds: str | None = opt(None, "serve HTTP on this Unix domain socket path instead of "
                           "--host / --port, which are then not read (vLLM's flag of the "
                           "same name; default: TCP)", metavar="PATH")
    engine_start_timeout: float = opt(600.0, "seconds to wait for the engine process to load "
                                       "the model")
    timeout_keep_alive: float = opt(20.0, "seconds an idle HTTP keep-alive connection stays "
                                     "open; longer than clients' own idle expiry (httpx 5 s, "
                                     "aiohttp 15 s) so a client never sends on a connection "
                                     "the server is closing")
    shutdown_timeout: float = opt(0.0, "on SIGTERM / Ctrl-C, seconds the open requests may "
                                  "take to finish while new ones get 503 "
                                  "(server_shutting_down); those still open then are "
                                  "aborted; 0: aborted at once (vLLM's flag of the same "
                                  "name; a second Ctrl-C stops the wait)")
    engine_failure: str = opt("exit", "when the engine-core process dies: open streams end "
                               "with an error event and new requests get 503, then the "
                               "server exits with status 1 ('exit') or starts a new engine "
                               "('restart')", choices=["exit", "restart"])
    tool_call_parser: str = opt("hermes", "how tool calls are read from the output under "
                                 "tool_choice=auto (vLLM's parser names; see README 'Tool "
                                 "calling')", choices=[
                                     "hermes", "llama3_json", "llama4_json", "mistral",
                                     "pythonic", "llama4_pythonic", "qwen3_coder", "deepseek_v3",
                                     "deepseek_v31", "kimi_k2", "granite", "internlm",
                                     "internlm2", "jamba", "xlam", "glm45", "qwen3_xml",
                                     "minimax", "phi4_mini_json", "seed_oss", "hunyuan_a13b",
                                     "step3", "granite-20b-fc"])
    exclude_tools_when_tool_choice_none: bool = opt(
        False, "leave a request's tools out of the chat template's prompt under "
        "tool_choice=none (default: the model still sees them and calls none, as with "
        "OpenAI; vLLM's flag of the same name)")
    reasoning_parser: str | None = opt(None, "split the reply's reasoning into "
                                        "reasoning: think (<think>...</think>), "
                                        "qwen3 (the same; none under enable_thinking false), "
                                        "deepseek_r1 (text before </think>), granite; "
                                        "vLLM's glm45, mistral, seed_oss, step3, ernie45, "
                                        "hunyuan_a13b, deepseek_v3 (see README)",
                                        choices=[None, "think", "deepseek_r1", "qwen3",
                                                 "granite", "glm45", "mistral", "seed_oss",
                                                 "step3", "ernie45", "hunyuan_a13b",
                                                 "deepseek_v3"])
    structured_outputs_config: str | dict | None = opt(  # noqa: RUF009 (a dict, once parsed)
        None, "vLLM's structured-output settings as a JSON object; kvflow reads one key, "
        "enable_in_reasoning: true applies a grammar (response_format, structured_outputs, "
        "forced tool calls) from the first token, reasoning included; default (false): with "
        "a --reasoning-parser the grammar starts after the reasoning end marker, as vLLM's")
    reasoning_config: str | dict | None = opt(  # noqa: RUF009 (a dict, once parsed)
        None, "vLLM's reasoning markers as a JSON object, e.g. '{\"reasoning_start_str\": "
        "\"<think>\", \"reasoning_end_str\": \"</think>\"}': the strings a request's "
        "thinking_token_budget is counted from and forces (tokenized once, without special "
        "tokens; several tokens are forced one by one), winning over the --reasoning-parser's "
        "markers; without a parser they serve the budget alone (a grammar then applies from "
        "the first token, as vLLM's)")
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
    return_tokens_as_token_ids: bool = opt(
        False, "write every logprobs token of /v1/completions and /v1/chat/completions "
        "replies, streamed or not (the chosen ones and the alternatives), as "
        "'token_id:{id}', so a token that is no whole character is still named; a request's "
        "own return_tokens_as_token_ids (true or false) wins (vLLM's flag of the same name)")
    enable_prompt_tokens_details: bool = opt(False, "add usage.prompt_tokens_details."
                                             "cached_tokens (the prompt tokens found in the "
                                             "prefix cache) to /v1/chat/completions and "
                                             "/v1/completions replies, streamed ones' usage "
                                             "chunks included; off: usage has no details "
                                             "(vLLM's flag of the same name)")
    lora_modules: tuple[str, ...] | None = opt(None, "LoRA adapters served from start-up, each "
                                                "NAME=PATH (a PEFT folder) or vLLM's JSON "
                                                "'{\"name\": NAME, \"path\": PATH}'; "
                                                "requests pick one "
                                                "by model=NAME (needs --enable-lora)",
                                                nargs="+")
    # vLLM's server flags (README "Coming from vLLM"): each honoured, or refused at start
    enable_auto_tool_choice: bool | None = opt(
        None, "accepted for vLLM command lines: kvflow always reads tool calls under "
        "tool_choice=auto with --tool-call-parser (vLLM answers such a request 400 without "
        "this flag); --no-enable-auto-tool-choice is refused, as kvflow cannot turn it off")
    enable_log_requests: bool | None = opt(
        None, "log each request at INFO as the engine gets it (completions, chat, responses, "
        "beam searches, embeddings, scores, classes): its id, prompt (cut to --max-log-len) "
        "and parameters (default: off; vLLM's flag of the same name)")
    disable_log_requests: bool | None = opt(
        None, "vLLM's deprecated inverse of --enable-log-requests (--no-disable-log-requests "
        "turns logging on); refused when the two contradict each other")
    enable_log_outputs: bool = opt(False, "with --enable-log-requests, also log each "
                                   "generated sample once it finishes: its text (cut to "
                                   "--max-log-len) and finish reason at INFO, its token ids "
                                   "at DEBUG, streamed or not (vLLM's flag of the same name; "
                                   "kvflow logs no per-delta lines; beam searches not "
                                   "logged)")
    disable_log_stats: bool | None = opt(
        None, "accepted for vLLM command lines: kvflow writes no periodic stats log line "
        "(vLLM's 'Avg prompt throughput ...'), so there is none to turn off; /metrics stays "
        "served; --no-disable-log-stats is refused (offline, LLM(disable_log_stats=False) "
        "keeps the metrics LLM.get_metrics reads, as vLLM's)")
    max_log_len: int | None = opt(None, "longest prompt logged under --enable-log-requests, "
                                   "in characters (text) or token ids (default: unlimited)")
    allowed_origins: tuple[str, ...] | None = opt(
        None, "CORS: origins browsers may call from, as vLLM takes them (a JSON list, "
        "'[\"https://a.example\"]') or one origin per flag (repeat it); '*': any; any CORS "
        "flag turns CORS on, its other settings taking vLLM's defaults (origins, methods, "
        "headers '*', no credentials) (default: CORS off, no Access-Control headers; vLLM's "
        "is on for '*')", action="append", metavar="ORIGINS")
    allowed_methods: tuple[str, ...] | None = opt(None, "CORS: allowed methods (as "
                                                   "--allowed-origins; default with CORS "
                                                   "on: '*')", action="append",
                                                   metavar="METHODS")
    allowed_headers: tuple[str, ...] | None = opt(None, "CORS: allowed request headers (as "
                                                   "--allowed-origins; default with CORS "
                                                   "on: '*')", action="append",
                                                   metavar="HEADERS")
    allow_credentials: bool | None = opt(None, "CORS: allow credentials (cookies, "
                                         "Authorization) on cross-origin requests; turns "
                                         "CORS on (default: off)")
    root_path: str | None = opt(None, "the path prefix a path-routing proxy serves this server "
                                "under, e.g. /llm (the ASGI root_path: the OpenAPI schema and "
                                "/docs name it; the proxy strips it, routes stay where they "
                                "are)")
    ssl_keyfile: str | None = opt(None, "serve HTTPS with this private key file (PEM; needs "
                                  "--ssl-certfile)")
    ssl_certfile: str | None = opt(None, "serve HTTPS with this certificate chain file (PEM); "
                                   "both files are loaded before the model")
    ssl_ca_certs: str | None = opt(None, "CA certificates file (PEM) given to uvicorn's TLS "
                                   "context, as vLLM does (client certificates stay "
                                   "optional; needs --ssl-certfile)")
    disable_fastapi_docs: bool = opt(False, "serve no /openapi.json, /docs or /redoc (404)")
    enable_request_id_headers: bool = opt(False, "add an X-Request-Id header to every "
                                          "response: the request's own X-Request-Id, else a "
                                          "new random id")
    response_role: str = opt("assistant", "the role of /v1/chat/completions replies to a "
                              "request with add_generation_prompt true (else the last "
                              "message's role, as vLLM)")
    default_chat_template_kwargs: str | dict | None = opt(  # noqa: RUF009 (a dict, once parsed)
        None, "chat template variables of every conversation, as a JSON object, e.g. "
        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win key by key; a key "
        "the template does not read is left out")
    sse_keep_alive_interval: float = opt(0.0, "seconds without a chunk after which a "
                                         "streamed /v1/chat/completions or /v1/completions "
                                         "reply gets an SSE comment line ': keep-alive' "
                                         "(queued, in prefill, between tokens), so a proxy's "
                                         "read timeout does not close it; 0: none (vLLM's "
                                         "flag of the same name)")
    enable_force_include_usage: bool = opt(False, "send the usage chunk at the end of every "
                                           "stream, as if each request asked for "
                                           "stream_options.include_usage")
    chat_template_content_format: str = opt(
        "auto", "how message content reaches the chat template: auto (a list of parts for a "
        "template that loops over a message's content, else one string), string (always "
        "one string) or openai (always a list of {type, ...} parts)",
        choices=["auto", "string", "openai"])
    enable_server_load_tracking: bool = opt(False, "serve GET /load: {\"server_load\": N}, "
                                            "the generation and pooling requests being "
                                            "served now (streams until their last chunk)")
    enable_tokenizer_info_endpoint: bool = opt(False, "serve GET /tokenizer_info: the "
                                               "tokenizer's configuration, its class and the "
                                               "chat template the server renders with")
    dev_mode: bool = opt(False, "serve the development endpoints: POST /reset_prefix_cache, "
                         "GET /server_info and sleep mode's /sleep, /wake_up, /is_sleeping, "
                         "/collective_rpc (set from KVFLOW_SERVER_DEV_MODE=1)", cli=False)
    profiling: bool = opt(False, "serve POST /start_profile and /stop_profile, the torch "
                          "profiler's (set when KVFLOW_TORCH_PROFILER_DIR names the traces' "
                          "folder)", cli=False)
    allow_runtime_lora_updating: bool = opt(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (set from "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, or KVFLOW_ALLOW_RUNTIME_LORA_UPDATING=1: any "
        "client holding the API key can then make the server read adapters from any path)",
        cli=False)

    def __post_init__(self) -> None:
        self._normalize_lists()
        check_choices(self)
        self._normalize_one_or_many()
        check_vllm_flags(self)
        check_disable_log_stats(self.disable_log_stats)
        check_values(self)

    def _normalize_lists(self) -> None:
        """The list fields as tuples (a string's words split) and
        ``default_chat_template_kwargs`` as a dict (a JSON object's text parsed), before the
        type checks.

        Raises:
            ValueError: for a value of neither form (named).
        """
        for name in LIST_FIELDS:
            setattr(self, name, word_list(name, getattr(self, name)))
        self.default_chat_template_kwargs = json_object(
            "default_chat_template_kwargs", self.default_chat_template_kwargs,
            '{"enable_thinking": false}')
        self.structured_outputs_config = structured_outputs_config(
            self.structured_outputs_config)
        self.reasoning_config = reasoning_config(self.reasoning_config)
        marker_strings(self.reasoning_parser, self.reasoning_config)  # one marker: refused

    def _normalize_one_or_many(self) -> None:
        """A config file's (or a caller's) one adapter / key / name as a tuple of one;
        ``lora_modules`` entries as ``NAME=PATH`` strings.

        Raises:
            ValueError: for a ``lora_modules`` entry :func:`lora_module` refuses.
        """
        self.lora_modules = one_or_many(self.lora_modules)
        if self.lora_modules is not None:
            self.lora_modules = tuple(lora_module(m) for m in self.lora_modules)
        self.api_key = one_or_many(self.api_key)
        self.served_model_name = one_or_many(self.served_model_name)

    def model_names(self, model: str) -> tuple[str, ...]:
        """The names the server answers to as its base model: ``--served-model-name``'s
        (first the main one), or ``model`` (the ``--model`` argument) when unset."""
        return self.served_model_name or (model,)

    @property
    def cors_enabled(self) -> bool:
        """Whether any CORS flag was given (CORS is off without one)."""
        return any(getattr(self, name) is not None for name in
                   ("allowed_origins", "allowed_methods", "allowed_headers",
                    "allow_credentials"))

    @property
    def log_requests(self) -> bool:
        """Whether each request is logged (``--enable-log-requests``, or
        ``--no-disable-log-requests``)."""
        return bool(self.enable_log_requests) or self.disable_log_requests is False

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
        """Build from parsed flags; ``--api-key`` falls back to ``KVFLOW_API_KEY`` or vLLM's
        ``VLLM_API_KEY`` in ``env`` (default: the process environment;
        :func:`kvflow.config.api_key_env.api_key_from_env`), and ``dev_mode`` is ``KVFLOW_SERVER_DEV_MODE``
        (vLLM's ``VLLM_SERVER_DEV_MODE``: ``1`` on; ``0`` or unset off), and ``profiling``
        whether ``KVFLOW_TORCH_PROFILER_DIR`` is set (vLLM's ``VLLM_TORCH_PROFILER_DIR``),
        and ``allow_runtime_lora_updating`` vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or
        ``KVFLOW_ALLOW_RUNTIME_LORA_UPDATING``; see
        :func:`kvflow.config.runtime_lora.runtime_lora_updating`).

        Raises:
            ValueError: for a bad flag value, a ``KVFLOW_API_KEY`` or ``VLLM_API_KEY`` that
                is set but empty or blank (it would leave the server open, as an empty
                ``--api-key`` would; unset it to serve without a key), the two set to
                different keys, a ``KVFLOW_SERVER_DEV_MODE`` other
                than 0 or 1, a bad ``KVFLOW_TORCH_PROFILER_*`` switch, or a
                ``*_ALLOW_RUNTIME_LORA_UPDATING`` other than 0, 1, false, true (or the two
                disagreeing).
        """
        env = os.environ if env is None else env
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        dev_mode = env.get("KVFLOW_SERVER_DEV_MODE", "0").strip()
        if dev_mode not in ("0", "1"):
            raise ValueError(f"KVFLOW_SERVER_DEV_MODE={dev_mode!r} must be 1 (serve the "
                             "development endpoints) or 0")
        values["dev_mode"] = dev_mode == "1"
        values["profiling"] = profiler_options(env) is not None
        values["allow_runtime_lora_updating"] = runtime_lora_updating(env)
        if values.get("api_key") is None:
            key = api_key_from_env(env)
            values["api_key"] = None if key is None else (key,)
        return cls(**values)
