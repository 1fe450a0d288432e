"""The checks of :class:`~kvflow.config.server.ServerConfig`'s values once parsed: each
field's range or form (the first that fails is named, ``"<field>=<value> is invalid: ..."``),
and the vLLM flag values kvflow refuses or pairs that contradict each other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvflow.config.options import parse_bytes
from kvflow.config.server_values import shown_value

if TYPE_CHECKING:
    from kvflow.config.server import ServerConfig


def check_values(config: ServerConfig) -> None:
    """Each of ``config``'s field values against its range or form, in
    :func:`value_checks`' order, then ``max_request_body_size`` parsed.

    Raises:
        ValueError: ``"<field>=<value> is invalid: ..."`` for the first one that fails.
    """
    for ok, name, why in value_checks(config):
        if not ok:
            raise ValueError(f"{name}={shown_value(name, getattr(config, name))} is invalid: "
                             f"it {why}")
    try:
        parse_bytes(config.max_request_body_size)
    except ValueError as e:
        raise ValueError(f"max_request_body_size={config.max_request_body_size!r} is "
                         f"invalid: {e}") from None


def value_checks(config: ServerConfig) -> list[tuple[bool, str, str]]:
    """(passes, field name, what it must be) for each checked field value of ``config``."""
    return [(0 <= config.port <= 65535, "port", "must be in [0, 65535]"),
            (config.max_n >= 1, "max_n", "must be >= 1"),
            (config.max_logprobs >= 0, "max_logprobs", "must be >= 0"),
            (config.responses_store_size >= 0, "responses_store_size", "must be >= 0"),
            (0 <= config.sse_keep_alive_interval < float("inf"), "sse_keep_alive_interval",
             "must be >= 0 seconds (0: no keep-alive comments)"),
            (config.max_waiting_requests is None or config.max_waiting_requests >= 1,
             "max_waiting_requests", "must be >= 1 (0 would refuse every request)"),
            (config.max_num_queued_reqs is None or config.max_num_queued_reqs >= 1,
             "max_num_queued_reqs", "must be >= 1 (0 would refuse every request)"),
            (config.api_key is None or (len(config.api_key) > 0 and all(
                isinstance(k, str) and k.strip() for k in config.api_key)), "api_key",
             "must not be empty (an empty key would leave the server open)"),
            (config.served_model_name is None or (
                len(config.served_model_name) > 0
                and all(isinstance(n, str) and n.strip()
                        for n in config.served_model_name)),
             "served_model_name", "must not be empty (nor hold an empty name)"),
            (len(set(config.served_model_name or ())) == len(config.served_model_name or ()),
             "served_model_name", "names a model twice"),
            (config.chat_template is None or config.chat_template.strip() != "",
             "chat_template", "must not be empty (leave it unset for the model's)"),
            (config.engine_start_timeout > 0, "engine_start_timeout", "must be > 0"),
            (config.timeout_keep_alive > 0, "timeout_keep_alive", "must be > 0"),
            (0 <= config.shutdown_timeout < float("inf"), "shutdown_timeout",
             "must be >= 0 seconds (0: open requests are aborted at once)"),
            (all(m.partition("=")[0] and m.partition("=")[2]
                 for m in config.lora_modules or []), "lora_modules",
             "must be NAME=PATH pairs"),
            (len({m.partition("=")[0] for m in config.lora_modules or []})
             == len(config.lora_modules or []), "lora_modules", "names an adapter twice")]


def check_vllm_flags(config: ServerConfig) -> None:
    """Refuse ``config``'s vLLM flag values kvflow cannot honour, and pairs that contradict
    each other.

    Raises:
        ValueError: naming the flag and why.
    """
    refusals = [
        (config.enable_auto_tool_choice is False,
         ("--no-enable-auto-tool-choice is refused: kvflow always reads tool calls under "
          "tool_choice=auto (with --tool-call-parser) and cannot turn that off")),
        (config.disable_log_requests is not None and config.enable_log_requests is not None
         and config.disable_log_requests == config.enable_log_requests,
         ("--disable-log-requests and --enable-log-requests (or their --no- forms) "
          "contradict each other")),
        (config.max_log_len is not None and config.max_log_len < 0,
         f"max_log_len={config.max_log_len} must be >= 0"),
        (config.max_log_len is not None and not config.log_requests,
         ("--max-log-len cuts the prompts --enable-log-requests logs: without it no "
          "request is logged (give --enable-log-requests too, or leave --max-log-len out)")),
        (config.enable_log_outputs and not config.log_requests,
         "--enable-log-outputs needs --enable-log-requests (as in vLLM)"),
        (config.ssl_keyfile is not None and config.ssl_certfile is None,
         "--ssl-keyfile needs --ssl-certfile (the certificate that goes with the key)"),
        (config.ssl_ca_certs is not None and config.ssl_certfile is None,
         "--ssl-ca-certs needs --ssl-certfile (it configures HTTPS)"),
        (config.root_path is not None and not (config.root_path == ""
                                               or config.root_path.startswith("/")),
         f"root_path={config.root_path!r} must start with '/' (e.g. /llm)"),
        (not config.response_role.strip(), "response_role must not be empty"),
        (config.uds is not None and not config.uds.strip(), "--uds must name a socket path")]
    for refused, why in refusals:
        if refused:
            raise ValueError(why)
