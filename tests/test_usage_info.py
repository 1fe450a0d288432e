"""``usage`` of /v1/completions and /v1/chat/completions: ``prompt_tokens_details`` only under
``--enable-prompt-tokens-details`` (the replies through the server:
tests/e2e/test_openai_prompt_tokens_details.py)."""

from __future__ import annotations

import json

from openai.types import CompletionUsage

from kvflow.config import ServerConfig
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.serving_checks import usage_info


def test_off_the_usage_has_no_details_key():
    assert ServerConfig().enable_prompt_tokens_details is False
    body = json.loads(usage_info(7, 3, 4, details=False).model_dump_json())
    assert body == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def test_on_the_cached_tokens_are_reported_and_openai_parses_them():
    for num_cached in (0, 4):  # 0 too: OpenAI reports it; vLLM would leave the details out
        body = json.loads(usage_info(7, 3, num_cached, details=True).model_dump_json())
        assert body == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                        "prompt_tokens_details": {"cached_tokens": num_cached}}
        parsed = CompletionUsage.model_validate(body)
        assert parsed.prompt_tokens_details.cached_tokens == num_cached


def test_the_flag_is_vllms():
    serve = build_parser()
    on = serve.parse_args(["serve", "m", "--enable-prompt-tokens-details"])
    off = serve.parse_args(["serve", "m"])
    assert ServerConfig.from_cli_args(on, env={}).enable_prompt_tokens_details is True
    assert ServerConfig.from_cli_args(off, env={}).enable_prompt_tokens_details is False
