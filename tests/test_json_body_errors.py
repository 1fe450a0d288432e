"""A request body that is not valid JSON: the server's 400 (code ``invalid_json``) says where
the syntax breaks, as ``run-batch`` does for a line and pydantic / vLLM report a place. Oracle:
Python's ``json.loads`` on the same bytes (its line, column and character offset) and
hand-counted positions."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kvflow.config import EngineConfig, ServerConfig


@pytest.fixture(scope="module")
def client() -> TestClient:
    """The app over a stub engine: a body that does not parse never reaches a handler."""
    from kvflow.entrypoints.api_server import build_app

    engine = SimpleNamespace(config=EngineConfig(), is_healthy=True, dead_error=None,
                             task="generate", processor=SimpleNamespace(pooler=None))
    return TestClient(build_app(engine, ServerConfig(), "m"))


@pytest.mark.parametrize("body, place", [
    (b'{"prompt": "hi",\n "max_tokens": }', "line 2 column 16 (char 32)"),
    (b'{"prompt": "hi" "n": 2}', "line 1 column 17 (char 16)"),
    ('{"prompt": "\u00e9\u00e9", x}'.encode(), "line 1 column 18 (char 17)"),  # characters
], ids=["second_line", "missing_comma", "non_ascii"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_bad_json_body_names_line_and_column(client, path, body, place):
    """The message was "the body is not valid JSON: Expecting value", with no place."""
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(body)
    expected = f"the body is not valid JSON: {parsed.value}"
    assert expected.endswith(place)
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": expected, "type": "invalid_request_error",
                                        "param": None, "code": "invalid_json"}
